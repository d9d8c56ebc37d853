"""Data-size mistakes are refused before any rank starts, in one line naming the key that makes
them (framework/config/data_sizes.py); the counts it judges by are the loaders' own."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from framework.components.data import load_splits, train_loader
from framework.config import validate
from framework.config.data_sizes import SPLITS, batches_per_rank
from framework.core.exits import ConfigError
from framework.core.launch_context import DistEnv
from tests.conftest import make_cfg

SHAPES = [
    ("data=digits",),
    ("data=digits", "data.val_fraction=0.3", "data.test_fraction=0.1"),
    ("data=diabetes",),
    ("data=diabetes", "data.val_fraction=0.05", "data.test_fraction=0.2"),
    ("data=text",),
    ("data=text", "data.block_size=64", "data.stride=32", "data.val_fraction=0.02"),
    ("data=synthetic", "data.train_size=37", "data.val_size=5"),
]


@pytest.mark.parametrize("overrides", SHAPES, ids=" ".join)
def test_the_predicted_split_sizes_are_what_the_loaders_build(overrides):
    data = make_cfg(*overrides).data
    splits = load_splits(data)
    assert SPLITS[data._target_](data) == (len(splits.train), len(splits.val))


@pytest.mark.parametrize("samples", [7, 64, 101])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("batch_size", [1, 5, 32])
@pytest.mark.parametrize("drop_last", [True, False])
def test_batches_per_rank_is_the_train_loaders_length(samples, world_size, batch_size, drop_last):
    dataset = TensorDataset(torch.zeros(samples, 1))
    options = {"batch_size": batch_size, "drop_last": drop_last, "shuffle": True}
    options |= {"num_workers": 0, "pin_memory": False, "persistent_workers": False}
    for rank in range(world_size):
        env = DistEnv(rank=rank, local_rank=rank, world_size=world_size)
        loader, _ = train_loader(dataset, options, env, 0, torch.device("cpu"))
        assert batches_per_rank(samples, world_size, batch_size, drop_last) == len(loader)


MISTAKES = [
    (("data=synthetic", "data.train_size=0"), "data.train_size=0 must be >= 1"),
    (("data=synthetic", "data.val_size=0"), "data.val_size=0 must be >= 1"),
    (("data.val_fraction=1.5",), "data.val_fraction=1.5 must be in (0, 1)"),
    (("data.val_fraction=0",), "data.val_fraction=0 must be in (0, 1)"),
    (("data.test_fraction=-0.1",), "data.test_fraction=-0.1 must be in [0, 1)"),
    (("data.val_fraction=0.0001",), "data.val_fraction=0.0001 holds out no sample of 1797"),
    (
        ("data.val_fraction=0.6", "data.test_fraction=0.4"),
        "data.val_fraction=0.6 and data.test_fraction=0.4 leave no training sample of 1797",
    ),
    (
        ("data.batch_size=5000",),
        "data.batch_size=5000: the training split (1438 samples) is smaller than one global batch",
    ),
    (
        ("data.batch_size=400", "launcher.nproc_per_node=4", "launcher.oversubscribe=true"),
        "data.batch_size=400: the training split (1438 samples) is smaller than one global batch "
        "(1600 = 400 per rank x 4 ranks",
    ),
    (
        ("experiment=char_gpt", "data.val_fraction=0.00001"),
        "data.val_fraction=1e-05 leaves 5 tokens",
    ),
    (("experiment=char_gpt", "data.val_fraction=0.99999"), "leaves 5 tokens for training"),
    (("experiment=char_gpt", "data.stride=0"), "data.stride=0 must be >= 1"),
]


@pytest.mark.parametrize(("overrides", "message"), MISTAKES, ids=lambda item: str(item))
def test_a_data_size_mistake_is_one_line_naming_its_key(overrides, message):
    with pytest.raises(ConfigError) as refused:
        validate(make_cfg(*overrides))
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_global_batch_the_training_split_holds_is_accepted():
    one_rank = "launcher.nproc_per_node=1"
    validate(make_cfg(one_rank, "data.batch_size=1438"))
    validate(make_cfg(one_rank, "data=synthetic", "data.train_size=1", "data.batch_size=1"))
    validate(make_cfg("data.batch_size=719"))  # 1438 samples on 2 ranks
