"""How a rank ends, as an exit code, and how a launcher turns the ranks' codes back into one
root cause.

A rank that knows the cause prints it (a traceback for a bug, one line otherwise). A rank that
only lost its peers exits quietly with PEER_LOST: printing "connection closed by peer" from
every survivor would bury the one message that matters.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from omegaconf import DictConfig

from framework.config import ConfigError, ReportedConfigError
from framework.distributed import DistEnv
from framework.stopping import INTERRUPTED, STOPPED, NonFiniteLoss, StopRun, received_signals
from framework.sweep import JobFailed

FAILED = 1  # a bug or a fault; this rank printed its traceback or message
CONFIG_REJECTED = 2  # the config is wrong; rank 0 printed why
PEER_LOST = 3  # another rank vanished mid-collective; that rank (or the launcher) says why
COLLECTIVE_TIMEOUT = 4  # no answer within dist.timeout_s; this rank printed one line

_PEER_LOST_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                      "Connection refused", "connectFullMesh")  # fmt: skip
_TIMEOUT_MARKERS = ("Timed out", "timed out", "Timeout")


class WorkerFailed(RuntimeError):
    """The job failed; the message names the root-cause rank, `detail` what it said."""

    detail: str | None = None


class ReportedStop(Exception):
    """The ranks stopped on a signal with a checkpoint (rank 0 said so)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.exit_code = INTERRUPTED if signal_name == "SIGINT" else STOPPED


def run_worker(cfg: DictConfig, run_dir: Path, env: DistEnv, store=None,
               stop_exit_code: int | None = None) -> dict | None:  # fmt: skip
    """One rank of a multi-process job: run() and return its summary, or leave with an exit
    code that the launcher reads (after a stop: stop_exit_code, if given)."""
    from framework.train import run  # imported late: train's app imports this module

    try:
        return run(cfg, run_dir, env, store)
    except ConfigError as error:
        if env.is_main:
            print(f"error: {error}", file=sys.stderr, flush=True)
            _tell_launcher(store, env, str(error))
        raise SystemExit(CONFIG_REJECTED) from None
    # After training's collectives every exit skips the interpreter's shutdown (see exit_now).
    except StopRun as stop:  # rank 0 logged where the checkpoint is
        exit_now(stop.exit_code if stop_exit_code is None else stop_exit_code)
    except NonFiniteLoss as error:  # rank 0 logged where it happened
        _tell_launcher(store, env, str(error))
        exit_now(FAILED)
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, without a checkpoint
        exit_now(INTERRUPTED)
    except Exception as error:  # noqa: BLE001 (every failure becomes an exit code)
        code = _report_failure(error, env, cfg.dist.timeout_s)
        if code == FAILED:
            _tell_launcher(store, env, f"{type(error).__name__}: {error}")
        exit_now(code)


FAILURE_KEY = "framework/failure"  # + /<rank>: a rank's one-line reason, in the launcher's store


def _tell_launcher(store, env: DistEnv, message: str) -> None:
    """The launcher names the root cause; with the reason, a sweep's summary can show it."""
    if store is not None:
        with contextlib.suppress(Exception):  # best effort: the store may be gone too
            store.set(f"{FAILURE_KEY}/{env.rank}", message)


def failure_messages(store, world_size: int) -> dict[int, str]:
    """What the ranks told the launcher's store before they failed."""
    keys = {rank: f"{FAILURE_KEY}/{rank}" for rank in range(world_size)}
    return {rank: store.get(key).decode() for rank, key in keys.items() if store.check([key])}


