"""The one place that decides how a run's ranks start, from how this process was started
(framework/core/launch_context.py) and cfg.launcher:

| this process                            | launcher          | how                                |
|-----------------------------------------|-------------------|------------------------------------|
| a rank of an external torchrun          | (any but slurm)   | this process is the rank           |
| a SLURM task of a submitted job, rank>0 | slurm/slurm_local | adopt rank 0's config, be the rank |
| a SLURM task of a submitted job, rank 0 | slurm/slurm_local | this process is rank 0             |
| a command a user typed                  | torchrun          | torch's elastic agent forks them   |
| a command a user typed                  | local, 1 rank     | this process is the rank           |
| a command a user typed                  | local, N ranks    | forked from the fork server        |

Before any rank starts, the run's parts are tried once (launch/trial.py): in this process
where it is a rank itself, else in a process forked from the fork server.

The process that launches ranks never imports the training stack (torch._dynamo and the rest):
its ranks get it from the fork server. Where this process is a rank itself, it imports it then,
and the launchers (torch.distributed) are imported only once the config is accepted: a
refused config never pays for them. Those imports sit in `start`.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from framework.config.validation import world_sizes
from framework.core import launch_context
from framework.core.heap import import_for_good
from framework.core.launch_context import DistEnv, LaunchContext
from framework.launch.trial import try_here, try_in_a_fork
from framework.storage.run_dir import RunDir

SUBMITIT_LAUNCHERS = ("slurm", "slurm_local")


class Start(Enum):
    EXTERNAL_TORCHRUN_RANK = "a rank of an external torchrun"
    SLURM_FOLLOWER = "a SLURM task that adopts rank 0's config"
    SLURM_TASK = "a SLURM task: one rank"
    TORCHRUN_AGENT = "ranks from torch's elastic agent"
    IN_PROCESS = "one rank in this process"
    LOCAL_RANKS = "ranks forked from the fork server"


RANK_HERE = (
    Start.EXTERNAL_TORCHRUN_RANK,
    Start.SLURM_FOLLOWER,
    Start.SLURM_TASK,
    Start.IN_PROCESS,
)


def adopts_rank_zero_config(here: LaunchContext) -> bool:
    """A SLURM task of rank > 0 runs rank 0's config, checked there: it checks nothing itself
    (and so reads nothing of the config before it has rank 0's)."""
    return isinstance(here, launch_context.SubmititTask) and here.is_follower


def how_ranks_start(launcher: DictConfig, here: LaunchContext) -> Start:
    """How this run's ranks start, from this process's launch context and the (checked)
    launcher settings."""
    if adopts_rank_zero_config(here):
        return Start.SLURM_FOLLOWER
    if isinstance(here, launch_context.TorchElastic):
        return Start.EXTERNAL_TORCHRUN_RANK
    if launcher.name in SUBMITIT_LAUNCHERS:
        # Not inside a job: slurm_task refuses it with the fix (submit through Hydra's multirun).
        return Start.SLURM_TASK
    if launcher.name == "torchrun":
        return Start.TORCHRUN_AGENT
    return Start.IN_PROCESS if launcher.nproc_per_node == 1 else Start.LOCAL_RANKS


def start(how: Start, cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Run cfg's ranks as `how` says; returns rank 0's summary where this process has it."""
    if how in RANK_HERE:
        import_for_good("framework.launch.rank_entry")  # the training stack
    if how is Start.SLURM_FOLLOWER:
        from framework.launch.slurm.task import follower_rank  # a rank: imports the stack

        follower_rank(cfg, run_dir)
        return None
    if how is Start.SLURM_TASK:
        from framework.launch.slurm.task import task_rank  # a rank: imports the stack

        return task_rank(cfg, run_dir)
    if how is Start.EXTERNAL_TORCHRUN_RANK:
        from framework.launch.torchrun.external import external_rank  # a rank, as above

        return external_rank(cfg, run_dir)
    if how is Start.IN_PROCESS:
        try_here(cfg, 1, run_dir)
        from framework.launch.rank_entry import enter_rank  # a rank, as above

        return enter_rank(cfg, run_dir, DistEnv(), own_process=False)
    if how is Start.TORCHRUN_AGENT:
        try_in_a_fork(cfg, min(world_sizes(cfg)[0]), run_dir)  # (an elastic range: its fewest)
        from framework.launch.torchrun.agent import launch_elastic  # torch.distributed, as above

        launch_elastic(cfg, run_dir)
    else:
        try_in_a_fork(cfg, cfg.launcher.nproc_per_node, run_dir)
        from framework.launch.local.launcher import launch_local  # torch.distributed, as above

        launch_local(cfg, run_dir, cfg.launcher.nproc_per_node)
    files = RunDir(run_dir)
    return files.read_summary() if files.summary.exists() else None


def launch(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Run a checked, resolved cfg from this process, as `train` does after composing it."""
    return start(how_ranks_start(cfg.launcher, launch_context.current()), cfg, run_dir)
