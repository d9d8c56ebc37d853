"""launcher=slurm against a real SLURM cluster (CI starts one: launchers/slurm_cluster.sh).

Skipped, with the reason, where no cluster answers; failed instead under CI=true, so a green
CI means they ran. The jobs are real sbatch array jobs whose srun tasks are the ranks of 2-rank
gloo groups."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import DIST_ENV_VARS, FAULTS, read_metrics, train_losses, unavailable
from tests.faults import FAULT_ENV, GATE_ENV, assert_same_weights, final_weights
from tests.integration.test_sweeps import TINY_CLI, summary_rows, sweep_dir


def _cluster_missing() -> str | None:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "no SLURM client on PATH (start one: launchers/slurm_cluster.sh start)"
    try:
        state = subprocess.run(
            ["sinfo", "--noheader", "--format=%t"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:  # a controller named in the config that never answers
        return "no SLURM controller answered sinfo within 30 s"
    if state.returncode != 0 or not {"idle", "mix", "alloc"} & set(state.stdout.split()):
        return f"no SLURM node is up (sinfo: {state.stdout.strip() or state.stderr.strip()})"
    return None


pytestmark = pytest.mark.slow


@pytest.fixture(scope="session", autouse=True)
def slurm_cluster() -> None:
    """Before the session's other fixtures (the reference runs): nothing is trained for a test
    that cannot run. Asked here, not on import: collecting the quick tests never waits for
    sinfo."""
    missing = _cluster_missing()
    if missing is not None:
        unavailable(missing)


SLURM = ("launcher=slurm", "launcher.tasks_per_node=2", "launcher.timeout_min=10")


def test_a_two_job_sweep_runs_each_job_as_two_srun_tasks_and_fails_a_job_out_of_time_outs(
    tmp_path, fault_references
):
    """One SLURM array job of two elements, each two srun tasks. Job 0 trains as a local run
    does. Job 1 (max_steps=40) holds at its step 31 until SIGUSR2 as before a time limit: with
    launcher.max_num_timeout=0 it saves, submitit refuses to requeue, and the sweep reports it
    failed instead of waiting, its checkpoint kept. (One sweep for both: every job start costs
    a full import of the training stack.)"""
    gate = tmp_path / "gate"
    gate.touch()  # job 0 never reaches step 31, so only job 1 holds
    env = {FAULT_ENV: "hold:0:31", GATE_ENV: str(gate)}
    overrides = ("trainer.max_steps=30,40", "launcher.max_num_timeout=0")
    with _sweep_in_background(tmp_path, *overrides, env=env) as (sweep_process, sweep):
        _wait_for_step(sweep / "1", 30, sweep_process, timeout=300)
        subprocess.run(
            ["scancel", "--signal=USR2", f"{_array_id(sweep)}_1"], check=True, timeout=30
        )
        _, stderr = sweep_process.communicate(timeout=300)
    assert sweep_process.returncode == 1, stderr[-3000:]
    assert "timed-out too many times" in stderr and "Traceback" not in stderr
    rows = summary_rows(sweep)
    assert [(row["job"], row["status"], row["trainer.max_steps"]) for row in rows] == [
        ("0", "completed", "30"),
        ("1", "failed", "40"),
    ]
    assert "stopped on SIGUSR2 at step" in rows[1]["error"]
    assert (sweep / "1" / "checkpoints" / "last.pt").exists()
    # One SLURM array job (<id>_<element>), two tasks per element, each task one rank.
    array_id = _array_id(sweep)
    logs = sorted(path.name for path in sweep.glob(".submitit/*/*_log.err"))
    assert logs == [f"{array_id}_{job}_{task}_log.err" for job in (0, 1) for task in (0, 1)]
    for job in (0, 1):  # the second job waited in the queue for the first
        logged, since_task_start = _startup_of(sweep / ".submitit" / f"{array_id}_{job}")
        assert logged <= since_task_start + 2.0  # (the rank's log times are whole seconds)

    local = fault_references["allreduce"]  # the same experiment, run by the local launcher's ranks
    assert train_losses(sweep / "0") == train_losses(local)
    assert read_metrics(sweep / "0")[-1]["val/accuracy"] == read_metrics(local)[-1]["val/accuracy"]


def _array_id(sweep: Path) -> str:
    """The SLURM array job's id, from submitit's folders (<id>_<element>)."""
    return sorted(sweep.glob(".submitit/*_0"))[0].name.removesuffix("_0")


def _startup_of(task_logs: Path) -> tuple[float, float]:
    """Rank 0's start-up line ("start-up: 9.8 s to the first step"), and the seconds from the
    moment submitit started the task to the moment that line was logged: a task counts its
    start-up from its own start, not from the command that submitted it."""
    out = next(task_logs.glob("*_0_log.out")).read_text()
    started = re.search(r"\((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)\) - Starting with", out)
    started_at = datetime.strptime(started.group(1), "%Y-%m-%d %H:%M:%S,%f")
    err = next(task_logs.glob("*_0_log.err")).read_text()
    line = re.search(r"\[(\d\d:\d\d:\d\d)\]\[rank 0\] start-up: ([\d.]+) s to the first step", err)
    clock = datetime.strptime(line.group(1), "%H:%M:%S").time()
    logged_at = datetime.combine(started_at.date(), clock)
    since_start = (logged_at - started_at).total_seconds() % 86400  # (past midnight)
    return float(line.group(2)), since_start


def test_a_missing_partition_is_refused_before_anything_is_submitted(cli, tmp_path):
    result = cli(*SLURM, "launcher.partition=nope", *TINY_CLI, cwd=tmp_path)
    assert result.returncode == 2
    assert "launcher.partition=nope: nope does not exist" in result.stderr
    assert "choose from debug" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "multirun").exists()


def _wait_for_step(run_dir: Path, step: int, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists():
            steps = [e["step"] for e in read_metrics(run_dir) if "train/loss" in e]
            if steps and steps[-1] >= step:
                return
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def _job_id(sweep: Path) -> str:
    [folder] = [path for path in sweep.glob(".submitit/*") if path.name[0].isdigit()]
    return folder.name


@contextlib.contextmanager
def _sweep_in_background(tmp_path: Path, *overrides: str, env: dict[str, str | None]):
    """`train` with launcher=slurm and the fault experiment, running while the test acts on its
    job. Yields the process and the sweep dir once job 0's dir exists; never leaves the
    process or the SLURM job behind."""
    full_env = {name: value for name, value in os.environ.items() if name not in DIST_ENV_VARS}
    for name, value in env.items():
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    command = [sys.executable, "-m", "framework.train", *SLURM, *FAULTS, *overrides]
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("multirun/*/*/0")) and time.monotonic() < deadline:
            time.sleep(0.2)
        yield process, sweep_dir(tmp_path)
    finally:
        if process.poll() is None:
            process.kill()
            for folder in tmp_path.glob("multirun/*/*/.submitit/[0-9]*"):
                subprocess.run(["scancel", folder.name], timeout=30)


def test_a_requeued_and_a_preempted_job_resume_in_the_same_run_dir_and_wandb_run(
    tmp_path, fault_references
):
    """`scontrol requeue` (SIGTERM; SLURM requeues) and SIGUSR2 as before a time limit (the
    ranks save, submitit requeues): each time the job comes back, resumes from its checkpoint
    and ends with the weights of an uninterrupted run."""
    env = {FAULT_ENV: "slow:0:1", "WANDB_MODE": "offline", "WANDB_API_KEY": None}
    overrides = ("logger=wandb", "launcher.max_num_timeout=1")
    with _sweep_in_background(tmp_path, *overrides, env=env) as (sweep_process, sweep):
        run_dir = sweep / "0"
        _wait_for_step(run_dir, 9, sweep_process, timeout=120)
        job_id = _job_id(sweep)
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
        # Back from the requeue: the log says so, then SIGUSR2 to the job's tasks.
        deadline = time.monotonic() + 240
        while "resumed from" not in _rank0_log(sweep) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "resumed from" in _rank0_log(sweep)
        resumed_at = _resumed_steps(sweep)[0]
        _wait_for_step(run_dir, resumed_at + 3, sweep_process, timeout=120)
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        stdout, stderr = sweep_process.communicate(timeout=400)
    assert sweep_process.returncode == 0, stderr[-3000:]
    assert [row["status"] for row in summary_rows(sweep)] == ["completed"]
    assert len(_resumed_steps(sweep)) == 2  # came back twice, each time from a checkpoint
    assert_same_weights(final_weights(run_dir), final_weights(fault_references["allreduce"]))
    assert [e["step"] for e in read_metrics(run_dir) if "train/loss" in e] == list(range(1, 31))
    segments = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(segments) == 3 and len({s.name.rsplit("-", 1)[1] for s in segments}) == 1


def _rank0_log(sweep: Path) -> str:
    return "".join(path.read_text() for path in sweep.glob(".submitit/*/*_0_log.err"))


def _resumed_steps(sweep: Path) -> list[int]:
    return [
        int(line.split(" at step ")[1].split()[0])
        for line in _rank0_log(sweep).splitlines()
        if "resumed from" in line
    ]
