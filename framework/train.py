"""`train` / `python -m framework.train`: the command. Checks the command line, composes the
config once (Hydra), hands it to the launcher and turns how the run ended into an exit code
(framework/core/exits.py). What each rank does is framework/rank/main.py.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from framework.app.eval_overrides import with_training_overrides
from framework.app.help import help_text, shown_config
from framework.app.hydra_errors import run_with_exit_codes
from framework.app.hydra_node_check import check_composed_hydra_node
from framework.config import CONF_DIR, validate
from framework.config.redaction import hide_command_line_secrets
from framework.config.registry import register_configs
from framework.config.validation import joins_other_node
from framework.core import launch_context, startup_clock
from framework.core.allowlist import check_command_line
from framework.core.exits import (
    ConfigError,
    JobFailed,
    NonFiniteLoss,
    Rejected,
    Stopped,
    WorkerFailed,
    end,
)
from framework.core.secrets import (
    install_log_scrubbing,
    install_traceback_scrubbing,
    scrubbed_console,
)
from framework.launch import forkserver, launcher_watch
from framework.launch.start import Start, adopts_rank_zero_config, how_ranks_start, start
from framework.storage.run_dir import RunDir, is_throwaway, throwaway_dir

# Every way into the app (the console script, `python -m framework.train`, a SLURM task unpickling
# hydra_app) imports this module before Hydra composes or resolves anything.
register_configs()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_app(cfg: DictConfig) -> float | None:
    """Hydra's task function: validated, resolved once, then its ranks started (launch/start.py
    decides how)."""
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
    try:
        if cfg.mode == "estimate":  # a single run printed it before Hydra started
            raise ConfigError(
                "mode=estimate prints one config's memory per rank: run it without -m "
                "(one command per setting you would sweep)"
            )
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
        end(error)
    return None if summary is None else summary[summary["objective"]]


def _run_held(
    cfg: DictConfig,
    run_dir: Path,
    hydra_cfg: DictConfig,
    here: launch_context.LaunchContext,
    sweep_job: bool,
) -> dict | None:
    """Validate and start the run in its dir, held; a rejected start removes what it made
    while it still holds the dir (another start never finds it half gone)."""
    try:
        validate(cfg)
        if sweep_job:
            join_sweep(cfg, RunDir(run_dir), hydra_cfg)
        OmegaConf.resolve(cfg)
        return start(how_ranks_start(cfg.launcher, here), cfg, run_dir)
    except Rejected:
        RunDir(run_dir).discard(sweep_job)
        raise


def join_sweep(cfg: DictConfig, run: RunDir, hydra_cfg: DictConfig) -> None:
    """A job of a sweep: its dir is only reused to resume it (a sweep run again with the same
    hydra.sweep.dir resumes every job), and its W&B run joins the sweep's group."""
    run.check_reusable(cfg, sweep_job=True, overrides=list(hydra_cfg.overrides.task))
    if "wandb" in cfg.logger:
        job, wandb = hydra_cfg.job, cfg.logger.wandb
        wandb.group = wandb.group or str(hydra_cfg.sweep.dir)
        wandb.run_name = wandb.run_name or f"{job.num}-{job.override_dirname}"[:128]


def _adopted_line(argv: list[str], record: Path, adopted: list[str]) -> str:
    if "mode=eval" in argv:
        return f"mode=eval: the training run's settings from {record}"
    taken = " ".join(adopted) if adopted else "none besides this command's"
    return f"resuming with the run's own overrides from {record}: {taken}"


def memory_estimate(cfg: DictConfig) -> str:
    """mode=estimate: the memory ledger of this config per rank (imports the training stack)."""
    from framework.rank.estimate import estimate_text

    return estimate_text(cfg)


def main() -> None:
    """`train`: every line it (and Hydra, and a rank in this process) prints or logs is
    scrubbed of secrets (core/secrets.py)."""
    install_log_scrubbing()
    install_traceback_scrubbing()
    with scrubbed_console():
        _main()


def _main() -> None:
    startup_clock.mark("imports")
    here = launch_context.current()
    if isinstance(here, launch_context.TorchElastic):  # a rank of an external torchrun
        launcher_watch.leave_with(os.getppid())  # its agent: no rank outlives it
    forkserver.warm_up_if_forking(sys.argv[1:])  # (already running when cli.py started it)
    # Hydra instantiates its own node (callbacks, launcher, sweeper, logging factories) before
    # any callback of ours can look at it: check the command line and the node composed from
    # every config file before Hydra starts.
    # mode=eval of a checkpoint, or a resume: the run's recorded overrides lead the command
    # line (checked below like any other).
    sys.argv[1:], record, adopted = with_training_overrides(sys.argv[1:])
    if record is not None and here.global_rank() == 0:
        print(_adopted_line(sys.argv[1:], record, adopted), file=sys.stderr)
    try:
        check_command_line(sys.argv[1:])
        if (text := help_text(sys.argv[1:])) is not None:
            print(text)
            return
        cfg = check_composed_hydra_node(sys.argv[1:], app=True)
        gc.enable()  # paused by cli.py until the config has passed its checks
        shown = shown_config(sys.argv[1:], cfg)
        if shown is None and cfg is not None and cfg.mode == "estimate":
            print(memory_estimate(cfg))  # before any rank, run dir or training
            return
    except ConfigError as error:
        end(error, rank=here.global_rank())  # under torchrun rank 0 says it once
    # Secrets typed as overrides move to environment variables: Hydra's records, its console
    # log and W&B's copy of argv then hold ${oc.env:NAME}, never the value.
    typed = list(sys.argv[1:])
    sys.argv[1:] = hide_command_line_secrets(typed, os.environ)
    if shown is not None and sys.argv[1:] == typed:  # (else Hydra shows ${oc.env:NAME})
        sys.stdout.write(shown)
        return
    cleanup_dir = None
    if here.is_follower and isinstance(here, launch_context.TorchElastic):
        # Ranks > 0 compose the same config but adopt rank 0's; Hydra gets a throwaway dir, and
        # no record of the job is written.
        cleanup_dir = throwaway_dir()
        sys.argv += [f"hydra.run.dir={cleanup_dir}", "hydra.callbacks.validate.output_subdir=null"]
    try:
        run_with_exit_codes(hydra_app)
    finally:
        if cleanup_dir:
            shutil.rmtree(cleanup_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
