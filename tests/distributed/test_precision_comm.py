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
class Variant:
    """One setting away from the baseline, trained at some of the baseline's seeds, and what its
    means over those seeds may lose against the baseline's means over the same seeds."""

    setting: tuple[str, ...]
    seeds: tuple[int, ...]
    accuracy_lost: float  # at most this much lower val/accuracy
    loss_ratio: float  # val/loss at most this many times the baseline's


# The digits MLP at 4 epochs (88 steps of 32 per rank; fp32 with allreduce reaches 95-97% of the
# 359 val images). A variant runs at the baseline's seeds (the same initial weights and data
# order), so what differs is the variant's own doing. These statistics over seeds 0-9 (PowerSGD's
# over all 45 pairs of them, as it runs two), min .. max:
#                                         accuracy lost (points)   val/loss ratio
#   fp16 and bf16 hooks, bf16 and amp     -0.28 .. +0.28           0.986 .. 1.017
#   the fp16 hook zeroing half a bucket   +0.84 .. +3.34           1.449 .. 1.875
#   PowerSGD                              -0.84 .. +1.11           0.968 .. 1.173
#   PowerSGD without error feedback       +5.29 .. +10.86          3.059 .. 4.353
# The loss ratio separates each broken variant from its correct one by more than its spread (a
# sd of 0.009 and 0.134 per seed for the first two rows, 0.06 and 0.36 for pairs in the last
# two); accuracy, what users read, moves in 0.28-point steps and alone would miss the zeroed half
# at 2 of 10 seeds. PowerSGD starts at step 2: at its default start of 10 the plain first steps
# do most of the learning and without error feedback it ended only 3.1-3.9 points behind (seeds
# 0-4); in fewer steps its error feedback has not caught up (2.5 points behind at 44). What is
# ours in a precision (autocast, the loss scaler, fp32 master weights) is the same for every
# model: with AMP's scaler bypassed this test fails (a non-finite loss at step 2), and bf16
# without fp32 master weights is test_reduced_precision_steps_update_fp32_master_weights's.
ACCURACY_BASELINE = ("model=mlp", "trainer.max_epochs=4", "trainer.log_every=1000")
LEAST_BASELINE_ACCURACY = 0.95
ACCURACY_VARIANTS = (
    Variant(("comm=powersgd", "comm.start_iter=2"), (0, 1), accuracy_lost=0.03, loss_ratio=1.5),
    *(
        Variant((setting,), (0,), accuracy_lost=0.01, loss_ratio=1.1)
        for setting in ("comm=fp16", "comm=bf16", "precision=bf16", "precision=amp")
    ),
)


def test_compressed_communication_and_every_precision_keep_digits_accuracy(tmp_path):
    """Each variant's mean val/accuracy and val/loss over its seeds within its tolerances of the
    baseline's at the same seeds."""
    baseline_seeds = sorted({seed for variant in ACCURACY_VARIANTS for seed in variant.seeds})
    runs = [((), seed) for seed in baseline_seeds] + [
        (variant.setting, seed) for variant in ACCURACY_VARIANTS for seed in variant.seeds
    ]
    jobs = [
        (
            make_cfg(*ACCURACY_BASELINE, *setting, f"trainer.seed={seed}"),
            tmp_path / "-".join(("baseline", *setting, str(seed))).replace("=", "-"),
        )
        for setting, seed in runs
    ]
    summaries = train_many(jobs)
    results = {
        (setting, seed): {metric: summary[metric] for metric in ("val/accuracy", "val/loss")}
        for (setting, seed), summary in zip(runs, summaries, strict=True)
    }

    def mean(setting: tuple[str, ...], seeds: tuple[int, ...], metric: str) -> float:
        return statistics.mean(results[(setting, seed)][metric] for seed in seeds)

    baseline_accuracy = mean((), tuple(baseline_seeds), "val/accuracy")
    assert baseline_accuracy >= LEAST_BASELINE_ACCURACY, results
    for variant in ACCURACY_VARIANTS:
        setting, seeds = variant.setting, variant.seeds
        lost = mean((), seeds, "val/accuracy") - mean(setting, seeds, "val/accuracy")
        ratio = mean(setting, seeds, "val/loss") / mean((), seeds, "val/loss")
        assert lost <= variant.accuracy_lost, (setting, lost, results)
        assert ratio <= variant.loss_ratio, (setting, ratio, results)
    print(results)
