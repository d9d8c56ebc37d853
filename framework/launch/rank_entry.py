"""The one way into a rank, from every start path (framework/launch/start.py's table), and how
the rank's outcome becomes an exit code (framework/core/exits.py's table)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import DictConfig

from framework.core.exits import (
    ExitCode,
    Outcome,
    OutOfMemory,
    Rejected,
    Stopped,
    announce,
    is_out_of_memory,
    out_of_memory,
    outcome_of,
)
from framework.core.launch_context import DistEnv
from framework.core.leaving import run_leaving_tasks
from framework.core.secrets import scrubbed_console
from framework.launch.failure_store import tell_launcher
from framework.rank.main import rank_main


def enter_rank(
    cfg: DictConfig,
    run_dir: Path,
    env: DistEnv,
    store=None,
    *,
    own_process: bool = True,
    stop_exit_code: int | None = None,
) -> dict | None:
    """Run this rank; returns its summary (rank 0's; None elsewhere).

    In a process of its own (own_process), every way out becomes the exit code its launcher
    reads (after a stop: stop_exit_code, if given), and the reason goes to the launcher's
    store. In the process that runs the app (one rank in the process, a SLURM job's rank 0),
    the outcome is raised for the app to report."""
    with scrubbed_console():  # what a library prints in a rank (W&B, a warning)
        return _enter_rank(cfg, run_dir, env, store, own_process, stop_exit_code)


def _enter_rank(
    cfg: DictConfig,
    run_dir: Path,
    env: DistEnv,
    store: Any,
    own_process: bool,
    stop_exit_code: int | None,
) -> dict | None:
    if not own_process:
        try:
            return rank_main(cfg, run_dir, env, store)
        except Exception as error:
            if is_out_of_memory(error):  # the app says it in one line and exits as the table says
                raise OutOfMemory(out_of_memory(env.rank, error)) from None
            raise
    try:
        return rank_main(cfg, run_dir, env, store)
    except BaseException as error:  # noqa: BLE001 (every way out becomes an exit code)
        outcome = report(error, env, cfg.dist.timeout_s, store)
        if isinstance(error, Rejected):  # before training: a normal exit
            raise SystemExit(outcome.code) from None
        if stop_exit_code is not None and isinstance(error, Stopped):
            exit_now(stop_exit_code)
        exit_now(outcome.code)


def report(error: BaseException, env: DistEnv, timeout_s: float, store=None) -> Outcome:
    """Print what this rank prints for `error` and tell the launcher's store the reason."""
    if isinstance(error, SystemExit):
        raise error
    outcome = outcome_of(error, env.rank, timeout_s)
    told = bool(outcome.reason) and store is not None
    if told:
        tell_launcher(store, env.rank, outcome.reason)
    # Every rank of a ddp job runs out of memory at the same step: the launcher that reads
    # their reasons says the first once, instead of a line from each.
    if not (told and outcome.code == ExitCode.OUT_OF_MEMORY):
        announce(outcome)
    return outcome


def exit_now(code: int) -> NoReturn:
    """Leave without the interpreter's shutdown. Gloo's worker threads may still hold work and
    need the GIL to drop it while shutdown holds it: after a failed or abandoned collective a
    rank that never exits (after a timeout, and once in ~50 runs after a NaN stop); after a run
    that ended well, shutdown's last collection frees DDP's reducer while a gloo thread frees
    an allreduce's tensors, and that thread, ended without the GIL, aborts the rank ("terminate
    called without an active exception": a core dump showed it, in about 1 of 15 external
    torchrun runs here). The run's files are closed by now (sinks close in `finally`); streams
    and log handlers are flushed."""
    run_leaving_tasks()  # (what the shutdown would have run)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
