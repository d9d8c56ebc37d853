"""trainer.ema_decay: an exponential moving average of the weights, evaluated instead of them."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from framework.components.strategy import local


class EMA:
    """A copy of the model that follows ema <- decay * ema + (1 - decay) * weights after every
    applied update (integer buffers, such as BatchNorm's counters, are copied). It starts from
    the initial weights. Every update stays on the device: a dropped update (a device flag) is
    dropped here too, without a host read."""

    def __init__(self, module: nn.Module, decay: float) -> None:
        self.module = copy.deepcopy(module).requires_grad_(False)
        self.decay = decay

    @staticmethod
    def _tensors(module: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # Under strategy=fsdp the EMA is sharded like the model: shard follows shard.
        tensors = [local(t.detach()) for t in (*module.parameters(), *module.buffers())]
        return (
            [t for t in tensors if t.is_floating_point()],
            [t for t in tensors if not t.is_floating_point()],
        )

    @torch.no_grad()
    def update(self, module: nn.Module, applied: torch.Tensor | None = None) -> None:
        (averages, counters), (weights, their_counters) = (
            self._tensors(self.module),
            self._tensors(module),
        )
        if applied is None:
            torch._foreach_lerp_(averages, weights, 1 - self.decay)
        else:
            deltas = torch._foreach_sub(weights, averages)
            torch._foreach_mul_(deltas, applied.to(averages[0].dtype) * (1 - self.decay))
            torch._foreach_add_(averages, deltas)
        for counter, theirs in zip(counters, their_counters, strict=True):
            counter.copy_(theirs if applied is None else torch.where(applied, theirs, counter))

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state)
