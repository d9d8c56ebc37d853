"""The benchmark harness stays working: its pool runs the plain loop and `train` on the same
tiny work with real gloo ranks, and its arithmetic is right. (The benchmarks' numbers are
measured by running them, never asserted here.)"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from benchmarks.command import (
    PLAIN_SCRIPT,
    commands,
    option_commands,
    option_figures,
    ratios_to_plain,
)
from benchmarks.common import Trial, Work, interleave, run_ours, run_pool, steady_samples_per_s
from benchmarks.plain import plain_loop
from benchmarks.startup import torchrun
from tests.conftest import REPO


def test_steady_rate_weights_windows_by_their_steps():
    events = [
        {"step": 2, "train/loss": 1.0, "samples_per_s": 1.0},  # warm-up window: left out
        {"step": 4, "train/loss": 1.0, "samples_per_s": 100.0},  # 2 steps
        {"step": 10, "train/loss": 1.0, "samples_per_s": 50.0},  # 6 steps
        {"step": 10, "val/accuracy": 0.5},
    ]
    # 8 steps in 2/100 + 6/50 seconds-per-sample units
    assert steady_samples_per_s(events, warmup=2) == pytest.approx(8 / (2 / 100 + 6 / 50))


def test_interleave_puts_every_contender_in_every_position():
    order = interleave(["a", "b", "c"], 3)
    rounds = [[label for round_, label in order if round_ == r] for r in range(3)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]


def test_the_command_benchmark_runs_train_as_of_an_earlier_revision_on_the_same_work(tmp_path):
    work = Work(model="cnn", steps=5, warmup=2)
    found = commands(work, tmp_path, before=("abc123", tmp_path / "tree"))
    earlier = found["train @abc123"]
    assert earlier[:2] == ["env", f"PYTHONPATH={tmp_path / 'tree'}"]
    assert earlier[-len(found["train"]) + 1 :] == found["train"][1:]  # the same overrides


def test_the_command_benchmark_compares_each_contender_with_the_plain_run_of_its_round():
    runs = {
        "train": [{"samples_per_s": 110.0}, {"samples_per_s": 90.0}, {"samples_per_s": 100.0}],
        "plain torchrun": [
            {"samples_per_s": 100.0},
            {"samples_per_s": 100.0},
            {"samples_per_s": 80.0},
        ],
        "train mistake": [{"command_s": 3.0}] * 3,
    }
    ratios = ratios_to_plain(runs)
    assert list(ratios) == ["train"]
    assert ratios["train"]["ratio_of_medians"] == pytest.approx(1.0)
    assert ratios["train"]["round_ratios"] == pytest.approx([1.1, 0.9, 1.25])


def test_each_speed_option_reaches_train_and_the_plain_loop_alike(tmp_path):
    work = Work(model="cnn", steps=5, warmup=2)
    found = option_commands(work, tmp_path, ["fp32", "bf16", "channels_last", "num_workers=1"])
    assert list(found) == [
        f"{side} [{option}]"
        for option in ("fp32", "bf16", "channels_last", "num_workers=1")
        for side in ("train", "plain torchrun")
    ]
    assert "precision=bf16" in found["train [bf16]"]
    assert "--precision=bf16" in found["plain torchrun [bf16]"]
    assert "precision=fp32" in found["train [fp32]"]
    assert "--precision=fp32" in found["plain torchrun [fp32]"]
    assert "trainer.channels_last=True" in found["train [channels_last]"]
    assert "--channels-last" in found["plain torchrun [channels_last]"]
    assert "--channels-last" not in found["plain torchrun [bf16]"]
    assert "data.num_workers=1" in found["train [num_workers=1]"]
    assert "--num-workers=1" in found["plain torchrun [num_workers=1]"]
    assert "--num-workers=0" in found["plain torchrun [fp32]"]


def test_the_options_compare_train_with_the_plain_loop_of_the_same_option_and_its_own_fp32():
    def runs(*rates):
        return [{"samples_per_s": rate} for rate in rates]

    found = option_figures(
        {
            "train [fp32]": runs(100.0, 90.0, 110.0),
            "plain torchrun [fp32]": runs(100.0, 100.0, 100.0),
            "train [bf16]": runs(150.0, 160.0, 140.0),
            "plain torchrun [bf16]": runs(200.0, 100.0, 140.0),
        },
        ["fp32", "bf16"],
    )
    assert found["bf16"]["ratio_of_medians"] == pytest.approx(150 / 140)
    assert found["bf16"]["round_ratios"] == pytest.approx([0.75, 1.6, 1.0])
    assert found["bf16"]["train_vs_fp32"] == pytest.approx(1.5)
    assert found["bf16"]["plain_vs_fp32"] == pytest.approx(1.4)
    assert found["fp32"]["train_vs_fp32"] == pytest.approx(1.0)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_plain_torchrun_loop_runs_with_the_speed_options():
    work = ["--steps=4", "--warmup=2", "--batch-size=8", "--image-size=8"]
    options = ["--precision=bf16", "--channels-last", "--num-workers=1"]
    result = subprocess.run(
        [*torchrun(), PLAIN_SCRIPT, *work, *options],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^samples_per_s=\d+\.\d$", result.stdout, re.MULTILINE), result.stdout


def _fails(trial, ctx):
    raise ValueError("this contender is broken")


@pytest.mark.slow
@pytest.mark.distributed
def test_pool_runs_plain_and_ours_on_the_same_work_and_names_a_failed_trial():
    work = Work(model="cnn", batch_size=8, warmup=2, steps=4)
    schedule = [Trial("plain", work), Trial("ours", work), Trial("ours", work, world_size=1)]
    plain, ours, single = run_pool(schedule, {"plain": plain_loop, "ours": run_ours})
    assert plain["samples_per_s"] > 0 and ours["samples_per_s"] > 0 and single["samples_per_s"] > 0
    assert [e["step"] for e in ours["events"]] == [2, 4, 6]  # log_every = warmup
    assert ours["summary"]["steps"] == single["summary"]["steps"] == 6
    with pytest.raises(RuntimeError, match="trial broken failed: .*this contender is broken"):
        run_pool([Trial("x", work, label="broken")], {"x": _fails})


def test_benchmarks_command_lists_the_benchmarks_and_rejects_unknown_ones():
    listing = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert listing.returncode == 0 and "overhead" in listing.stdout and "comm" in listing.stdout
    unknown = subprocess.run(
        [sys.executable, "-m", "benchmarks", "nope"], cwd=REPO, capture_output=True, text=True
    )
    assert unknown.returncode == 2
