"""launcher=slurm against a real SLURM cluster (CI starts one: launchers/slurm_cluster.sh).

Skipped, with the reason, where no cluster answers; failed instead under CI=true, so a green
CI means they ran. The jobs are real sbatch array jobs whose srun tasks are the ranks of 2-rank
gloo groups. The two jobs of a sweep run side by side: on one node, its cores must take both
(launchers/slurm_cluster.sh lets jobs share them)."""

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

from tests.conftest import (
    DIST_ENV_VARS,
    FAULTS,
    SHADOWING_MODULE,
    plant_shadowing_modules,
    read_metrics,
    train_losses,
    unavailable,
)
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


def test_a_two_job_sweep_comes_back_from_requeue_and_preemption_and_fails_a_job_out_of_time_outs(
    tmp_path, fault_references
):
    """One SLURM array job of two elements, each two srun tasks, side by side. Both hold at their
    9th step in each start (FRAMEWORK_TEST_GATE) until a signal, so each is acted on at a known
    step:
    - job 0: `scontrol requeue` (SIGTERM; SLURM requeues). It comes back, resumes from its
      checkpoint in the same dir, and ends with the losses and weights of an
      uninterrupted run (the local launcher's).
    - job 1: SIGUSR2 as before a time limit. The ranks save and submitit requeues (its one
      time-out, launcher.max_num_timeout=1); it comes back and resumes alike. A second SIGUSR2
      finds no time-out left: submitit refuses, and the sweep reports the job failed instead of
      waiting, its checkpoint kept.
    (One sweep for all: every job start costs a full import of the training stack, and the two
    jobs come back from their requeues together, let go 2 s on rather than after SLURM's hold:
    _released.)"""
    gate = tmp_path / "gate"
    gate.touch()
    env = {FAULT_ENV: "hold:0:9", GATE_ENV: str(gate)}
    # Two jobs that train alike (checkpoint.keep only decides how many files stay), so both
    # compare with the one uninterrupted reference run.
    overrides = ("checkpoint.keep=3,4", "launcher.max_num_timeout=1")
    with _sweep_in_background(tmp_path, *overrides, env=env) as (sweep_process, sweep):
        jobs = (sweep / "0", sweep / "1")
        for run_dir in jobs:  # each holds in its 9th step: 8 logged
            _wait_for_step(run_dir, 8, sweep_process, timeout=180)
        array_id = _array_id(sweep)
        _slurm("scontrol", "requeue", f"{array_id}_0")
        _slurm("scancel", "--signal=USR2", f"{array_id}_1")
        for job in (0, 1):  # (job 1 requeued by its rank 0's task, as submitit does)
            _released(f"{array_id}_{job}", sweep_process)
        # Back from the requeues, each resumed and holding again 9 steps on.
        for job, run_dir in enumerate(jobs):
            _wait_until(
                lambda job=job: len(_resumed_steps(sweep, job)) == 1,
                f"job {job} resumed",
                sweep_process,
                180,
            )
            _wait_for_step(run_dir, _resumed_steps(sweep, job)[0] + 8, sweep_process, timeout=180)
        _slurm("scancel", "--signal=USR2", f"{array_id}_1")
        # Job 1 has stopped (on the signal, not at its end) before job 0 may go on to its end.
        _wait_until(
            lambda: len(_stopped_steps(sweep, 1, "SIGUSR2")) == 2,
            "job 1 stopped twice",
            sweep_process,
            180,
        )
        gate.unlink()
        _, stderr = sweep_process.communicate(timeout=300)
    assert sweep_process.returncode == 1, stderr[-3000:]
    assert "timed-out too many times" in stderr and "Traceback" not in stderr
    assert SHADOWING_MODULE not in stderr + _task_logs(sweep)
    rows = summary_rows(sweep)
    assert [(row["job"], row["status"]) for row in rows] == [("0", "completed"), ("1", "failed")]
    assert "stopped on SIGUSR2 at step" in rows[1]["error"]
    assert (sweep / "1" / "checkpoints" / "last.pt").exists()
    # One SLURM array job (<id>_<element>), two tasks per element, each task one rank.
    logs = sorted(path.name for path in sweep.glob(".submitit/*/*_log.err"))
    assert logs == [f"{array_id}_{job}_{task}_log.err" for job in (0, 1) for task in (0, 1)]

    # Each job came back once, from the checkpoint of the step where it stopped; job 1 stopped
    # a second time, for good.
    stopped = [_stopped_steps(sweep, 0, "SIGTERM"), _stopped_steps(sweep, 1, "SIGUSR2")]
    assert [len(steps) for steps in stopped] == [1, 2]
    assert [_resumed_steps(sweep, job) for job in (0, 1)] == [steps[:1] for steps in stopped]
    local = fault_references["allreduce"]  # the same experiment, run by the local launcher's ranks
    ends = (30, stopped[1][-1])
    for run_dir, end in zip(jobs, ends, strict=True):  # every step once, as in one straight run
        assert [e["step"] for e in read_metrics(run_dir) if "train/loss" in e] == list(
            range(1, end + 1)
        )
        assert train_losses(run_dir) == train_losses(local)[:end]
    assert read_metrics(jobs[0])[-1]["val/accuracy"] == read_metrics(local)[-1]["val/accuracy"]
    assert_same_weights(final_weights(jobs[0]), final_weights(local))
    # A task counts its start-up from its own start, not from the command that submitted it
    # (which a requeued start follows by a whole run and SLURM's hold).
    for job in (0, 1):
        startups = _startups_of(sweep / ".submitit" / f"{array_id}_{job}")
        assert len(startups) == 2
        for logged, since_task_start in startups:
            assert logged <= since_task_start + 2.0  # (the rank's log times are whole seconds)


