"""Every shipped task on real 2-rank gloo jobs, under ddp and fsdp: the same losses as one rank
with the whole batch,
the same evaluation on a validation set the world size does not divide, token-weighted losses
exact under padding and accumulation, and a language model resumed bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from framework.components.data import load_splits
from framework.core.exits import Stopped
from tests.conftest import (
    REPO,
    make_cfg,
    read_metrics,
    train_in_process,
    train_losses,
    train_many,
)
from tests.faults import FAULT_ENV, assert_same_weights, final_weights

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TESTS_CONF = f"hydra.searchpath=[file://{REPO / 'tests' / 'conf'}]"

# Tiny versions of each task's preset: no dropout, no noise (DDP is exact without them).
TASKS = {
    "regression": (
        "task=regression",
        "model=ffn",
        "model.hidden_sizes=[16]",
        "data=diabetes",
        "data.val_fraction=0.21",
    ),  # 93 validation samples
    "language_model": (
        "task=language_model",
        "model=gpt",
        "model.layers=1",
        "model.width=32",
        "model.heads=2",
        "data=text",
        "data.block_size=16",
        "data.stride=512",
        "data.val_fraction=0.02",
        "task.sample_tokens=0",
    ),
    "autoencoder": (
        "task=autoencoder",
        "task.vae=true",
        "task.reconstruction=bce",
        "model=vae",
        "model.sample=false",
        "model.hidden_size=32",
        "model.latent_dim=4",
        "data=digits",
        "data.normalize=false",
        "data.val_fraction=0.19",
    ),  # 341
}
UNDER_FSDP = list(TASKS)
COMMON = (
    "optimizer=adamw",
    "optimizer.lr=3e-3",
    "scheduler=constant",
    "trainer.max_epochs=null",
    "trainer.max_steps=8",
    "trainer.log_every=1",
)


def val_metrics(run_dir) -> dict[str, float]:
    return {k: v for k, v in read_metrics(run_dir)[-1].items() if k.startswith("val/")}


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    """Each task as 2 ranks x batch 4 and as 1 rank x batch 8."""
    root = tmp_path_factory.mktemp("parity")
    two = [
        (make_cfg(*TASKS[name], *COMMON, "data.batch_size=4"), root / f"{name}-2") for name in TASKS
    ]
    one = [
        (
            make_cfg(*TASKS[name], *COMMON, "data.batch_size=8", "launcher.nproc_per_node=1"),
            root / f"{name}-1",
        )
        for name in TASKS
    ]
    sharded = [
        (
            make_cfg(*TASKS[name], *COMMON, "data.batch_size=4", "strategy=fsdp"),
            root / f"{name}-fsdp",
        )
        for name in UNDER_FSDP
    ]
    train_many(two + sharded, world_size=2)
    train_many(one, world_size=1)
    return root


@pytest.mark.parametrize("task", list(TASKS))
def test_two_ranks_at_batch_b_match_one_rank_at_batch_2b_for_every_task(parity_runs, task):
    two, one = train_losses(parity_runs / f"{task}-2"), train_losses(parity_runs / f"{task}-1")
    assert len(two) == len(one) == 8
    torch.testing.assert_close(two, one, rtol=1e-5, atol=0)
    assert len(set(two)) == len(two)  # a new loss every step: the model trains


@pytest.mark.parametrize("task", list(TASKS))
def test_two_rank_evaluation_equals_one_rank_on_an_odd_sized_set_for_every_task(parity_runs, task):
    two, one = val_metrics(parity_runs / f"{task}-2"), val_metrics(parity_runs / f"{task}-1")
    assert two.keys() == one.keys() and len(two) >= 1
    for name in two:
        assert two[name] == pytest.approx(one[name], rel=1e-5), name


@pytest.mark.parametrize("task", UNDER_FSDP)
def test_the_tasks_under_fsdp_on_two_ranks_match_one_rank_at_batch_2b(parity_runs, task):
    """strategy=fsdp: sharded parameters, reduce-scattered gradients, lockstep evaluation."""
    sharded, one = parity_runs / f"{task}-fsdp", parity_runs / f"{task}-1"
    torch.testing.assert_close(train_losses(sharded), train_losses(one), rtol=1e-5, atol=0)
    two, whole = val_metrics(sharded), val_metrics(one)
    assert two.keys() == whole.keys() and len(two) >= 1
    for name in two:
        assert two[name] == pytest.approx(whole[name], rel=1e-5), name


def pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path)).astype(np.int16)


@pytest.mark.parametrize("picture", ["samples.png", "reconstructions.png"])
def test_the_autoencoder_under_fsdp_draws_ddps_pictures(parity_runs, picture):
    """samples.png decodes draws with the model's decode(), which FSDP gathers the sharded
    parameters for as it does for forward (else: a traceback after training)."""
    sharded, whole = (
        pixels(parity_runs / "autoencoder-fsdp" / picture),
        pixels(parity_runs / "autoencoder-2" / picture),
    )
    assert sharded.shape == whole.shape
    assert np.abs(sharded - whole).max() <= 1  # 8-bit rounding of float-tolerance weights
    assert sharded.std() > 10  # a picture, not a blank


def test_the_validation_sets_of_the_parity_runs_are_odd_sized():
    for name in TASKS:
        assert len(load_splits(make_cfg(*TASKS[name]).data).val) % 2 == 1, name


RAGGED = (
    TESTS_CONF,
    "data=ragged_text",
    "task=language_model",
    "model=gpt",
    "model.layers=1",
    "model.width=32",
    "model.heads=2",
    "task.sample_tokens=0",
    *COMMON,
    "trainer.max_steps=6",
)


def test_padded_sequences_on_two_ranks_with_accumulation_give_one_big_batchs_losses(tmp_path):
    """Micro-batches of 1 to 24 real tokens each (padding ignored): 2 ranks x accumulation 2 x
    batch 4 equals 1 rank x batch 16, token for token (a mean of per-micro-batch means would
    weigh a token of a short batch up to 24 times more: tests/unit/test_tasks.py)."""
    jobs = [(make_cfg(*RAGGED, "data.batch_size=4", "trainer.grad_accum=2"), tmp_path / "two")]
    train_many(jobs, world_size=2)
    one = [(make_cfg(*RAGGED, "data.batch_size=16", "launcher.nproc_per_node=1"), tmp_path / "one")]
    train_many(one, world_size=1)
    torch.testing.assert_close(
        train_losses(tmp_path / "two"), train_losses(tmp_path / "one"), rtol=1e-5, atol=0
    )
    assert val_metrics(tmp_path / "two") == pytest.approx(val_metrics(tmp_path / "one"), rel=1e-5)


CHAR_GPT = (
    "experiment=char_gpt",
    TESTS_CONF,
    "allowed_targets=[tests]",
    "model._target_=tests.faults.FaultyGPT",
    "model.layers=1",
    "model.width=32",
    "model.heads=2",
    "model.dropout=0.1",
    "data.block_size=16",
    "data.stride=256",
    "data.val_fraction=0.02",
    "data.batch_size=4",
    "task.sample_tokens=0",
    "trainer.max_epochs=null",
    "trainer.max_steps=24",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "checkpoint.every=5",
)


def test_char_gpt_stopped_mid_epoch_and_resumed_ends_with_bit_identical_weights(
    tmp_path, monkeypatch
):
    reference = tmp_path / "reference"
    train_in_process(make_cfg(*CHAR_GPT), reference)
    run_dir = tmp_path / "run"
    monkeypatch.setenv(FAULT_ENV, "SIGUSR1:1:9")
    with pytest.raises(Stopped):
        train_in_process(make_cfg(*CHAR_GPT), run_dir)
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["step"] == 10 and saved["trainer"]["epoch"] == 0  # mid-epoch (~800 windows)
    monkeypatch.delenv(FAULT_ENV)
    train_in_process(make_cfg(*CHAR_GPT), run_dir)
    assert_same_weights(final_weights(run_dir), final_weights(reference))
    assert train_losses(run_dir) == train_losses(reference)
