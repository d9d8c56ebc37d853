"""The config, composed once: Hydra's own loader over the search path Hydra would use, and the
composition the checks judge is the one Hydra then runs. A sweep's jobs are composed once each
too (Hydra's sweeper composes a batch to see that it can, its launcher again to run it: the
second gets the first), and each is checked before Hydra uses its node. A composition Hydra
refuses is a config mistake: one line, exit 2 (Hydra's traceback with HYDRA_FULL_ERROR=1).
"""

from __future__ import annotations

import argparse
import copy
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml
from hydra import version
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import create_automatic_config_search_path
from hydra.core.config_search_path import ConfigSearchPath, SearchPathQuery
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import (
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
)
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, read_write
from omegaconf.errors import OmegaConfBaseException

from framework.app.command_line import CommandLine, parse
from framework.config.keys import check_keys
from framework.config.registry import register_configs
from framework.core.config_dir import APP_FILE, CONF_DIR
from framework.core.exits import ConfigError, first_line
from framework.core.pruners import unknown_pruner_key

# What composing raises for a config mistake: Hydra's, a file that is not YAML, and OmegaConf's
# (a missing key, a wrong type).
COMPOSITION_MISTAKES = (
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
    yaml.YAMLError,
    OmegaConfBaseException,
)
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
FULL_ERROR = "HYDRA_FULL_ERROR"  # Hydra's switch for its own tracebacks
CheckJob = Callable[[DictConfig, list[str]], None]
# Every composition goes through this module's loader, in the command and in a SLURM job that
# unpickles it: the schemas and resolvers the YAML files use, and Hydra 1.3's defaults (a job
# runs in the working dir it was started in), are set as it is imported.
register_configs()
version.setbase("1.3")


@dataclass(frozen=True)
class Composition:
    """The config as Hydra will run it, the run mode Hydra will pick, and the overrides Hydra
    composes it from (hydra.mode added where Hydra adds it)."""

    cfg: DictConfig
    mode: RunMode
    overrides: list[str]
    config_name: str | None = "config"  # None: Hydra's help composes Hydra's config alone


class OnceLoader(ConfigLoaderImpl):
    """Hydra's config loader, composing each config once in this process: Hydra gets the
    composition the checks judged, and each job of a sweep is composed and checked once
    (`check_job`, a module-level function: a submitit job unpickles this loader and checks the
    jobs it composes too)."""

    def __init__(self, search_path: ConfigSearchPath, check_job: CheckJob) -> None:
        super().__init__(config_search_path=search_path)
        self.check_job = check_job
        self._made: dict[tuple[str, ...], DictConfig] = {}
        self._jobs: dict[tuple[str, ...], DictConfig] = {}

    def keep(self, config_name: str | None, overrides: list[str], cfg: DictConfig) -> None:
        """Hydra's next composition of these arguments is `cfg`."""
        self._made[(str(config_name), *overrides)] = cfg

    def load_configuration(
        self, config_name: str | None, overrides: list[str], run_mode: RunMode, **options: Any
    ) -> DictConfig:
        made = self._made.pop((str(config_name), *overrides), None)
        if made is not None:
            return made
        return super().load_configuration(config_name, overrides, run_mode, **options)

    def load_sweep_config(
        self, master_config: DictConfig, sweep_overrides: list[str]
    ) -> DictConfig:
        """A job of a sweep: composed and checked once, before Hydra uses its node; asked again
        (the command composes every job before the sweep starts, Hydra's sweeper a batch to see
        that it can, its launcher a job to run it), the same composition."""
        key = ("sweep job", *sweep_overrides)
        if key not in self._jobs:
            try:
                cfg = super().load_sweep_config(master_config, sweep_overrides)
            except Exception as error:  # noqa: BLE001 (a config mistake is refused in one line)
                raise refusal_of(error, self, sweep_overrides) or error from None
            self.check_job(cfg, [*_recorded(master_config, "hydra"), *sweep_overrides])
            self._jobs[key] = cfg
        # Each job its own copy: Hydra's launcher writes the job's id into it, then locks it.
        return copy.deepcopy(self._jobs[key])

    def composed_jobs(self) -> list[DictConfig]:
        return list(self._jobs.values())

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_made": {}, "_jobs": {}}  # a submitit job composes its own


