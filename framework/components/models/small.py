"""Small image classifiers. Each takes in_channels/num_classes from the data config.

torchvision is imported inside the ResNet builders: the MLP and the CNN need not pay its import
at start-up."""

from __future__ import annotations

from torch import nn


class MLP(nn.Module):
    """Flatten, then Linear-ReLU blocks. No BatchNorm or dropout: exact DDP parity tests."""

    def __init__(
        self, in_channels: int, image_size: int, num_classes: int, hidden_sizes: list[int]
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

    def __init__(self, in_channels: int, num_classes: int, width: int) -> None:
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


def resnet18_cifar(in_channels: int, num_classes: int) -> nn.Module:
    """torchvision ResNet-18 with the usual 32x32 stem: 3x3 stride-1 conv and no max-pool."""
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def resnet50(in_channels: int, num_classes: int) -> nn.Module:
    """torchvision ResNet-50 with its ImageNet stem, for 224x224 inputs (GPU throughput)."""
    import torchvision

    model = torchvision.models.resnet50(weights=None, num_classes=num_classes)
    if in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model
