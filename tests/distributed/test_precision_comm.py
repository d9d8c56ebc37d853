"""Every precision x comm combination on 2 CPU ranks, and what each does to accuracy."""

from __future__ import annotations

import statistics

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


SEEDS = (0, 1)  # one seed alone moves digits accuracy by one or two points (359 val images)
# That holds for the near-lossless variants too: 330 steps on, a run with fp16 on the wire no
# longer tracks the allreduce run of its seed (seed 0: 1.1 points below it, 4 images), so one
# seed each would fail on noise. At 3 epochs every fp32 variant is still below 35%.
# PowerSGD (rank 2) is about a point behind after 330 steps, at the margin: its seed-to-seed noise
# decides, so it and its baseline get a third seed. Without error feedback it ends 21 to 45
# points behind. At 10 epochs it is still 4 points behind (93% vs 97%): the comms get the full 15.
SEEDS_OF = {"comm=allreduce": (0, 1, 2), "comm=powersgd": (0, 1, 2)}
# Each variant against its baseline at the same number of steps: the comms at the default 15
# epochs, the precisions at 8 (176 steps), where fp32 is at 93-95%. On a CPU without float16 or
# bfloat16 arithmetic (AVX2 only, as here) reduced-precision convolutions run torch's slow
# reference kernels, 7x fp32's step even in channels_last (which learns what the default layout
# learns: test_speed_options), so 15 epochs of them were two thirds of this test. What 8 epochs
# no longer catches, bf16 without fp32 master weights (at 15 epochs 1.5 points below fp32, at 8
# level with it), test_reduced_precision_steps_update_fp32_master_weights catches directly.
COMPARED = {
    "comm=allreduce": ["comm=fp16", "comm=bf16", "comm=powersgd"],
    "precision=fp32": ["precision=bf16", "precision=amp"],
}
ALONG_WITH = {
    "precision=fp32": ("trainer.max_epochs=8",),
    "precision=amp": ("trainer.max_epochs=8", "trainer.channels_last=true"),
    "precision=bf16": ("trainer.max_epochs=8", "trainer.channels_last=true"),
}
LEAST_BASELINE_ACCURACY = {"comm=allreduce": 0.95, "precision=fp32": 0.9}


def test_compressed_communication_and_every_precision_keep_digits_accuracy(tmp_path):
    """The default digits experiment; each variant's mean over seeds within a point of its
    baseline's, at the same number of steps."""
    variants = [v for baseline, compared in COMPARED.items() for v in (baseline, *compared)]
    runs = [(variant, seed) for variant in variants for seed in SEEDS_OF.get(variant, SEEDS)]
    jobs = [
        (
            make_cfg(
                variant,
                *ALONG_WITH.get(variant, ()),
                f"trainer.seed={seed}",
                "trainer.log_every=1000",
            ),
            tmp_path / f"{variant.replace('=', '-')}-{seed}",
        )
        for variant, seed in runs
    ]
    summaries = train_many(jobs)
    accuracy = {run: summary["val/accuracy"] for run, summary in zip(runs, summaries, strict=True)}

    def mean(variant: str, seeds: tuple[int, ...]) -> float:
        return statistics.mean(accuracy[(variant, seed)] for seed in seeds)

    for baseline, compared in COMPARED.items():
        assert mean(baseline, SEEDS) >= LEAST_BASELINE_ACCURACY[baseline], accuracy
        for variant in compared:
            seeds = SEEDS_OF.get(variant, SEEDS)
            assert mean(variant, seeds) >= mean(baseline, seeds) - 0.01, accuracy
    print(accuracy)
