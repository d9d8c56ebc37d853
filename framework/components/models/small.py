"""Small image classifiers. Each takes in_channels/num_classes from the data config.

torchvision is imported inside the ResNet builders: the MLP and the CNN need not pay its import
at start-up."""

from __future__ import annotations

from typing import Annotated

from annotated_types import Ge
from torch import nn

Size = Annotated[int, Ge(1)]  # a count of channels, pixels, classes or units


class MLP(nn.Module):
    """Flatten, then Linear-ReLU blocks. No BatchNorm or dropout: exact DDP parity tests."""

    def __init__(
        self,
        in_channels: Size,
        image_size: Size,
        num_classes: Size,
        hidden_sizes: list[Size],
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_channels * image_size * image_size
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    """Three 3x3 conv layers and global pooling: works on 8x8 digits and 32x32 CIFAR alike."""

    def __init__(self, in_channels: Size, num_classes: Size, width: Size) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        return self.head(self.features(x))


def resnet18_cifar(in_channels: Size, num_classes: Size) -> nn.Module:
    """torchvision ResNet-18 with the usual 32x32 stem: 3x3 stride-1 conv and no max-pool."""
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def resnet50(in_channels: Size, num_classes: Size, image_size: Size | None) -> nn.Module:
    """torchvision ResNet-50 with its ImageNet stem, for 224x224 inputs (GPU throughput)."""
    if image_size is not None and image_size < 32:  # it trains, to nonsense
        raise ValueError(
            f"ImageNet's stem downsamples 32x, and images of {image_size} pixels leave nothing "
            "to pool: use model=resnet18 (a 32x32 stem), or images of 32 pixels or more "
            "(data=synthetic data.image_size=224)"
        )
    import torchvision

    model = torchvision.models.resnet50(weights=None, num_classes=num_classes)
    if in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model
