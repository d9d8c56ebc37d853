"""Start the ranks of one run from the process Hydra started.

Workers receive the already-resolved config and the run directory; they never compose a
config again. `local` spawns processes itself; `torchrun` hands them to torch's elastic agent
(what the `torchrun` command runs), which adds restarts and multi-node rendezvous.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import multiprocessing.connection as mp_connection
import os
import signal
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig

from framework.distributed import DistEnv
from framework.slurm import task_env
from framework.stopping import stop_signal_names
from framework.train import run
from framework.workers import (
    ReportedStop,
    failure_messages,
    raise_for_exit_codes,
    run_task,
    run_worker,
)

EXIT_GRACE_S = 3.0  # after a rank fails: time for the others to exit before SIGTERM, then SIGKILL


def launch(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Run cfg with cfg.launcher; returns rank 0's summary."""
    nproc = cfg.launcher.nproc_per_node
    if cfg.launcher.name in ("slurm", "slurm_local"):  # this process is one task: one rank
        return run_task(cfg, run_dir, task_env(cfg.launcher))
    if cfg.launcher.name == "torchrun":
        _launch_elastic(cfg, run_dir)
    elif nproc == 1:
        return run(cfg, run_dir, DistEnv())
    else:
        _launch_local(cfg, run_dir, nproc)
    summary_file = run_dir / "summary.json"
    return json.loads(summary_file.read_text()) if summary_file.exists() else None


# --- launcher=local: torch.multiprocessing spawn, rendezvous on a store this process hosts ----
def _launch_local(cfg: DictConfig, run_dir: Path, nproc: int) -> None:
    # After a rank fails, spawn's "Terminating process ... via SIGTERM" only adds noise.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    # Port 0: the OS picks a free port, so concurrent runs and tests never collide.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.start_processes(
        _local_worker,
        args=(cfg, run_dir, store.port, nproc),
        nprocs=nproc,
        join=False,
        start_method="spawn",
    )
    signals = stop_signal_names(list(cfg.trainer.stop_signals))
    with _forward_signals(signals, [p.pid for p in context.processes]):
        victims = _wait_for_ranks(context.processes)
    codes = [process.exitcode for process in context.processes]
    if any(code != 0 for code in codes):
        raise_for_exit_codes(codes, victims, failure_messages(store, nproc))


def _wait_for_ranks(processes: list) -> set[int]:
    """Wait for every rank. Once one fails, the others get EXIT_GRACE_S to exit on their own,
    then SIGTERM, then SIGKILL as long after: no process is left behind. Returns the ranks
    this function had to stop (their exit codes are consequences, not causes)."""
    failed_at: float | None = None
    victims: set[int] = set()
    while alive := [p for p in processes if p.exitcode is None]:
        mp_connection.wait([p.sentinel for p in alive], timeout=0.5)
        if failed_at is None and any(p.exitcode not in (None, 0) for p in processes):
            failed_at = time.monotonic()
        if failed_at is None:
            continue
        waited = time.monotonic() - failed_at
        for rank, process in enumerate(processes):
            if process.exitcode is not None or waited <= EXIT_GRACE_S:
                continue
            if waited > 2 * EXIT_GRACE_S:
                process.kill()
            elif rank not in victims:
                process.terminate()
            victims.add(rank)
    for process in processes:
        process.join()
    return victims


@contextlib.contextmanager
def _forward_signals(names: list[str], pids: list[int]) -> Iterator[None]:
    """Signals sent to the launcher reach every rank (ranks count repeats once)."""

    def forward(signum: int, frame: object) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {}
    for name in names:
        signum = getattr(signal, name)
        previous[signum] = signal.signal(signum, forward)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _local_worker(local_rank: int, cfg: DictConfig, run_dir: Path, port: int, nproc: int) -> None:
    env = DistEnv(
        rank=local_rank, local_rank=local_rank, world_size=nproc, local_world_size=nproc,
        source="local",
    )  # fmt: skip
    timeout = timedelta(seconds=cfg.dist.timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    run_worker(cfg, run_dir, env, store)


# --- launcher=torchrun: torch.distributed's elastic agent, in this process ---------------------
def _launch_elastic(cfg: DictConfig, run_dir: Path) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launcher = cfg.launcher
    # Restarted rounds re-create the store; sharing torchrun's store made gloo reconnects flaky.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config = LaunchConfig(
        min_nodes=launcher.nnodes,
        max_nodes=launcher.nnodes,
        nproc_per_node=launcher.nproc_per_node,
        run_id=run_dir.name + "-" + uuid.uuid4().hex[:8] if launcher.nnodes == 1 else run_dir.name,
        rdzv_backend="c10d",
        rdzv_endpoint=launcher.rdzv_endpoint,
        rdzv_configs={"rank": launcher.node_rank} if launcher.nnodes > 1 else {},
        max_restarts=launcher.max_restarts,
        monitor_interval=launcher.monitor_interval_s,
        start_method="spawn",
        # The agent passes these on to the ranks; by default it dies on SIGUSR1/2 instead and
        # leaves its workers running.
        signals_to_handle=",".join(stop_signal_names(list(cfg.trainer.stop_signals))),
    )
    try:
        elastic_launch(config, _elastic_worker)(cfg, run_dir)
    except ChildFailedError as error:
        codes = [0] * (launcher.nproc_per_node * launcher.nnodes)
        for rank, failure in error.failures.items():
            codes[rank] = failure.exitcode
        raise_for_exit_codes(codes)
    except SignalException as error:  # the agent waited for the ranks to save and stop
        raise ReportedStop(signal.Signals(error.sigval).name) from None


def _elastic_worker(cfg: DictConfig, run_dir: Path) -> None:
    # The agent set RANK/WORLD_SIZE/MASTER_*; the config came from our caller, not from Hydra,
    # so this rank must not wait for another rank's config the way an external torchrun does.
    env = dataclasses.replace(DistEnv.from_environ(), source="elastic")
    run_worker(cfg, run_dir, env)
