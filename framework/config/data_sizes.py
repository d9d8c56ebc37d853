"""How many samples each split of a shipped data option holds, from its settings alone (no torch,
no data read), so a size mistake is refused before any rank starts, naming the key that makes
it. A data option of the user's own is judged by its ranks, once they have built it
(framework/rank/build.py).

The counts follow the loaders in framework/components/data.py exactly;
tests/unit/test_data_sizes.py compares them with what the loaders build.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from omegaconf import DictConfig

from framework.core.exits import ConfigError

DIGITS_SAMPLES = 1797  # scikit-learn's digits.csv.gz
DIABETES_SAMPLES = 442  # scikit-learn's diabetes_data_raw.csv.gz


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _check_fraction(data: DictConfig, key: str, low_open: bool) -> None:
    value = data[key]
    inside = (0 < value < 1) if low_open else (0 <= value < 1)
    interval = "(0, 1)" if low_open else "[0, 1)"
    _require(inside, f"data.{key}={value} must be in {interval}: the share of the data it holds")


def table_splits(data: DictConfig, samples: int) -> tuple[int, int]:
    """(train, val) of digits and diabetes: val and test are rounded shares, train the rest."""
    _check_fraction(data, "val_fraction", low_open=True)
    _check_fraction(data, "test_fraction", low_open=False)
    val = round(samples * data.val_fraction)
    test = round(samples * data.test_fraction)
    _require(
        val >= 1,
        f"data.val_fraction={data.val_fraction} holds out no sample of {samples}: raise it",
    )
    _require(
        samples - val - test >= 1,
        f"data.val_fraction={data.val_fraction} and data.test_fraction={data.test_fraction} "
        f"leave no training sample of {samples}: lower them",
    )
    return samples - val - test, val


def text_length() -> int:
    """Tokens of data=text: one per character of the standard library's help topics."""
    from pydoc_data.topics import topics  # plain strings, no torch

    return sum(len(topic) for topic in topics.values()) + 2 * (len(topics) - 1)


def _windows(tokens: int, block_size: int, stride: int) -> int:
    return max(0, (tokens - block_size - 1) // stride + 1)


def text_splits(data: DictConfig) -> tuple[int, int]:
    """(train, val) windows of data=text: the last val_fraction of the text is validation."""
    _check_fraction(data, "val_fraction", low_open=True)
    _require(data.block_size >= 1, f"data.block_size={data.block_size} must be >= 1")
    _require(data.stride >= 1, f"data.stride={data.stride} must be >= 1")
    tokens = text_length()
    split = round(tokens * (1 - data.val_fraction))
    train = _windows(split, data.block_size, data.stride)
    val = _windows(tokens - split, data.block_size, data.block_size)
    needs = f"a window needs data.block_size+1={data.block_size + 1} tokens"
    _require(
        val >= 1,
        f"data.val_fraction={data.val_fraction} leaves {tokens - split} tokens for validation; "
        f"{needs}: raise data.val_fraction or lower data.block_size",
    )
    _require(
        train >= 1,
        f"data.val_fraction={data.val_fraction} leaves {split} tokens for training; {needs}: "
        "lower data.val_fraction or data.block_size",
    )
    return train, val


def synthetic_splits(data: DictConfig) -> tuple[int, int]:
    _require(data.train_size >= 1, f"data.train_size={data.train_size} must be >= 1")
    _require(data.val_size >= 1, f"data.val_size={data.val_size} must be >= 1")
    return data.train_size, data.val_size


SPLITS: dict[str, Callable[[DictConfig], tuple[int, int]]] = {
    "framework.components.data.synthetic": synthetic_splits,
    "framework.components.data.digits": lambda data: table_splits(data, DIGITS_SAMPLES),
    "framework.components.data.diabetes": lambda data: table_splits(data, DIABETES_SAMPLES),
    "framework.components.data.text": text_splits,
}


def batches_per_rank(samples: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Training batches each rank draws per epoch: DistributedSampler's share, then
    DataLoader's batches (framework/components/data.py: train_loader)."""
    if drop_last and samples % world_size:
        share = math.ceil((samples - world_size) / world_size)
    else:
        share = math.ceil(samples / world_size)
    return share // batch_size if drop_last else math.ceil(share / batch_size)


def check_data_sizes(data: DictConfig, world_size: int, grad_accum: int) -> None:
    """Every split of a shipped data option holds samples, and the training split at least one
    global batch (on the fewest ranks the launcher may start)."""
    splits = SPLITS.get(str(data._target_))
    if splits is None:
        return
    train, _ = splits(data)
    if batches_per_rank(train, world_size, data.batch_size, data.drop_last) >= grad_accum:
        return
    batch = data.batch_size * world_size * grad_accum
    raise ConfigError(
        f"data.batch_size={data.batch_size}: the training split ({train} samples) is smaller "
        f"than one global batch ({batch} = {data.batch_size} per rank x {world_size} ranks x "
        f"{grad_accum} accumulation steps): lower data.batch_size, trainer.grad_accum or "
        "launcher.nproc_per_node"
    )