def run_task(cfg: DictConfig, run_dir: Path, env: DistEnv) -> dict | None:
    """One rank as one submitit task (launcher=slurm|slurm_local). Ranks > 0 leave as
    run_worker's ranks do. Rank 0's result is the job's: a failure comes back to the sweep as
    JobFailed with its message, and a stop on submitit's signal goes to submitit to requeue."""
    from framework.slurm import hand_back_to_submitit
    from framework.train import run

    if not env.is_main:
        # Exit 0 after a stop: a non-zero exit could make srun kill rank 0 (KillOnBadExit)
        # before it has saved and requeued. Rank 0 speaks for the job.
        return run_worker(cfg, run_dir, env, stop_exit_code=0)
    try:
        return run(cfg, run_dir, env)
    except StopRun as stop:
        # The agreed signal counts too: under clock skew another rank may have got it first.
        requeue = hand_back_to_submitit(received_signals() | {stop.signal_name})
        if requeue is None:  # SLURM requeues by itself (preemption, scontrol requeue) or not
            exit_now(stop.exit_code)
        try:
            requeue()  # exits once the job is requeued
        except SystemExit as exit_:  # submitit's own code (its local executor reads it)
            exit_now(exit_.code if isinstance(exit_.code, int) else stop.exit_code)
        except Exception as error:  # noqa: BLE001 (submitit: not requeued, e.g. timed out too often)
            failure = f"{stop}; {error}"
        else:
            exit_now(stop.exit_code)
    except (ConfigError, NonFiniteLoss) as error:  # rank 0 already logged a NonFiniteLoss
        failure = str(error)
    except Exception as error:  # noqa: BLE001
        code = _report_failure(error, env, cfg.dist.timeout_s)
        if received_signals():
            # Preempted, requeued or cancelled while failing (a signal reaches every process of
            # the job): no result, or the sweep would take it for the job's last word.
            exit_now(code)
        failure = {
            PEER_LOST: "rank 0 lost contact with the other ranks: see their logs (.submitit/)",
            COLLECTIVE_TIMEOUT: f"rank 0 timed out in a collective (dist.timeout_s="
                                f"{cfg.dist.timeout_s:g}): another rank hung or died",
        }.get(code, f"rank 0 failed: {type(error).__name__}: {error}")  # fmt: skip
    # submitit still writes the JobReturn; then leave without the interpreter's shutdown.
    atexit.register(exit_now, FAILED)
    raise JobFailed(failure)


def exit_now(code: int) -> NoReturn:
    """Leave without the interpreter's shutdown. After a failed or abandoned collective, gloo's
    worker thread may still hold work and need the GIL to drop it while shutdown waits: seen as
    a rank that never exits (after a timeout, and once in ~50 runs after a NaN stop). The run's
    files are closed by now (sinks close in `finally`); streams and log handlers are flushed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report_failure(error: Exception, env: DistEnv, timeout_s: float) -> int:
    text = str(error)
    if any(marker in text for marker in _PEER_LOST_MARKERS):
        return PEER_LOST
    if any(marker in text for marker in _TIMEOUT_MARKERS):
        print(
            f"error: rank {env.rank} waited dist.timeout_s={timeout_s:g} s in a collective "
            "without an answer: another rank hung or died (raise dist.timeout_s if a step or "
            "a save legitimately takes longer)",
            file=sys.stderr,
            flush=True,
        )
        return COLLECTIVE_TIMEOUT
    print(f"rank {env.rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    return FAILED


def raise_for_exit_codes(codes: list[int | None], victims: set[int] | frozenset = frozenset(),
                         messages: dict[int, str] | None = None) -> None:  # fmt: skip
    """Turn every rank's exit code into nothing (all 0) or one exception naming the cause.

    Negative codes are deaths by signal (multiprocessing's convention). `victims` are ranks
    the launcher stopped after another failed: never the cause. `messages`: what ranks said
    (failure_messages), kept on the exception as `detail`."""
    if all(code == 0 for code in codes):
        return
    messages = messages or {}
    causes = [(rank, code) for rank, code in enumerate(codes) if rank not in victims]
    rejected = [rank for rank, code in causes if code == CONFIG_REJECTED]
    if rejected:
        said = [messages[rank] for rank in rejected if rank in messages]
        raise ReportedConfigError(said[0] if said else "a rank rejected the config (see above)")
    stopped = [code for _, code in causes if code in (STOPPED, INTERRUPTED)]
    if stopped and all(code in (STOPPED, INTERRUPTED, 0) for _, code in causes):
        raise ReportedStop("SIGINT" if INTERRUPTED in stopped else "SIGTERM")
    for wanted, describe in (
        (lambda c: c == FAILED, "failed (its output is above)"),
        (lambda c: c is not None and c < 0, None),
        (lambda c: c == COLLECTIVE_TIMEOUT, "timed out in a collective (see above)"),
        (lambda c: c == PEER_LOST, "lost contact with the other ranks"),
        (lambda c: c != 0, None),
    ):
        for rank, code in causes or list(enumerate(codes)):
            if wanted(code):
                failure = WorkerFailed(f"rank {rank} {describe or _describe(code)}")
                failure.detail = messages.get(rank)
                raise failure


def _describe(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
