"""Every precision x comm combination on 2 CPU ranks, what each does to accuracy, and the
loop's update order (unscale, then clip) measured in the weights it moves."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import pytest
import torch

from tests.conftest import TINY, make_cfg, read_metrics, train_many

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
PRECISIONS = ["fp32", "bf16", "amp"]
COMMS = ["allreduce", "fp16", "bf16", "powersgd"]
COMBINATIONS = [(p, c) for p in PRECISIONS for c in COMMS]


@pytest.fixture(scope="module")
def combination_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("combinations")
    jobs = [
        (
            make_cfg(
                *TINY,
                "model=cnn",
                "model.width=8",
                f"precision={precision}",
                f"comm={comm}",
                "trainer.max_steps=5",
                "trainer.clip_grad_norm=1.0",
                "data.batch_size=8",
                *(["comm.start_iter=2"] if comm == "powersgd" else []),
            ),
            root / f"{precision}-{comm}",
        )
        for precision, comm in COMBINATIONS
    ]
    summaries = train_many(jobs)
    return {
        combo: (summary, read_metrics(run_dir), run_dir)
        for combo, summary, (_, run_dir) in zip(COMBINATIONS, summaries, jobs, strict=True)
    }


@pytest.mark.parametrize(("precision", "comm"), COMBINATIONS)
def test_every_precision_and_comm_combination_trains_on_two_cpu_ranks(
    combination_runs, precision, comm
):
    summary, events, _ = combination_runs[(precision, comm)]
    train_events = [e for e in events if "train/loss" in e]
    assert summary["steps"] == 5 and summary["world_size"] == 2
    assert all(e["train/loss"] == e["train/loss"] for e in train_events)  # no NaN
    assert "precision/skipped_steps" in train_events[-1]
    if precision == "amp":
        assert train_events[-1]["precision/loss_scale"] > 0
    expected_compression = {"allreduce": 1.0, "fp16": 2.0, "bf16": 2.0}
    if comm in expected_compression:
        assert summary["comm/compression"] == pytest.approx(expected_compression[comm])
    else:
        assert train_events[0]["comm/compression"] == 1.0  # plain allreduce before start_iter
        assert summary["comm/compression"] > 2.0


LOW_PRECISION = {"bf16": torch.bfloat16, "amp": torch.float16}


@pytest.mark.parametrize("precision", list(LOW_PRECISION))
def test_reduced_precision_steps_update_fp32_master_weights(combination_runs, precision):
    """Autocast computes in bf16 or fp16; the optimizer updates fp32 weights. Weights kept in (or
    rounded to) the low precision would all be bf16 or fp16 numbers after a step; fp32 updates
    make almost none of them one (none, in these runs)."""
    summary, events, run_dir = combination_runs[(precision, "allreduce")]
    last = [e for e in events if "train/loss" in e][-1]
    assert last["precision/skipped_steps"] < summary["steps"]  # some update was applied
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    weights = [t for t in saved.values() if t.is_floating_point()]
    assert {t.dtype for t in weights} == {torch.float32}
    flat = torch.cat([t.flatten() for t in weights])
    representable = (flat.to(LOW_PRECISION[precision]).float() == flat).float().mean().item()
    assert representable < 0.05, representable


# Plain SGD (no momentum, no decay) at a constant lr, the gradient clipped to a norm far below
# its own: each applied update then moves the weights by exactly lr x CLIP_NORM.
CLIP_NORM = 0.01
PLAIN_CLIPPED_SGD = (
    *TINY,
    "model=mlp",
    "data.batch_size=8",
    "optimizer.momentum=0.0",
    "optimizer.weight_decay=0.0",
    "scheduler=constant",
    f"trainer.clip_grad_norm={CLIP_NORM}",
    "trainer.max_steps=2",
    "checkpoint.every=1",
)


def test_the_loops_update_clips_the_unscaled_gradient_so_amp_moves_the_weights_as_fp32_does(
    tmp_path,
):
    """Runner.update itself (framework/rank/loop.py): the weights move from step 1's checkpoint
    to step 2's by lr x clip_grad_norm under amp as under fp32. Clipping amp's gradients while
    they are still scaled by 65536 and unscaling them after would move them 65536 times less."""
    jobs = [
        (make_cfg(*PLAIN_CLIPPED_SGD, f"precision={precision}"), tmp_path / precision)
        for precision in ("fp32", "amp")
    ]
    train_many(jobs)
    for _, run_dir in jobs:
        [step_2] = [e for e in read_metrics(run_dir) if e["step"] == 2 and "lr" in e]
        assert step_2["precision/skipped_steps"] == 0, run_dir.name
        before, after = (
            torch.load(run_dir / "checkpoints" / f"step_0000000{step}.pt", weights_only=True)
            for step in (1, 2)
        )
        moved = torch.cat(
            [(after["model"][name] - tensor).flatten() for name, tensor in before["model"].items()]
        )
        assert moved.norm().item() == pytest.approx(step_2["lr"] * CLIP_NORM, rel=1e-3), (
            run_dir.name
        )


@dataclass(frozen=True)
class Arm:
    """A baseline and the variants compared with it, each at the baseline's settings and steps,
    as a mean over seeds."""

    name: str
    settings: tuple[str, ...]
    baseline: str
    variants: tuple[str, ...]
    seeds: tuple[int, ...]
    least_baseline_accuracy: float


# PowerSGD, the lossy hook, on the default experiment (the CNN, 15 epochs, 330 steps): it is
# about a point behind there, so its seed-to-seed noise decides (one seed alone moves digits
# accuracy by one or two points, 359 val images) and both get three seeds. Without error
# feedback it ends 21 to 45 points behind; at 10 epochs it is still 4 behind (93% vs 97%).
# The precisions and the near-lossless hooks on the digits MLP at 4 epochs (88 steps, fp32 at
# 96-97%). What is ours in a precision (autocast, the loss scaler, fp32 master weights) is the
# same for every model, and on a CPU without float16 or bfloat16 arithmetic (AVX2 only, as
# here) the CNN's reduced-precision convolutions run torch's reference kernels, 5-7x an fp32
# step. The break that only the CNN at 15 epochs showed, bf16 without fp32 master weights, is
# test_reduced_precision_steps_update_fp32_master_weights's; the MLP arm fails with AMP's scaler
# bypassed (non-finite loss at step 2).
ARMS = (
    Arm("cnn", (), "comm=allreduce", ("comm=powersgd",), (0, 1, 2), 0.95),
    Arm(
        "mlp",
        ("model=mlp", "trainer.max_epochs=4"),
        "precision=fp32",
        ("precision=bf16", "precision=amp", "comm=fp16", "comm=bf16"),
        (0, 1),
        0.95,
    ),
)


def test_compressed_communication_and_every_precision_keep_digits_accuracy(tmp_path):
    """Each variant's mean accuracy over seeds within a point of its baseline's."""
    runs = [
        (arm, variant, seed)
        for arm in ARMS
        for variant in (arm.baseline, *arm.variants)
        for seed in arm.seeds
    ]
    jobs = [
        (
            make_cfg(*arm.settings, variant, f"trainer.seed={seed}", "trainer.log_every=1000"),
            tmp_path / f"{arm.name}-{variant.replace('=', '-')}-{seed}",
        )
        for arm, variant, seed in runs
    ]
    summaries = train_many(jobs)
    accuracy = {
        (arm.name, variant, seed): summary["val/accuracy"]
        for (arm, variant, seed), summary in zip(runs, summaries, strict=True)
    }

    def mean(arm: Arm, variant: str) -> float:
        return statistics.mean(accuracy[(arm.name, variant, seed)] for seed in arm.seeds)

    for arm in ARMS:
        assert mean(arm, arm.baseline) >= arm.least_baseline_accuracy, accuracy
        for variant in arm.variants:
            assert mean(arm, variant) >= mean(arm, arm.baseline) - 0.01, accuracy
    print(accuracy)
