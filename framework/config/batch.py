"""The global batch: data.batch_size per rank x ranks x trainer.grad_accum micro-batches.

With trainer.global_batch_size set, the accumulation is derived from it for the number of ranks
the job has, so a job that runs on another number of ranks (an elastic job after a lost or a
new node, a resume on other hardware) takes optimizer steps over the same number of samples.
Where the global batch is not a whole number of per-rank batches x ranks, the run is refused:
a silently different global batch would change what every later step computes.
"""

from __future__ import annotations

import math
from typing import Any

from framework.core.exits import ConfigError


def grad_accum(trainer: Any, batch_size: int, world_size: int) -> int:
    """Micro-batches per optimizer step: trainer.grad_accum, or derived from
    trainer.global_batch_size for `world_size` ranks (ConfigError where it does not divide)."""
    wanted = trainer.global_batch_size
    if wanted is None:
        return int(trainer.grad_accum)
    check(wanted, batch_size, [world_size], f"{world_size} ranks in this round")
    return int(wanted // (batch_size * world_size))


def check(global_batch: int, batch_size: int, world_sizes: list[int], where: str) -> None:
    """ConfigError in one line where `global_batch` is no whole number of per-rank batches x
    ranks at one of `world_sizes` (`where` says where those come from), naming the global
    batches that fit them all."""
    bad = [size for size in world_sizes if global_batch % (batch_size * size)]
    if not bad:
        return
    fits = math.lcm(*(batch_size * size for size in world_sizes))
    sizes = " or ".join(str(size) for size in bad)
    raise ConfigError(
        f"trainer.global_batch_size={global_batch} is not a whole number of "
        f"data.batch_size={batch_size} x {sizes} ranks ({where}): the gradient accumulation is "
        f"global batch / (per-rank batch x ranks); give a multiple of {fits}, another "
        "data.batch_size, or trainer.global_batch_size=null (the global batch then follows the "
        "number of ranks)"
    )
