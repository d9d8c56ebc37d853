"""Process-group lifetime: the configured timeout fires, teardown happens on errors too, and DDP
is freed before its group."""

from __future__ import annotations

import gc
import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from framework.core.distributed import process_group
from framework.core.launch_context import DistEnv
from tests.conftest import TINY, make_cfg, prepare_run, spawn_ranks, start_ranks, train_many

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
    results[f"collecting_after_{rank}"] = gc.isenabled()


def test_a_rank_stuck_in_a_collective_fails_after_dist_timeout_s_and_the_group_is_destroyed():
    results = mp.Manager().dict()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    start_ranks(_blocked_collective, (store.port, results))
    seconds, message = results[0]
    assert 1.5 < seconds < 5.5, (seconds, message)  # the 2 s timeout, not the 10 min default
    assert results["initialized_after_0"] is False  # destroyed on the exception path
    assert results["initialized_after_1"] is False
    # No collection once the group is gone: DDP's reducer freed then hung or aborted a rank.
    assert results["collecting_after_0"] is False and results["collecting_after_1"] is False


def _look_carrying_window_sums(rank: int, world_size: int) -> None:
    from framework.rank.nonfinite import NonFiniteWatch

    env = DistEnv(rank=rank, world_size=world_size, local_world_size=world_size, source="local")
    watch = NonFiniteWatch(env, torch.device("cpu"))
    for step in (1, 2, 3):
        loss_sum = math.nan if (rank, step) == (1, 2) else 1.5 * (rank + 1)
        watch.add(
            step, torch.tensor([loss_sum, 32.0], dtype=torch.float64), torch.tensor(0.0), None
        )
    window = torch.tensor([10.0 * (rank + 1), 96.0, 2**40 + rank], dtype=torch.float64)
    collectives = []
    original = dist.all_reduce
    dist.all_reduce = lambda tensor, *args, **kwargs: (
        collectives.append(tensor.numel()),
        original(tensor, *args, **kwargs),
    )[1]
    try:
        report, summed = watch.look_carrying(window)
    finally:
        dist.all_reduce = original
    assert collectives == [world_size * NonFiniteWatch.FIELDS + 3]  # one all-reduce, not two
    assert summed == [30.0, 192.0, 2.0**41 + 1]  # every rank's window, added exactly
    assert (report.step, report.loss_ranks, report.gradients, report.last_step) == (
        2,
        [1],
        False,
        2,
    )
    assert window.tolist() == [10.0 * (rank + 1), 96.0, 2**40 + rank]  # the rider is untouched


def test_a_logging_steps_look_carries_the_window_sums_in_its_one_all_reduce():
    """The logging step's two reductions (the non-finite records, the loss window) travel as
    one all-reduce: a rank's NaN loss is reported with its step and rank, and the window sums
    are every rank's added, exact as float64."""
    spawn_ranks(_look_carrying_window_sums)


def _ddp_alive_when_the_group_is_destroyed(rank: int, port: int, cfg, run_dir, results) -> None:
    from framework.rank.main import rank_main

    env = DistEnv(rank=rank, local_rank=rank, world_size=2, local_world_size=2, source="local")
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    destroy = dist.destroy_process_group

    def counting(*args, **kwargs):
        results[rank] = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
        return destroy(*args, **kwargs)

    dist.destroy_process_group = counting
    try:
        rank_main(cfg, run_dir, env, store)
    finally:
        dist.destroy_process_group = destroy


def test_an_evaluations_ddp_is_freed_before_its_process_group_is_destroyed(tmp_path):
    """DDP's reducer freed after destroy_process_group destroys the group holding the GIL while
    gloo's thread waits for it: 4 of 12 two-rank `train mode=eval` commands hung at their end."""
    train_many([(make_cfg(*TINY, "trainer.max_steps=2"), tmp_path / "run")])
    checkpoint = tmp_path / "run" / "checkpoints" / "last.pt"
    cfg = make_cfg(*TINY, "trainer.max_steps=2", "mode=eval", f"checkpoint.resume={checkpoint}")
    prepare_run(cfg, tmp_path / "eval")
    results = mp.Manager().dict()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    start_ranks(
        _ddp_alive_when_the_group_is_destroyed, (store.port, cfg, tmp_path / "eval", results)
    )
    assert dict(results) == {0: 0, 1: 0}
