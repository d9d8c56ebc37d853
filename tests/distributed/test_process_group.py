"""Process-group lifetime: the configured timeout fires, and teardown happens on errors too."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from framework.context import DistEnv
from framework.distributed import process_group
from tests.conftest import start_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _blocked_collective(rank: int, port: int, results) -> None:
    env = DistEnv(rank=rank, world_size=2, local_world_size=2, source="local")
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    started = time.perf_counter()
    try:
        with process_group(env, "gloo", timeout_s=2.0, store=store):
            if rank == 0:
                dist.all_reduce(torch.ones(1))  # rank 1 never joins this collective
            else:
                time.sleep(6)
    except RuntimeError as error:
        results[rank] = (time.perf_counter() - started, str(error)[:200])
    results[f"initialized_after_{rank}"] = dist.is_initialized()


def test_a_rank_stuck_in_a_collective_fails_after_dist_timeout_s_and_the_group_is_destroyed():
    results = mp.Manager().dict()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    start_ranks(_blocked_collective, (store.port, results))
    seconds, message = results[0]
    assert 1.5 < seconds < 5.5, (seconds, message)  # the 2 s timeout, not the 10 min default
    assert results["initialized_after_0"] is False  # destroyed on the exception path
    assert results["initialized_after_1"] is False
