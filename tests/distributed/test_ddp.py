"""Real 2-rank gloo jobs on CPU, compared against 1-rank runs of the same experiment."""

from __future__ import annotations

import tempfile
from typing import NamedTuple

import pytest
import torch

from tests.conftest import (
    TINY,
    make_cfg,
    read_metrics,
    train_in_process,
    train_losses,
    train_many,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# fp32/allreduce, no BatchNorm or dropout: the conditions under which DDP is exact.
PARITY = (*TINY, "model=mlp", "optimizer=sgd", "scheduler=constant", "trainer.max_steps=12")


class Run(NamedTuple):
    summary: dict
    losses: list[float]


def run(tmp_path, name: str, *overrides: str) -> Run:
    run_dir = tmp_path / name
    summary = train_in_process(make_cfg(*PARITY, *overrides), run_dir)
    return Run(summary, train_losses(run_dir))


ONE_RANK = ("launcher.nproc_per_node=1", "data.batch_size=16")
TWO_RANKS = ("launcher.nproc_per_node=2", "data.batch_size=8")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Run:
    """The reference every parity test compares with: 1 rank at batch 16."""
    return run(tmp_path_factory.mktemp("one_rank"), "single", *ONE_RANK)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Run:
    """2 ranks at batch 8 each: the same global batch as one_rank."""
    return run(tmp_path_factory.mktemp("two_ranks"), "ddp", *TWO_RANKS)


def test_two_ranks_at_batch_b_match_one_rank_at_batch_2b(two_ranks, one_rank):
    assert len(two_ranks.losses) == len(one_rank.losses) == 12
    torch.testing.assert_close(two_ranks.losses, one_rank.losses, rtol=1e-5, atol=0)


def test_grad_accumulation_matches_the_larger_batch(tmp_path, one_rank):
    """The accumulation derived from trainer.global_batch_size: 16 / (8 per rank x 1 rank)."""
    summary, accum = run(
        tmp_path,
        "accum",
        "launcher.nproc_per_node=1",
        "data.batch_size=8",
        "trainer.global_batch_size=16",
    )
    assert summary["global_batch_size"] == 16
    assert (
        "global batch 16 = 8 per rank x 1 ranks x 2 accumulation"
        in (tmp_path / "accum" / "train.log").read_text()
    )
    torch.testing.assert_close(accum, one_rank.losses, rtol=1e-5, atol=0)


def test_two_rank_accumulation_matches_one_rank_batch_4b(tmp_path, one_rank):
    _, ddp = run(
        tmp_path,
        "ddp_accum",
        "launcher.nproc_per_node=2",
        "data.batch_size=4",
        "trainer.grad_accum=2",
    )
    torch.testing.assert_close(ddp, one_rank.losses, rtol=1e-5, atol=0)


def test_two_rank_evaluation_equals_one_rank_on_an_odd_sized_val_set(two_ranks, one_rank):
    # 101 validation samples: rank 0 gets 51, rank 1 gets 50; no sample counted twice.
    two, one = two_ranks.summary, one_rank.summary
    assert two["val/accuracy"] == one["val/accuracy"]
    assert two["val/accuracy"] * 101 == pytest.approx(round(two["val/accuracy"] * 101))
    assert two["val/loss"] == pytest.approx(one["val/loss"], rel=1e-5)


def test_same_seed_same_world_size_gives_identical_losses(tmp_path):
    overrides = (*PARITY, "model=cnn", "trainer.max_steps=8")
    seeds = {"a": 0, "b": 0, "c": 1}
    train_many(
        [
            (make_cfg(*overrides, f"trainer.seed={seed}"), tmp_path / name)
            for name, seed in seeds.items()
        ]
    )
    first, second, other_seed = (train_losses(tmp_path / name) for name in seeds)
    assert first == second
    assert other_seed != first


def test_summary_and_metrics_have_the_contract_keys(tmp_path):
    summary, _ = run(
        tmp_path,
        "ddp",
        "launcher.nproc_per_node=2",
        "data.batch_size=8",
        "trainer.grad_accum=2",
        "trainer.log_every=4",
    )
    events = read_metrics(tmp_path / "ddp")
    train_events = [e for e in events if "train/loss" in e]
    assert [e["step"] for e in train_events] == [4, 8, 12]
    for key in ("step", "epoch", "train/loss", "lr", "samples_per_s"):
        assert all(key in e for e in train_events), key
    assert summary["world_size"] == 2 and summary["global_batch_size"] == 32
    assert summary["steps"] == 12
    for key in ("val/loss", "val/accuracy", "samples_per_s", "wall_s"):
        assert key in summary
    config = (tmp_path / "ddp" / "config.yaml").read_text()
    assert "${" not in config and "batch_size: 8" in config  # fully resolved


def test_ema_clipping_and_ddp_options_run_together(tmp_path):
    summary, losses = run(
        tmp_path,
        "options",
        "model=resnet18",
        "data.image_size=8",
        "data.in_channels=3",
        "launcher.nproc_per_node=2",
        "data.batch_size=4",
        "trainer.max_steps=3",
        "trainer.ema_decay=0.9",
        "trainer.clip_grad_norm=1.0",
        "dist.ddp.bucket_cap_mb=1",
        "dist.ddp.static_graph=true",
        "dist.ddp.gradient_as_bucket_view=false",
        "data.num_workers=2",
        "data.persistent_workers=true",
    )
    assert summary["steps"] == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_ema_changes_what_is_evaluated(tmp_path, one_rank):
    ema, _ = run(tmp_path, "ema", *ONE_RANK, "trainer.ema_decay=0.5")
    assert ema["val/loss"] != one_rank.summary["val/loss"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal; CUDA runs SyncBatchNorm")
def test_sync_batchnorm_on_cpu_is_refused_with_the_fix(tmp_path, capfd):
    from framework.core.exits import ConfigError

    with pytest.raises(ConfigError):
        run(
            tmp_path,
            "sbn",
            "model=resnet18",
            "data.in_channels=3",
            "launcher.nproc_per_node=2",
            "data.batch_size=4",
            "trainer.max_steps=1",
            "trainer.sync_batchnorm=true",
        )
    assert "trainer.sync_batchnorm=false" in capfd.readouterr().err


def test_torchrun_launcher_trains_as_local_and_leaves_no_torchelastic_folder(
    tmp_path, monkeypatch, two_ranks
):
    """The elastic agent runs in the launcher's process, so this process's temp dir (Python's
    tempfile.tempdir: TMPDIR is read once) is where its folders would be left."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    _, elastic = run(tmp_path, "elastic", "launcher=torchrun", *TWO_RANKS)
    assert elastic == two_ranks.losses
    assert sorted(p.name for p in temp.iterdir() if "elastic" in p.name) == []
