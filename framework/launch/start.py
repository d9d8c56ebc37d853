"""Which launcher starts the ranks of this run: launch(cfg, run_dir) dispatches on
cfg.launcher (framework/launch/__init__.py says what the launchers share)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from framework.core.launch_context import DistEnv
from framework.launch.local import launch_local
from framework.launch.torchrun_agent import launch_elastic
from framework.storage.run_dir import RunDir


def launch(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Run cfg with cfg.launcher; returns rank 0's summary."""
    if cfg.launcher.name in ("slurm", "slurm_local"):  # this process is one task: one rank
        from framework.launch.slurm_task import run_task  # (a rank: framework/launch/__init__.py)

        return run_task(cfg, run_dir)
    if cfg.launcher.name == "torchrun":
        launch_elastic(cfg, run_dir)
    elif cfg.launcher.nproc_per_node == 1:
        from framework.run.assemble import run  # (a rank: framework/launch/__init__.py)

        return run(cfg, run_dir, DistEnv())
    else:
        launch_local(cfg, run_dir, cfg.launcher.nproc_per_node)
    files = RunDir(run_dir)
    return files.read_summary() if files.summary.exists() else None
