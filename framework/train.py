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

import argparse
import contextlib
import gc
import os
import sys
from collections.abc import Iterator, MutableMapping

from hydra._internal.hydra import Hydra
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from framework.app.command_line import CommandLine, read_command_line
from framework.app.composition import (
    Composition,
    OnceLoader,
    compose,
    compose_jobs,
    search_path,
    wants_hydras_traceback,
)
from framework.config.keys import check_keys
from framework.config.redaction import remember_secrets
from framework.core import launch_context, startup_clock
from framework.core.exits import (
    ConfigError,
    ExitCode,
    end,
)
from framework.core.secrets import (
    install_log_scrubbing,
    install_traceback_scrubbing,
    scrub,
    scrubbed_console,
)
from framework.launch import forkserver

APP_NAME = "train"  # hydra.job.name


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
        from framework.launch.launcher_watch import leave_with  # (a rank's: none outlives it)

        leave_with(os.getppid())  # its agent
    forkserver.warm_up_if_forking(sys.argv[1:])  # (already running when cli.py started it)
    with _follower_overrides(here) as overrides:
        try:
            command, hydra, composition = checked([*sys.argv[1:], *overrides])
            answer = _answer(command, hydra, composition)
        except ConfigError as error:
            end(error, rank=here.global_rank())  # under torchrun rank 0 says it once
        if answer is not None:
            sys.stdout.write(answer)
            return
        gc.enable()  # paused by cli.py until the config has passed its checks
        sys.argv[1:] = command.argv  # what W&B records: secrets as ${oc.env:NAME}
        _run(command, hydra, composition)
    if isinstance(here, launch_context.TorchElastic):  # a rank in a process of its own
        from framework.launch.rank_entry import exit_now  # (a rank: the stack is imported)

        exit_now(ExitCode.DONE)  # every other way out of a rank leaves so too


def checked(
    argv: list[str], environ: MutableMapping[str, str] = os.environ
) -> tuple[CommandLine, Hydra, Composition | None]:
    """The command read, its config composed once and checked: everything `train` does before
    Hydra runs anything. Raises ConfigError for a mistake."""
    here = launch_context.current()
    command = read_command_line(argv, environ)
    if command.record is not None and here.global_rank() == 0:
        print(_adopted_line(command), file=sys.stderr)
    loader = OnceLoader(search_path(command.args), check_sweep_job)
    hydra = Hydra(task_name=APP_NAME, config_loader=loader)  # (Hydra's resolvers, the job name)
    if command.args.shell_completion:  # its arguments name a shell, not overrides: Hydra's
        return command, hydra, None
    composition = compose(command, loader)
    check(composition, command, loader)
    return command, hydra, composition


@contextlib.contextmanager
def _follower_overrides(here: launch_context.LaunchContext) -> Iterator[list[str]]:
    """Ranks > 0 of an external torchrun compose the same config but run rank 0's: Hydra gets a
    throwaway dir, and no record of the job is written."""
    if not (here.is_follower and isinstance(here, launch_context.TorchElastic)):
        yield []
        return
    from framework.storage.files import throwaway_dir  # (a follower's alone)

    with throwaway_dir() as folder:
        yield [f"hydra.run.dir={folder}", "hydra.callbacks.run_dir.output_subdir=null"]


def _adopted_line(command: CommandLine) -> str:
    if any(line == "mode=eval" for line in command.overrides):
        return f"mode=eval: the training run's settings from {command.record}"
    taken = " ".join(command.adopted) or "none besides this command's"
    return f"resuming with the run's own overrides from {command.record}: {taken}"


