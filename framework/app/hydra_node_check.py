"""The config, composed from every config file before Hydra starts, and checked whole.

Hydra configures its logging from the composed node and instantiates its callbacks, launcher and
sweeper before any callback of ours runs, so a config file (an experiment of a colleague's, a
group option in a folder on the search path) could name code there. This composes the config
exactly as Hydra will (same search path, config name, overrides and run mode, and each job of a
sweep), without configuring anything, and checks what Hydra would call (core/allowlist.py).

The same composition is validated as the app will validate it (config/validation.py): a mistake
is refused after one composition, before Hydra composes twice more (once to find the run mode,
once to run), and before anything imports the training stack.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator
from pathlib import Path

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.utils import create_automatic_config_search_path
from hydra.core.config_search_path import ConfigSearchPath, SearchPathQuery
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import setup_globals
from hydra.errors import OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.app.hydra_errors import config_mistake, wants_hydras_traceback
from framework.app.hydra_reference import check_hydra_settings
from framework.config import CONF_DIR, validate
from framework.config.redaction import remember_secrets
from framework.config.registry import register_configs
from framework.config.validation import check_keys
from framework.core.allowlist import check_hydra_node, parsed_arguments, trusted_prefixes
from framework.core.exits import ConfigError

APP_FILE = Path(__file__).resolve().parents[1] / "train.py"  # where @hydra.main is


def check_composed_hydra_node(argv: list[str], app: bool = False) -> DictConfig | None:
    """Raise ConfigError when a composed Hydra node (the run's, or any sweep job's) names code
    that is not allowed or sets a key off the positive list (app/hydra_reference.py), or
    (`app`) when the rest of it is not a valid config. Compositions Hydra will refuse itself
    are left to Hydra. Returns the run's config once validated (a single run's, with `app`),
    or the composition `--cfg` shows (its keys checked), else None."""
    args = parsed_arguments(argv)
    if args is None or args.overrides is None:
        return None
    check_hydra_flags(args)
    register_configs()  # the schemas the YAML files extend (train.py registers them too)
    setup_globals()  # Hydra's resolvers (now, hydra), which Hydra registers when it starts
    loader = ConfigLoaderImpl(config_search_path=search_path(args))
    sweep_asked = args.multirun or _sweeps(args.overrides)
    refuse_at_once = not sweep_asked and _composes_the_run(args)
    mode, overrides, mode_composition = _found_mode(loader, args, refuse_mistakes=refuse_at_once)
    if mode_composition is not None and not OmegaConf.missing_keys(
        mode_composition.hydra.runtime.choices
    ):
        # The same files and command line as the run's own composition, less hydra.mode: a
        # mistake is refused one composition sooner (two, where the shipped node is not yet
        # composed). Passing here proves nothing: the run's own composition is checked below.
        # (A group left `???` is skipped in this one, and the run's composition fails in
        # Hydra, with Hydra's message.)
        if app and mode is RunMode.RUN and not sweep_asked:
            # Without a sweep override its app keys are the run's (Hydra's run mode only
            # changes how sweeps and `???` groups compose), and validating reads files, runs
            # nothing: a typo costs this one composition.
            remember_secrets(mode_composition)  # (an error may quote a value)
            _validate(mode_composition)
        _check_composed_node(mode_composition, args.overrides)
    validated, jobs, refused = None, 0, []
    for cfg, used, sweep_job in _compositions(loader, args, mode, overrides):
        if args.cfg != "job":  # (what it shows holds no Hydra node, and nothing runs)
            _check_composed_node(cfg, used)
        _check_shown_package(cfg, args)
        remember_secrets(cfg)  # before anything prints the config (--cfg, an error) or runs
        if app and not args.cfg and mode is RunMode.RUN:
            _validate(cfg)
            validated = cfg
        elif app and args.cfg in ("job", "all"):
            # The config shown is the one meant: a misspelt key or a value of the wrong type
            # is refused as the run would refuse it. A value a rule refuses is shown as it is.
            check_keys(cfg)
            validated = cfg
        elif app and not args.cfg and sweep_job:
            jobs += 1
            if (refusal := _sweep_job_refusal(cfg)) is not None:
                refused.append(refusal)
    if refused and len(refused) == jobs:
        # What every job would fail on (a misspelt key, a value of the wrong type) is refused
        # before the first starts. A job of its own mistake fails alone, and the sweep goes on.
        raise refused[0]
    return validated


def _sweep_job_refusal(cfg: DictConfig) -> ConfigError | None:
    """Why this sweep job would be refused by its keys or callables (validation.check_keys),
    if it would. A value that cannot be resolved here (`${hydra:job.num}`: Hydra's runtime is
    set only in the job) is left to the job."""
    try:
        check_keys(cfg)
    except ConfigError as refusal:
        return refusal
    except OmegaConfBaseException:
        pass
    return None


def check_hydra_flags(args: argparse.Namespace) -> None:
    """Hydra's own refusals of its flags, in Hydra's order (hydra/_internal/utils.py:_run_hydra),
    as one line: Hydra raises them before it reports anything its way, as a traceback."""
    if args.resolve and args.cfg is None and not args.help:
        raise ConfigError("--resolve resolves what --cfg or --help shows: add --cfg job")
    if args.hydra_help:  # Hydra answers it before it counts the commands
        return
    if args.package is not None and args.cfg is None and not (args.help or args.info):
        # Hydra ignores it, and runs: the user meant to see one part of the config
        raise ConfigError(f"--package {args.package} picks what --cfg shows: add --cfg job")
    given = {
        "--run": args.run,
        "--multirun": args.multirun,
        "--cfg": args.cfg is not None,
        "--info": args.info is not None,
        "--shell-completion": args.shell_completion,
    }
    if sum(given.values()) > 1:
        named = " and ".join(flag for flag, on in given.items() if on)
        raise ConfigError(f"{named}: Hydra runs one of {', '.join(given)} at a time: keep one")


def _check_shown_package(cfg: DictConfig, args: argparse.Namespace) -> None:
    """--cfg's --package names a key of what --cfg shows: Hydra's show_cfg selects it and
    prints "not found" with exit 1 where the selection is None (a missing or null key). A
    selection that cannot resolve here (an interpolation of Hydra's runtime) is left to
    Hydra."""
    package = args.package
    if args.cfg is None or args.hydra_help or package in (None, "_global_"):
        return
    shown = [key for key in cfg if (key == "hydra") == (args.cfg == "hydra")]
    view = cfg if args.cfg == "all" else OmegaConf.masked_copy(cfg, shown)
    if args.cfg == "hydra" and package.startswith(("hydra.help", "hydra.hydra_help")):
        selected = None  # what Hydra's get_sanitized_hydra_cfg removes
    else:
        try:
            selected = OmegaConf.select(view, package)
        except Exception:  # noqa: BLE001 (Hydra resolves it with its runtime set, or reports it)
            return
    if selected is None:
        shows = f"`train --cfg {args.cfg}` shows the whole config"
        raise ConfigError(f"--package {package}: not a key, or null: nothing to show ({shows})")


def composition_refusal(
    error: Exception,
    loader: ConfigLoaderImpl,
    overrides: list[str],
    config_name: str = "config",
    run_mode: RunMode = RunMode.RUN,
) -> ConfigError | None:
    """The ConfigError (one line, exit 2) for an error of composing these overrides (with this
    config name and run mode) that is a config mistake; None for any other error, and where the
    user asked for Hydra's traceback (HYDRA_FULL_ERROR=1): those are Hydra's to report."""
    if wants_hydras_traceback():
        return None
    mistake = _unknown_key_mistake(error, loader, overrides, config_name, run_mode)
    mistake = mistake or _composition_mistake(error, loader, overrides)
    return ConfigError(mistake) if mistake is not None else None


# Hydra's answer to `key=value` for a key the config does not have.
_APPEND_ADVICE = re.compile(
    r"Could not override '(?P<key>[^']+)'\.\s+To append to your config use \+"
)


def _unknown_key_mistake(
    error: Exception,
    loader: ConfigLoaderImpl,
    overrides: list[str],
    config_name: str,
    run_mode: RunMode,
) -> str | None:
    """Hydra's fix for `key=value` naming a key the config lacks is to append it (`+key=...`):
    for a misspelt key, the wrong fix. The config composed with the key appended is validated
    instead, and its refusal, which names the key and the near one (did you mean), is the
    mistake. None where that refusal is about something else, or there is none."""
    found = _APPEND_ADVICE.match(str(error))
    if found is None:
        return None
    parsed = OverridesParser.create().parse_overrides(overrides)
    appended = [
        f"+{override.input_line}"
        if override.key_or_group == found["key"] and not (override.is_add() or override.package)
        else override.input_line
        for override in parsed
    ]
    try:
        validate(
            loader.load_configuration(
                config_name, appended, run_mode=run_mode, validate_sweep_overrides=False
            )
        )
    except ConfigError as refusal:
        return str(refusal) if str(refusal).startswith(f"{found['key']} ") else None
    except Exception:  # noqa: BLE001 (another mistake: Hydra's line about this key stands)
        return None
    return None


def _composition_mistake(
    error: Exception, loader: ConfigLoaderImpl, overrides: list[str]
) -> str | None:
    """The one line for a config mistake, else None. A config group set to a value that is not
    an option's name (null, a number) is one: Hydra says only that an override "must be a
    string or a list", naming neither the override nor the options."""
    if isinstance(error, ValueError) and not isinstance(error, OmegaConfBaseException):
        for override in OverridesParser.create().parse_overrides(overrides):
            if override.is_delete() or override.is_sweep_override():
                continue
            group = override.key_or_group
            if not isinstance(override.value(), (str, list)) and (
                options := loader.get_group_options(group)
            ):
                choose = f"name one of its options ({', '.join(options)})"
                return f"{override.input_line}: {group} is a config group: {choose}"
    return config_mistake(error)


def _check_composed_node(cfg: DictConfig, overrides: list[str]) -> None:
    """Hydra's node of one composition (made with `overrides`): what it calls, and every key
    it changes from the shipped node."""
    hydra_node = OmegaConf.to_container(cfg.hydra, resolve=False)
    assert isinstance(hydra_node, dict)
    trusted = trusted_prefixes(cfg)
    check_hydra_node(hydra_node, trusted)
    check_hydra_settings(cfg, overrides, trusted)


def run_mode(loader: ConfigLoaderImpl, args: argparse.Namespace) -> tuple[RunMode, list[str]]:
    """The run mode Hydra will pick, and the overrides it will compose with (it adds
    hydra.mode): -m, or hydra.mode from the config (a file or an override may set it), as
    hydra/_internal/utils.py decides. --cfg and --info compose a single run."""
    mode, overrides, _ = _found_mode(loader, args)
    return mode, overrides


def _found_mode(
    loader: ConfigLoaderImpl, args: argparse.Namespace, refuse_mistakes: bool = False
) -> tuple[RunMode, list[str], DictConfig | None]:
    """run_mode's answer, and the composition it read hydra.mode from (None when it composed
    nothing, or Hydra could not compose or read hydra.mode: the run's composition then sets
    it). With `refuse_mistakes` (a single run: no -m, no sweep override), a composition that
    fails on a config mistake is refused here, one composition before the run's own would be:
    this one, made in multirun mode, skips `???` groups and is otherwise the same, so the run's
    composition fails too."""
    overrides = list(args.overrides)
    if not args.multirun and (args.cfg or args.info or args.shell_completion):
        return RunMode.RUN, overrides, None
    composed: DictConfig | None
    config_name = config_name_of(args)
    try:
        composed = loader.load_configuration(
            config_name,
            overrides,
            run_mode=RunMode.MULTIRUN,
            validate_sweep_overrides=False,
        )
    except Exception as error:  # noqa: BLE001 (Hydra's get_mode also treats any failure as unset)
        refusal = (
            composition_refusal(error, loader, overrides, config_name, RunMode.MULTIRUN)
            if refuse_mistakes
            else None
        )
        # Hydra's advice to append a key (no did-you-mean found) is left to the run's own
        # composition: where the key lies in a group left `???`, which this one skipped, that
        # one names the group to pick instead.
        if refusal is not None and not _APPEND_ADVICE.match(str(refusal)):
            raise refusal from None
        composed = None
    try:
        found = composed.hydra.mode if composed is not None else None
    except Exception:  # noqa: BLE001 (as in Hydra's get_mode: an unreadable mode is unset)
        composed, found = None, None
    if found is None or (args.multirun and found is RunMode.RUN):
        mode = RunMode.MULTIRUN if args.multirun else RunMode.RUN
        return mode, [*overrides, f"hydra.mode={mode.name}"], composed
    return found, overrides, composed


def config_name_of(args: argparse.Namespace) -> str:
    return args.config_name or "config"


def _composes_the_run(args: argparse.Namespace) -> bool:
    """Hydra will compose these arguments as the run's (or a sweep's, or --cfg's) config."""
    return not (args.info or args.shell_completion or args.hydra_help)


def _sweeps(overrides: list[str]) -> bool:
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException:  # refused where it is composed, in Hydra's words
        return False
    return any(override.is_sweep_override() for override in parsed)


def _validate(cfg: DictConfig) -> None:
    try:
        validate(cfg)
    except OmegaConfBaseException as error:  # a value that is not of its key's type
        raise ConfigError(f"{error.full_key}: {str(error).splitlines()[0]}") from None


def search_path(args: argparse.Namespace) -> ConfigSearchPath:
    """Hydra's search path for these arguments: the shipped conf/, the user's config folders
    (the search path plugins), and --config-dir."""
    config_path = args.config_path if args.config_path is not None else str(CONF_DIR)
    found = create_automatic_config_search_path(str(APP_FILE), None, config_path)
    if args.config_dir is not None:
        config_dir = os.path.abspath(args.config_dir)
        if not os.path.isdir(config_dir):  # Hydra: exit 1, as it reports
            raise ConfigError(f"--config-dir {args.config_dir}: no such folder of config files")
        found.prepend(
            provider="command-line",
            path=f"file://{config_dir}",
            anchor=SearchPathQuery(provider="schema"),
        )
    return found


def _compositions(
    loader: ConfigLoaderImpl, args: argparse.Namespace, mode: RunMode, overrides: list[str]
) -> Iterator[tuple[DictConfig, list[str], bool]]:
    """(config, the overrides it was composed with, whether it is a sweep's job) of the run;
    for a sweep, its master config, its first job and each other value of each swept key (the
    others at their first value): every file and value any job selects is composed once. A
    job Hydra would fail to compose is refused as the run's composition is."""
    try:
        master = loader.load_configuration(config_name_of(args), overrides, run_mode=mode)
    except Exception as error:  # noqa: BLE001 (Hydra would refuse the same composition)
        # Hydra's message, exit 2, without Hydra's own two compositions first; anything else
        # (and a user's HYDRA_FULL_ERROR=1) is left to Hydra, which reports it its way. So are
        # Hydra's own commands: --info, --hydra-help (which composes no app config) and shell
        # completion (whose arguments, `-sc install=bash`, are not overrides).
        _refuse_a_mistake(error, loader, overrides, args, mode)
        return
    yield master, overrides, False
    if mode is RunMode.RUN:
        return
    recorded = OmegaConf.to_container(master.hydra.overrides, resolve=False)
    assert isinstance(recorded, dict)
    values = _sweep_values(master, list(recorded["task"]))
    first = {key: options[0] for key, options in values.items()}
    jobs = [list(first.values())] + [
        list({**first, key: option}.values())
        for key, options in values.items()
        for option in options[1:]
    ]
    for job in jobs:
        try:
            composed = loader.load_sweep_config(master, job)
        except Exception as error:  # noqa: BLE001 (this job fails in Hydra too, before its logging is set up)
            _refuse_a_mistake(error, loader, job, args, RunMode.RUN)
            continue
        yield composed, [*recorded["hydra"], *job], True


def _refuse_a_mistake(
    error: Exception,
    loader: ConfigLoaderImpl,
    overrides: list[str],
    args: argparse.Namespace,
    mode: RunMode,
) -> None:
    """Raise the refusal of a composition's error that is a config mistake, where Hydra would
    compose these arguments as a run's; anything else is left to Hydra."""
    refusal = composition_refusal(error, loader, overrides, config_name_of(args), mode)
    if refusal is not None and _composes_the_run(args):
        raise refusal from None


def _sweep_values(master: DictConfig, overrides: list[str]) -> dict[str, list[str]]:
    """Each key's job overrides (`key=value`, one per swept value), from hydra.sweeper.params
    and the command line, as the basic sweeper splits them (its split_arguments)."""
    params = OmegaConf.to_container(master.hydra.sweeper, resolve=False).get("params") or {}
    lines = [f"{key}={value}" for key, value in params.items()] + overrides
    found: dict[str, list[str]] = {}
    for override in OverridesParser.create().parse_overrides(lines):
        key = override.get_key_element()
        if not override.is_sweep_override():
            found[key] = [f"{key}={override.get_value_element_as_str()}"]
            continue
        try:
            found[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        except Exception:  # noqa: BLE001 (an interval or a glob: numbers or names, no file of their own)
            continue
    return found
