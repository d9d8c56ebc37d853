"""Datasets (digits, synthetic, CIFAR-10 folder) and the per-rank loaders that feed DDP.

A data option's `_target_` is a function returning `Splits`; any function with that shape works,
so bringing your own dataset is one YAML file pointing at it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from framework.config.schemas import Cifar10Config, DigitsConfig, SyntheticConfig
from framework.context import DistEnv


@dataclass(frozen=True)
class Splits:
    train: Dataset
    val: Dataset


def digits(val_fraction: float = DigitsConfig.val_fraction,
           split_seed: int = DigitsConfig.split_seed, **_: object) -> Splits:  # fmt: skip
    """scikit-learn's bundled handwritten digits: 1,797 real 8x8 images, 10 classes."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = (images - 0.5) / 0.5
    labels = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(split_seed))
    val_count = round(len(labels) * val_fraction)
    val_idx, train_idx = order[:val_count], order[val_count:]
    return Splits(
        train=TensorDataset(images[train_idx], labels[train_idx]),
        val=TensorDataset(images[val_idx], labels[val_idx]),
    )


def synthetic(
    train_size: int = SyntheticConfig.train_size,
    val_size: int = SyntheticConfig.val_size,
    in_channels: int = SyntheticConfig.in_channels,
    image_size: int = SyntheticConfig.image_size,
    num_classes: int = SyntheticConfig.num_classes,
    seed: int = SyntheticConfig.seed,
    **_: object,
) -> Splits:
    """Random CIFAR-shaped images; labels come from a fixed random projection, so they are
    learnable and losses fall, which keeps tests that compare runs meaningful."""
    generator = torch.Generator().manual_seed(seed)
    total = train_size + val_size
    images = torch.randn(total, in_channels, image_size, image_size, generator=generator)
    projection = torch.randn(
        in_channels * image_size * image_size, num_classes, generator=generator
    )
    labels = (images.flatten(1) @ projection).argmax(dim=1)
    return Splits(
        train=TensorDataset(images[:train_size], labels[:train_size]),
        val=TensorDataset(images[train_size:], labels[train_size:]),
    )


CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def _cifar_folder() -> type:
    """torchvision's reader for the python-pickle batches with the checksums cleared
    (torchvision then checks only that each file exists), so a local copy or a small file in
    the same format is read as it is."""
    from torchvision.datasets import CIFAR10

    class CifarFolder(CIFAR10):
        train_list = [[name, None] for name, _ in CIFAR10.train_list]
        test_list = [[name, None] for name, _ in CIFAR10.test_list]
        meta = {**CIFAR10.meta, "md5": None}

    return CifarFolder


def cifar10(root: str | None, download: bool = Cifar10Config.download,
            augment: bool = Cifar10Config.augment, **_: object) -> Splits:  # fmt: skip
    """CIFAR-10 from a local folder in torchvision's layout (`cifar-10-batches-py`)."""
    # torchvision is imported here, not at the top: runs that use neither CIFAR-10 nor a
    # ResNet need not pay its import at start-up.
    import torchvision
    from torchvision import transforms

    path = Path(root or "data").expanduser()
    if path.name == "cifar-10-batches-py":  # accept the batches folder itself
        path = path.parent
    normalize = [transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    train_tf = normalize
    if augment:
        train_tf = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
        train_tf += normalize
    dataset = torchvision.datasets.CIFAR10 if download else _cifar_folder()
    return Splits(
        train=dataset(
            str(path), train=True, download=download, transform=transforms.Compose(train_tf)
        ),
        val=dataset(
            str(path), train=False, download=False, transform=transforms.Compose(normalize)
        ),
    )


class ShardSampler(Sampler[int]):
    """Evaluation shard: indices rank, rank+W, ... with no padding and no duplicates, so
    summed metrics over ranks equal the single-process ones exactly."""

    def __init__(self, length: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, length, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way through: a resumed run sees exactly
    the samples the interrupted one had not reached, in the same order."""

    skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return max(0, self.num_samples - self.skip)


def _loader_options(data_cfg, device: torch.device) -> dict:
    workers = data_cfg["num_workers"]
    return {
        "num_workers": workers,
        "pin_memory": bool(data_cfg["pin_memory"]) and device.type == "cuda",
        "persistent_workers": bool(data_cfg["persistent_workers"]) and workers > 0,
    }


@dataclass(frozen=True)
class Loaders:
    """This rank's loaders: its shard of the training set (resumable mid-epoch) and of the
    validation set (every sample exactly once over all ranks)."""

    train: DataLoader
    sampler: ResumableSampler
    val: DataLoader


def build_loaders(splits: Splits, data_cfg, env: DistEnv, seed: int,
                  device: torch.device) -> Loaders:  # fmt: skip
    train, sampler = train_loader(splits.train, data_cfg, env, seed, device)
    return Loaders(train, sampler, eval_loader(splits.val, data_cfg, env, device))


def train_loader(
    dataset: Dataset, data_cfg, env: DistEnv, seed: int, device: torch.device
) -> tuple[DataLoader, ResumableSampler]:
    sampler = ResumableSampler(
        dataset,
        num_replicas=env.world_size,
        rank=env.rank,
        shuffle=data_cfg["shuffle"],
        seed=seed,
        drop_last=data_cfg["drop_last"],
    )
    loader = DataLoader(
        dataset,
        batch_size=data_cfg["batch_size"],
        sampler=sampler,
        drop_last=data_cfg["drop_last"],
        # A dedicated generator keeps loader construction off the global RNG stream.
        generator=torch.Generator().manual_seed(seed + env.rank),
        **_loader_options(data_cfg, device),
    )
    return loader, sampler


def eval_loader(dataset: Dataset, data_cfg, env: DistEnv, device: torch.device) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=data_cfg["eval_batch_size"],
        sampler=ShardSampler(len(dataset), env.rank, env.world_size),
        **_loader_options(data_cfg, device),
    )
