"""A user's own model and dataset, reached only through `_target_` (docs/tasks.md)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from framework.components.data import Splits


class TinyNet(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, depth: int) -> None:
        if depth < 1:  # what a user's model says of a setting it cannot take
            raise ValueError(f"depth must be at least 1, got {depth}")
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_channels * 4 * 4
        for _ in range(depth):
            layers += [nn.Linear(width, 16), nn.ReLU()]
            width = 16
        self.net = nn.Sequential(*layers, nn.Linear(width, num_classes))

    def forward(self, x):
        return self.net(x)


def load_my_data(seed: int = 0, **_: object) -> Splits:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(96, 2, 4, 4, generator=generator)
    labels = (images.sum(dim=(1, 2, 3)) > 0).long()
    return Splits(TensorDataset(images[:64], labels[:64]), TensorDataset(images[64:], labels[64:]))
