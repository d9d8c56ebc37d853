"""Hydra multiruns as users start them: every job a full DDP group in its own dir, a summary
table at the end, failed jobs reported, optuna's trials, and the launcher checks that run before
anything is submitted. (Real SLURM: tests/integration/test_slurm.py.)"""

from __future__ import annotations

import csv
import json
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import submitit
import yaml

from framework.launch.slurm.sweep import Watch
from tests.conftest import read_metrics, train_losses
from tests.integration.test_faults import processes_mentioning
from tests.integration.test_quick_refusal import train_without_torch

pytestmark = pytest.mark.slow
TINY_CLI = (
    "data=synthetic",
    "data.in_channels=1",
    "data.image_size=8",
    "data.train_size=256",
    "data.val_size=101",
    "trainer.max_steps=3",
    "trainer.log_every=1",
)
OFFLINE_WANDB = {"WANDB_MODE": "offline", "WANDB_API_KEY": None}


def sweep_dir(root: Path) -> Path:
    [found] = root.glob("multirun/*/*")
    return found


def summary_rows(sweep: Path) -> list[dict]:
    with (sweep / "summary.csv").open() as file:
        return list(csv.DictReader(file))


def wandb_run_record(run_dir: Path):
    """The run record of the job's one offline W&B run, read from W&B's own log file (LevelDB
    log framing: 32 KiB blocks, 7-byte chunk headers, after a 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    [log_file] = run_dir.glob("wandb/offline-run-*/*.wandb")
    data, position, record = log_file.read_bytes(), 7, b""
    while position + 7 <= len(data):
        room = 32768 - position % 32768
        if room < 7:  # block trailer
            position += room
            continue
        length, kind = (
            int.from_bytes(data[position + 4 : position + 6], "little"),
            data[position + 6],
        )
        record += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            parsed = pb.Record()
            parsed.ParseFromString(record)
            record = b""
            if parsed.WhichOneof("record_type") == "run":
                return parsed.run
    raise AssertionError(f"no run record in {log_file}")


def test_a_sweep_runs_each_job_as_a_ddp_group_in_its_own_dir_with_a_summary_and_one_wandb_group(
    cli,
    tmp_path,
):
    result = cli(
        "-m",
        "optimizer.lr=0.1,0.05",
        "comm=allreduce,powersgd",
        *TINY_CLI,
        "logger=wandb",
        cwd=tmp_path,
        env=OFFLINE_WANDB,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    sweep = sweep_dir(tmp_path)
    jobs = sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    assert [job.name for job in jobs] == ["0", "1", "2", "3"]
    summaries = [json.loads((job / "summary.json").read_text()) for job in jobs]
    assert all(summary["world_size"] == 2 for summary in summaries)
    assert [read_metrics(job)[0]["lr"] for job in jobs] == [0.1, 0.1, 0.05, 0.05]

    rows = summary_rows(sweep)
    assert [(row["job"], row["status"], row["optimizer.lr"], row["comm"]) for row in rows] == [
        ("0", "completed", "0.1", "allreduce"),
        ("1", "completed", "0.1", "powersgd"),
        ("2", "completed", "0.05", "allreduce"),
        ("3", "completed", "0.05", "powersgd"),
    ]
    assert [float(row["val/accuracy"]) for row in rows] == pytest.approx(
        [summary["val/accuracy"] for summary in summaries], rel=1e-5
    )
    assert list(rows[0])[:2] == ["job", "status"] and "val/loss" in rows[0]
    markdown = (sweep / "summary.md").read_text().splitlines()
    assert len(markdown) == 2 + 4 and markdown[0].startswith("| job | status |")
    png = b"\x89PNG\r\n\x1a\n"
    assert (sweep / "sweep.png").read_bytes()[:8] == png  # the jobs' curves side by side
    assert all((job / "curves.png").read_bytes()[:8] == png for job in jobs)

    records = [wandb_run_record(job) for job in jobs]
    assert {record.run_group for record in records} == {str(sweep.relative_to(tmp_path))}
    assert len({record.run_id for record in records}) == 4
    assert records[1].display_name.startswith("1-") and "comm=powersgd" in records[1].display_name


def test_a_failed_job_is_reported_in_the_summary_and_the_sweep_goes_on(cli, tmp_path):
    # Job 0 asks for a global batch larger than the data set (refused); job 1 runs.
    result = cli("-m", "data.batch_size=4096,16", *TINY_CLI, cwd=tmp_path, timeout=240)
    assert result.returncode == 1
    assert "smaller than one global batch" in result.stderr
    assert "Traceback" not in result.stderr
    rows = summary_rows(sweep_dir(tmp_path))
    assert [(row["job"], row["status"]) for row in rows] == [("0", "failed"), ("1", "completed")]
    assert "smaller than one global batch" in rows[0]["error"] and rows[1]["error"] == ""
    assert float(rows[1]["val/accuracy"]) > 0


def test_two_jobs_with_the_same_overrides_each_train_and_train_alike(cli, tmp_path):
    """A value repeated in a sweep (or one an Optuna sampler proposes twice): two jobs."""
    one_rank = ("launcher.nproc_per_node=1", *TINY_CLI)
    result = cli("-m", "optimizer.lr=0.05,0.05", *one_rank, cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    sweep = sweep_dir(tmp_path)
    assert [row["status"] for row in summary_rows(sweep)] == ["completed", "completed"]
    assert train_losses(sweep / "0") == train_losses(sweep / "1")


def test_what_a_refusing_rank_says_reaches_the_summary(cli, tmp_path):
    """The ranks refuse the job themselves (the model does not fit the task): the reason they
    leave in the store reaches the summary through its host (framework/launch/local)."""
    result = cli("-m", "task=autoencoder", *TINY_CLI, cwd=tmp_path, timeout=240)
    assert result.returncode == 1
    [row] = summary_rows(sweep_dir(tmp_path))
    assert row["status"] == "failed"
    assert "task=autoencoder: the model returns float32 [32, 10]" in row["error"], row


def test_optuna_trials_train_with_their_values_and_return_the_objective_to_optuna(cli, tmp_path):
    """Hydra's optuna sweeper asks for two trials at a time; each is a 2-rank job of the local
    launcher, whose ranks train with the trial's values and whose app returns the objective
    (val/accuracy). (The same as submitit jobs, one task per rank, under the pruning sweeper:
    tests/integration/test_pruning_sweep.py.)"""
    result = cli(
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.direction=maximize",
        "hydra.sweeper.sampler.seed=0",
        "optimizer.lr=interval(0.01,0.3)",
        *TINY_CLI,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    sweep = sweep_dir(tmp_path)
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    rows = summary_rows(sweep)
    assert len(rows) == 2 and all(row["status"] == "completed" for row in rows)
    for row in rows:
        job = sweep / row["run_dir"]
        trial_lr = float(row["optimizer.lr"])
        assert read_metrics(job)[0]["lr"] == pytest.approx(trial_lr)
        assert json.loads((job / "summary.json").read_text())["world_size"] == 2
    assert rows[0]["optimizer.lr"] != rows[1]["optimizer.lr"]
    # The app returned the objective (val/accuracy) to optuna.
    assert best["best_value"] == pytest.approx(max(float(row["val/accuracy"]) for row in rows))


def test_an_optuna_trial_a_bound_refuses_is_one_line_in_a_sweep_that_logs_only_its_news(
    tmp_path,
):
    """A new interpreter, as a user starts it (optuna first imported as Hydra makes the
    sampler, once its logging prints INFO), torch unimportable: the trial's value is refused
    before any rank starts, and alembic's set-up lines under optuna's storage are not printed."""
    sweep = tmp_path / "sweep"
    argv = (
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=1",
        "optimizer.lr=interval(-2,-1)",
    )
    result = train_without_torch(tmp_path, *argv, f"hydra.sweep.dir={sweep}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1].startswith("error: optimizer.lr=-1.")
    assert result.stderr.splitlines()[-1].endswith(" must be > 0")
    assert "Launching 1 jobs" in result.stdout and "alembic" not in result.stdout + result.stderr


LAUNCHER_CHECKS = [
    (
        ["launcher=slurm", "launcher.tasks_per_node=2", "launcher.gpus_per_node=4"],
        {},
        ["launcher.tasks_per_node=2", "launcher.gpus_per_node=4", "launcher.tasks_per_node=4"],
    ),
    (
        ["launcher=slurm"],
        {"TORCHELASTIC_RUN_ID": "job", "LOCAL_RANK": "0"},
        ["launcher=slurm under torchrun", "not under torchrun"],
    ),
    (["launcher=slurm"], {"PATH": "/nonexistent"}, ["sbatch", "launcher=slurm_local"]),
    (["launcher=slurm", "trainer.stop_signals=[SIGTERM]"], {}, ["SIGUSR2", "trainer.stop_signals"]),
    ([], {"SLURM_STEP_NUM_TASKS": "4"}, ["one of 4 tasks of an srun step", "launcher=slurm"]),
    (["-m", "objective=accuracy"], {}, ["objective='accuracy'", "val/accuracy"]),
]


@pytest.mark.parametrize(("overrides", "env", "expected"), LAUNCHER_CHECKS, ids=lambda v: str(v))
def test_impossible_launches_are_refused_before_anything_is_submitted(
    cli, tmp_path, overrides, env, expected
):
    result = cli(*overrides, "trainer.max_steps=1", cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    for text in expected:
        assert text in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    "sigint", [signal.default_int_handler, signal.SIG_IGN], ids=["sigint-handled", "sigint-ignored"]
)
def test_a_local_task_still_running_after_its_result_is_stopped_before_the_sweep_returns(
    tmp_path, sigint
):
    """A rank hung after rank 0's result (in a collective, say) is stopped after the grace: the
    sweep's processes never outlive `train`, also where `train` started with SIGINT ignored (a
    command put in the background of a script, or a pytest-xdist worker: its job's processes
    ignore submitit's cancel). A real submitit local job, sleeping."""
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="local")
    previous = signal.signal(signal.SIGINT, sigint)
    try:
        job = executor.submit(time.sleep, 120)
    finally:
        signal.signal(signal.SIGINT, previous)
    while job.state != "RUNNING":
        time.sleep(0.1)
    Watch(SimpleNamespace(_EXECUTOR="local"), time.time()).settle([job], grace_s=1.0)
    assert job.done(force_check=True)
    assert not processes_mentioning(str(tmp_path))
