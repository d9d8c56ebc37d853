"""The task: squared error, and the share of predictions within a tolerance of the target."""

import torch
from torch import nn

from framework.components.tasks import Task, TaskLoss, state_sum


class WithinTolerance(Task):
    name = "__project__"  # the option's name, for messages (task=__project__)
    # val/<name>: whether lower or higher is better; the first is the run's objective
    metrics = {"within": "max", "mse": "min"}
    states = ("squared_error", "within", "count")  # sums over the validation set, across ranks
    # The loss takes the model's outputs as they are, not as logits. A loss that takes logits
    # (cross-entropy, BCE with logits) names itself here, logits_loss = "cross-entropy": the
    # check before the first step then refuses a model ending in softmax or sigmoid.
    logits_loss = None

    def __init__(self, tolerance: float = 0.2) -> None:
        self.tolerance = tolerance

    def count(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        """How many items the loss sums over: the framework divides by the global count."""
        return batch[1].numel()

    def errors(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return model(inputs) - targets

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> TaskLoss:
        return TaskLoss.sum(self.errors(model, batch).square().sum())

    def evaluate(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        errors = self.errors(model, batch)
        return {
            # per item, added up in float64: the same on any number of ranks
            "squared_error": state_sum(errors.square()),
            "within": (errors.abs() <= self.tolerance).sum(),
            "count": torch.tensor(errors.numel(), device=errors.device),
        }

    def compute(self, totals: dict[str, float]) -> dict[str, float]:
        return {
            "within": totals["within"] / totals["count"],
            "mse": totals["squared_error"] / totals["count"],
        }
