"""Device and backend choice, process-group lifetime, DDP wrapping and small collectives."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from framework.core.launch_context import DistEnv

log = logging.getLogger(__name__)


def pick_device(env: DistEnv) -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def pick_backend(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def limit_cpu_threads(env: DistEnv) -> None:
    """Share the cores between local ranks unless the user (or torchrun) already chose."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // env.local_world_size))


@contextlib.contextmanager
def process_group(
    env: DistEnv, backend: str, timeout_s: float, store: dist.Store | None = None
) -> Iterator[None]:
    """Init the default process group for a multi-rank job; destroy it on every exit path."""
    if not env.distributed:
        yield
        return
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        yield
    finally:
        # No collection from here on: DDP's reducer sits in reference cycles, and freed once
        # the group is gone it destroys the group holding the GIL that gloo's threads wait for
        # (a rank hung, or aborted, at its end). The rank's process leaves soon after.
        gc.disable()
        dist.destroy_process_group()


def host_group(env: DistEnv, backend: str) -> dist.ProcessGroup | None:
    """Collective (every rank): a gloo group for flags that live on the host (stop signals),
    when training talks over NCCL; None when the default group already is gloo."""
    if not env.distributed or backend == "gloo":
        return None
    return dist.new_group(backend="gloo")


def wrap_ddp(model: nn.Module, device: torch.device, options: Mapping[str, Any]) -> nn.Module:
    """`options`: DistributedDataParallel's keywords (dist.ddp.*)."""
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, **options)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_object(obj: object, src: int = 0) -> object:
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
