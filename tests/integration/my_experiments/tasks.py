"""A task of one's own: L1 regression, reporting the share of predictions within 0.5."""

import torch

from framework.components.tasks import Task, TaskLoss


class AbsoluteError(Task):
    name = "abs_error"
    metrics = {"within_half": "max", "mae": "min"}  # val/<name>: direction; the first is the main
    states = ("error", "within", "count")  # sums added up over the validation set

    def count(self, batch):  # items the loss sums over (an int: fixed by the batch size)
        return batch[1].numel()

    def errors(self, model, batch):
        inputs, targets = batch
        return (model(inputs).squeeze(-1) - targets).abs()

    def loss(self, model, batch):
        return TaskLoss.sum(self.errors(model, batch).sum())

    def evaluate(self, model, batch):
        errors = self.errors(model, batch)
        return {
            "error": errors.sum(),
            "within": (errors < 0.5).sum(),
            "count": torch.tensor(errors.numel()),
        }

    def compute(self, totals):
        return {
            "mae": totals["error"] / totals["count"],
            "within_half": totals["within"] / totals["count"],
        }
