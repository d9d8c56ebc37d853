"""`train` as a user runs it, from this project's folder: the experiment trains on 2 ranks, the
streamed one too, and a misspelt key of the project's own data option is refused before anything
runs."""

import json
import math
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]


def train(*overrides: str) -> subprocess.CompletedProcess[str]:
    """`uv run train <overrides>` in this folder (the console script's module, this venv)."""
    command = [sys.executable, "-m", "framework.cli", *overrides]
    return subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=600)


def test_the_experiment_trains_two_steps_on_two_ranks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = train(
        "experiment=__project__",
        "trainer.max_steps=2",
        "launcher.nproc_per_node=2",
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["world_size"] == 2
    assert math.isfinite(summary["val/mse"]) and 0 <= summary["val/within"] <= 1


def test_the_streamed_option_trains_two_steps_on_two_ranks_through_its_transform_and_collate(
    tmp_path: Path,
) -> None:
    """data=__project___stream (src/__project__/stream.py) streams this project's own source, 2
    DataLoader workers per rank; every batch is padded to data.block_size by its own collate."""
    run_dir = tmp_path / "run"
    result = train(
        "experiment=__project___stream",
        "trainer.max_steps=2",
        "trainer.eval_every=0",
        "task.sample_tokens=0",
        "data.num_workers=2",
        "launcher.nproc_per_node=2",
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["world_size"] == 2
    assert math.isfinite(summary["val/loss"])


def test_a_misspelt_data_key_is_refused_before_the_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = train("experiment=__project__", "data.noize=0.3", f"hydra.run.dir={run_dir}")
    assert result.returncode == 2
    assert "error: data.noize is not a setting of __project__.data.noisy_sine" in result.stderr
    assert "did you mean data.noise?" in result.stderr
    assert not run_dir.exists()