def check(composition: Composition, command: CommandLine, loader: OnceLoader) -> None:
    """The config's rules and Hydra's node, once. A run, and a sweep's master (what all its
    jobs share), for every rule; each job of a sweep for its keys, types, bounds and targets
    (the facts between values fail a job alone, in it). What a command only shows (--cfg,
    --help) for its keys and types; --cfg job and --help print no Hydra node and run nothing:
    the node is checked when the config runs."""
    cfg, args = composition.cfg, command.args
    remember_secrets(cfg)  # before anything prints the config (--cfg, an error) or runs
    shows = args.cfg or args.help or args.info or args.shell_completion or args.hydra_help
    if not args.hydra_help:  # (Hydra's help composes Hydra's config alone: its node is all)
        check_keys(cfg, bounds=not shows)  # (a value out of bounds is shown as it is)
        from framework.app.job_values import check_resolves  # (as the rules below)

        check_resolves(cfg)  # (shown or run: a value that cannot resolve is no config)
    # Loaded once the keys passed: a misspelt key, the commonest mistake, is refused without
    # loading the rules between keys and the check of Hydra's node (docs/benchmarks.md).
    from framework.app.help import check_shown_package, prints_the_job_config
    from framework.app.hydra_node import check_config_folders, check_hydra_node
    from framework.app.pruning_settings import check_pruning
    from framework.config.validation import check_rules

    if not shows:
        check_rules(cfg)  # (a sweep's master: what every job shares)
    if not (args.help or prints_the_job_config(args)):  # (they print no Hydra node, run nothing)
        check_hydra_node(cfg, composition.overrides, composition.config_name)
        check_pruning(cfg)
    if not shows:
        check_config_folders(cfg)
    if composition.mode is RunMode.MULTIRUN and not shows:
        compose_jobs(cfg, loader)
    check_shown_package(cfg, args)


def check_sweep_job(cfg: DictConfig, overrides: list[str]) -> None:
    """A job of a sweep, as Hydra composes it (app/composition.py: before it starts): its keys,
    types, bounds and targets, and its Hydra node. The facts between values fail the job
    alone, in it."""
    from framework.app.hydra_node import check_hydra_node  # (as in check)
    from framework.app.job_values import check_resolves

    remember_secrets(cfg)
    check_keys(cfg)
    check_resolves(cfg)
    check_hydra_node(cfg, overrides)


def _answer(command: CommandLine, hydra: Hydra, composition: Composition | None) -> str | None:
    """What the command prints instead of running: --help, --cfg job, mode=estimate."""
    from framework.app.help import (
        help_text,
        job_config_text,
        prints_the_job_config,
    )  # (as in check)

    args = command.args
    if composition is None or args.cfg and not prints_the_job_config(args):
        return None  # Hydra's to answer
    cfg = composition.cfg
    if args.help:
        return help_text(cfg, hydra.config_loader, args.resolve)
    if prints_the_job_config(args):
        return job_config_text(cfg)
    if args.info or args.hydra_help:
        return None
    if composition.mode is RunMode.RUN and cfg.mode == "estimate":
        from framework.rank.estimate import estimate_text  # (the training stack: torch)

        return estimate_text(cfg) + "\n"  # before any rank, run dir or training
    return None


def _run(command: CommandLine, hydra: Hydra, composition: Composition | None) -> None:
    """Hydra's own commands, or the run: Hydra composes again only what the checks did not
    (the loader hands it theirs), makes the run dir and calls hydra_app."""
    args, name = command.args, command.config_name
    if composition is None:  # shell completion
        with _hydras_errors_as_exits(hydra):
            hydra.shell_completion(config_name=name, overrides=args.overrides)
        return
    overrides = composition.overrides
    # Imported once the config has passed its checks: a refusal never loads the machinery
    # that runs a job (its run dir, how its ranks start).
    from framework.launch.job import hydra_app

    with _hydras_errors_as_exits(hydra):
        if args.hydra_help:  # (given the overrides the checked composition was made of)
            composed = argparse.Namespace(**{**vars(args), "overrides": overrides})
            hydra.hydra_help(config_name=None, args_parser=get_args_parser(), args=composed)
        elif args.cfg:
            hydra.show_cfg(name, overrides, args.cfg, args.package, args.resolve)
        elif args.info:
            hydra.show_info(args.info, config_name=name, overrides=overrides)
        elif composition.mode is RunMode.MULTIRUN:
            hydra.multirun(config_name=name, task_function=hydra_app, overrides=overrides)
        else:
            hydra.run(config_name=name, task_function=hydra_app, overrides=overrides)


@contextlib.contextmanager
def _hydras_errors_as_exits(hydra: Hydra):
    """A sweep job that cannot be composed or checked is a config mistake (exit 2, one line: the
    loader says it); a failed job is reported once the sweep is over (exit 1, one line);
    HYDRA_FULL_ERROR=1 gets Hydra's traceback. Anything else is a fault: its traceback."""
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
    finally:
        GlobalHydra.instance().clear()


if __name__ == "__main__":
    main()
