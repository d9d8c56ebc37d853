"""Data: shards cover the validation set exactly once; CIFAR-10's real on-disk format loads."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from framework.components.data import (
    ResumableSampler,
    ShardSampler,
    bundled_with_scikit_learn,
    cifar10,
    digits,
    epoch_coverage,
    split_indices,
    synthetic,
    train_loader,
)
from framework.config.registry import option_values
from framework.core.launch_context import DistEnv


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_eval_shards_cover_every_sample_once_without_padding(world_size):
    shards = [list(ShardSampler(101, rank, world_size)) for rank in range(world_size)]
    assert sorted(i for shard in shards for i in shard) == list(range(101))


def samplers(world_size: int, start: int = 0) -> list[ResumableSampler]:
    found = []
    for rank in range(world_size):
        sampler = ResumableSampler(
            range(100), num_replicas=world_size, rank=rank, shuffle=True, seed=7, drop_last=True
        )
        sampler.set_epoch(3, start=start)
        found.append(sampler)
    return found


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 3), (2, 3), (3, 2), (2, 2)])
def test_a_resumed_epoch_continues_from_the_global_position_on_any_world_size(before, after):
    """Rank r of W draws every W-th sample of one global order: 12 per rank on `before` ranks,
    then the rest of the epoch on `after` ranks, is that order with no sample twice or skipped
    (except the tail that drop_last cuts to a multiple of `after`)."""
    seen = [i for sampler in samplers(before) for i in list(sampler)[:12]]
    rest = [list(sampler) for sampler in samplers(after, start=12 * before)]
    order = samplers(after)[0].global_order()
    assert sorted(seen + [i for shard in rest for i in shard]) == sorted(order)
    assert sorted(seen) == sorted(order[: 12 * before])
    assert [len(shard) for shard in rest] == [
        len(sampler) for sampler in samplers(after, 12 * before)
    ]


def test_on_the_same_world_size_the_resumed_shard_is_the_rest_of_the_uninterrupted_one():
    for whole, resumed in zip(samplers(2), samplers(2, start=2 * 10), strict=True):
        assert list(resumed) == list(whole)[10:]
        reference = torch.utils.data.DistributedSampler(
            range(100), num_replicas=2, rank=whole.rank, shuffle=True, seed=7, drop_last=True
        )
        reference.set_epoch(3)
        assert list(whole) == list(reference)  # torch's own split, unchanged


def test_digits_is_the_real_bundled_dataset():
    splits = digits(**option_values("data", "digits"))
    assert len(splits.train) + len(splits.val) == 1797
    images, labels = splits.val.tensors
    assert images.shape[1:] == (1, 8, 8)
    assert set(labels.tolist()) == set(range(10))


def test_digits_classes_keeps_those_digits_labelled_in_the_order_given():
    every = digits(**option_values("data", "digits", val_fraction=0.0))
    images, labels = every.train.tensors
    kept = digits(**option_values("data", "digits", val_fraction=0.0, classes=[7, 3]))
    kept_images, kept_labels = kept.train.tensors
    assert sorted(kept_labels.unique().tolist()) == [0, 1]
    assert (kept_labels == 0).sum() == (labels == 7).sum()
    assert (kept_labels == 1).sum() == (labels == 3).sum()
    assert torch.equal(kept_images[kept_labels == 0].sum(0), images[labels == 7].sum(0))


def test_digits_and_diabetes_equal_scikit_learns_loaders_without_importing_it():
    from sklearn.datasets import load_diabetes, load_digits

    splits = digits(**option_values("data", "digits", val_fraction=0.0, normalize=False))
    ours = torch.cat([splits.train.tensors[0], splits.val.tensors[0]])
    labels = torch.cat([splits.train.tensors[1], splits.val.tensors[1]])
    order = split_indices(1797, 0.0, 0.0, 0)[0]  # the rows in the order the split put them
    reference = load_digits()
    images = torch.tensor(reference.images[order], dtype=torch.float32)[:, None] / 16
    assert torch.equal(ours, images)
    assert torch.equal(labels, torch.tensor(reference.target[order]))

    features, target = load_diabetes(return_X_y=True, scaled=False)
    assert np.array_equal(bundled_with_scikit_learn("diabetes_data_raw.csv.gz"), features)
    assert np.array_equal(bundled_with_scikit_learn("diabetes_target.csv.gz"), target)


def test_synthetic_is_deterministic_and_sized_by_config():
    a, b = (
        synthetic(**option_values("data", "synthetic", train_size=16, val_size=5, seed=3)),
        synthetic(**option_values("data", "synthetic", train_size=16, val_size=5, seed=3)),
    )
    assert len(a.train) == 16 and len(a.val) == 5
    assert torch.equal(a.train.tensors[0], b.train.tensors[0])


def write_cifar_batch(path, count: int, seed: int) -> None:
    """A file in CIFAR-10's python format: a pickled dict (str keys once read with latin1,
    as the real Python 2 pickles are) holding uint8 rows of 3072 values (R, G, B planes)."""
    rng = np.random.default_rng(seed)
    batch = {
        "batch_label": "tiny",
        "labels": rng.integers(0, 10, count).tolist(),
        "data": rng.integers(0, 256, (count, 3072), dtype=np.uint8),
        "filenames": [f"{i}.png" for i in range(count)],
    }
    with open(path, "wb") as handle:
        pickle.dump(batch, handle, protocol=2)


def make_tiny_cifar(root) -> None:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for index in range(1, 6):
        write_cifar_batch(folder / f"data_batch_{index}", count=8, seed=index)
    write_cifar_batch(folder / "test_batch", count=6, seed=0)
    with open(folder / "batches.meta", "wb") as handle:
        pickle.dump({"label_names": [str(i) for i in range(10)]}, handle, protocol=2)


@pytest.mark.parametrize("point_at", ["parent", "batches_folder"])
def test_cifar10_reads_a_local_folder_in_torchvision_format(tmp_path, point_at):
    make_tiny_cifar(tmp_path)
    root = tmp_path if point_at == "parent" else tmp_path / "cifar-10-batches-py"
    splits = cifar10(**option_values("data", "cifar10", root=str(root), augment=True))
    assert len(splits.train) == 40 and len(splits.val) == 6
    image, label = splits.train[0]
    assert image.shape == (3, 32, 32) and 0 <= label < 10


class _PlantsAFile:
    """A pickle that runs code when it is loaded (here: it creates a file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_cifar_folder_holding_a_code_pickle_is_refused_unrun(tmp_path):
    make_tiny_cifar(tmp_path)
    marker = tmp_path / "ran"
    with open(tmp_path / "cifar-10-batches-py" / "test_batch", "wb") as handle:
        pickle.dump({"data": _PlantsAFile(marker), "labels": [0]}, handle, protocol=2)
    with pytest.raises(pickle.UnpicklingError, match="is not CIFAR-10 data"):
        cifar10(**option_values("data", "cifar10", root=str(tmp_path)))
    assert not marker.exists()


@pytest.mark.parametrize(
    ("drop_last", "world_size", "accumulation", "expected"),
    [
        (True, 2, 1, "an epoch uses 8 of the 15 training samples: data.drop_last=true drops the 7"),
        (True, 1, 2, "an epoch uses 8 of the 15 training samples"),
        (True, 3, 1, "an epoch uses 12 of the 15 training samples"),
        (False, 2, 1, None),  # padded: every sample is used
    ],
)
def test_the_start_says_how_many_samples_an_epoch_uses(
    drop_last, world_size, accumulation, expected
):
    """15 samples in batches of 4 per rank: what the loader of rank 0 will give in an epoch."""
    dataset = torch.utils.data.TensorDataset(torch.arange(15.0))
    data = {"batch_size": 4, "drop_last": drop_last, "shuffle": True, "num_workers": 0}
    data |= {"pin_memory": False, "persistent_workers": False}
    env = DistEnv(rank=0, world_size=world_size, local_world_size=world_size)
    loader, _ = train_loader(dataset, data, env, seed=0, device=torch.device("cpu"))
    said = epoch_coverage(loader, accumulation)
    assert said == expected or (expected is not None and said.startswith(expected))
    steps = len(loader) // accumulation
    if expected is not None:  # the number said is what the steps take
        assert f"uses {steps * accumulation * 4 * world_size} of" in said
