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
        make_cfg(
            *TINY,
            "model=cnn",
            f"precision={precision}",
            f"comm={comm}",
            "comm.start_iter=2" if comm == "powersgd" else "trainer.seed=0",
            f"launcher.nproc_per_node={ranks}",
            "trainer.max_steps=20",
        ),
        tmp_path,
    )
    events = [e for e in read_metrics(tmp_path) if "train/loss" in e]
    assert summary["steps"] == 20 and all(e["train/loss"] == e["train/loss"] for e in events)
    if precision == "amp":
        assert events[-1]["precision/loss_scale"] > 0


@pytest.mark.parametrize(
    "overrides",
    [
        ("precision=bf16", "trainer.on_nonfinite=skip", "trainer.ema_decay=0.9"),
        ("precision=amp", "trainer.clip_grad_norm=1.0"),
    ],
    ids=["bf16-skip-ema", "amp-clip"],
)
def test_steady_state_steps_on_cuda_never_synchronise_with_the_host(tmp_path, overrides):
    """torch.cuda.set_sync_debug_mode("error") from the start of step 3 to the start of step 11:
    any synchronising call in a step or between steps raises (tests/distributed/
    test_host_syncs.py counts the same reads on CPU ranks)."""
    from framework.rank.loop import Runner

    original = Runner.train_step

    def train_step(self, micro_batches):
        step = self.state.step + 1
        if step in (3, 11):
            torch.cuda.set_sync_debug_mode("error" if step == 3 else "default")
        return original(self, micro_batches)

    Runner.train_step = train_step
    try:
        summary = train_in_process(
            make_cfg(
                *TINY,
                "model=cnn",
                *overrides,
                "launcher.nproc_per_node=1",
                "trainer.max_steps=12",
                "trainer.log_every=1000",
                "checkpoint.every=0",
            ),
            tmp_path,
        )
    finally:
        Runner.train_step = original
        torch.cuda.set_sync_debug_mode("default")
    assert summary["steps"] == 12