def compose_jobs(master: DictConfig, loader: OnceLoader) -> None:
    """Each job of a sweep of Hydra's basic sweeper, composed (and checked: the loader's
    check_job) before Hydra starts, as the sweeper will list them: a mistake in any is refused
    before the sweep dir exists. Optuna's sampler picks its trials as it goes: each is checked
    as it is composed."""
    if OmegaConf.select(master, "hydra.sweeper._target_") != BASIC_SWEEPER:
        return
    params = OmegaConf.to_container(master.hydra.sweeper, resolve=False).get("params") or {}
    lines = [f"{key}={value}" for key, value in params.items()]
    lines += _recorded(master, "task")
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(lines)
    for batch in BasicSweeper.split_arguments(parsed, None):
        for job in batch:
            loader.load_sweep_config(master, list(job))


def _recorded(cfg: DictConfig, kind: str) -> list[str]:
    """Hydra's record of the overrides, as typed (an element holding `${...}` is no
    interpolation of the record's)."""
    return list(OmegaConf.to_container(cfg.hydra.overrides[kind], resolve=False))


def search_path(args: argparse.Namespace) -> ConfigSearchPath:
    """Hydra's search path for these arguments: the shipped conf/, the user's config folders
    (the search path plugins), and --config-dir."""
    config_path = args.config_path if args.config_path is not None else str(CONF_DIR)
    found = create_automatic_config_search_path(str(APP_FILE), None, config_path)
    if args.config_dir is not None:
        config_dir = os.path.abspath(args.config_dir)
        if not os.path.isdir(config_dir):
            raise ConfigError(f"--config-dir {args.config_dir}: no such folder of config files")
        found.prepend(
            provider="command-line",
            path=f"file://{config_dir}",
            anchor=SearchPathQuery(provider="schema"),
        )
    return found


def compose(command: CommandLine, loader: OnceLoader) -> Composition:
    """The command's config, composed once, and the run mode Hydra would find: -m, or
    hydra.mode from the config (launcher=slurm sets MULTIRUN). Hydra's own commands (--cfg,
    --info, shell completion, help) compose a single run's config."""
    args = command.args
    shows = args.cfg or args.info or args.shell_completion or args.hydra_help or args.help
    asked = RunMode.MULTIRUN if command.sweeps and not shows else RunMode.RUN
    name = None if args.hydra_help else command.config_name  # (as Hydra's help composes)
    try:
        cfg = loader.load_configuration(name, command.overrides, run_mode=asked)
    except Exception as error:  # noqa: BLE001 (a config mistake is refused in one line)
        raise refusal_of(error, loader, command.overrides, command.config_name) or error from None
    if shows:
        loader.keep(name, command.overrides, cfg)
        return Composition(cfg, RunMode.RUN, command.overrides, name)
    mode, added = _run_mode(cfg, command)
    if added:  # as Hydra adds it (hydra/_internal/utils.py: _run_app)
        with read_write(cfg.hydra):
            cfg.hydra.mode = mode
            cfg.hydra.overrides.hydra.append(added)
    overrides = [*command.overrides, *([added] if added else [])]
    loader.keep(command.config_name, overrides, cfg)
    return Composition(cfg, mode, overrides)


def _run_mode(cfg: DictConfig, command: CommandLine) -> tuple[RunMode, str | None]:
    """The mode Hydra runs cfg in, and the override Hydra adds for it (None: the config set it)."""
    try:
        found = cfg.hydra.mode
    except OmegaConfBaseException:  # as Hydra's get_mode: an unreadable mode is unset
        found = None
    if command.args.multirun:
        return RunMode.MULTIRUN, None if found is RunMode.MULTIRUN else "hydra.mode=MULTIRUN"
    if found is not RunMode.MULTIRUN and command.sweeps:
        swept = next(o.input_line for o in parse(command.overrides) if o.is_sweep_override())
        raise ConfigError(
            f"{swept} sweeps over values: run it with -m (or pick one value, or quote it to "
            "give a string)"
        )
    return found or RunMode.RUN, None if found else "hydra.mode=RUN"


