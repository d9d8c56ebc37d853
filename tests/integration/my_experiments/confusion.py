"""A task whose evaluation state is a matrix: classification scored by balanced accuracy (the
mean of per-class recalls) from a confusion matrix summed over ranks."""

import torch

from framework.components.tasks import Classification


class BalancedAccuracy(Classification):
    name = "balanced"
    metrics = {"balanced_accuracy": "max", "accuracy": "max"}
    states = ("confusion",)  # [true class, predicted class] counts

    def __init__(self, num_classes: int) -> None:
        super().__init__(label_smoothing=0.0, ignore_index=None)  # plain cross-entropy
        self.num_classes = num_classes

    def evaluate(self, model, batch):
        inputs, targets = batch
        predicted = model(inputs).argmax(dim=1)
        cells = torch.bincount(
            targets * self.num_classes + predicted, minlength=self.num_classes**2
        )
        return {"confusion": cells.reshape(self.num_classes, self.num_classes)}

    def compute(self, totals):
        confusion = totals["confusion"]
        recall = confusion.diag() / confusion.sum(dim=1).clamp(min=1)
        return {
            "balanced_accuracy": recall.mean().item(),
            "accuracy": (confusion.diag().sum() / confusion.sum()).item(),
        }
