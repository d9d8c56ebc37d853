"""launcher=slurm|slurm_local, inside the job: every task runs Hydra's job (the same sweep
config, the same run dir) and is one rank (its place comes from
framework/core/launch_context.py); rank 0 hands a preemption or time-out back to submitit once
the ranks have saved. The submitting side is hydra-submitit-launcher
(hydra_plugins/) and framework/launch/slurm/partition.py."""

from __future__ import annotations

import atexit
import signal
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from framework.config.validation import validate
from framework.core import launch_context
from framework.core.exits import (
    ConfigError,
    ExitCode,
    JobFailed,
    NonFiniteLoss,
    Rejected,
    Stopped,
)
from framework.core.launch_context import DistEnv
from framework.launch.rank_entry import enter_rank, exit_now, report
from framework.launch.trial import try_here
from framework.rank.stopping import received_signals


def task_env(launcher: DictConfig) -> DistEnv:
    """This task's rank, from submitit's view of SLURM (or of its local executor). Exports the
    rendezvous of rank 0 (the first node) for torch's env:// initialisation."""
    task = launch_context.current()
    if not isinstance(task, launch_context.SubmititTask):
        raise ConfigError(
            f"launcher={launcher.name} submits jobs through Hydra's multirun: leave hydra.mode "
            "alone (`train launcher=slurm ...` or `train -m launcher=slurm ...`)"
        )
    expected = launcher.get("nodes", 1) * launcher.tasks_per_node
    if task.num_tasks() != expected:
        raise ConfigError(
            f"this job has {task.num_tasks()} tasks, but launcher.nodes x "
            f"launcher.tasks_per_node = {expected}: the submitted resources come from the "
            "sweep's launcher settings, which cannot differ between the jobs of one sweep (run "
            "one sweep per setting)"
        )
    env = task.dist_env()
    if env.distributed:
        launch_context.export_rendezvous(*task.rendezvous(launcher.master_port))
    return env


def task_rank(cfg: DictConfig, run_dir: Path) -> dict | None:
    """This task as one rank. Ranks > 0 leave as the ranks of every launcher do. Rank 0's result
    is the job's: a failure comes back to the sweep as JobFailed with its message, and a stop on
    submitit's signal goes to submitit to requeue."""
    env = task_env(cfg.launcher)
    if not env.is_main:
        try_here(cfg, env.world_size, run_dir)  # (refused alike on rank 0, which says it)
        # Exit 0 after a stop: a non-zero exit could make srun kill rank 0 (KillOnBadExit)
        # before it has saved and requeued. Rank 0 speaks for the job.
        # (No collection once its group is gone, as submitit pickles the result: one there froze
        # a rank 1 for 20 minutes; core/distributed.py, process_group.)
        return enter_rank(cfg, run_dir, env, stop_exit_code=0)
    try:
        try_here(cfg, env.world_size, run_dir)
        summary = enter_rank(cfg, run_dir, env, own_process=False)
        # submitit still writes the JobReturn; then leave without the interpreter's shutdown
        # (launch/rank_entry.py, exit_now: gloo's threads and a last collection race there).
        atexit.register(exit_now, ExitCode.DONE)
        return summary
    except Stopped as stop:
        failure = _requeue_or_exit(stop)
    except (Rejected, NonFiniteLoss) as error:  # rank 0 already logged a NonFiniteLoss
        failure = str(error)
    except Exception as error:  # noqa: BLE001
        outcome = report(error, env, cfg.dist.timeout_s)
        if received_signals():
            # Preempted, requeued or cancelled while failing (a signal reaches every process of
            # the job): no result, or the sweep would take it for the job's last word.
            exit_now(outcome.code)
        failure = {
            ExitCode.PEER_LOST: "rank 0 lost contact with the other ranks: see their logs "
            "(.submitit/)",
            ExitCode.COLLECTIVE_TIMEOUT: f"rank 0 timed out in a collective (dist.timeout_s="
            f"{cfg.dist.timeout_s:g}): another rank hung or died",
        }.get(outcome.code, f"rank 0 failed: {type(error).__name__}: {error}")
    # submitit still writes the JobReturn; then leave without the interpreter's shutdown.
    atexit.register(exit_now, ExitCode.FAILED)
    raise JobFailed(failure)


def _requeue_or_exit(stop: Stopped) -> str:
    """After the ranks stopped with a checkpoint: submitit requeues the job (and this exits),
    or refuses to; returns why it refused."""
    # The agreed signal counts too: under clock skew another rank may have got it first.
    requeue = hand_back_to_submitit(received_signals() | {stop.signal_name})
    if requeue is None:  # SLURM requeues by itself (preemption, scontrol requeue) or not
        exit_now(stop.exit_code)
    try:
        requeue()  # exits once the job is requeued
    except SystemExit as exit_:  # submitit's own code (its local executor reads it)
        exit_now(exit_.code if isinstance(exit_.code, int) else stop.exit_code)
    except Exception as error:  # noqa: BLE001 (submitit: not requeued, e.g. timed out too often)
        return f"{stop}; {error}"
    exit_now(stop.exit_code)


def follower_rank(cfg: DictConfig, run_dir: Path) -> None:
    """Rank > 0 of a submitit job: it runs rank 0's config (broadcast at the start) and writes
    nothing, so it neither judges the sweep dir nor discards files; a config it rejects ends
    it quietly (rank 0 rejects the same config and reports it)."""
    try:
        validate(cfg)
        OmegaConf.resolve(cfg)
        task_rank(cfg, run_dir)
    except Rejected:
        raise SystemExit(ExitCode.CONFIG_REJECTED) from None


def requeue_signal() -> str:
    """The signal submitit asks SLURM for before the time limit (and sends on preemption)."""
    import submitit  # only submitit tasks pay for it

    return signal.Signals(submitit.JobEnvironment._usr_sig()).name


def hand_back_to_submitit(received: set[str]) -> Callable[[], None] | None:
    """After the ranks stopped with a checkpoint: if submitit's signal was among those this task
    received, its handler (restored once training let go of the signals) decides: requeue the
    job (time-outs count against launcher.max_num_timeout) and exit, or raise
    submitit's UncompletedJobError when the job may not come back. Returns that call, or None
    when SLURM itself requeues (preemption, `scontrol requeue`) or the job was cancelled."""
    name = requeue_signal()
    handler = signal.getsignal(getattr(signal, name))
    if name not in received or not callable(handler):
        return None
    return lambda: handler(getattr(signal, name), None)
