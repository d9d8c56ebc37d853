"""task=classification: class logits against integer labels (per sample, or per pixel)."""

from __future__ import annotations

from typing import Annotated, Any

import torch
import torch.nn.functional as F
from annotated_types import Interval
from torch import nn

from framework.components.tasks.base import Count, Task, TaskLoss, mean, pick, state_sum
from framework.core.exits import ConfigError


class Classification(Task):
    """Cross-entropy of `model(inputs)` ([N, C] or [N, C, ...] logits) against `targets`
    ([N] or [N, ...] class indices). Batches are (inputs, targets) or {"inputs", "targets"}."""

    name = "classification"
    metrics = {"accuracy": "max", "loss": "min"}
    states = ("loss", "correct", "count")
    reads = "(inputs, targets) with integer class labels"
    logits_loss = "cross-entropy"
    fix = "for real-valued targets use task=regression; for token sequences task=language_model"

    def __init__(
        self,
        label_smoothing: Annotated[float, Interval(ge=0, lt=1)],
        ignore_index: int | None,
    ) -> None:
        self.label_smoothing = label_smoothing
        self.ignore_index = ignore_index

    def _split(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return model(pick(batch, 0, "inputs")), pick(batch, 1, "targets")

    def _cross_entropy(
        self, logits: torch.Tensor, targets: torch.Tensor, smoothing: float, reduction: str = "sum"
    ) -> torch.Tensor:
        ignore = -100 if self.ignore_index is None else self.ignore_index
        return F.cross_entropy(
            logits.float(),
            targets,
            reduction=reduction,
            ignore_index=ignore,
            label_smoothing=smoothing,
        )

    def count(self, batch: Any) -> Count:
        targets = pick(batch, 1, "targets")
        if self.ignore_index is None:
            return targets.numel()  # from the shape: no device work
        return (targets != self.ignore_index).sum()

    def loss(self, model: nn.Module, batch: Any) -> TaskLoss:
        logits, targets = self._split(model, batch)
        return TaskLoss.sum(self._cross_entropy(logits, targets, self.label_smoothing))

    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        logits, targets = self._split(model, batch)
        valid = (
            torch.ones_like(targets, dtype=torch.bool)
            if self.ignore_index is None
            else (targets != self.ignore_index)
        )
        return {
            # the plain loss, for comparison; per item, added up in float64
            "loss": state_sum(self._cross_entropy(logits, targets, 0.0, reduction="none")),
            "correct": ((logits.argmax(dim=1) == targets) & valid).sum(),
            "count": valid.sum(),
        }

    def compute(self, totals: dict[str, float]) -> dict[str, float]:
        return {
            "loss": mean(totals["loss"], totals["count"]),
            "accuracy": mean(totals["correct"], totals["count"]),
        }

    def check(self, model: nn.Module, batch: Any) -> None:
        try:
            logits, targets = self._split(model, batch)
        except Exception as error:  # noqa: BLE001
            raise self.failed_on(batch, error, model) from None
        logits = self.one_tensor(logits, "class logits")
        if (
            not isinstance(targets, torch.Tensor)
            or targets.is_floating_point()
            or targets.dtype == torch.bool
        ):
            raise self.misfit(batch, "its targets are not integer class labels")
        if (
            logits.dim() != targets.dim() + 1
            or logits.shape[0] != targets.shape[0]
            or logits.shape[2:] != targets.shape[1:]
        ):
            raise ConfigError(
                f"task=classification needs one logit per class for each target: the model "
                f"returns {list(logits.shape)} for targets {list(targets.shape)}. For a model "
                "with one output per sample and real-valued targets use task=regression"
            )
        if logits.shape[1] < 2:
            raise ConfigError(
                f"task=classification needs at least 2 class logits per target, the model "
                f"returns {logits.shape[1]} (shape {list(logits.shape)}): set the model's "
                "num_classes, or use task=regression for a single real-valued output"
            )
        valid = targets if self.ignore_index is None else targets[targets != self.ignore_index]
        if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= logits.shape[1]):
            raise ConfigError(
                f"task=classification: labels run from {int(valid.min())} to "
                f"{int(valid.max())} but the model has {logits.shape[1]} class logits: set "
                "data.num_classes (the model's num_classes follows it)"
            )
        super().check(model, batch)
