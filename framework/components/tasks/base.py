"""The Task interface, and helpers to read batches of any shape."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from framework.core.exits import ConfigError

Count = int | torch.Tensor  # an int when it follows from shapes, else a tensor on the device


@dataclass
class TaskLoss:
    """A micro-batch's loss as a sum over its items (`Task.count` of them), and optional sums
    of cheap training metrics over the same items (logged as train/<name>, per item)."""

    total: torch.Tensor
    sums: dict[str, torch.Tensor] = field(default_factory=dict)


class Task:
    """How a batch feeds the model, and what the loss and the metrics are.

    Subclasses set `metrics` ({name: "min" | "max"}, reported as val/<name>; the first is the
    run's default objective) and `states` (the sums evaluation adds up), and implement `count`,
    `loss`, `evaluate` and `compute`.
    """

    name: ClassVar[str] = "task"  # the option name, for messages (task=<name>)
    metrics: dict[str, str] = {}
    states: tuple[str, ...] = ()
    train_sums: tuple[str, ...] = ()  # keys of TaskLoss.sums logged during training
    # What a batch must look like, for the message when it does not.
    reads: ClassVar[str] = "a batch"
    fix: ClassVar[str] = "pick a data option this task can read"

    def count(self, batch: Any) -> Count:
        """How many items the loss of this batch sums over (called on the batch before it moves
        to the device). An int must follow from the batch size, so that it is the same on every
        rank for full batches (the runner then needs no collective); a count that depends on
        the data (tokens that are not padding) is a tensor."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Any) -> TaskLoss:
        raise NotImplementedError

    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """This batch's contribution to every sum in `states` (scalars on the device)."""
        raise NotImplementedError

    def compute(self, totals: dict[str, float]) -> dict[str, float]:
        """The metrics from the states summed over the whole validation set."""
        raise NotImplementedError

    def check(self, model: nn.Module, batch: Any) -> None:
        """Raise ConfigError naming the task and the fix when it cannot train this model on
        this data. Called once, on a real batch, before the first step (eval mode, no grad)."""
        try:
            loss = self.loss(model, batch)
            states = self.evaluate(model, batch)
            self.count(batch)
        except ConfigError:
            raise
        except Exception as error:  # noqa: BLE001 (any failure on a real batch is a misfit)
            raise self.misfit(batch, f"{type(error).__name__}: {error}") from None
        if loss.total.dim() != 0:
            raise ConfigError(
                f"task={self.name}: the loss of a batch must be a scalar (a sum over its items), "
                f"got shape {list(loss.total.shape)}: reduce it with .sum()"
            )
        missing = set(self.states) - set(states)
        if missing:
            raise ConfigError(f"task={self.name}: evaluate() does not return {sorted(missing)}")

    def misfit(self, batch: Any, problem: str) -> ConfigError:
        return ConfigError(
            f"task={self.name} reads {self.reads}; this data gives {batch_shapes(batch)} "
            f"({problem}): {self.fix}"
        )

    def artifacts(
        self, model: nn.Module, val_batch: Any, decode: Callable | None = None
    ) -> dict[str, torch.Tensor | str]:
        """What the trained model makes, by file name: images [N, C, H, W] in [0, 1] (`*.png`,
        drawn as a grid) or text (`*.txt`). Rank 0 writes them into the run dir at the end;
        `decode` turns token ids into text when the data gives it."""
        return {}

    def directions(self) -> dict[str, str]:
        return {f"val/{name}": direction for name, direction in self.metrics.items()}


def pick(batch: Any, position: int, key: str) -> Any:
    """An element of a batch: by `key` in a mapping, else by `position` in a sequence."""
    if isinstance(batch, Mapping):
        return batch[key]
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return batch[position]
    if position == 0:
        return batch  # a bare tensor is the inputs
    raise TypeError(f"no element {position} in a {type(batch).__name__}")


def batch_shapes(batch: Any) -> str:
    """`(float32 [32, 1, 8, 8], int64 [32])`: a batch's structure, for messages."""
    if isinstance(batch, torch.Tensor):
        return f"{str(batch.dtype).removeprefix('torch.')} {list(batch.shape)}"
    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{k!r}: {batch_shapes(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return "(" + ", ".join(batch_shapes(item) for item in batch) + ")"
    return type(batch).__name__


def first_batch(dataset: Dataset, size: int, collate: Callable | None = None) -> Any:
    """The first `size` samples as one batch, read without a loader (no generator is drawn)."""
    items = [dataset[index] for index in range(min(size, len(dataset)))]
    return (collate or default_collate)(items)


def mean(total: float, count: float) -> float:
    return total / count if count else math.nan
