"""The trial (framework/rank/preflight.py): what only the built parts can show is refused before
any rank starts, in one line naming the option, by running every part once on a real batch,
not by a rule per model."""

from __future__ import annotations

import re

import pytest

from framework.config.validation import validate
from framework.core.exits import ConfigError
from framework.rank.preflight import preflight
from tests.conftest import make_cfg

REFUSED = [
    # A data option's shape keys describe what it gives, for the models to read.
    (["data.image_size=32", "model=resnet50"], "data.image_size=32, but the data's batches have"),
    (
        ["data=diabetes", "task=regression", "model=ffn", "data.num_features=3"],
        "data.num_features=3, but the data's batches have num_features 10",
    ),
    # A model whose inputs or classes do not fit the data's.
    (["model.num_classes=5"], "labels run from 0 to 9 but the model has 5 class logits"),
    (["model=mlp", "model.image_size=16"], "the model cannot take this data's inputs"),
    (["model.in_channels=3"], "the model cannot take this data's inputs"),
    (["experiment=char_gpt", "model.block_size=32"], "the model cannot take this data's inputs"),
    (["experiment=char_gpt", "data.vocab_size=64"], "the model cannot take this data's inputs"),
    # A model's own refusal of its settings: heads that do not divide the width.
    (["experiment=char_gpt", "model.heads=3"], "ValueError: heads=3 does not divide width=128"),
    # A task and a model, or a task and data, that do not go together.
    (["model=vae"], "a VAE's (reconstruction, mu, logvar) goes with task=autoencoder"),
    (["task=language_model"], "task=language_model reads"),
    # torch's optimizers refuse what they cannot take.
    (["optimizer.momentum=-0.5"], "ValueError: Invalid momentum value: -0.5"),
    (["optimizer.momentum=0", "optimizer.nesterov=true"], "Nesterov momentum requires"),
    (["optimizer=adamw", "optimizer.betas=[0.9,1.5]"], "Invalid beta parameter at index 1"),
    (["optimizer=adamw", "optimizer.eps=-1"], "Invalid epsilon value: -1"),
    # A model's own knowledge of what it needs: ResNet-50's stem on 8x8 digits.
    (["model=resnet50"], "ImageNet's stem downsamples 32x, and images of 8 pixels"),
    # The data's sizes: what the loaders build at the fewest ranks the launcher starts.
    (["data.batch_size=5000"], "the training set (1438 samples) is smaller than one global"),
    (["data.val_fraction=0.0001"], "the validation split of framework.components.data.digits"),
    # An empty split names the keys of this data option that size its splits.
    (
        ["data.val_fraction=0.6", "data.test_fraction=0.4"],
        "the training split of framework.components.data.digits is empty: give it samples "
        "(data.val_fraction, data.test_fraction)",
    ),
    (["experiment=char_gpt", "data.val_fraction=0.00001"], "the validation split of"),
    (["data=cifar10"], "data.root=None holds no CIFAR-10 python batches"),
    (["data=cifar10", "data.root=/nonexistent"], "data.root=/nonexistent holds no CIFAR-10"),
    # A block class FSDP would shard that the model does not have.
    (["strategy=fsdp", "strategy.block_classes=[my block]"], "my block is no module class"),
]


@pytest.mark.parametrize(("overrides", "expected"), REFUSED, ids=lambda item: str(item))
def test_what_only_the_built_parts_show_is_one_line_naming_the_setting(overrides, expected):
    cfg = make_cfg(*overrides)
    validate(cfg)  # the config alone shows nothing wrong
    with pytest.raises(ConfigError, match=re.escape(expected)) as refused:
        preflight(cfg, world_size=2)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["experiment=char_gpt"],
        ["experiment=digits_vae"],
        ["experiment=diabetes_mlp"],
        ["strategy=fsdp", "experiment=char_gpt"],
        ["data.batch_size=719"],  # 1438 samples on 2 ranks: one global batch
        ["data=synthetic", "data.train_size=2", "data.batch_size=1"],
    ],
)
def test_the_shipped_experiments_pass_their_trial(overrides):
    cfg = make_cfg(*overrides)
    validate(cfg)
    preflight(cfg, world_size=2)


def test_the_trial_leaves_the_random_streams_as_it_found_them():
    """Training starts from the seed, whatever the trial drew."""
    import numpy as np
    import torch

    torch.manual_seed(7)
    np.random.seed(7)
    expected = (torch.rand(3), np.random.rand(3))
    torch.manual_seed(7)
    np.random.seed(7)
    preflight(make_cfg(), world_size=2)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
