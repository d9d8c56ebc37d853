"""The ranks of one run train one model: a rank that ran a different config is caught."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from framework.core.exits import ReplicasDiverged
from framework.core.launch_context import DistEnv
from framework.rank.main import rank_main
from tests.conftest import TINY, make_cfg, prepare_run, start_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _rank_with_its_own_lr(rank: int, port: int, run_dir, lrs: tuple[float, float]) -> None:
    import torch

    torch.set_num_threads(1)
    cfg = make_cfg(*TINY, "trainer.max_steps=3", f"optimizer.lr={lrs[rank]}")
    prepare_run(cfg, run_dir)
    env = DistEnv(rank=rank, local_rank=rank, world_size=2, local_world_size=2, source="local")
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    if lrs[0] == lrs[1]:
        rank_main(cfg, run_dir, env, store)
        return
    try:
        rank_main(cfg, run_dir, env, store)
    except ReplicasDiverged as error:
        caught = "weights of rank(s) [1] differ" in str(error)
        # Leave as a failed worker does (workers.exit_now): freeing the DDP model right after
        # a collective can deadlock with gloo's thread (seen: ~Reducer vs ~AsyncAllgatherWork).
        os._exit(0 if caught else 3)
    os._exit(4)  # the ranks trained different models and nothing noticed


@pytest.mark.parametrize("lrs", [(0.1, 0.1), (0.1, 0.2)], ids=["same-lr", "lr-per-rank"])
def test_ranks_that_trained_with_different_learning_rates_are_caught_at_the_end(tmp_path, lrs):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    start_ranks(_rank_with_its_own_lr, (store.port, tmp_path / "run", lrs))
    assert (tmp_path / "run" / "summary.json").exists() == (lrs[0] == lrs[1])
