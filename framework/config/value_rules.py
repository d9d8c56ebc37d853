"""What the shipped models and schedules need of their settings' values, checked before torch
loads. Torch would refuse each of these only inside a rank, after start-up, with a traceback: a
layer of width -4 ("negative dimension"), heads that do not divide the width (a reshape on the
first batch), a StepLR of step_size 0 (a modulo by zero at the first step), a VAE's tuple of
outputs given to a task that reads one tensor.

Each rule is registered by the callable an option names (validation.CHECKS), so a user's option
naming the same class is checked alike; a user's own model gets its constructor's error as one
line (framework/rank/build.py).
"""

from __future__ import annotations

from collections.abc import Callable

from omegaconf import DictConfig, ListConfig

from framework.core.exits import ConfigError

Check = Callable[[DictConfig, DictConfig], None]  # (the group's node, the whole config)
MODELS = "framework.components.models"
AUTOENCODER = "framework.components.tasks.Autoencoder"


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _at_least_one(group: str, node: DictConfig, keys: tuple[str, ...]) -> None:
    """Sizes: each key (or each item of a list of sizes) is at least 1. A null is left to the
    type check, which names where it came from."""
    for key in keys:
        value = node.get(key)
        sizes = list(value) if isinstance(value, ListConfig) else [value]
        require(
            all(size is None or size >= 1 for size in sizes),
            f"{group}.{key}={_shown(value)} must be >= 1"
            + (" (each size)" if isinstance(value, ListConfig) else ""),
        )


def _shown(value: object) -> str:
    return str(list(value)) if isinstance(value, ListConfig) else str(value)


def _dropout(group: str, node: DictConfig) -> None:
    require(0 <= node.dropout < 1, f"{group}.dropout={node.dropout} must be in [0, 1)")


def sizes(*keys: str) -> Check:
    """A rule: the model's `keys` are sizes (>= 1)."""

    def check(model: DictConfig, cfg: DictConfig) -> None:
        _at_least_one("model", model, keys)

    return check


def _check_feedforward(model: DictConfig, cfg: DictConfig) -> None:
    _at_least_one("model", model, ("in_features", "out_features", "hidden_sizes"))
    _dropout("model", model)


def _check_gpt(model: DictConfig, cfg: DictConfig) -> None:
    _at_least_one("model", model, ("vocab_size", "block_size", "layers", "heads", "width"))
    require(
        model.width % model.heads == 0,
        f"model.heads={model.heads} does not divide model.width={model.width}: each head takes "
        f"width/heads channels; pick heads among {_divisors(model.width)}, or change the width",
    )
    _dropout("model", model)


def _divisors(width: int) -> str:
    return ", ".join(str(n) for n in range(1, min(width, 64) + 1) if width % n == 0)


def _check_vae(model: DictConfig, cfg: DictConfig) -> None:
    _at_least_one("model", model, ("in_channels", "image_size", "latent_dim", "hidden_size"))
    task = cfg.task
    reads_it = task._target_ == AUTOENCODER and task.vae
    require(
        reads_it or not str(task._target_).startswith("framework.components.tasks."),
        "model=vae returns (reconstruction, mu, logvar), which only task=autoencoder with "
        "task.vae=true reads: add task=autoencoder task.vae=true (experiment=digits_vae has both)",
    )


def _check_step_schedule(scheduler: DictConfig, cfg: DictConfig) -> None:
    _at_least_one("scheduler", scheduler, ("step_size",))
    require(scheduler.gamma > 0, f"scheduler.gamma={scheduler.gamma} must be > 0")


def _check_cosine_schedule(scheduler: DictConfig, cfg: DictConfig) -> None:
    require(
        scheduler.warmup_steps >= 0,
        f"scheduler.warmup_steps={scheduler.warmup_steps} must be >= 0",
    )
    require(
        0 <= scheduler.min_lr_ratio <= 1,
        f"scheduler.min_lr_ratio={scheduler.min_lr_ratio} must be in [0, 1] (of the base lr)",
    )


VALUE_RULES: dict[str | type, Check] = {
    f"{MODELS}.SmallCNN": sizes("in_channels", "num_classes", "width"),
    f"{MODELS}.MLP": sizes("in_channels", "image_size", "num_classes", "hidden_sizes"),
    f"{MODELS}.resnet18_cifar": sizes("in_channels", "num_classes"),
    f"{MODELS}.resnet50": sizes("in_channels", "num_classes"),
    f"{MODELS}.FeedForward": _check_feedforward,
    f"{MODELS}.GPT": _check_gpt,
    f"{MODELS}.VAE": _check_vae,
    "framework.components.schedulers.step": _check_step_schedule,
    "framework.components.schedulers.cosine_with_warmup": _check_cosine_schedule,
}
