"""Rank discovery: one frozen value from torchrun's, SLURM's or no variables."""

from __future__ import annotations

import dataclasses
import os

import pytest

from framework.core.exits import ConfigError
from framework.core.launch_context import DistEnv


def test_torchrun_variables():
    env = DistEnv.from_environ(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert env.source == "torchrun" and env.distributed and not env.is_main


def test_a_slurm_task_is_one_rank_and_rank_0_on_the_first_node_hosts_the_rendezvous(monkeypatch):
    from omegaconf import OmegaConf

    from framework.core.launch_context import rendezvous_port
    from framework.launch.slurm.task import task_env

    slurm = {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    launcher = {"name": "slurm", "nodes": 2, "tasks_per_node": 2, "master_port": None}
    env = task_env(OmegaConf.create(launcher))
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert env.source == "slurm" and not env.is_main
    assert os.environ["MASTER_ADDR"] == "gpu07"
    assert os.environ["MASTER_PORT"] == str(rendezvous_port("4242")) == "24242"
    task_env(OmegaConf.create({**launcher, "master_port": 29400}))
    assert os.environ["MASTER_PORT"] == "29400"
    with pytest.raises(ConfigError, match="this job has 4 tasks, but launcher.nodes x"):
        task_env(OmegaConf.create({**launcher, "tasks_per_node": 4}))  # a swept launcher key


def test_no_variables_is_one_process():
    assert DistEnv.from_environ({}) == DistEnv()
    assert DistEnv().is_main and not DistEnv().distributed


def test_the_environment_value_cannot_change():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DistEnv().rank = 1
