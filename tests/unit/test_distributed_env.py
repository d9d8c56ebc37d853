"""Rank discovery: one frozen value from torchrun's, SLURM's or no variables."""

from __future__ import annotations

import dataclasses

import pytest

from framework.distributed import DistEnv


def test_torchrun_variables():
    env = DistEnv.from_environ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                "LOCAL_WORLD_SIZE": "2"})  # fmt: skip
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert env.source == "torchrun" and env.distributed and not env.is_main


def test_slurm_task_variables():
    env = DistEnv.from_environ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
                                "SLURM_NTASKS_PER_NODE": "2(x1)"})  # fmt: skip
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 2, 1, 2)
    assert env.source == "slurm"


def test_a_single_slurm_task_or_no_variables_is_one_process():
    assert DistEnv.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == DistEnv()
    assert DistEnv.from_environ({}) == DistEnv()
    assert DistEnv().is_main and not DistEnv().distributed


def test_the_environment_value_cannot_change():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DistEnv().rank = 1  # type: ignore[misc]
