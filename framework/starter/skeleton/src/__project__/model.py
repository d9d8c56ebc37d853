"""The model: a small tanh MLP from one input to one output."""

import torch
from torch import nn


class SineNet(nn.Module):
    def __init__(self, hidden: int = 32, depth: int = 2) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = 1
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.Tanh()]
            width = hidden
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs).squeeze(-1)