# --- Hydra's errors as one line -------------------------------------------------------------
def wants_hydras_traceback() -> bool:
    """The user asked for Hydra's traceback of an error (HYDRA_FULL_ERROR=1)."""
    return os.environ.get(FULL_ERROR) == "1"


def refusal_of(
    error: Exception, loader: ConfigLoaderImpl, overrides: list[str], config_name: str = "config"
) -> ConfigError | None:
    """The ConfigError (one line, exit 2) for an error of composing these overrides: composing
    reads files and merges values, and runs nothing of anyone's, so whatever fails there is a
    mistake in what it was given. None where the user asked for Hydra's traceback."""
    if wants_hydras_traceback():
        return None
    mistake = _unknown_key(error, loader, overrides, config_name) or _group_value(
        error, loader, overrides
    )
    if mistake is None and isinstance(error, COMPOSITION_MISTAKES):
        mistake = describe(_yaml_mistake(error) if isinstance(error, yaml.YAMLError) else error)
    if mistake is None:  # composing runs nothing: what fails there is what it was given
        at = re.search(r"full_key: (\S+)", str(error))
        where = f" at {at[1]}" if at else ""
        mistake = (
            f"the overrides do not compose{where}: {type(error).__name__}: {first_line(error)}"
        )
    return ConfigError(mistake)


# Hydra's answer to `key=value` for a key the config does not have.
_APPEND_ADVICE = re.compile(
    r"Could not override '(?P<key>[^']+)'\.\s+To append to your config use \+"
)


def _unknown_key(
    error: Exception, loader: ConfigLoaderImpl, overrides: list[str], config_name: str
) -> str | None:
    """Hydra's fix for `key=value` naming a key the config lacks is to append it (`+key=...`):
    for a misspelt key, the wrong fix. The config composed with the key appended is checked
    instead (one more composition, on this refusal only), and its refusal, which names the key
    and the near one, is the mistake. None where that refusal is about something else."""
    found = _APPEND_ADVICE.match(str(error))
    if found is None:
        return None
    if pruning_key := unknown_pruner_key(found["key"]):
        return pruning_key
    appended = [
        f"+{override.input_line}"
        if override.key_or_group == found["key"] and not (override.is_add() or override.package)
        else override.input_line
        for override in OverridesParser.create().parse_overrides(overrides)
    ]
    try:
        check_keys(
            loader.load_configuration(
                config_name, appended, run_mode=RunMode.MULTIRUN, validate_sweep_overrides=False
            )
        )
    except ConfigError as refusal:
        return str(refusal) if str(refusal).startswith(f"{found['key']} ") else None
    except Exception:  # noqa: BLE001 (another mistake: Hydra's line about this key stands)
        return None
    return None


def _group_value(error: Exception, loader: ConfigLoaderImpl, overrides: list[str]) -> str | None:
    """A config group set to a value that is not an option's name (null, a number): Hydra says
    only that an override "must be a string or a list", naming neither it nor the options."""
    if not isinstance(error, ValueError) or isinstance(error, OmegaConfBaseException):
        return None
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_delete() or override.is_sweep_override():
            continue
        group = override.key_or_group
        if not isinstance(override.value(), str | list) and (
            options := loader.get_group_options(group)
        ):
            choose = f"name one of its options ({', '.join(options)})"
            return f"{override.input_line}: {group} is a config group: {choose}"
    return None


def _yaml_mistake(error: yaml.YAMLError) -> Exception:
    mark = getattr(error, "problem_mark", None)
    where = f"{mark.name}, line {mark.line + 1}" if mark else "a config file"
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return ValueError(f"{where} is not valid YAML: {problem}")


def describe(error: Exception) -> str:
    """Hydra's message and, when OmegaConf caused it, OmegaConf's reason, on one line (OmegaConf's
    lines after its first repeat the key and name internal types)."""
    lines = str(error).strip().splitlines()
    message = " ".join(line.strip() for line in lines if line.strip())
    if isinstance(error, OmegaConfBaseException):
        message = lines[0].strip() if lines else type(error).__name__
    cause = error.__cause__
    if isinstance(cause, OmegaConfBaseException) and str(cause).strip():
        reason = str(cause).strip().splitlines()[0]
        if reason not in message:
            message = f"{message}: {reason}"
        message = message.split(" full_key:")[0]
    return message
