"""Tasks as users meet them: the presets, a task of one's own from a package outside framework/,
and a task that does not fit its data or model refused with one line and no run dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, make_cfg, read_metrics, train_many

pytestmark = pytest.mark.slow
SHORT = (
    "trainer.max_epochs=null",
    "trainer.max_steps=4",
    "trainer.log_every=2",
    "trainer.eval_every=2",
)


@pytest.fixture(scope="module")
def preset_runs(tmp_path_factory):
    """Every preset, shortened, as one 2-rank job each."""
    root = tmp_path_factory.mktemp("presets")
    presets = {
        "digits_cnn": (),
        "diabetes_mlp": (),
        "digits_vae": (),
        "char_gpt": (
            "model.layers=1",
            "model.width=32",
            "data.stride=512",
            "task.sample_tokens=40",
        ),
    }
    jobs = [
        (make_cfg(f"experiment={name}", *extra, *SHORT), root / name)
        for name, extra in presets.items()
    ]
    return dict(zip(presets, train_many(jobs), strict=True)), root


@pytest.mark.parametrize(
    ("preset", "main", "files"),
    [
        ("digits_cnn", "val/accuracy", []),
        ("diabetes_mlp", "val/r2", []),
        ("digits_vae", "val/elbo", ["reconstructions.png", "samples.png"]),
        ("char_gpt", "val/loss", ["samples.txt"]),
    ],
)
def test_every_preset_trains_on_two_ranks_and_reports_its_tasks_metrics(
    preset_runs, preset, main, files
):
    summaries, root = preset_runs
    summary, run_dir = summaries[preset], root / preset
    assert summary["objective"] == main and summary["world_size"] == 2
    assert summary["steps"] == 4
    val_events = [e for e in read_metrics(run_dir) if main in e]
    assert [e["step"] for e in val_events] == [2, 4]  # step 4's is the final one, logged once
    for name in files:
        assert (run_dir / name).stat().st_size > 0
    if preset == "char_gpt":
        assert "the model's continuation (40 tokens" in (run_dir / "samples.txt").read_text()
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_a_task_from_the_users_own_package_trains_on_two_ranks(cli, tmp_path):
    """tests/integration/my_experiments is outside framework/: one class and one YAML file,
    found through FRAMEWORK_CONFIG_PATH."""
    run_dir = tmp_path / "run"
    result = cli(
        "task=abs_error",
        "data=diabetes",
        "model=ffn",
        "trainer.max_epochs=2",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        env={
            "PYTHONPATH": str(REPO),
            "FRAMEWORK_CONFIG_PATH": "pkg://tests.integration.my_experiments.conf",
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["objective"] == "val/within_half" and summary["world_size"] == 2
    assert 0 <= summary["val/within_half"] <= 1 and summary["val/mae"] > 0
    assert "done: val/within_half=" in result.stderr.strip().splitlines()[-1]
    assert "all in [0, 1]" not in result.stderr  # its regression outputs: no false alarm
    lines = Path(REPO / "tests/integration/my_experiments/tasks.py").read_text().splitlines()
    yaml = Path(REPO / "tests/integration/my_experiments/conf/task/abs_error.yaml")
    assert len(lines) + len(yaml.read_text().splitlines()) < 40


def test_a_matrix_state_reduces_exactly_across_ranks(cli, tmp_path):
    """A confusion matrix summed over 2 ranks (batch 16 each) gives the metrics of 1 rank
    (batch 32)."""
    summaries = []
    for ranks, batch in ((2, 16), (1, 32)):
        run_dir = tmp_path / f"ranks{ranks}"
        result = cli(
            "task=balanced",
            "data.val_fraction=0.21",  # 378 validation images: odd-sized shards
            "trainer.max_epochs=null",
            "trainer.max_steps=6",
            f"data.batch_size={batch}",
            f"launcher.nproc_per_node={ranks}",
            f"hydra.run.dir={run_dir}",
            cwd=tmp_path,
            env={
                "PYTHONPATH": str(REPO),
                "FRAMEWORK_CONFIG_PATH": "pkg://tests.integration.my_experiments.conf",
            },
        )
        assert result.returncode == 0, result.stderr[-3000:]
        summaries.append(json.loads((run_dir / "summary.json").read_text()))
    two, one = summaries
    assert two["objective"] == "val/balanced_accuracy" and two["world_size"] == 2
    for name in ("val/balanced_accuracy", "val/accuracy"):
        assert two[name] == pytest.approx(one[name], rel=1e-5), name
    assert 0 < two["val/balanced_accuracy"] <= 1


MISFITS = [
    (
        ["task=language_model"],  # (the trial's, before any rank starts)
        ["task=language_model reads (inputs, targets) of token ids", "data=text"],
    ),
    (
        ["data=diabetes", "model=ffn"],
        ["task=classification", "not integer class labels", "task=regression"],
    ),
    (  # (model.num_classes=1 on digits is refused by the trial: it does not cover 10 labels)
        ["data=synthetic", "data.num_classes=1", "launcher.nproc_per_node=1"],
        ["at least 2 class logits", "task=regression"],
    ),
    (["objective=val/acuracy"], ["objective='val/acuracy' is not a metric", "val/accuracy"]),
    (  # refused by the ranks after Hydra made the run dir: the dir is removed again
        ["task=autoencoder"],
        [
            "task=autoencoder: the model returns float32 [32, 10]",
            "float32 [32, 1, 8, 8]",
            "must have its inputs' shape",
        ],
    ),
]


@pytest.mark.parametrize(("overrides", "expected"), MISFITS, ids=lambda v: " ".join(v))
def test_a_task_that_does_not_fit_exits_2_with_one_line_and_no_run_dir(
    cli, tmp_path, overrides, expected
):
    result = cli(*overrides, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    for text in expected:
        assert text in errors[0], errors[0]
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 10, result.stderr[-3000:]
    assert not (tmp_path / "outputs").exists()
