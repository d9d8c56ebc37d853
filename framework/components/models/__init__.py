"""Reference models, reached from config through `_target_`."""

from framework.components.models.generative import GPT, VAE, FeedForward
from framework.components.models.small import MLP, SmallCNN, resnet18_cifar, resnet50

__all__ = ["GPT", "MLP", "VAE", "FeedForward", "SmallCNN", "resnet18_cifar", "resnet50"]
