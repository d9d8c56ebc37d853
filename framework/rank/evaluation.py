"""Evaluation: the task's metrics over a whole split, exact on any world size (mode=eval runs it
on a checkpoint's weights: eval_mode.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from framework.components.precision import Precision
from framework.components.tasks import Task
from framework.components.tasks.base import pack_states, unpack_states
from framework.core.distributed import all_reduce_sum
from framework.core.exits import ConfigError


@torch.no_grad()
def evaluate(
    task: Task,
    model: nn.Module,
    loader: DataLoader,
    precision: Precision,
    to_device: Callable[[Any], Any],
    split: str = "val",
    lockstep: bool = False,
    max_batches: int | None = None,
) -> dict[str, float]:
    """The task's metrics over a whole split: every rank adds up the task's sum states over its
    shard (no padding, no duplicates) on the device, packed into one vector whatever their
    shapes (task.state_shapes), then one all-reduce of all of them.
    `lockstep`: a forward is a collective (strategy=fsdp gathers parameters), so a rank with
    fewer batches runs its last one again, uncounted, until every rank has run as many.
    `max_batches`: only this rank's first batches (trainer.eval_batches); None: all."""
    model.eval()
    shapes = {name: task.state_shapes.get(name, ()) for name in task.states}
    device = next(model.parameters()).device
    totals = pack_states(task, {name: torch.zeros(shapes[name]) for name in shapes}, shapes, device)
    # Counted before any forward: the count's all-reduce must not meet another rank's gather.
    batches = len(loader) if max_batches is None else min(len(loader), max_batches)
    missing = _missing_forwards(batches, device) if lockstep else 0
    batch = None
    for batch in itertools.islice(loader, batches):
        batch = to_device(batch)
        with precision.forward_context():
            states = task.evaluate(model, batch)
        totals += pack_states(task, states, shapes, device)
    _run_uncounted(task, model, batch, precision, missing)
    reduced = unpack_states(task, all_reduce_sum(totals), shapes)
    return {f"{split}/{name}": float(value) for name, value in task.compute(reduced).items()}


def _missing_forwards(batches: int, device: torch.device) -> int:
    """How many fewer batches this rank has than the rank with the most (one all-reduce)."""
    most = torch.tensor(batches, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most) - batches


def _run_uncounted(
    task: Task, model: nn.Module, batch: Any, precision: Precision, times: int
) -> None:
    if times and batch is None:
        raise ConfigError(
            "strategy=fsdp: this rank's shard of the evaluation split is empty, and every rank "
            "must run each forward: use fewer ranks or a larger split"
        )
    for _ in range(times):
        with precision.forward_context():
            task.evaluate(model, batch)
