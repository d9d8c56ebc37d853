"""Start the ranks of one run from the process Hydra started.

Workers receive the already-resolved config and the run directory; they never compose a
config again. `local` spawns processes itself; `torchrun` hands them to torch's elastic agent
(what the `torchrun` command runs), which adds restarts and multi-node rendezvous.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import traceback
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig

from framework.config import ConfigError, ReportedConfigError
from framework.distributed import DistEnv
from framework.train import run


def launch(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Run cfg with cfg.launcher; returns rank 0's summary."""
    nproc = cfg.launcher.nproc_per_node
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
    # After a rank fails, spawn's "Terminating process ... via SIGTERM" only adds noise: the
    # failing rank has printed why.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    # Port 0: the OS picks a free port, so concurrent runs and tests never collide.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        mp.start_processes(
            _local_worker,
            args=(cfg, run_dir, store.port, nproc),
            nprocs=nproc,
            join=True,
            start_method="spawn",
        )
    except mp.ProcessExitedException as error:
        _raise_worker_failure(error.error_index, error.exit_code)


def _local_worker(local_rank: int, cfg: DictConfig, run_dir: Path, port: int, nproc: int) -> None:
    env = DistEnv(
        rank=local_rank, local_rank=local_rank, world_size=nproc, local_world_size=nproc,
        source="local",
    )  # fmt: skip
    timeout = timedelta(seconds=cfg.dist.timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    _run_reporting_config_errors(cfg, run_dir, env, store)


CONFIG_REJECTED = 2  # a worker's exit code for "the config is wrong, message printed"


def _run_reporting_config_errors(cfg, run_dir, env, store=None) -> None:
    """Each worker reports its own failure: when rank 0 dies, the launcher would otherwise
    show only another rank's "connection closed by peer"."""
    try:
        run(cfg, run_dir, env, store)
    except ConfigError as error:
        if env.is_main:
            print(f"error: {error}", file=sys.stderr)
        raise SystemExit(CONFIG_REJECTED) from None
    except Exception:
        print(f"rank {env.rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _raise_worker_failure(rank: int, exit_code: int) -> None:
    if exit_code == CONFIG_REJECTED:
        raise ReportedConfigError(f"rank {rank} rejected the config") from None
    raise WorkerFailed(
        f"rank {rank} failed with exit code {exit_code} (its output is above)"
    ) from None


# --- launcher=torchrun: torch.distributed's elastic agent, in this process ---------------------
def _launch_elastic(cfg: DictConfig, run_dir: Path) -> None:
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
    )
    try:
        elastic_launch(config, _elastic_worker)(cfg, run_dir)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        _raise_worker_failure(rank, failure.exitcode)


def _elastic_worker(cfg: DictConfig, run_dir: Path) -> None:
    # The agent set RANK/WORLD_SIZE/MASTER_*; the config came from our caller, not from Hydra,
    # so this rank must not wait for another rank's config the way an external torchrun does.
    env = dataclasses.replace(DistEnv.from_environ(), source="elastic")
    _run_reporting_config_errors(cfg, run_dir, env)


class WorkerFailed(RuntimeError):
    """A rank died; its own output above says why."""
