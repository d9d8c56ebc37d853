"""task=regression: real-valued predictions against real-valued targets."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.components.tasks.base import Count, Task, TaskLoss, mean, pick
from framework.core.exits import ConfigError


class Regression(Task):
    """Squared error of `model(inputs)` against float `targets`, summed over every target value
    (a model output [N, 1] for targets [N] is read as [N]). Batches are (inputs, targets) or
    {"inputs", "targets"}. R² is over all target values: 1 - SSE / SST."""

    name = "regression"
    metrics = {"r2": "max", "mse": "min", "mae": "min"}
    states = ("sse", "sae", "sum", "sum_squares", "count")
    reads = "(inputs, targets) with real-valued targets"
    fix = "for integer class labels use task=classification"

    def _predict(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        predictions, targets = model(pick(batch, 0, "inputs")).float(), pick(batch, 1, "targets")
        if predictions.shape == (*targets.shape, 1):
            predictions = predictions.squeeze(-1)
        return predictions, targets.float()

    def count(self, batch: Any) -> Count:
        return pick(batch, 1, "targets").numel()

    def loss(self, model: nn.Module, batch: Any) -> TaskLoss:
        predictions, targets = self._predict(model, batch)
        return TaskLoss.sum(F.mse_loss(predictions, targets, reduction="sum"))

    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        predictions, targets = (t.double() for t in self._predict(model, batch))
        errors = predictions - targets
        return {
            "sse": errors.square().sum(),
            "sae": errors.abs().sum(),
            "sum": targets.sum(),
            "sum_squares": targets.square().sum(),
            "count": torch.tensor(targets.numel(), device=targets.device),
        }

    def compute(self, totals: dict[str, float]) -> dict[str, float]:
        count = totals["count"]
        total_variation = totals["sum_squares"] - totals["sum"] ** 2 / count if count else 0.0
        return {
            "r2": 1.0 - totals["sse"] / total_variation if total_variation else float("nan"),
            "mse": mean(totals["sse"], count),
            "mae": mean(totals["sae"], count),
        }

    def check(self, model: nn.Module, batch: Any) -> None:
        try:
            predictions = model(pick(batch, 0, "inputs"))
            targets = pick(batch, 1, "targets")
        except Exception as error:  # noqa: BLE001
            raise self.failed_on(batch, error, model) from None
        predictions = self.one_tensor(predictions, "predictions")
        if not isinstance(targets, torch.Tensor) or not targets.is_floating_point():
            raise self.misfit(batch, "its targets are not real numbers")
        if predictions.shape not in (targets.shape, (*targets.shape, 1)):
            raise ConfigError(
                f"task=regression: the model returns {list(predictions.shape)} for targets "
                f"{list(targets.shape)}: its outputs must match the targets' shape (set the "
                "model's number of outputs; for class logits use task=classification)"
            )
        super().check(model, batch)
