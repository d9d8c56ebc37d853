"""launcher=slurm|slurm_local, the submitting side: hydra-submitit-launcher's launchers submit
the jobs; this waits differently for them.

hydra-submitit-launcher waits for every task of every job through `sacct`; a task that died
without a result (killed, out of memory, a rank that left with os._exit) then leaves the sweep
waiting forever where SLURM keeps no accounting, and raises out of the whole sweep where it
does. Here the sweep waits for rank 0's result (the task that runs the job's Hydra task function
to its end), or for the job to leave the queue without one, and records that job as failed.
framework/app/summarized_sweep.py's SubmittedSweep calls it, once a sweep launches.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import OmegaConf, open_dict

from framework.core.exits import JobFailed
from framework.launch.forkserver import started_without_the_working_dir

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often the submitting process looks for a job's result
STATE_POLL_S = 5.0  # how often it asks the scheduler about the job
RESULT_GRACE_S = 20.0  # a job that left the queue may still show its result this late
# submitit's local controller polls its tasks, SIGKILLs them 1 s after a SIGINT, then exits.
CANCEL_GRACE_S = 5.0
# SLURM job states after which no result will come (a requeued job goes back to PENDING).
ENDED_STATES = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "TIMEOUT",
    "SPECIAL_EXIT",
}


def submit_and_wait(launcher: Any, job_overrides: Any, initial_job_idx: int) -> list[JobReturn]:
    """A submitit launcher's launch() (its executor set-up, `launcher.params`), waiting for each
    job's rank 0 result; `launcher.job_ended(num, result)` as each comes (the sweep summary
    grows row by row)."""
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    log.info("Submitit '%s' sweep output dir: %s", launcher._EXECUTOR, sweep_dir)
    arguments = []
    for num, overrides in enumerate(job_overrides, start=initial_job_idx):
        log.info("\t#%d : %s", num, " ".join(filter_overrides(overrides)))
        arguments.append(
            (list(overrides), "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state())
        )
    submitted_at = time.time()
    try:
        # sbatch and submitit's local controller pass this environment on; InTask puts the
        # working dir last.
        with started_without_the_working_dir() as set_here:
            task = InTask(launcher, unset_safe_path=set_here)
            jobs = _executor(launcher).map_array(task, *zip(*arguments, strict=True))
    except Exception as error:  # noqa: BLE001 (sbatch's refusal, as one message)
        raise JobFailed(f"{launcher._EXECUTOR}: the jobs were not submitted: {error}") from None
    for job, (overrides, *_rest) in zip(jobs, arguments, strict=True):
        log.info("job %s: %s", job.job_id, " ".join(filter_overrides(overrides)))
    watch = Watch(launcher, submitted_at)
    returns = []
    for num, job in enumerate(jobs, start=initial_job_idx):
        returns.append(watch.result(job, num, arguments[num - initial_job_idx][0]))
        launcher.job_ended(num, returns[-1])
    watch.settle(jobs)
    return returns


class Watch:
    """Rank 0's result of each job of one submission: from submitit's result file, or the
    job's state in the queue (`squeue` on a cluster, submitit's own watch of its local
    processes)."""

    def __init__(self, launcher: Any, submitted_at: float) -> None:
        self.launcher, self.submitted_at = launcher, submitted_at
        self.executor = launcher._EXECUTOR
        self.on_cluster = self.executor == "slurm"

    def result(self, job: Any, num: int, overrides: list[str]) -> JobReturn:
        """Rank 0's JobReturn. A completed one counts at once; a failed one once the job has
        left the queue (a requeued job runs again and writes a new one); none, RESULT_GRACE_S
        after the job left the queue (a shared filesystem may show a new file late)."""
        rank0 = job.task(0)
        ended_at: float | None = None
        state, state_at = "UNKNOWN", 0.0
        while True:
            outcome = _fresh_result(rank0.paths.result_pickle, self.submitted_at)
            if outcome is not None and _completed(outcome):
                return outcome[1]
            if time.monotonic() - state_at >= STATE_POLL_S:
                state, state_at = self._state(job), time.monotonic()
                ended_at = (ended_at or time.monotonic()) if self._is_ended(job, state) else None
            if outcome is not None and ended_at is not None:
                return self._as_return(num, overrides, outcome, job, rank0)
            if ended_at is not None and time.monotonic() - ended_at > RESULT_GRACE_S:
                return self._failed(
                    num,
                    overrides,
                    JobFailed(
                        f"{self.executor} job {job.job_id} ended without a result ({state}); "
                        f"its log: {rank0.paths.stderr}"
                    ),
                )
            time.sleep(POLL_S)

    def settle(self, jobs: list[Any], grace_s: float = RESULT_GRACE_S) -> None:
        """The local executor's tasks are processes of this machine: the sweep ends once they
        have left, so none outlives `train` (rank 0's result comes first; the other ranks were
        still writing theirs). One still running `grace_s` later (a rank hung in a collective
        after rank 0 failed) is stopped: SIGINT, as submitit cancels, and SIGKILL to the job's
        processes if that did not end it (a process started with SIGINT ignored, as a command put
        in the background of a script is, passes that on to the job). A cluster's tasks are
        SLURM's to end."""
        if self.on_cluster or _all_left(jobs, grace_s):
            return
        running = [job for job in jobs if not job.done(force_check=True)]
        for job in running:
            log.warning("job %s ran on %g s after its result: stopped", job.job_id, grace_s)
            job.cancel(check=False)  # SIGINT: its ranks stop as on Ctrl-C
        if _all_left(running, CANCEL_GRACE_S):
            return
        for job in running:  # a local job's id is its controller's pid
            for pid in _process_tree(int(job.job_id)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        _all_left(running, CANCEL_GRACE_S)

    def _as_return(
        self, num: int, overrides: list[str], outcome: tuple, job: Any, rank0: Any
    ) -> JobReturn:
        kind, value = outcome
        if kind == "success":
            return value  # Hydra's JobReturn, status FAILED
        lines = str(value).strip().splitlines() or [repr(value)]  # the task raised outside Hydra
        return self._failed(
            num,
            overrides,
            JobFailed(f"{self.executor} job {job.job_id}: {lines[-1]} (log: {rank0.paths.stderr})"),
        )

    def _failed(self, num: int, overrides: list[str], error: Exception) -> JobReturn:
        launcher = self.launcher
        config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
        with open_dict(config):
            config.hydra.job.num = num
        job_dir = Path(config.hydra.sweep.dir, str(config.hydra.sweep.subdir))
        ret = JobReturn(overrides=overrides, status=JobStatus.FAILED, working_dir=str(job_dir))
        ret.return_value = error
        return ret

    def _is_ended(self, job: Any, state: str) -> bool:
        if self.on_cluster:
            return state in ENDED_STATES or state == "GONE"
        return bool(job.done(force_check=True))  # the local executor watches its processes

    def _state(self, job: Any) -> str:
        """squeue's view on a cluster (no accounting needed; GONE once SLURM forgot the job),
        else submitit's."""
        if not self.on_cluster:
            return str(job.state)
        try:
            listing = subprocess.run(
                ["squeue", "--noheader", "--states=all", "--format=%T", f"--jobs={job.job_id}"],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (subprocess.TimeoutExpired, OSError):
            return "UNKNOWN"  # slurmctld busy or unreachable: ask again later
        states = listing.stdout.split()
        if listing.returncode != 0 and "Invalid job id" not in listing.stderr:
            return "UNKNOWN"
        return states[0] if states else "GONE"


def _all_left(jobs: list[Any], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not all(job.done(force_check=True) for job in jobs):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S / 10)
    return True


def _process_tree(root: int) -> list[int]:
    """`root` and every process under it, parents first (Linux's /proc; elsewhere `root`)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The fields after the command name, which may hold spaces and parentheses.
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    tree = [root]
    for pid in tree:
        tree.extend(children.get(pid, []))
    return tree


class InTask:
    """What each task runs: the launcher, pickled apart, so that unpickling this object puts the
    working dir last on the task's path before the launcher's state (a project's own Hydra
    callbacks) loads."""

    def __init__(self, launcher: Any, unset_safe_path: bool) -> None:
        import cloudpickle  # (submitit's own pickler)

        self.pickled_launcher = cloudpickle.dumps(launcher)
        self.unset_safe_path = unset_safe_path

    def __setstate__(self, state: dict[str, Any]) -> None:
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        if state["unset_safe_path"]:  # the task's own children get the user's environment
            os.environ.pop("PYTHONSAFEPATH", None)
        self.__dict__.update(state)

    def __call__(self, *args: Any) -> Any:
        return pickle.loads(self.pickled_launcher)(*args)

    def checkpoint(self, *args: Any) -> Any:
        """submitit's requeue (as hydra-submitit-launcher's): this call again, as it was."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args)


def _executor(launcher: Any) -> Any:
    import submitit

    # As hydra-submitit-launcher: max_num_timeout goes to the executor, keys shared by all
    # executors as they are, the others prefixed with the executor's name.
    name, params = launcher._EXECUTOR, dict(launcher.params)
    folder = params.pop("submitit_folder")
    init = (
        {f"{name}_max_num_timeout": params.pop("max_num_timeout")}
        if "max_num_timeout" in params
        else {}
    )
    executor = submitit.AutoExecutor(folder=folder, cluster=name, **init)
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(
        **{key if key in shared else f"{name}_{key}": value for key, value in params.items()}
    )
    return executor


def _fresh_result(path: Path, submitted_at: float) -> tuple[str, Any] | None:
    """submitit's (outcome, value) for rank 0, if written by this submission (a sweep run
    again in the same dir may find an old one; job ids repeat)."""
    from submitit.core.utils import pickle_load

    try:
        path.parent.chmod(path.parent.stat().st_mode)  # refresh a shared filesystem's view
        if path.stat().st_mtime < submitted_at - 1:
            return None
        return pickle_load(path)
    except (OSError, EOFError):  # not there yet, or being replaced
        return None


def _completed(outcome: tuple[str, Any]) -> bool:
    kind, value = outcome
    return kind == "success" and getattr(value, "status", None) == JobStatus.COMPLETED
