"""Learning-rate schedules built from torch.optim.lr_scheduler, stepped once per optimizer step.

Each option is a partial in config; the runner supplies `optimizer` and `total_steps`.
"""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    LambdaLR,
    LinearLR,
    LRScheduler,
    SequentialLR,
    StepLR,
)


def constant(optimizer: Optimizer, total_steps: int) -> LRScheduler:
    return LambdaLR(optimizer, lambda _: 1.0)


def cosine_with_warmup(
    optimizer: Optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0
) -> LRScheduler:
    """Linear warmup from ~0 to the base lr, then cosine decay to min_lr_ratio * base lr."""
    base_lr = optimizer.param_groups[0]["lr"]
    cosine = CosineAnnealingLR(
        optimizer, T_max=max(1, total_steps - warmup_steps), eta_min=base_lr * min_lr_ratio
    )
    if warmup_steps <= 0:
        return cosine
    warmup = LinearLR(optimizer, start_factor=1.0 / (warmup_steps + 1), total_iters=warmup_steps)
    return SequentialLR(optimizer, [warmup, cosine], milestones=[warmup_steps])


def step(
    optimizer: Optimizer, total_steps: int, step_size: int = 100, gamma: float = 0.1
) -> LRScheduler:
    return StepLR(optimizer, step_size=step_size, gamma=gamma)
