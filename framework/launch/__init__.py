"""Start the ranks of one run (launcher=local|torchrun|slurm|slurm_local), each running
framework.rank.run with the same resolved config and run dir.

The process that launches ranks never imports the training stack (torch._dynamo and the rest):
its ranks get it from the fork server (framework/launch/forkserver.py). Where this process is a
rank itself (one process, a SLURM task) it imports it then.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from framework.context import DistEnv
from framework.launch.elastic import launch_elastic
from framework.launch.local import launch_local
from framework.rundir import RunDir


def launch(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Run cfg with cfg.launcher; returns rank 0's summary."""
    if cfg.launcher.name in ("slurm", "slurm_local"):  # this process is one task: one rank
        from framework.launch.submitit import run_task  # (a rank: see the module docstring)

        return run_task(cfg, run_dir)
    if cfg.launcher.name == "torchrun":
        launch_elastic(cfg, run_dir)
    elif cfg.launcher.nproc_per_node == 1:
        from framework.rank import run  # (a rank: see the module docstring)

        return run(cfg, run_dir, DistEnv())
    else:
        launch_local(cfg, run_dir, cfg.launcher.nproc_per_node)
    files = RunDir(run_dir)
    return files.read_summary() if files.summary.exists() else None
