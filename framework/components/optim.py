"""The optimizer from `optimizer=<option>`: its lr scaled to the real global batch, its
parameter groups (no weight decay on biases and normalisation weights, lr multipliers by name),
and the parameters it leaves out (optimizer.freeze)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from fnmatch import fnmatch
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from framework.core.exits import ConfigError

OUR_KEYS = ("lr_scaling", "reference_batch_size", "no_weight_decay", "lr_multipliers", "freeze")


def scaled_lr(optimizer_cfg: Any, global_batch_size: int) -> float:
    """optimizer.lr is meant for reference_batch_size; scale it to the real global batch."""
    ratio = global_batch_size / optimizer_cfg.reference_batch_size
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[optimizer_cfg.lr_scaling]
    return optimizer_cfg.lr * factor


def parameter_groups(
    optimizer_cfg: Any, params: nn.Module | Iterable[torch.Tensor], lr: float
) -> list[dict[str, Any]]:
    """One group per (weight decay, lr multiplier), in the order parameters first appear; the
    groups at the base lr come first (`lr` in the logs is group 0's)."""
    named = (
        params.named_parameters()
        if isinstance(params, nn.Module)
        else ((f"param{i}", p) for i, p in enumerate(params))
    )
    multipliers = dict(optimizer_cfg.get("lr_multipliers") or {})
    used: set[str] = set()
    groups: dict[tuple[float, float], list[torch.Tensor]] = {}
    for name, parameter in named:
        if not parameter.requires_grad:
            continue
        pattern = next((p for p in multipliers if fnmatch(name, p)), None)
        if pattern is not None:
            used.add(pattern)
        skip_decay = optimizer_cfg.get("no_weight_decay") and parameter.ndim <= 1
        decay = 0.0 if skip_decay else optimizer_cfg.weight_decay
        groups.setdefault((decay, multipliers.get(pattern, 1.0)), []).append(parameter)
    unused = [pattern for pattern in multipliers if pattern not in used]
    if unused:
        raise ConfigError(
            f"optimizer.lr_multipliers: {', '.join(unused)} matches no parameter of the model "
            f"(they are named like {', '.join(name for name, _ in list(_names(params))[:4])})"
        )
    ordered = sorted(groups.items(), key=lambda item: item[0][1] != 1.0)
    return [
        {"params": group, "weight_decay": decay, "lr": lr * multiplier}
        for (decay, multiplier), group in ordered
    ]


def freeze(module: nn.Module, patterns: Iterable[str]) -> nn.Module:
    """optimizer.freeze: the parameters whose names match keep their values (no gradient, so
    the optimizer never gets them). Before DDP or FSDP wraps the module: they then neither
    wait for nor reduce a gradient for them."""
    patterns = list(patterns)
    used: set[str] = set()
    for name, parameter in module.named_parameters():
        matched = [pattern for pattern in patterns if fnmatch(name, pattern)]
        if matched:
            parameter.requires_grad_(False)
            used.update(matched)
    unused = [pattern for pattern in patterns if pattern not in used]
    if unused:
        raise ConfigError(
            f"optimizer.freeze: {', '.join(unused)} matches no parameter of the model "
            f"(they are named like {', '.join(name for name, _ in list(_names(module))[:4])})"
        )
    return module


def describe_groups(optimizer: torch.optim.Optimizer, module: nn.Module) -> str:
    """What each parameter group holds and what is frozen, for the start-up lines."""
    lines = [
        f"group {index}: {_count(group['params'])} (lr={group['lr']:.4g}, "
        f"weight_decay={group.get('weight_decay', 0.0):g})"
        for index, group in enumerate(optimizer.param_groups)
    ]
    frozen = [p for p in module.parameters() if not p.requires_grad]
    if frozen:
        lines.append(f"frozen: {_count(frozen)}")
    return "; ".join(lines)


def _count(parameters: list[torch.Tensor]) -> str:
    tensors = "tensor" if len(parameters) == 1 else "tensors"
    return f"{sum(p.numel() for p in parameters):,} parameters in {len(parameters)} {tensors}"


def _names(params: nn.Module | Iterable[torch.Tensor]) -> Iterable[tuple[str, Any]]:
    return params.named_parameters() if isinstance(params, nn.Module) else ()


def build_optimizer(
    optimizer_cfg: Any,
    params: nn.Module | Iterable[torch.Tensor],
    lr: float,
    overrides: dict[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """`overrides`: keywords the strategy replaces (strategy=fsdp: SGD unfused)."""
    kwargs = OmegaConf.to_container(optimizer_cfg)
    for key in OUR_KEYS:
        kwargs.pop(key, None)
    kwargs.update(overrides or {}, lr=lr)
    # Plain lists, not ListConfig: the optimizer keeps its keywords in param_groups, which a
    # checkpoint saves (torch 2.9 and older keep AdamW's betas as given), and loading refuses
    # any class that is not a tensor or a plain value.
    optimizer = instantiate(kwargs, _convert_="all")
    return optimizer(params=parameter_groups(optimizer_cfg, params, lr))
