"""Learning-rate schedules built from torch.optim.lr_scheduler, stepped once per optimizer step.

Each option is a partial in config; the runner supplies `optimizer` and `total_steps`.
"""

from __future__ import annotations

import math
from typing import Annotated

from annotated_types import Ge, Gt, Interval
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, StepLR


def constant(optimizer: Optimizer, total_steps: int) -> LRScheduler:
    return LambdaLR(optimizer, lambda _: 1.0)


def cosine_with_warmup(
    optimizer: Optimizer,
    total_steps: int,
    warmup_steps: Annotated[int, Ge(0)],
    min_lr_ratio: Annotated[float, Interval(ge=0, le=1)],  # of the base lr
) -> LRScheduler:
    """Linear warmup from ~0 to the base lr, then cosine decay to min_lr_ratio * base lr.

    A closed form of the step (not torch's recursive CosineAnnealingLR): a run resumed with a
    larger trainer.max_steps follows the longer schedule from where it stands."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def step(
    optimizer: Optimizer,
    total_steps: int,
    step_size: Annotated[int, Ge(1)],
    gamma: Annotated[float, Gt(0)],
) -> LRScheduler:
    return StepLR(optimizer, step_size=step_size, gamma=gamma)
