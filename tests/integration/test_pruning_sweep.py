"""hydra/sweeper=optuna_prune (framework/app/pruning_sweep.py): trials that are real 2-rank gloo
jobs, rank 0 reporting each evaluation to the study in the sweep dir, every rank stopping at the
step its pruner said; pruned trials marked in Optuna and in the summary; a sweep killed midway
resumed by the same command; bad settings refused in one line before any trial starts."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import optuna
import pytest

from framework.core.pruners import STUDY_FILE, storage_url
from tests.conftest import read_metrics

TINY = (
    "model=mlp",
    "data=synthetic",
    "data.in_channels=1",
    "data.image_size=8",
    "data.train_size=256",
    "data.val_size=101",
    "trainer.log_every=1",
    "trainer.eval_every=2",
)
PRUNING = (
    "-m",
    "hydra/sweeper=optuna_prune",
    "hydra/sweeper/sampler=random",
    "hydra.sweeper.sampler.seed=1",
    "hydra.sweeper.direction=maximize",
    "hydra.sweeper.n_jobs=1",
)


def study_trials(sweep: Path) -> list[optuna.trial.FrozenTrial]:
    storage = storage_url(sweep / STUDY_FILE)
    [summary] = optuna.study.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage).trials


def summary_rows(sweep: Path) -> dict[str, dict]:
    with (sweep / "summary.csv").open() as file:
        return {row["job"]: row for row in csv.DictReader(file)}


@pytest.mark.slow
@pytest.mark.distributed
def test_pruned_trials_stop_on_every_rank_at_one_step_and_are_marked_pruned(cli, tmp_path):
    sweep = tmp_path / "sweep"
    result = cli(
        *PRUNING,
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.pruner=median",
        "hydra.sweeper.median.n_startup_trials=1",
        "optimizer.lr=tag(log,interval(0.00001,1.0))",
        "trainer.max_steps=8",
        *TINY,
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    trials = study_trials(sweep)
    states = [trial.state.name for trial in trials]
    assert "PRUNED" in states and "COMPLETE" in states, states
    rows = summary_rows(sweep)
    for trial in trials:
        job = trial.user_attrs["job"]
        run = sweep / str(job)
        summary = json.loads((run / "summary.json").read_text())
        row = rows[str(job)]
        if trial.state.name == "COMPLETE":
            assert (row["status"], summary["steps"], summary.get("pruned")) == (
                "completed",
                8,
                None,
            )
            assert trial.value == summary["val/accuracy"]
            continue
        # The step the pruner stopped at: the last one rank 0 reported.
        step = max(trial.intermediate_values)
        assert step < 8 and row["status"] == "pruned" and summary["pruned"] is True
        assert summary["steps"] == step and row["steps"] == str(step)
        assert max(event["step"] for event in read_metrics(run)) == step
        assert (run / "checkpoints" / f"step_{step:08d}.pt").is_file()
        # Each rank says where it stopped: both at the pruner's step.
        for rank in (0, 1):
            said = rf"\[rank {rank}\] pruned by the sweep's median pruner at step {step} .*"
            assert re.search(rf"{said}; rank {rank} stops at step {step}\n", result.stderr)
    assert "pruned" in (sweep / "summary.md").read_text()

    # The same command again: every trial has ended, none runs again.
    again = cli(
        *PRUNING,
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.pruner=median",
        "hydra.sweeper.median.n_startup_trials=1",
        "optimizer.lr=tag(log,interval(0.00001,1.0))",
        "trainer.max_steps=8",
        *TINY,
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Launching" not in again.stderr and "world_size=" not in again.stderr
    assert [t.state.name for t in study_trials(sweep)] == states
