"""Datasets that ship (digits, diabetes, text, synthetic, a CIFAR-10 folder), the per-rank
loaders that feed DDP, and moving batches of any structure to the device.

A data option's `_target_` is a function returning `Splits`; any function with that shape works,
so bringing your own dataset is one YAML file pointing at it. The function's signature is the
schema of its own keys (`load_splits`): it is called with the keys it names, and the framework's
own (batch_size, num_workers, ...) only if it names them or takes **kwargs.

Samples may be tensors, tuples or dicts; a data option's `collate_fn` (by `_target_`) batches
samples that default_collate cannot (variable-length sequences: `PadSequences`; graphs).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import inspect
import logging
import math
import os
import pickle
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Protocol, runtime_checkable

import numpy as np
import torch
from annotated_types import Ge, Interval
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
    TensorDataset,
)

from framework.core.exits import ConfigError
from framework.core.launch_context import DistEnv
from framework.core.parent_death import die_with_parent

log = logging.getLogger("framework")
# The shares a data option holds out: some of it for validation, none or some for a test split.
ValShare = Annotated[float, Interval(gt=0, lt=1)]
TestShare = Annotated[float, Interval(ge=0, lt=1)]
Size = Annotated[int, Ge(1)]


@dataclass(frozen=True)
class Splits:
    train: Dataset
    val: Dataset
    test: Dataset | None = None  # a held-out test split, when the data option has one
    decode: Callable[[list[int]], str] | None = None  # token ids -> text, for text data


def load_splits(node: DictConfig) -> Splits:
    """Call the data option's `_target_` with the keys of its node that it takes (all of them
    when it takes **kwargs); `collate_fn` is the loaders' business, built elsewhere."""
    signature = inspect.signature(get_object(node._target_))
    parameters = signature.parameters.values()
    keys = dict(OmegaConf.to_container(node, resolve=True), collate_fn=None)
    if not any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters):
        named = {parameter.name for parameter in parameters}
        keys = {key: value for key, value in keys.items() if key in named or key.startswith("_")}
    return instantiate(keys)


def split_indices(
    count: int, val_fraction: float, test_fraction: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(train, val, test or None) indices of a seeded permutation: validation first, then the
    test split, then training (so a test split takes nothing from validation)."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    val_count, test_count = round(count * val_fraction), round(count * test_fraction)
    test = order[val_count : val_count + test_count] if test_count else None
    return order[val_count + test_count :], order[:val_count], test


def _tensor_splits(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    val_fraction: float,
    test_fraction: float,
    seed: int,
) -> Splits:
    train, val, test = split_indices(len(targets), val_fraction, test_fraction, seed)
    return Splits(
        train=TensorDataset(inputs[train], targets[train]),
        val=TensorDataset(inputs[val], targets[val]),
        test=None if test is None else TensorDataset(inputs[test], targets[test]),
    )


def bundled_with_scikit_learn(name: str, **loadtxt: Any) -> np.ndarray:
    """A data file that ships inside scikit-learn (a gzipped CSV), read as its loaders read it
    but without importing scikit-learn, which costs about 5 s of a run's start-up on 2 cores.
    tests/unit/test_data.py checks the result against scikit-learn's own loaders."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{name}: scikit-learn, which ships it, is not installed")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / name
    with gzip.open(path, "rt", encoding="utf-8") as file:
        return np.loadtxt(file, **loadtxt)


def digits(
    val_fraction: ValShare,
    test_fraction: TestShare,
    split_seed: int,
    normalize: bool,
    classes: list[Annotated[int, Interval(ge=0, le=9)]] | None,
) -> Splits:
    """scikit-learn's bundled handwritten digits: 1,797 real 8x8 images, 10 classes. Pixels in
    [-1, 1] (normalize) or [0, 1]. `classes`: only these digits, labelled 0, 1, ... in the
    order given (a fine-tuning task of its own: [5, 6, 7, 8, 9] after pretraining on 0-4)."""
    table = bundled_with_scikit_learn("digits.csv.gz", delimiter=",")  # 64 pixels, then the label
    if classes is not None:
        if len(set(classes)) != len(classes) or not classes:
            raise ValueError(f"classes={classes}: name each digit once")
        table = table[np.isin(table[:, -1], classes)]
        table[:, -1] = [classes.index(int(label)) for label in table[:, -1]]
    pixels = torch.tensor(table[:, :-1].reshape(-1, 1, 8, 8), dtype=torch.float32)
    images = pixels / 16.0
    if normalize:
        images = (images - 0.5) / 0.5
    labels = torch.tensor(table[:, -1].astype(np.int64))
    return _tensor_splits(images, labels, val_fraction, test_fraction, split_seed)


def diabetes(
    val_fraction: ValShare,
    test_fraction: TestShare,
    split_seed: int,
) -> Splits:
    """scikit-learn's bundled diabetes data: 442 patients, 10 features, disease progression one
    year later (a real number). Features and target standardised with the training split's
    mean and std (R² does not depend on the target's scale)."""
    files = ("diabetes_data_raw.csv.gz", "diabetes_target.csv.gz")
    arrays = (bundled_with_scikit_learn(name) for name in files)
    features, target = (torch.tensor(array, dtype=torch.float32) for array in arrays)
    train, _, _ = split_indices(len(target), val_fraction, test_fraction, split_seed)

    def standardise(values: torch.Tensor) -> torch.Tensor:
        reference = values[train]
        return (values - reference.mean(0)) / reference.std(0)

    return _tensor_splits(
        standardise(features), standardise(target), val_fraction, test_fraction, split_seed
    )


# Python's help texts hold 9 characters outside ASCII; each becomes its ASCII look-alike, so the
# vocabulary is the 128 ASCII codes whatever the Python version.
_ASCII_FOLD = str.maketrans(
    {"°": "o", "ß": "s", "–": "-", "—": "-", "‘": "'", "’": "'", "“": '"', "”": '"', "…": "."}
)


class TokenWindows(Dataset):
    """Windows of `block_size` + 1 tokens, every `stride` tokens: (inputs, next tokens)."""

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int) -> None:
        self.tokens, self.block_size, self.stride = tokens, block_size, stride

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - self.block_size - 1) // self.stride + 1)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.stride
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]


