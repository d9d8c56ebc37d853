"""CUDA paths: amp (GradScaler) and bf16 with nccl. Skipped on machines without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY, make_cfg, read_metrics, train_in_process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("comm", ["allreduce", "powersgd"])
@pytest.mark.parametrize("precision", ["amp", "bf16"])
def test_amp_and_bf16_train_on_cuda_with_nccl(tmp_path, precision, comm):
    ranks = min(2, torch.cuda.device_count())  # NCCL needs one GPU per rank
    summary = train_in_process(
        make_cfg(*TINY, "model=cnn", f"precision={precision}", f"comm={comm}",
                 "comm.start_iter=2" if comm == "powersgd" else "trainer.seed=0",
                 f"launcher.nproc_per_node={ranks}", "trainer.max_steps=20"),
        tmp_path,
    )  # fmt: skip
    events = [e for e in read_metrics(tmp_path) if "train/loss" in e]
    assert summary["steps"] == 20 and all(e["train/loss"] == e["train/loss"] for e in events)
    if precision == "amp":
        assert events[-1]["precision/loss_scale"] > 0
