"""The memory ledger: the exact bytes of the tensors a rank holds for its parameters, gradients
and optimizer state (its own shards under strategy=fsdp), and of one micro-batch's activations.

Resident memory hides what sharding saves on a CPU (the allocator keeps freed blocks, and the
libraries' own pages dominate small models), so every figure here is counted from the tensors
themselves: elements x element size of this rank's part of each tensor. `held` measures a
training rank; `activation_bytes` measures a forward and backward as it runs, on the meta device
(no memory, no compute: what `train ... mode=estimate` uses) or a real one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MIB = 2**20


@dataclass(frozen=True)
class Ledger:
    """Bytes one rank holds; `activations`: one micro-batch's (None where not measured)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int | None = None

    def states(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    def line(self) -> str:
        shown = [
            f"parameters {self.parameters / MIB:.2f} MiB",
            f"gradients {self.gradients / MIB:.2f} MiB",
            f"optimizer state {self.optimizer / MIB:.2f} MiB",
        ]
        if self.activations is not None:
            shown.append(f"activations {self.activations / MIB:.2f} MiB")
        return ", ".join(shown)

    def as_dict(self) -> dict[str, int]:
        counted = {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
        }
        return counted if self.activations is None else {**counted, "activations": self.activations}


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Elements x element size of this rank's part of each tensor (a DTensor's local shard),
    each tensor counted once."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        own = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += own.numel() * own.element_size()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        yield from (value for value in state.values() if isinstance(value, torch.Tensor))


def held(module: nn.Module, optimizer: torch.optim.Optimizer) -> Ledger:
    """What this rank holds now: call it after an optimizer step, before the gradients are
    zeroed (the optimizer's state exists from its first step on)."""
    parameters = list(module.parameters())
    return Ledger(
        parameters=local_bytes(parameters),
        gradients=local_bytes(p.grad for p in parameters if p.grad is not None),
        optimizer=local_bytes(optimizer_tensors(optimizer)),
    )


def every_rank(ledger: Ledger, rank: int, world_size: int, device: torch.device) -> list[Ledger]:
    """Each rank's ledger, on every rank (one small all-reduce: each rank fills its own row)."""
    rows = torch.zeros(world_size, 3, dtype=torch.int64, device=device)
    rows[rank] = torch.tensor([ledger.parameters, ledger.gradients, ledger.optimizer])
    if dist.is_initialized() and world_size > 1:
        dist.all_reduce(rows)
    return [Ledger(*(int(v) for v in row)) for row in rows.cpu().tolist()]


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages that operations made and that are still alive: a storage is
    counted when an operation returns it new, and uncounted when it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.counted: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.counted.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {
            t.untyped_storage()._cdata
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self.counted or key in inputs:  # a view, or written in place
                continue
            self.counted.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out


def activation_bytes(loss_of: Callable[[], Any]) -> tuple[int, int]:
    """(bytes alive between forward and backward, the most alive at once during the forward)
    for `loss_of()`, a forward returning the loss: what a micro-batch keeps for its backward
    (the activations), and its forward's peak. The graph is freed before returning."""
    tracker = _LiveBytes()
    with tracker:
        loss = loss_of()
        saved, peak = tracker.live, tracker.peak
        del loss
    return saved, peak
