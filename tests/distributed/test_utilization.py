"""The hardware metrics on real 2-rank gloo jobs: FLOPs per step against the exact matmul count,
TFLOP/s and MFU from the same window as samples/s, every rank's peak memory, and losses that
counting does not change (framework/components/utilization.py)."""

from __future__ import annotations

import pytest
import torch

from framework.components.models import MLP
from tests.conftest import FAULTS, make_cfg, read_metrics, train_losses, train_many
from tests.unit.test_utilization import mlp_flops

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# The fault experiment without a fault: FaultyMLP draws from the python, numpy and torch streams
# in every training forward, so a count that moved any stream would change the losses.
# 2 ranks x 2 micro-batches of 16 per step.
SHAPE = (*FAULTS, "data.batch_size=16", "trainer.grad_accum=2", "trainer.max_steps=8")
HOST_READING = "model._target_=tests.faults.HostReadingMLP"  # counted on the real device
RUNS = {
    "peak": ("trainer.peak_tflops=0.001",),
    "no-peak": (),
    "off": ("trainer.count_flops=false",),
    "real-device": (HOST_READING,),
    "real-device-off": (HOST_READING, "trainer.count_flops=false"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardware")
    jobs = [(make_cfg(*SHAPE, *extra), root / name) for name, extra in RUNS.items()]
    summaries = train_many(jobs)
    run_dirs = [run_dir for _, run_dir in jobs]
    return dict(zip(RUNS, zip(summaries, run_dirs, strict=True), strict=True))


def train_events(run_dir) -> list[dict]:
    return [event for event in read_metrics(run_dir) if "train/loss" in event]


def test_flops_per_step_are_the_exact_matmul_count_of_the_whole_job(runs):
    per_micro_batch = mlp_flops(MLP(1, 8, 10, [32]), batch_size=16)
    for name in ("peak", "no-peak", "real-device"):
        summary, run_dir = runs[name]
        assert summary["flops_per_step"] == per_micro_batch * 2 * 2, (
            name
        )  # x 2 micro-batches x 2 ranks
        log = (run_dir / "train.log").read_text()
        where = "cpu" if name == "real-device" else "meta"
        assert f"micro-batches x 2 ranks (forward + backward, counted on {where})" in log
        assert log.count("model FLOPs per optimizer step") == 1


def test_tflops_and_mfu_come_from_the_windows_measured_time(runs):
    summary, run_dir = runs["peak"]
    events = train_events(run_dir)
    assert [event["step"] for event in events] == list(range(1, 9))
    for event in events:
        # samples/s and TFLOP/s divide by the same window's seconds.
        steps_per_s = event["samples_per_s"] / summary["global_batch_size"]
        expected = summary["flops_per_step"] * steps_per_s / 1e12
        assert event["tflops_per_s"] == pytest.approx(expected, rel=1e-9)
        assert event["mfu"] == pytest.approx(event["tflops_per_s"] / (2 * 0.001), rel=1e-9)
    assert 0 < summary["mfu"] == pytest.approx(summary["tflops_per_s"] / 0.002)


def test_no_mfu_on_cpu_without_a_configured_peak_and_no_flops_when_off(runs):
    summary, run_dir = runs["no-peak"]
    assert all("tflops_per_s" in e and "mfu" not in e for e in train_events(run_dir))
    assert "mfu" not in summary and summary["tflops_per_s"] > 0
    summary, run_dir = runs["off"]
    assert not any("tflops_per_s" in e or "mfu" in e for e in train_events(run_dir))
    assert "flops_per_step" not in summary and "tflops_per_s" not in summary


def test_every_logging_step_has_both_ranks_peak_memory(runs):
    for name, (_, run_dir) in runs.items():
        for event in train_events(run_dir):
            # Each rank process imported torch: well over 100 MiB resident, below the machine.
            assert 100 < event["memory/peak_mib_min"] <= event["memory/peak_mib_max"] < 24 * 1024
            assert event["memory/peak_mib_max_rank"] in (0, 1), name
        peaks = [event["memory/peak_mib_max"] for event in train_events(run_dir)]
        assert peaks == sorted(peaks), name  # a peak since the start never falls


def test_counting_changes_no_loss_and_no_weight(runs):
    losses = {name: train_losses(run_dir) for name, (_, run_dir) in runs.items()}
    assert len(losses["off"]) == 8
    assert losses["peak"] == losses["no-peak"] == losses["off"]
    assert losses["real-device"] == losses["real-device-off"]
    for counted, off in (("peak", "off"), ("real-device", "real-device-off")):
        weights = [
            torch.load(runs[name][1] / "checkpoints" / "last.pt", weights_only=True)["model"]
            for name in (counted, off)
        ]
        assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
