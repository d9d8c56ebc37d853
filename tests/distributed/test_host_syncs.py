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


@pytest.fixture(scope="module")
def steady_runs(tmp_path_factory):
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("steady")
    jobs = []
    for name, overrides in CASES.items():
        cfg = make_cfg(*overrides, *STEADY)
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
