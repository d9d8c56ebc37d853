"""The dataset: noisy samples of y = sin(x) on [-pi, pi]."""

import math

import torch
from torch.utils.data import TensorDataset

from framework.components.data import Splits


def noisy_sine(
    num_samples: int = 1024, noise: float = 0.1, val_fraction: float = 0.2, seed: int = 0
) -> Splits:
    """This signature is the schema of the data option's own keys (conf/data/__project__.yaml):
    `train` refuses a key it does not name (`data.noize=0.3`: did you mean data.noise?) or a value
    of the wrong type (`data.noise=abc`), before anything runs. The framework's own keys
    (batch_size, num_workers, ...) are not passed: name one here to receive it."""
    generator = torch.Generator().manual_seed(seed)
    inputs = (torch.rand(num_samples, 1, generator=generator) * 2 - 1) * math.pi
    targets = torch.sin(inputs).squeeze(-1) + noise * torch.randn(num_samples, generator=generator)
    cut = int(num_samples * (1 - val_fraction))
    return Splits(
        train=TensorDataset(inputs[:cut], targets[:cut]),
        val=TensorDataset(inputs[cut:], targets[cut:]),
    )