def decode_ascii(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def text(
    block_size: Size,
    stride: Size,
    val_fraction: ValShare,
) -> Splits:
    """English text that ships with Python: the standard library's help topics
    (pydoc_data.topics, ~465,000 characters), one token per character. The last val_fraction
    of the text is the validation split."""
    from pydoc_data.topics import topics

    corpus = "\n\n".join(topics[key] for key in sorted(topics)).translate(_ASCII_FOLD)
    tokens = torch.tensor(list(corpus.encode("ascii", errors="replace")), dtype=torch.long)
    split = round(len(tokens) * (1 - val_fraction))
    val_text = corpus[split:]
    log.info(
        "text: %d characters (%d for validation); the validation text's unigram entropy is "
        "%.3f bits/char",
        len(corpus),
        len(val_text),
        unigram_entropy(val_text),
    )
    return Splits(
        train=TokenWindows(tokens[:split], block_size, stride),
        val=TokenWindows(tokens[split:], block_size, block_size),
        decode=decode_ascii,
    )


def unigram_entropy(text: str) -> float:
    """Bits per character of the text's own character frequencies: what a model that ignores
    context can reach at best."""
    counts = Counter(text)
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())


class PadSequences:
    """collate_fn for (inputs, targets) token sequences of different lengths: pads both to the
    batch's longest, inputs with `pad_id`, targets with `ignore_index` (their loss is skipped)."""

    def __init__(self, pad_id: int = 0, ignore_index: int = -100) -> None:
        self.pad_id, self.ignore_index = pad_id, ignore_index

    def __call__(self, samples: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        inputs, targets = zip(*samples, strict=True)
        pad = torch.nn.utils.rnn.pad_sequence
        return (
            pad(list(inputs), batch_first=True, padding_value=self.pad_id),
            pad(list(targets), batch_first=True, padding_value=self.ignore_index),
        )


def synthetic(
    train_size: Size,
    val_size: Size,
    in_channels: Size,
    image_size: Size,
    num_classes: Size,
    seed: int,
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


class _ArraysOnly(pickle.Unpickler):
    """CIFAR-10's python batches hold dicts of bytes, lists and numpy arrays. A pickle can hold
    any call, and a config names the folder it is read from: anything but arrays is refused."""

    ALLOWED = {
        (module, name)
        for module in ("numpy.core.multiarray", "numpy._core.multiarray")
        for name in ("_reconstruct", "scalar")
    } | {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}  # bytes, protocol 2

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not CIFAR-10 data: refused")
        return super().find_class(module, name)


class CifarBatches(Dataset):
    """CIFAR-10 read from a local copy of its python batches (`cifar-10-batches-py`), or a small
    file in the same format, with only arrays unpickled (torchvision's reader unpickles
    anything, and checks only the official files' checksums)."""

    def __init__(self, folder: Path, train: bool, transform: Callable) -> None:
        names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        images, self.targets = [], []
        for name in names:
            with open(folder / name, "rb") as file:
                batch = _ArraysOnly(file, encoding="latin1").load()
            images.append(batch["data"])
            self.targets += list(batch["labels"])
        self.data = np.vstack(images).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        from PIL import Image  # with torchvision, only for CIFAR-10

        return self.transform(Image.fromarray(self.data[index])), self.targets[index]


def cifar10(
    root: str | None,
    download: bool,
    augment: bool,
) -> Splits:
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
    train_tf, val_tf = transforms.Compose(train_tf), transforms.Compose(normalize)
    if download:  # the official files, checked against torchvision's checksums
        dataset = torchvision.datasets.CIFAR10
        return Splits(
            train=dataset(str(path), train=True, download=True, transform=train_tf),
            val=dataset(str(path), train=False, download=False, transform=val_tf),
        )
    folder = path / "cifar-10-batches-py"
    if not all((folder / name).is_file() for name in ("data_batch_1", "test_batch")):
        raise ValueError(
            f"data.root={root} holds no CIFAR-10 python batches (data_batch_1 ... test_batch): "
            "set data.root=/path/to/cifar-10-batches-py (or data.download=true with internet "
            "access)"
        )
    return Splits(
        train=CifarBatches(folder, train=True, transform=train_tf),
        val=CifarBatches(folder, train=False, transform=val_tf),
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
    """DistributedSampler that can start an epoch part-way through its global order: a resumed
    run, on the same or another number of ranks, sees exactly the samples of the epoch that the
    interrupted one had not reached. The epoch's order does not depend on the world size
    (seed + epoch); rank r of W takes every W-th sample of it, so after `start` samples of all
    ranks together the rest is order[start + r :: W] (DistributedSampler's own split, when
    `start` is a multiple of W)."""

    start = 0  # samples of this epoch's global order already consumed, by all ranks together

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch)
        self.start = start

    def global_order(self) -> list[int]:
        """The epoch's order over all ranks, cut or padded to total_size as DistributedSampler
        does before it strides."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            order = list(range(len(self.dataset)))
        if self.drop_last:
            return order[: self.total_size]
        padding = self.total_size - len(order)
        return order + (order * math.ceil(padding / max(len(order), 1)))[:padding]

    def __iter__(self) -> Iterator[int]:
        return iter(
            self.global_order()[self.start + self.rank : self.total_size : self.num_replicas]
        )

    def __len__(self) -> int:
        return len(range(self.start + self.rank, self.total_size, self.num_replicas))


def _loader_options(data_cfg, device: torch.device, collate_fn: Callable | None) -> dict:
    workers = data_cfg["num_workers"]
    return {
        "num_workers": workers,
        # No worker outlives its rank (core/parent_death.py).
        "worker_init_fn": functools.partial(die_with_parent, os.getpid()) if workers else None,
        "pin_memory": bool(data_cfg["pin_memory"]) and device.type == "cuda",
        "persistent_workers": bool(data_cfg["persistent_workers"]) and workers > 0,
        "collate_fn": collate_fn,
    }


class EpochStart(Protocol):
    """What the training loop moves at each epoch: a sampler's or a stream's position."""

    def set_epoch(self, epoch: int, start: int = 0) -> None: ...


@runtime_checkable
class ShardedStream(Protocol):
    """A streamed training split (an IterableDataset, framework/components/data_stream.py):
    `for_rank` returns this rank's shard, which yields whole batches per DataLoader worker and
    resumes at a global position (set_epoch's `start`) on any number of ranks."""

    def for_rank(
        self, rank: int, world_size: int, batch_size: int, seed: int, shuffle: bool
    ) -> Any: ...


@dataclass(frozen=True)
class Loaders:
    """This rank's loaders: its shard of the training set (resumable mid-epoch) and of the
    validation set (every sample exactly once over all ranks)."""

    train: DataLoader
    sampler: EpochStart
    val: DataLoader
    test: DataLoader | None = None


def build_loaders(
    splits: Splits,
    data_cfg,
    env: DistEnv,
    seed: int,
    device: torch.device,
    collate_fn: Callable | None = None,
) -> Loaders:
    train, sampler = train_loader(splits.train, data_cfg, env, seed, device, collate_fn)
    test = (
        None if splits.test is None else eval_loader(splits.test, data_cfg, env, device, collate_fn)
    )
    return Loaders(train, sampler, eval_loader(splits.val, data_cfg, env, device, collate_fn), test)


def train_loader(
    dataset: Dataset,
    data_cfg,
    env: DistEnv,
    seed: int,
    device: torch.device,
    collate_fn: Callable | None = None,
) -> tuple[DataLoader, EpochStart]:
    if isinstance(dataset, IterableDataset):
        return stream_loader(dataset, data_cfg, env, seed, device, collate_fn)
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
        **_loader_options(data_cfg, device, collate_fn),
    )
    return loader, sampler


def stream_loader(
    dataset: IterableDataset,
    data_cfg,
    env: DistEnv,
    seed: int,
    device: torch.device,
    collate_fn: Callable | None = None,
) -> tuple[DataLoader, EpochStart]:
    """A streamed training split: this rank's shard is its own position (set_epoch)."""
    if not isinstance(dataset, ShardedStream):
        raise ConfigError(
            f"data: the training split is an IterableDataset ({type(dataset).__name__}) without "
            "for_rank(rank, world_size, batch_size, seed, shuffle): subclass "
            "framework.components.data_stream.TextStream, or return a map-style Dataset"
        )
    if data_cfg["persistent_workers"] and data_cfg["num_workers"]:
        raise ConfigError(
            "data.persistent_workers=true keeps a stream's workers from seeing each epoch's "
            "position: set data.persistent_workers=false"
        )
    shard = dataset.for_rank(
        env.rank, env.world_size, data_cfg["batch_size"], seed, data_cfg["shuffle"]
    )
    loader = DataLoader(
        shard,
        batch_size=data_cfg["batch_size"],
        drop_last=True,  # every worker yields whole batches; the shard keeps whole global ones
        generator=torch.Generator().manual_seed(seed + env.rank),
        **_loader_options(data_cfg, device, collate_fn),
    )
    return loader, shard


def epoch_coverage(loader: DataLoader, grad_accum: int) -> str | None:
    """How many of the training samples an epoch uses, where data.drop_last drops some (the
    samples that do not fill a global batch): None where it uses them all."""
    sampler, batch = loader.sampler, loader.batch_size or 1
    if not loader.drop_last or not isinstance(sampler, ResumableSampler):
        return None
    total, ranks = len(sampler.dataset), sampler.num_replicas  # type: ignore[arg-type]
    steps = sampler.total_size // ranks // batch // grad_accum
    used = steps * grad_accum * batch * ranks
    if used >= total:
        return None
    return (
        f"an epoch uses {used} of the {total} training samples: data.drop_last=true drops the "
        f"{total - used} that do not fill a global batch (other ones each epoch, when shuffled)"
    )


def eval_loader(
    dataset: Dataset,
    data_cfg,
    env: DistEnv,
    device: torch.device,
    collate_fn: Callable | None = None,
) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=data_cfg["eval_batch_size"],
        sampler=ShardSampler(len(dataset), env.rank, env.world_size),
        **_loader_options(data_cfg, device, collate_fn),
    )


def to_device(batch: Any, device: torch.device, channels_last: bool = False) -> Any:
    """A batch of any nesting (tensors in tuples, lists, dicts) on `device`; 4-D floating
    tensors (images) go channels-last when asked (trainer.channels_last)."""

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if channels_last and tensor.dim() == 4 and tensor.is_floating_point():
            return tensor.to(device, non_blocking=True, memory_format=torch.channels_last)
        return tensor.to(device, non_blocking=True)

    return map_tensors(batch, move)


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`fn` of every tensor in a nest of tuples, lists and dicts (their own types rebuilt);
    anything else as it is."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        return type(tree)({k: map_tensors(v, fn) for k, v in tree.items()})
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple
        return type(tree)(*(map_tensors(v, fn) for v in tree))
    if isinstance(tree, Sequence) and not isinstance(tree, str):
        return type(tree)(map_tensors(v, fn) for v in tree)
    return tree
