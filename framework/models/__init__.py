"""Reference models, reached from config through `_target_`."""

from framework.models.small import MLP, SmallCNN, resnet18_cifar, resnet50

__all__ = ["MLP", "SmallCNN", "resnet18_cifar", "resnet50"]
