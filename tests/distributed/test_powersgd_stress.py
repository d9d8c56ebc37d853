"""The short version of benchmarks/powersgd_stress.py: consecutive 2-rank ResNet-18 jobs on gloo
with DDP's default 25 MB buckets (several buckets) and PowerSGD active for 10 steps.
torch's own hook aborted 3 of 5 such runs (collective mismatch between buckets)."""

from __future__ import annotations

import pytest

from tests.conftest import make_cfg, read_metrics, train_many

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_consecutive_resnet18_powersgd_runs_on_gloo_all_finish(tmp_path):
    overrides = (
        "model=resnet18",
        "data=synthetic",
        # ResNet-18's 11M parameters make the buckets, whatever the image size: 8x8 images
        # (spatially 1x1 by the last stage) and a 16-image validation keep the compute small.
        "data.image_size=8",
        "data.batch_size=4",
        "data.train_size=512",
        "data.val_size=16",
        "comm=powersgd",
        "comm.start_iter=2",
        "trainer.max_steps=12",
        "trainer.log_every=1",
        # No checkpoint: writing ResNet-18 and its momentum took a fifth of each run, and
        # PowerSGD's saved state per rank is test_comm's and test_resume's to check.
        "checkpoint.final=false",
    )
    jobs = [(make_cfg(*overrides, f"trainer.seed={n}"), tmp_path / f"run{n}") for n in range(3)]
    summaries = train_many(jobs)
    for summary, (_, run_dir) in zip(summaries, jobs, strict=True):
        compressed = [e for e in read_metrics(run_dir) if e.get("comm/compression", 1) > 1]
        assert summary["steps"] == 12 and len(compressed) >= 10
        assert summary["comm/compression"] == pytest.approx(135.8, rel=0.01)  # rank 2
