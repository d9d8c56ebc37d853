"""hydra/sweeper=optuna_prune (framework/app/pruning_sweep.py): trials that are real 2-rank gloo
jobs, rank 0 reporting each evaluation to the study in the sweep dir, every rank stopping at the
step its pruner said; pruned trials marked in Optuna and in the summary; a sweep killed midway
resumed by the same command; bad settings refused in one line before any trial starts."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from framework.core.sweep_study import STUDY_FILE, storage_url
from tests.conftest import (
    DIST_ENV_VARS,
    FAULTS,
    SHADOWING_MODULE,
    plant_shadowing_modules,
    read_metrics,
)
from tests.conftest import TINY as TINY_DATA
from tests.faults import FAULT_ENV
from tests.integration.test_faults import processes_mentioning

TINY = ("model=mlp", *TINY_DATA, "trainer.eval_every=2")
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
    command = (
        *PRUNING,
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.pruner=median",
        "hydra.sweeper.median.n_startup_trials=1",
        "optimizer.lr=tag(log,interval(0.00001,1.0))",
        "trainer.max_steps=8",
        *TINY,
        f"hydra.sweep.dir={sweep}",
    )
    result = cli(*command, cwd=tmp_path)
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
    again = cli(*command, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Launching" not in again.stderr and "world_size=" not in again.stderr
    assert [t.state.name for t in study_trials(sweep)] == states


SHORT = ("trainer.max_steps=2", "model=mlp", "data=synthetic")
PRUNE = (
    "-m",
    "hydra/sweeper=optuna_prune",
    "hydra.sweeper.direction=maximize",
    "hydra.sweeper.n_trials=1",
)
EVALUATES = ("trainer.eval_every=2", "optimizer.lr=tag(log,interval(0.001,0.1))")
BAD_INPUT = [
    # An objective that no evaluation reports (samples_per_s: only at the end) or none at all.
    (
        (*PRUNE, *EVALUATES, "objective=samples_per_s"),
        "objective=samples_per_s is not reported at each evaluation, so "
        "hydra/sweeper=optuna_prune cannot prune on it: choose one of val/accuracy, val/loss",
    ),
    ((*PRUNE, *EVALUATES, "objective=val/acuracy"), "objective='val/acuracy' is not a metric"),
    # Pruner settings out of range, or a pruner there is not.
    (
        (*PRUNE, *EVALUATES, "hydra.sweeper.pruner=asha", "hydra.sweeper.asha.reduction_factor=1"),
        "hydra.sweeper.asha.reduction_factor=1 must be >= 2",
    ),
    (
        (*PRUNE, *EVALUATES, "hydra.sweeper.median.n_warmup_steps=-1"),
        "hydra.sweeper.median.n_warmup_steps=-1 must be >= 0",
    ),
    (
        (*PRUNE, *EVALUATES, "hydra.sweeper.hyperband.min_resource=zero"),
        "hydra.sweeper.hyperband.min_resource='zero' is not of type int",
    ),
    (
        (*PRUNE, *EVALUATES, "hydra.sweeper.pruner=patient"),
        "hydra.sweeper.pruner=patient is not one of median, asha, hyperband",
    ),
    # A pruner with a sweeper that cannot prune.
    (
        ("-m", "hydra.sweeper.pruner=asha", "optimizer.lr=0.1,0.01", "trainer.eval_every=2"),
        "hydra.sweeper.pruner is a setting of hydra/sweeper=optuna_prune (Optuna with a pruner): "
        "add hydra/sweeper=optuna_prune; the basic and optuna sweepers run every trial to its end",
    ),
    (
        ("-m", "+hydra.sweeper.pruner=asha", "optimizer.lr=0.1,0.01", "trainer.eval_every=2"),
        "hydra.sweeper.pruner is a setting of hydra/sweeper=optuna_prune",
    ),
    (
        (
            "-m",
            "hydra/sweeper=optuna",
            "hydra.sweeper.n_trials=1",
            "hydra.sweeper.asha.min_resource=2",
            *EVALUATES,
        ),
        "hydra.sweeper.asha.min_resource is a setting of hydra/sweeper=optuna_prune",
    ),
    # Settings of a pruner the sweep does not use (median is the default): they would change
    # nothing.
    (
        (*PRUNE, *EVALUATES, "hydra.sweeper.asha.min_resource=2"),
        "hydra.sweeper.asha.min_resource=2 sets the asha pruner, but this sweep prunes with "
        "hydra.sweeper.pruner=median: set hydra.sweeper.pruner=asha, or leave asha's settings",
    ),
    (
        (*PRUNE, *EVALUATES, "hydra.sweeper.asha.patience=3"),
        "hydra.sweeper.asha.patience is not a setting of the asha pruner: it takes "
        "min_resource, reduction_factor, min_early_stopping_rate",
    ),
    # Nothing to prune at, or the study optimising the other way.
    (
        (
            "-m",
            "hydra/sweeper=optuna_prune",
            "hydra.sweeper.direction=maximize",
            "hydra.sweeper.n_trials=1",
            "trainer.eval_every=0",
        ),
        "hydra/sweeper=optuna_prune prunes at evaluations: set trainer.eval_every",
    ),
    (
        ("-m", "hydra/sweeper=optuna_prune", "hydra.sweeper.n_trials=1", *EVALUATES),
        "hydra.sweeper.direction=minimize but val/accuracy is better when higher: set "
        "hydra.sweeper.direction=maximize",
    ),
]


@pytest.mark.parametrize(("argv", "said"), BAD_INPUT)
def test_bad_pruning_settings_are_one_line_before_any_trial(cli, tmp_path, argv, said):
    sweep = tmp_path / "sweep"
    # Short, should a mistake get through: one trial (a basic sweep: two jobs) of two steps.
    result = cli(*argv, *SHORT, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = result.stderr.strip().splitlines()
    assert said in line, line
    assert not sweep.exists()


# Never pruned (a median pruner that waits for 10 trials): the resume is the point here.
RESUMABLE = (
    *PRUNING,
    "hydra.sweeper.n_trials=3",
    "hydra.sweeper.median.n_startup_trials=10",
    "optimizer.lr=tag(log,interval(0.001,0.1))",
    *FAULTS,
    "trainer.max_steps=6",
    "trainer.eval_every=2",
    "checkpoint.every=2",
)


def killed_midway(sweep: Path, cwd: Path) -> str:
    """The sweep, SIGKILLed with its process group once job 1 has saved its step-2 checkpoint
    (every rank 0 step sleeps 0.3 s: job 1 is then mid-run). Returns its stderr."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS}
    env[FAULT_ENV] = "slow:0:1"
    process = subprocess.Popen(
        [sys.executable, "-m", "framework.cli", *RESUMABLE, f"hydra.sweep.dir={sweep}"],
        cwd=cwd,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    checkpoint = sweep / "1" / "checkpoints" / "step_00000002.pt"
    deadline = time.monotonic() + 240
    while not checkpoint.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    _, stderr = process.communicate(timeout=60)
    assert checkpoint.exists(), stderr[-3000:]
    return stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_sweep_resumes_with_the_same_command(cli, tmp_path):
    sweep = tmp_path / "sweep"
    killed_midway(sweep, tmp_path)
    assert [t.state.name for t in study_trials(sweep)] == ["COMPLETE", "RUNNING"]
    assert not (sweep / "1" / "summary.json").exists()
    finished_log = (sweep / "0" / "train.log").read_text()

    result = cli(*RESUMABLE, f"hydra.sweep.dir={sweep}", cwd=tmp_path, env={FAULT_ENV: None})
    assert result.returncode == 0, result.stderr[-3000:]
    trials = study_trials(sweep)
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3
    assert [t.user_attrs["job"] for t in trials] == [0, 1, 2]
    # The finished trial did not run again; the cut-off one went on from its checkpoint.
    assert (sweep / "0" / "train.log").read_text() == finished_log
    resumed = (sweep / "1" / "train.log").read_text()
    assert re.search(r"resumed from \S+step_0000000[24]\.pt at step [24] ", resumed), resumed
    for trial in trials:
        summary = json.loads((sweep / str(trial.user_attrs["job"]) / "summary.json").read_text())
        assert summary["steps"] == 6 and trial.value == summary["val/accuracy"]
    rows = summary_rows(sweep)
    assert [rows[job]["status"] for job in ("0", "1", "2")] == ["completed"] * 3


# A project's own Hydra callback, in its own module and experiment.
OWN_CALLBACK = """import os
from pathlib import Path

from hydra.experimental.callback import Callback


class Mark(Callback):
    def on_job_end(self, config, job_return, **kwargs):
        mark = Path(config.hydra.runtime.output_dir, "own_callback_ran")
        mark.write_text(os.environ.get("PYTHONSAFEPATH", "unset"))
"""
OWN_CALLBACK_EXPERIMENT = """# @package _global_
allowed_targets: [own_callback]
hydra:
  callbacks:
    mark:
      _target_: own_callback.Mark
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_trials_run_in_parallel_as_submitit_jobs_each_reporting_to_the_study(
    cli, tmp_path, monkeypatch
):
    """launcher=slurm_local: each trial's ranks are submitit tasks (rank 0's task starts its
    rank in the job's own process), both trials at once; each rank 0 reports to the one study
    file while the other trial's does. Each rank's task composes the config itself, and every
    rank trains with its trial's values (runner.check_replicas_agree fails a job whose ranks
    did not). Started in a project's folder: its re.py, numbers.py and random.py are not what
    submitit's controller and tasks import, while its own Hydra callback (unpickled by each
    task) is."""
    plant_shadowing_modules(tmp_path)
    (tmp_path / "own_callback.py").write_text(OWN_CALLBACK)
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "own_callback.yaml").write_text(OWN_CALLBACK_EXPERIMENT)
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])  # as the console script does
    sweep = tmp_path / "sweep"
    result = cli(
        *PRUNING[:-1],
        "launcher=slurm_local",
        "experiment=own_callback",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.median.n_startup_trials=1",
        "optimizer.lr=tag(log,interval(0.00001,1.0))",
        "trainer.max_steps=8",
        *TINY,
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        env={"PYTHONSAFEPATH": None},  # (the user's own: none)
    )
    # Every rank's task has left with the sweep: rank 0's result ended the wait, and its
    # local processes are the sweep's to end (rank 1 was still writing its result).
    assert not processes_mentioning(str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert SHADOWING_MODULE not in result.stderr
    trials = study_trials(sweep)
    assert [t.user_attrs["job"] for t in trials] == [0, 1]
    rows = summary_rows(sweep)
    for trial in trials:
        job = sweep / str(trial.user_attrs["job"])
        reported = sorted(trial.intermediate_values)  # by its rank 0, at each evaluation
        assert reported and reported == [2, 4, 6][: len(reported)]
        summary = json.loads((job / "summary.json").read_text())
        assert summary["world_size"] == 2
        assert read_metrics(job)[0]["lr"] == pytest.approx(trial.params["optimizer.lr"])
        if trial.state.name == "PRUNED":
            step = max(trial.intermediate_values)
            assert summary["steps"] == step and rows[job.name]["status"] == "pruned"
        else:
            assert trial.state.name == "COMPLETE" and summary["steps"] == 8
        # Each task ran the project's callback, in the environment the user gave `train`.
        assert (job / "own_callback_ran").read_text() == "unset"
    assert len(list(sweep.glob(".submitit/*/*_result.pkl"))) == 4  # 2 trials x 2 ranks
