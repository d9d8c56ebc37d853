"""Checkpoints and exact resume with real gloo ranks: stopped anywhere, continued bit for bit."""

from __future__ import annotations

import json
import math

import pytest
import torch

from framework.core.exits import Stopped as ReportedStop
from framework.core.exits import WorkerFailed
from tests.conftest import FAULT_COMMS as COMMS
from tests.conftest import FAULTS, make_cfg, read_metrics, train_in_process
from tests.faults import FAULT_ENV, assert_same_weights, final_weights

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def measured(key: str) -> bool:
    """Time and memory: measured, so different in any two runs."""
    return key in ("samples_per_s", "tflops_per_s", "mfu") or key.startswith("memory/")


def events_without_timing(run_dir):
    return [{k: v for k, v in e.items() if not measured(k)} for e in read_metrics(run_dir)]


@pytest.mark.parametrize("comm", list(COMMS))
def test_stopped_mid_epoch_by_a_signal_to_one_rank_then_resumed_is_bit_identical(
    comm, fault_references, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(FAULT_ENV, "SIGUSR1:1:10")
    with pytest.raises(ReportedStop):
        train_in_process(make_cfg(*FAULTS, *COMMS[comm]), run_dir)
    # Both ranks learned of rank 1's signal at the next step (the flags travel asynchronously)
    # and stopped there: step 11 = epoch 2, 3 of its 4 steps done. One file, both ranks' state.
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["step"] == 11 and len(saved["ranks"]) == 2
    assert saved["trainer"]["epoch"] == 2
    if comm == "powersgd":
        assert saved["ranks"][1]["comm"]["iter"] == 11 and saved["ranks"][1]["comm"]["errors"]
        rank0, rank1 = (saved["ranks"][r]["comm"]["errors"] for r in (0, 1))
        assert any(not torch.equal(rank0[k], rank1[k]) for k in rank0)  # per-rank memory

    monkeypatch.delenv(FAULT_ENV)
    train_in_process(make_cfg(*FAULTS, *COMMS[comm]), run_dir)  # the same command again
    assert_same_weights(final_weights(run_dir), final_weights(fault_references[comm]))
    # The resumed run appended to the same metrics.jsonl: every event matches.
    assert events_without_timing(run_dir) == events_without_timing(fault_references[comm])


def test_a_killed_rank_loses_only_the_steps_since_the_last_checkpoint(
    fault_references, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(FAULT_ENV, "kill:1:11")
    with pytest.raises(WorkerFailed, match="rank 1 was killed by SIGKILL"):
        train_in_process(make_cfg(*FAULTS), run_dir)
    assert json.loads((run_dir / "checkpoints" / "step_00000008.json").read_text())["step"] == 8
    steps_logged = [e["step"] for e in read_metrics(run_dir)]
    assert max(steps_logged) == 10  # logged past the checkpoint; trimmed on resume

    monkeypatch.delenv(FAULT_ENV)
    train_in_process(make_cfg(*FAULTS), run_dir)
    assert_same_weights(final_weights(run_dir), final_weights(fault_references["allreduce"]))
    assert events_without_timing(run_dir) == events_without_timing(fault_references["allreduce"])


# fused=false: an optimizer that cannot drop an update on the device (one host read per step).
@pytest.mark.parametrize("fused", ["true", "false"])
def test_nonfinite_skip_drops_that_update_on_every_rank_and_powersgd_memory_stays_finite(
    tmp_path, monkeypatch, fused
):
    monkeypatch.setenv(FAULT_ENV, "nan:1:6")
    run_dir = tmp_path / "run"
    summary = train_in_process(
        make_cfg(
            *FAULTS, *COMMS["powersgd"], "trainer.on_nonfinite=skip", f"optimizer.fused={fused}"
        ),
        run_dir,
    )
    assert summary["steps"] == 30
    logged = [e for e in read_metrics(run_dir) if "train/loss" in e]
    skipped = [e["train/nonfinite_skipped"] for e in logged]
    assert skipped[4] == 0 and skipped[5] == 1 and skipped[-1] == 1
    # The dropped step has no loss to report: NaN, never a plausible 0.0.
    assert math.isnan(logged[5]["train/loss"]) and logged[5]["step"] == 6
    assert all(math.isfinite(e["train/loss"]) for e in logged if e["step"] != 6)
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in saved["model"].values())
    for rank_state in saved["ranks"]:
        assert all(torch.isfinite(t).all() for t in rank_state["comm"]["errors"].values())
    assert summary["val/loss"] < 2.3


def test_a_signal_between_logging_steps_on_fast_steps_stops_every_rank_at_one_step(
    tmp_path, monkeypatch
):
    """Steps of a few ms and no log for 200 steps: the ranks exchange their flags only every
    ~0.25 s, and still stop together with one checkpoint that resumes bit-identically."""
    quiet = ("trainer.max_steps=200", "trainer.log_every=200", "checkpoint.every=0")
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    train_in_process(make_cfg(*FAULTS, *quiet), reference)
    monkeypatch.setenv(FAULT_ENV, "SIGUSR1:1:10")
    with pytest.raises(ReportedStop):
        train_in_process(make_cfg(*FAULTS, *quiet), run_dir)
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert 10 < saved["step"] < 200 and len(saved["ranks"]) == 2
    monkeypatch.delenv(FAULT_ENV)
    train_in_process(make_cfg(*FAULTS, *quiet), run_dir)
    assert_same_weights(final_weights(run_dir), final_weights(reference))
