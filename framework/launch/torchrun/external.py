"""A rank started by an external `torchrun` (launchers/torchrun.sh): every rank entered the app
and composed the config; ranks > 0 adopt rank 0's config and run dir over the process group."""

from __future__ import annotations

import shutil
from pathlib import Path

from omegaconf import DictConfig

from framework.core import launch_context
from framework.core.exits import ExitCode
from framework.launch.rank_entry import enter_rank
from framework.launch.trial import try_here
from framework.storage.files import is_throwaway
from framework.storage.run_dir import RunDir


def external_rank(cfg: DictConfig, run_dir: Path) -> dict | None:
    """This rank, with exit codes as for our own launchers."""
    if is_throwaway(run_dir):
        # Rank > 0: Hydra needed a dir; this rank adopts rank 0's. Gone now, so a rank that is
        # killed later leaves nothing behind.
        shutil.rmtree(run_dir, ignore_errors=True)
    env = launch_context.current().dist_env()
    try:
        try_here(cfg, env.world_size, run_dir)  # every rank, each of its own composition, alike
        return enter_rank(cfg, run_dir, env)
    except SystemExit as exit_:
        if exit_.code == ExitCode.CONFIG_REJECTED:
            RunDir(run_dir).discard()
        raise
