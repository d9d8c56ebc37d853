"""`train` / `python -m framework.train`: the command, top to bottom.

    read the command line -> compose the config, once -> check it -> Hydra runs it

Reading refuses what may not be typed and lets a run's record lead a resume or an evaluation
(app/command_line.py). The composition is Hydra's own, and it is the one Hydra then runs
(app/composition.py). The check is the config's (framework/config/validation.py: keys, types
and bounds declared beside each key, then the facts between keys) and Hydra's node's
(app/hydra_node.py), all before torch is imported: a mistake is one line, exit 2, and no run
dir. Hydra then makes the run dir and calls `hydra_app`, which starts the ranks
(launch/start.py decides how); how the run ended becomes the exit code (core/exits.py). What
each rank does is framework/rank/main.py.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
from collections.abc import MutableMapping
from pathlib import Path

from hydra import version
from hydra._internal.hydra import Hydra
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from framework.app.command_line import CommandLine, read_command_line
from framework.app.composition import (
    Composition,
    OnceLoader,
    compose,
    compose_jobs,
    refusal_of,
    search_path,
    wants_hydras_traceback,
)
from framework.app.config_search_path import check_config_folders
from framework.app.help import (
    check_shown_package,
    help_text,
    job_config_text,
    prints_the_job_config,
)
from framework.app.hydra_node import check_hydra_node
from framework.config import validate
from framework.config.redaction import remember_secrets
from framework.config.registry import register_configs
from framework.config.validation import check_keys, joins_other_node, require
from framework.core import launch_context, startup_clock
from framework.core.exits import (
    ConfigError,
    ExitCode,
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
    scrub,
    scrubbed_console,
)
from framework.launch import forkserver, launcher_watch
from framework.launch.start import Start, adopts_rank_zero_config, how_ranks_start, start
from framework.storage.run_dir import RunDir, is_throwaway, throwaway_dir

APP_NAME = "train"  # hydra.job.name
# Every way into the app (the console script, `python -m framework.train`, a SLURM task unpickling
# hydra_app) imports this module before Hydra composes or resolves anything.
register_configs()
version.setbase("1.3")  # Hydra 1.3's defaults: a job runs in the working dir it was started in


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
    try:
        command, hydra, composition = checked(sys.argv[1:])
        answer = _answer(command, hydra, composition)
    except ConfigError as error:
        end(error, rank=here.global_rank())  # under torchrun rank 0 says it once
    if answer is not None:
        sys.stdout.write(answer)
        return
    gc.enable()  # paused by cli.py until the config has passed its checks
    sys.argv[1:] = command.argv  # what W&B records: secrets as ${oc.env:NAME}
    cleanup_dir = None
    if here.is_follower and isinstance(here, launch_context.TorchElastic):
        cleanup_dir = composition.cfg.hydra.run.dir  # a throwaway dir (_follower_overrides)
    try:
        _run(command, hydra, composition)
    finally:
        if cleanup_dir is not None:
            shutil.rmtree(cleanup_dir, ignore_errors=True)


def checked(
    argv: list[str], environ: MutableMapping[str, str] = os.environ
) -> tuple[CommandLine, Hydra, Composition]:
    """The command read, its config composed once and checked: everything `train` does before
    Hydra runs anything. Raises ConfigError for a mistake."""
    here = launch_context.current()
    command = read_command_line([*argv, *_follower_overrides(here)], environ)
    if command.record is not None and here.global_rank() == 0:
        print(_adopted_line(command), file=sys.stderr)
    loader = OnceLoader(search_path(command.args), check_sweep_job)
    hydra = Hydra(task_name=APP_NAME, config_loader=loader)  # (Hydra's resolvers, the job name)
    composition = compose(command, loader)
    check(composition, command, loader)
    return command, hydra, composition


def _follower_overrides(here: launch_context.LaunchContext) -> list[str]:
    """Ranks > 0 of an external torchrun compose the same config but run rank 0's: Hydra gets a
    throwaway dir, and no record of the job is written."""
    if not (here.is_follower and isinstance(here, launch_context.TorchElastic)):
        return []
    return [f"hydra.run.dir={throwaway_dir()}", "hydra.callbacks.run_dir.output_subdir=null"]


def _adopted_line(command: CommandLine) -> str:
    if any(line == "mode=eval" for line in command.overrides):
        return f"mode=eval: the training run's settings from {command.record}"
    taken = " ".join(command.adopted) or "none besides this command's"
    return f"resuming with the run's own overrides from {command.record}: {taken}"


def check(composition: Composition, command: CommandLine, loader: OnceLoader) -> None:
    """The config's rules and Hydra's node, once. A run, and a sweep's master (what all its
    jobs share), for every rule; each job of a sweep for its keys, types, bounds and targets
    (the facts between values fail a job alone, in it). What a command only shows (--cfg,
    --help) for its keys and types; --cfg job prints no Hydra node and runs nothing: its node
    is checked when it runs."""
    cfg, args = composition.cfg, command.args
    remember_secrets(cfg)  # before anything prints the config (--cfg, an error) or runs
    shows = args.cfg or args.help or args.info or args.shell_completion or args.hydra_help
    if shows:
        check_keys(cfg, bounds=False)  # a value out of bounds is shown as it is
    else:
        validate(cfg)  # (a sweep's master: what every job shares)
    if not prints_the_job_config(args):
        check_hydra_node(cfg, composition.overrides)
    if not shows:
        _check_run_settings(cfg, composition.mode)
    if composition.mode is RunMode.MULTIRUN and not shows:
        compose_jobs(cfg, loader)
    check_shown_package(cfg, args)


def _check_run_settings(cfg: DictConfig, mode: RunMode) -> None:
    require(
        cfg.hydra.output_subdir is None,
        f"hydra.output_subdir={cfg.hydra.output_subdir} would make Hydra write its records with "
        "secrets unredacted: leave it null and set hydra.callbacks.run_dir.output_subdir instead",
    )
    require(
        mode is RunMode.RUN or cfg.mode != "estimate",
        "mode=estimate prints one config's memory per rank: run it without -m (one command per "
        "setting you would sweep)",
    )
    check_config_folders(cfg)


def check_sweep_job(cfg: DictConfig, overrides: list[str]) -> None:
    """A job of a sweep, as Hydra composes it (app/composition.py: before it starts): its keys,
    types and targets, and its Hydra node. The rules on values fail the job alone, in it."""
    remember_secrets(cfg)
    check_keys(cfg)
    check_hydra_node(cfg, overrides)


def _answer(command: CommandLine, hydra: Hydra, composition: Composition) -> str | None:
    """What the command prints instead of running: --help, --cfg job, mode=estimate."""
    cfg, args = composition.cfg, command.args
    if args.help:
        return help_text(cfg, hydra.config_loader, args.resolve)
    if prints_the_job_config(args):
        return job_config_text(cfg)
    if not args.cfg and composition.mode is RunMode.RUN and cfg.mode == "estimate":
        from framework.rank.estimate import estimate_text  # (the training stack: torch)

        return estimate_text(cfg) + "\n"  # before any rank, run dir or training
    return None


def _run(command: CommandLine, hydra: Hydra, composition: Composition) -> None:
    """Hydra's own commands, or the run: Hydra composes again only what the checks did not
    (the loader hands it theirs), makes the run dir and calls hydra_app."""
    args, name, overrides = command.args, command.config_name, composition.overrides
    with _hydras_errors_as_exits(hydra):
        if args.hydra_help:
            hydra.hydra_help(config_name=name, args_parser=get_args_parser(), args=args)
        elif args.cfg:
            hydra.show_cfg(name, overrides, args.cfg, args.package, args.resolve)
        elif args.info:
            hydra.show_info(args.info, config_name=name, overrides=overrides)
        elif args.shell_completion:
            hydra.shell_completion(config_name=name, overrides=overrides)
        elif composition.mode is RunMode.MULTIRUN:
            hydra.multirun(config_name=name, task_function=hydra_app, overrides=overrides)
        else:
            hydra.run(config_name=name, task_function=hydra_app, overrides=overrides)


@contextlib.contextmanager
def _hydras_errors_as_exits(hydra: Hydra):
    """A sweep job that Hydra cannot compose is a config mistake (exit 2, one line); a failed
    job is reported once the sweep is over (exit 1, one line); HYDRA_FULL_ERROR=1 gets Hydra's
    traceback."""
    GlobalHydra.instance().clear()
    GlobalHydra.instance().initialize(hydra)
    try:
        yield
    except ConfigError as error:  # a sweep job's, checked as Hydra composes it
        end(error)
    except CompactHydraException as error:
        if wants_hydras_traceback():
            raise
        print(scrub(f"error: {error}"), file=sys.stderr, flush=True)
        raise SystemExit(ExitCode.FAILED) from None
    except Exception as error:
        refusal = refusal_of(error, hydra.config_loader, [])
        if refusal is None:
            raise
        end(refusal)
    finally:
        GlobalHydra.instance().clear()


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


if __name__ == "__main__":
    main()
