"""Every precision x comm combination on 2 CPU ranks, and what each does to accuracy."""

from __future__ import annotations

import statistics

import pytest

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
        combo: (summary, read_metrics(run_dir))
        for combo, summary, (_, run_dir) in zip(COMBINATIONS, summaries, jobs, strict=True)
    }


@pytest.mark.parametrize(("precision", "comm"), COMBINATIONS)
def test_every_precision_and_comm_combination_trains_on_two_cpu_ranks(
    combination_runs, precision, comm
):
    summary, events = combination_runs[(precision, comm)]
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


SEEDS = (0, 1)  # one seed alone moves digits accuracy by one or two points (359 val images)
# That holds for the near-lossless variants too: 330 steps on, a run with fp16 on the wire no
# longer tracks the allreduce run of its seed (seed 0: 1.1 points below it, 4 images), so one
# seed each would fail on noise. Runs shorter than 15 epochs cannot stand in: at 3 epochs every
# fp32 variant is still below 35%.
# PowerSGD (rank 2) is about a point behind after 330 steps, at the margin: its seed-to-seed noise
# decides, so it and its baseline get a third seed. Without error feedback it ends 21 to 45
# points behind.
SEEDS_OF = {"comm=allreduce": (0, 1, 2), "comm=powersgd": (0, 1, 2)}
VARIANTS = [
    "comm=allreduce",
    "comm=fp16",
    "comm=bf16",
    "comm=powersgd",
    "precision=bf16",
    "precision=amp",
]
# On a CPU without float16 or bfloat16 arithmetic (AVX2 only, as here), reduced-precision
# convolutions run torch's slow reference kernels, faster in channels_last: a step of the default
# CNN (16 images, one thread) takes amp 167 -> 115 ms, bf16 158 -> 99 ms (fp32 13 ms). The layout
# does not change what is learned (test_speed_options). The model stays the default's: at width
# 16, bf16 without fp32 master weights (every weight rounded to bf16 after each step) ended above
# its baseline and passed; at the default width it ends 1.5 points below it and fails.
ALONG_WITH = {
    "precision=amp": ("trainer.channels_last=true",),
    "precision=bf16": ("trainer.channels_last=true",),
}


def test_compressed_communication_and_every_precision_keep_digits_accuracy(tmp_path):
    """The default digits experiment, same number of steps, mean over seeds."""
    # The full 15 epochs: at 10, PowerSGD (rank 2) is still 4 points behind (93% vs 97%).
    runs = [(variant, seed) for variant in VARIANTS for seed in SEEDS_OF.get(variant, SEEDS)]
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
    baseline = "comm=allreduce"  # = fp32 with allreduce

    def mean(variant: str, seeds: tuple[int, ...]) -> float:
        return statistics.mean(accuracy[(variant, seed)] for seed in seeds)

    assert mean(baseline, SEEDS) >= 0.95, accuracy
    for variant in VARIANTS[1:]:
        seeds = SEEDS_OF.get(variant, SEEDS)
        assert mean(variant, seeds) >= mean(baseline, seeds) - 0.01, accuracy
    print(accuracy)
