"""A steady-state step never waits for the device: between two logging steps nothing reads a
tensor the training computation produced (loss, gradients, their finiteness). Counted on real
2-rank gloo jobs with every precision, both non-finite policies, PowerSGD, EMA, clipping,
accumulation and a token-weighted loss. (On a GPU: tests/distributed/test_cuda.py runs the same
steps under torch.cuda.set_sync_debug_mode("error").)"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.conftest import REPO, make_cfg, prepare_run, start_ranks
from tests.sync_counting import watch_steps

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
STEADY = (
    "trainer.max_steps=12",
    "trainer.log_every=1000",
    "trainer.eval_every=0",
    "checkpoint.every=0",
    "checkpoint.final=false",
)
TINY = (
    "data=synthetic",
    "data.in_channels=1",
    "data.image_size=8",
    "data.train_size=256",
    "model=mlp",
    "model.hidden_sizes=[16]",
)
CASES = {
    "fp32": (*TINY,),
    "bf16-skip-ema-clip": (
        *TINY,
        "precision=bf16",
        "trainer.on_nonfinite=skip",
        "trainer.ema_decay=0.9",
        "trainer.clip_grad_norm=1.0",
    ),
    "amp-skip-powersgd": (
        *TINY,
        "precision=amp",
        "trainer.on_nonfinite=skip",
        "comm=powersgd",
        "comm.start_iter=2",
        "optimizer=adamw",
    ),
    "accumulation": (*TINY, "trainer.grad_accum=2", "data.batch_size=8"),
    "padded-tokens": (
        f"hydra.searchpath=[file://{REPO / 'tests' / 'conf'}]",
        "data=ragged_text",
        "task=language_model",
        "model=gpt",
        "model.layers=1",
        "model.width=16",
        "model.heads=2",
        "task.sample_tokens=0",
    ),
}
# The positive control: logging every step reads the window's sums and the non-finite flag
# back (the logging step's one read), so the same window must count reads here.
LOGGING_EVERY_STEP = "logging-every-step"
CONTROL = {LOGGING_EVERY_STEP: (*TINY, "trainer.log_every=1")}


def _count_in_rank(rank: int, world_size: int, port: int, jobs: list, found: dict) -> None:
    import torch

    from framework.core.launch_context import DistEnv
    from framework.rank.loop import Runner
    from framework.rank.main import rank_main

    torch.set_num_threads(1)
    env = DistEnv(
        rank=rank,
        local_rank=rank,
        world_size=world_size,
        local_world_size=world_size,
        source="local",
    )
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    original = Runner.train_step
    for index, (name, cfg, run_dir) in enumerate(jobs):
        reads: list[str] = []
        watch_steps(Runner, first=3, last=11, results=reads)  # steps 3-10, and between them
        rank_main(cfg, run_dir, env, dist.PrefixStore(f"job{index}", store))
        Runner.train_step = original
        found[f"{name}/{rank}"] = reads


@pytest.mark.parametrize("name", list(CASES))
def test_steady_state_steps_read_nothing_the_device_computed(steady_runs, name):
    for rank in (0, 1):
        reads = steady_runs[f"{name}/{rank}"]
        assert reads == [], f"rank {rank} read the device: {reads}"


def test_the_same_window_counts_the_reads_of_a_run_that_logs_every_step(steady_runs):
    """Guards the test above against a window that never opens (steps that are never reached,
    a loop that no longer steps through train_step): there, too, nothing would be counted.
    Steps 3-10 are logged, and each reads the window's sums summed over the ranks back once, on
    every rank (the look for non-finite values they ride on is collective)."""
    for rank in (0, 1):
        reads = steady_runs[f"{LOGGING_EVERY_STEP}/{rank}"]
        assert reads.count("Tensor.tolist") == 8, f"rank {rank}: {reads}"


@pytest.fixture(scope="module")
def steady_runs(tmp_path_factory):
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("steady")
    jobs = []
    for name, overrides in {**CASES, **CONTROL}.items():
        cfg = make_cfg(*STEADY, *overrides)
        prepare_run(cfg, root / name)
        jobs.append((name, cfg, root / name))
    found = mp.Manager().dict()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    start_ranks(_count_in_rank, (2, store.port, jobs, found))
    return dict(found)


def test_the_counter_sees_a_read_of_a_device_tensor():
    """Guards the test above against a counter that sees nothing."""
    import torch

    from tests.sync_counting import counting_reads

    loss = torch.ones(3).sum()
    with counting_reads(lambda tensor: False) as mode:
        bool(torch.isfinite(loss))
        loss.item()
        loss.tolist()
        int(loss)
    assert mode.reads == [
        "aten::_local_scalar_dense",
        "aten::_local_scalar_dense",
        "Tensor.tolist",
        "aten::_local_scalar_dense",
    ]
