"""Hydra's job: the task function Hydra calls with a checked config, in the run dir Hydra made
(a sweep's job dir). It holds the dir, checks a sweep job's own values, and starts the ranks
(launch/start.py decides how). A SLURM task unpickles it by its name and runs it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from framework.config.validation import joins_other_node, validate
from framework.core import launch_context, startup_clock
from framework.core.exits import JobFailed, NonFiniteLoss, Rejected, Stopped, WorkerFailed, end
from framework.core.pruners import PRUNING_SWEEPER
from framework.core.sweep_study import SWEEP_TRIAL, study_path, trial_environment
from framework.launch.start import Start, adopts_rank_zero_config, how_ranks_start, start
from framework.storage.files import is_throwaway
from framework.storage.run_dir import RunDir


def hydra_app(cfg: DictConfig) -> float | None:
    """Hydra's task function: the run's ranks started (launch/start.py decides how) in its run
    dir, held. Returns the objective for a sweeper."""
    here = launch_context.current()
    if isinstance(here, launch_context.SubmititTask):
        startup_clock.count_from_this_process()
    startup_clock.mark("compose")
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    sweep_job = hydra_cfg.mode == RunMode.MULTIRUN
    if adopts_rank_zero_config(here):
        start(Start.SLURM_FOLLOWER, cfg, run_dir)
        return None
    name_the_trial(hydra_cfg, sweep_job)
    try:
        # A node that joins another node's torchrun job shares its run dir: the host holds it.
        unheld = is_throwaway(run_dir) or joins_other_node(cfg.launcher)
        with contextlib.nullcontext() if unheld else RunDir(run_dir).held(adopt=True):
            summary = _run_held(cfg, run_dir, hydra_cfg, here, sweep_job)
    except Stopped as stop:  # rank 0 said where the checkpoint is
        raise SystemExit(stop.exit_code) from None  # a stop (Ctrl-C) ends a whole sweep too
    except (Rejected, NonFiniteLoss, WorkerFailed) as error:
        if sweep_job:  # Hydra records it and goes on with the next job
            detail = getattr(error, "detail", None)  # what the failing rank said
            raise JobFailed(f"{error}: {detail}" if detail else str(error)) from None
        end(error, rank=here.global_rank())  # (every rank of an external torchrun: rank 0 says it)
    return None if summary is None else summary[summary["objective"]]


def _run_held(
    cfg: DictConfig,
    run_dir: Path,
    hydra_cfg: DictConfig,
    here: launch_context.LaunchContext,
    sweep_job: bool,
) -> dict | None:
    """Start the run in its dir, held (a sweep's job checked first: its own values are checked
    in it, so a job of its own mistake fails alone); a rejected start removes what it made
    while it still holds the dir (another start never finds it half gone)."""
    try:
        if sweep_job:
            validate(cfg)
            join_sweep(cfg, RunDir(run_dir), hydra_cfg)
        OmegaConf.resolve(cfg)
        return start(how_ranks_start(cfg.launcher, here), cfg, run_dir)
    except (Rejected, KeyboardInterrupt):  # (Ctrl-C before any rank took it over)
        RunDir(run_dir).discard(sweep_job)
        raise


def name_the_trial(hydra_cfg: DictConfig, sweep_job: bool) -> None:
    """A pruning sweep's job tells its ranks which trial of the sweep's study they run (rank 0
    reports to it: framework/rank/pruning.py); any other run, that it runs none."""
    sweeper = OmegaConf.select(hydra_cfg, "sweeper._target_")
    if sweep_job and sweeper == PRUNING_SWEEPER:
        study = study_path(Path(hydra_cfg.sweep.dir))
        os.environ[SWEEP_TRIAL] = trial_environment(int(hydra_cfg.job.num), study)
    else:
        os.environ.pop(SWEEP_TRIAL, None)


def join_sweep(cfg: DictConfig, run: RunDir, hydra_cfg: DictConfig) -> None:
    """A job of a sweep: its dir is only reused to resume it (a sweep run again with the same
    hydra.sweep.dir resumes every job), and its W&B run joins the sweep's group."""
    run.check_reusable(cfg, sweep_job=True, overrides=list(hydra_cfg.overrides.task))
    if "wandb" in cfg.logger:
        job, wandb = hydra_cfg.job, cfg.logger.wandb
        wandb.group = wandb.group or str(hydra_cfg.sweep.dir)
        wandb.run_name = wandb.run_name or f"{job.num}-{job.override_dirname}"[:128]
