"""The optimizer from `optimizer=<option>`, with its lr scaled to the real global batch."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

OUR_KEYS = ("lr_scaling", "reference_batch_size")  # ours, not the optimizer's


def scaled_lr(optimizer_cfg: Any, global_batch_size: int) -> float:
    """optimizer.lr is meant for reference_batch_size; scale it to the real global batch."""
    ratio = global_batch_size / optimizer_cfg.reference_batch_size
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[optimizer_cfg.lr_scaling]
    return optimizer_cfg.lr * factor


def build_optimizer(optimizer_cfg: Any, params: Iterable[torch.Tensor],
                    lr: float) -> torch.optim.Optimizer:  # fmt: skip
    kwargs = OmegaConf.to_container(optimizer_cfg)
    for key in OUR_KEYS:
        kwargs.pop(key, None)
    kwargs["lr"] = lr
    return instantiate(kwargs)(params=params)
