"""strategy=fsdp against strategy=ddp: real 2-rank gloo jobs, compared number for number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from framework.storage.export import whole_weights
from tests.conftest import TINY, make_cfg, read_metrics, train_losses, train_many

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# Accumulation (the reduce-scatter skipped until the last micro-batch) and clipping (the
# global norm over DTensor gradients) on; a constant lr keeps every step's update comparable.
COMMON = (
    "launcher.nproc_per_node=2",
    "trainer.max_steps=30",
    "trainer.grad_accum=2",
    "trainer.clip_grad_norm=0.5",
    "scheduler=constant",
    "trainer.log_every=1",
    "checkpoint.every=0",
)
GPT = (
    "task=language_model",
    "model=gpt",
    "data=text",
    "model.layers=2",
    "model.width=32",
    "model.heads=2",
    "data.block_size=16",
    "data.stride=16",
    "data.eval_batch_size=256",
    "task.sample_tokens=8",
    "optimizer=adamw",
)
MODELS = {
    # 101 validation samples in batches of 25: rank 0 has 3 batches, rank 1 2; under fsdp rank 1
    # runs an uncounted third forward (every forward gathers parameters from every rank).
    "mlp": (*TINY, "model=mlp", "data.batch_size=4", "data.eval_batch_size=25"),
    "cnn": (*TINY, "model=cnn", "model.width=8", "data.batch_size=4"),
    "gpt": (*GPT, "data.batch_size=2"),
}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """A one-file checkpoint's or a sharded one's (strategy=fsdp's default), whole."""
    return whole_weights(run_dir / "checkpoints" / "last.pt")


@pytest.mark.parametrize("model", MODELS)
def test_fsdp_on_two_ranks_reproduces_ddp_on_two_ranks(tmp_path, model):
    overrides = (*MODELS[model], *COMMON)
    ddp, fsdp = train_many(
        [
            (make_cfg(*overrides, "strategy=ddp"), tmp_path / "ddp"),
            (make_cfg(*overrides, "strategy=fsdp"), tmp_path / "fsdp"),
        ]
    )
    ddp_losses, fsdp_losses = train_losses(tmp_path / "ddp"), train_losses(tmp_path / "fsdp")
    assert len(ddp_losses) == len(fsdp_losses) == 30
    torch.testing.assert_close(fsdp_losses, ddp_losses, rtol=1e-5, atol=1e-6)
    expected, sharded = final_weights(tmp_path / "ddp"), final_weights(tmp_path / "fsdp")
    assert sharded.keys() == expected.keys()
    # atol 1e-5: the GPT's key bias has a gradient of rounding noise only (softmax ignores a
    # constant per query), which AdamW scales up: it differs by ~1e-6 between reduction orders.
    for name, tensor in expected.items():
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-5, atol=1e-5, msg=name)
    assert fsdp[ddp["objective"]] == pytest.approx(ddp[ddp["objective"]], rel=1e-5)


def test_fsdp_with_ema_bf16_and_best_k_resumed_halfway_ends_with_the_straight_runs_weights(
    tmp_path,
):
    """EMA (sharded like the model), precision=bf16 (FSDP's mixed precision), best-K by
    val/loss and the test on the best checkpoint's weights: a run stopped at step 4 and resumed
    to 8 ends as the one run straight to 8 does, bit for bit: its final weights and its EMA's
    (each restored from its own shards), every validation metric (computed with the EMA), the
    best checkpoints kept with their scores, the losses and the test metrics."""
    overrides = (
        "model=cnn",
        "model.width=8",
        "data=digits",
        "trainer.log_every=1",
        "data.test_fraction=0.2",
        "data.batch_size=8",
        "scheduler=constant",
        "launcher.nproc_per_node=2",
        "strategy=fsdp",
        "precision=bf16",
        "trainer.ema_decay=0.9",
        "trainer.eval_every=2",
        "objective=val/loss",  # differs at every evaluation: the best two are not ties
        "checkpoint.best=2",
        "checkpoint.every=2",
        "trainer.on_nonfinite=skip",
    )
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    straight, first_half = train_many(
        [
            (make_cfg(*overrides, "trainer.max_steps=8"), straight_dir),
            (make_cfg(*overrides, "trainer.max_steps=4"), resumed_dir),
        ]
    )
    (resumed,) = train_many([(make_cfg(*overrides, "trainer.max_steps=8"), resumed_dir)])
    assert first_half["steps"] == 4 and resumed["steps"] == straight["steps"] == 8
    assert train_losses(resumed_dir) == train_losses(straight_dir)
    for ema in (False, True):
        expected = whole_weights(straight_dir / "checkpoints" / "last.pt", ema=ema)
        got = whole_weights(resumed_dir / "checkpoints" / "last.pt", ema=ema)
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), f"{'ema' if ema else 'model'}: {name}"
    assert validation(resumed_dir) == validation(straight_dir)
    assert sorted(validation(straight_dir)) == [2, 4, 6, 8]
    assert best_kept(resumed_dir) == best_kept(straight_dir)
    assert len(best_kept(straight_dir)) == 2
    for key in ("test/loss", "test/accuracy", "test/weights"):
        assert resumed[key] == straight[key], key
    assert straight["test/weights"].startswith("best checkpoint")


def validation(run_dir: Path) -> dict[int, dict[str, float]]:
    """Every evaluation's val/* metrics, by step."""
    return {
        event["step"]: {key: value for key, value in event.items() if key.startswith("val/")}
        for event in read_metrics(run_dir)
        if "val/loss" in event
    }


def best_kept(run_dir: Path) -> dict[str, float]:
    """The best checkpoints kept (checkpoint.best), with their scores."""
    return {
        sidecar.stem: json.loads(sidecar.read_text())["score"]
        for sidecar in (run_dir / "checkpoints" / "best").glob("step_*.json")
    }