def test_a_missing_partition_is_refused_before_anything_is_submitted(cli, tmp_path):
    result = cli(*SLURM, "launcher.partition=nope", *TINY_CLI, cwd=tmp_path)
    assert result.returncode == 2
    assert "launcher.partition=nope: nope does not exist" in result.stderr
    assert "choose from debug" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "multirun").exists()


def _slurm(*command: str) -> None:
    subprocess.run(command, check=True, timeout=30)


def _released(job: str, process: subprocess.Popen) -> None:
    """Once `job` is back in the queue after a requeue, lets it start 2 s on. SLURM holds a
    requeued job until its first start's credential has expired (cred_expire + 1 s: 6-7 s on
    this cluster, where 5 s is the least slurmctld takes); a credential made in a later second
    than the revocation is valid already. How long SLURM holds is not what is tested here."""

    def pending() -> bool:
        state = subprocess.run(
            ["squeue", "--noheader", "--jobs", job, "--format=%T"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return state.stdout.strip() == "PENDING"

    _wait_until(pending, f"{job} back in the queue", process, 60)
    update = ["scontrol", "update", f"jobid={job}", "starttime=now+2"]
    updated = subprocess.run(update, capture_output=True, text=True, timeout=30)
    assert updated.returncode == 0 or not pending(), updated.stderr  # (or SLURM's hold ended)


def _array_id(sweep: Path) -> str:
    """The SLURM array job's id, from submitit's folders (<id>_<element>)."""
    return sorted(sweep.glob(".submitit/*_0"))[0].name.removesuffix("_0")


def _startups_of(task_logs: Path) -> list[tuple[float, float]]:
    """For each start of the job: rank 0's start-up line ("start-up: 9.8 s to the first step"),
    and the seconds from the moment submitit started the task to the moment that line was
    logged."""
    out = next(task_logs.glob("*_0_log.out")).read_text()
    starts = re.findall(r"\((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)\) - Starting with", out)
    err = next(task_logs.glob("*_0_log.err")).read_text()
    lines = re.findall(
        r"\[(\d\d:\d\d:\d\d)\]\[rank 0\] start-up: ([\d.]+) s to the first step", err
    )
    assert len(starts) == len(lines), (starts, lines)
    startups = []
    for started, (clock, logged) in zip(starts, lines, strict=True):
        started_at = datetime.strptime(started, "%Y-%m-%d %H:%M:%S,%f")
        logged_at = datetime.combine(started_at.date(), datetime.strptime(clock, "%H:%M:%S").time())
        since_start = (logged_at - started_at).total_seconds() % 86400  # (past midnight)
        startups.append((float(logged), since_start))
    return startups


@contextlib.contextmanager
def _sweep_in_background(tmp_path: Path, *overrides: str, env: dict[str, str | None]):
    """`train` with launcher=slurm and the fault experiment, running while the test acts on its
    job, in a folder holding a project's re.py, numbers.py and random.py (which no task may
    import). Yields the process and the sweep dir once job 0's dir exists; never leaves the
    process or the SLURM job behind."""
    plant_shadowing_modules(tmp_path)
    full_env = {name: value for name, value in os.environ.items() if name not in DIST_ENV_VARS}
    for name, value in env.items():
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    command = [str(Path(sys.executable).parent / "train"), *SLURM, *FAULTS, *overrides]
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


def _wait_for_step(run_dir: Path, step: int, process: subprocess.Popen, timeout: float) -> None:
    def reached() -> bool:
        if not (run_dir / "metrics.jsonl").exists():
            return False
        steps = [e["step"] for e in read_metrics(run_dir) if "train/loss" in e]
        return bool(steps) and steps[-1] >= step

    _wait_until(reached, f"{run_dir.name}: step {step}", process, timeout)


def _wait_until(condition, what: str, process: subprocess.Popen, timeout: float) -> None:
    """Until condition() holds. Fails at once if the sweep's process ended, and after timeout s
    with the queue in the message (a cluster whose jobs cannot share a node's cores holds job 1
    back while job 0 holds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.communicate()[1][-3000:]
        if time.monotonic() > deadline:
            queue = subprocess.run(
                ["squeue", "--format=%i %T %r"], capture_output=True, text=True, timeout=30
            )
            raise AssertionError(f"{what}: not after {timeout} s. squeue:\n{queue.stdout}")
        time.sleep(0.2)


def _task_logs(sweep: Path) -> str:
    return "".join(path.read_text() for path in sweep.glob(".submitit/*/*_log.err"))


def _rank0_log(sweep: Path, job: int) -> str:
    """What rank 0 of the sweep's job logged, every start of it."""
    return "".join(path.read_text() for path in sweep.glob(f".submitit/*_{job}/*_{job}_0_log.err"))


def _resumed_steps(sweep: Path, job: int) -> list[int]:
    return [
        int(step) for step in re.findall(r"resumed from \S+ at step (\d+)", _rank0_log(sweep, job))
    ]


def _stopped_steps(sweep: Path, job: int, signal: str) -> list[int]:
    return [
        int(step)
        for step in re.findall(rf"stopped on {signal} at step (\d+)", _rank0_log(sweep, job))
    ]
