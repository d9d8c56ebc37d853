"""launcher=local: this process forks the ranks from the fork server and waits for them. It never
imports torch: the ranks' rendezvous store is hosted by a process forked for it (store_host.py).

Workers receive the already-resolved config and the run directory; they never compose a
config again.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

from omegaconf import DictConfig

from framework.core import startup_clock
from framework.core.exits import root_cause
from framework.core.launch_context import DistEnv
from framework.core.stop_signals import stop_signal_names
from framework.launch import forked, forkserver
from framework.launch.local.store_host import hosted_store

EXIT_GRACE_S = 3.0  # after a rank fails: time for the others to exit before SIGTERM, then SIGKILL


def launch_local(cfg: DictConfig, run_dir: Path, nproc: int) -> None:
    """nproc ranks forked from the fork server, joined through a store a process of their own
    hosts."""
    forkserver.warm_up()  # (already running when `train` started it)
    context = multiprocessing.get_context(forkserver.START_METHOD)
    signals = stop_signal_names(list(cfg.trainer.stop_signals))
    with hosted_store(context, signals) as store:
        ranks = [
            context.Process(
                target=_local_worker,
                args=(rank, cfg, run_dir, store.port, nproc, *forked.launcher_context()),
                name=f"rank {rank}",
            )
            for rank in range(nproc)
        ]
        for process in ranks:
            process.start()
        with _forward_signals(signals, [p.pid for p in ranks]):
            victims = _wait_for_ranks(ranks)
        messages = store.failure_messages(nproc)
    codes = [process.exitcode for process in ranks]
    cause = root_cause(codes, victims, messages)
    if cause is not None:
        raise cause


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


def _local_worker(
    local_rank: int,
    cfg: DictConfig,
    run_dir: Path,
    port: int,
    nproc: int,
    environ: dict[str, str],
    cwd: str,
    stdio: list[int],
) -> None:
    forked.adopt(environ, cwd, stdio)
    startup_clock.mark("start ranks")
    # Imported in the rank (the fork server has them loaded): the launcher never imports torch.
    import torch.distributed as dist

    from framework.launch.rank_entry import enter_rank

    env = DistEnv(
        rank=local_rank,
        local_rank=local_rank,
        world_size=nproc,
        local_world_size=nproc,
        source="local",
    )
    timeout = timedelta(seconds=cfg.dist.timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    enter_rank(cfg, run_dir, env, store)
