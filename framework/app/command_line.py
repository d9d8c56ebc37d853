"""The command line, read once: Hydra's flags and overrides as Hydra's own parser reads them,
what may not be typed refused in one line, the run's record adopted (a resume, mode=eval), and
secrets typed as values moved into the environment. What comes out is what the config is
composed from (app/composition.py)."""

from __future__ import annotations

import argparse
import difflib
import os
import re
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep
from hydra.core.plugins import Plugins
from hydra.plugins.completion_plugin import CompletionPlugin
from omegaconf import OmegaConf

from framework.app.config_search_path import searchpath_problem
from framework.core.allowlist import matches_prefix
from framework.core.config_dir import CONF_DIR
from framework.core.exits import ConfigError
from framework.core.secrets import REDACTED, env_secret_values, is_secret_name, scrub


@dataclass(frozen=True)
class CommandLine:
    """What `train` was asked: Hydra's flags (`args`), and the overrides the config is composed
    from (the run's record first, then those typed, secrets as `${oc.env:NAME}`)."""

    args: argparse.Namespace
    overrides: list[str]
    argv: list[str]  # the command line with those overrides, for the run's own records
    record: Path | None = None  # the run's record the overrides adopted from
    adopted: tuple[str, ...] = ()

    @property
    def config_name(self) -> str:
        return self.args.config_name or "config"

    @property
    def sweeps(self) -> bool:
        """-m, or an override that sweeps (which Hydra composes only for a multirun)."""
        return self.args.multirun or any(o.is_sweep_override() for o in parse(self.overrides))


def read_command_line(argv: list[str], environ: MutableMapping[str, str]) -> CommandLine:
    """argv read as Hydra reads it; raises ConfigError for a mistake or for what may not be
    typed. Secrets typed as values move into `environ`."""
    if (mistake := argument_mistake(argv)) is not None:
        raise ConfigError(mistake)
    args = parsed_arguments(argv)
    _check_flags(args)
    typed = list(args.overrides)
    record, adopted = (None, []) if args.multirun else adopted_overrides(typed)
    overrides = [*adopted, *typed]
    _check_typed(overrides)
    overrides = hide_secrets(overrides, environ)
    start = _first_override(argv, typed)
    argv = argv[:start] + overrides + argv[start + len(typed) :]
    return CommandLine(args, overrides, argv, record, tuple(adopted))


def parse(overrides: list[str]) -> list[Any]:
    """Hydra's own override parser; [] for what Hydra will refuse itself, in its words."""
    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 (the override grammar: composing reports it)
        return []


def _first_override(argv: list[str], overrides: list[str]) -> int:
    """Where the overrides start in argv: argparse takes them as one run, after any flag."""
    return next(
        at
        for at in range(len(argv) - len(overrides) + 1)
        if argv[at : at + len(overrides)] == overrides
    )


# --- Hydra's flags --------------------------------------------------------------------------
def _raising_parser() -> argparse.ArgumentParser:
    """Hydra's parser, raising ValueError where argparse would print its usage text and exit."""
    parser = get_args_parser()

    def refuse(message: str) -> NoReturn:
        raise ValueError(message)

    parser.error = refuse  # type: ignore[method-assign]
    return parser


def parsed_arguments(argv: list[str]) -> argparse.Namespace:
    return _raising_parser().parse_args(argv)


def argument_mistake(argv: list[str]) -> str | None:
    """Why Hydra's parser refuses argv, as one line with the fix (argparse prints its whole
    usage text), or None where it parses: a flag it does not have, an override after a flag
    that follows other overrides (argparse takes one run of them), a flag's value it does not
    take."""
    parser = _raising_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except ValueError as refused:  # a flag's value: argparse's line names the flag and choices
        return f"{refused}: train --help lists the flags"
    if args.shell_completion and (mistake := shell_completion_mistake(args.overrides)):
        return mistake
    unknown = [arg for arg in extra if arg.startswith("-")]
    if unknown:
        flags = [flag for action in parser._actions for flag in action.option_strings]
        near = difflib.get_close_matches(unknown[0].split("=")[0], flags, n=1)
        hint = f"did you mean {near[0]}?" if near else "train --help lists them"
        return f"{unknown[0]} is not a flag of train: {hint}"
    if extra:
        return (
            f"{extra[0]} comes after a flag that follows other overrides: put the flags "
            "(-m, --cfg job, ...) before every override"
        )
    return None


SHELL_COMMANDS = ("install", "uninstall", "query")


def shell_completion_mistake(arguments: list[str]) -> str | None:
    """Why Hydra's `--shell-completion` would raise a traceback for its arguments (it reads
    them as install=, uninstall= or query= naming a shell, not as overrides), or None."""
    usage = "--shell-completion takes one of install=SHELL, uninstall=SHELL or query=SHELL"
    asked = [arg.split("=", 1) for arg in arguments if arg.split("=")[0] in SHELL_COMMANDS]
    if len(asked) != 1 or len(asked[0]) != 2:
        return f"{usage}, e.g. train --shell-completion install=bash"
    plugins = Plugins.instance().discover(CompletionPlugin)
    shells = sorted(p.provides() for p in plugins if issubclass(p, CompletionPlugin))
    command, shell = asked[0]
    if shell in shells:
        return None
    near = difflib.get_close_matches(shell, shells, n=1)
    hint = f"did you mean {command}={near[0]}?" if near else f"SHELL is one of {shells}"
    return f"--shell-completion {command}={shell}: no completion for that shell: {hint}"


def _check_flags(args: argparse.Namespace) -> None:
    """Hydra's own refusals of its flags, in Hydra's order (hydra/_internal/utils.py:_run_hydra),
    as one line: Hydra raises them as a traceback."""
    if args.experimental_rerun is not None:
        raise ConfigError("--experimental-rerun loads a pickle, which can run any code: refused")
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


# --- what may not be typed -----------------------------------------------------------------
def _check_typed(overrides: list[str]) -> None:
    """Refuse what a command line may not set, where it acts before the composed config is
    checked (app/hydra_node.py checks every key of Hydra's node there, before Hydra uses it):
    allowed_targets, which only a config file may set (a command line handed to you must not
    trust code), a sweep parameter included; and config folders that are not file://, which
    are read, and a pkg:// one imported, as the config is composed."""
    pending = parse(overrides)
    while pending:
        override = pending.pop(0)
        key = override.key_or_group
        if matches_prefix(key, ["allowed_targets"]):
            raise ConfigError(
                f"{key} cannot be set on the command line: list your own modules in a config file"
            )
        if matches_prefix(key, ["hydra.searchpath"]) and override.is_sweep_override():
            raise ConfigError(f"{key}: the config folders cannot be swept: set them once")
        if matches_prefix(key, ["hydra.searchpath"]) and (
            problem := searchpath_problem(override.value())
        ):
            raise ConfigError(problem)
        pending += parse(_sweeper_params(override))


def _sweeper_params(override: Any) -> list[str]:
    """hydra.sweeper.params maps override keys to values the sweeper applies to every job:
    those overrides, as the sweeper writes them (`f"{key}={value}"`)."""
    key, value, params = override.key_or_group, override.value(), "hydra.sweeper.params"
    if key == params and isinstance(value, dict):
        return [f"{name}={item}" for name, item in value.items()]
    if matches_prefix(key, [params]) and key != params and value is not None:
        return [f"{key[len(params) + 1 :]}={value}"]
    return []


# --- secrets typed as values ----------------------------------------------------------------
def hide_secrets(overrides: list[str], environ: MutableMapping[str, str]) -> list[str]:
    """overrides with every plain secret `KEY=VALUE` (a secret-looking KEY, or a VALUE holding a
    known secret) rewritten to `KEY=${oc.env:NAME}`, VALUE stored in environ[NAME]; a sweep
    `KEY=A,B` becomes `KEY=${oc.env:NAME_0},${oc.env:NAME_1}`. Hydra records overrides in
    .hydra/, multirun.yaml, a job's name and its console log, and W&B records argv: all of them
    then hold only the variables' names."""
    known = env_secret_values(environ)
    rewritten = {}
    for override in parse(overrides):
        key = override.key_or_group
        if override.is_delete() or override.package is not None or _is_config_group(key):
            continue
        values = _plain_values(override)
        if values is None or not any(
            is_secret_name(key) or scrub(text, known) != text for text in values
        ):
            continue
        name = "FRAMEWORK_SECRET_" + re.sub(r"[^A-Za-z0-9]", "_", key).upper()
        names = [f"{name}_{i}" for i in range(len(values))] if len(values) > 1 else [name]
        environ.update(zip(names, values, strict=True))
        prefix = override.input_line.split("=", 1)[0]
        references = ",".join(f"${{oc.env:{name}}}" for name in names)
        rewritten[override.input_line] = f"{prefix}={references}"
    return [rewritten.get(line, line) for line in overrides]


def _is_config_group(key: str) -> bool:
    """`db/credentials=prod` or `credentials=prod` (a folder in conf/) picks a config file:
    its value is an option name, not a secret, and must stay as it is."""
    return "/" in key or (CONF_DIR / key).is_dir()


def _plain_values(override: Any) -> list[str] | None:
    """The values an override sets, as text: one, or each of a sweep's plain choices (`A,B`,
    `choice(A,B)`); None for anything else (a range, a dict, a reference `${...}`)."""
    value = override.value()
    if override.is_sweep_override():
        if not isinstance(value, ChoiceSweep):
            return None
        value = value.list
    values = value if isinstance(value, list) and override.is_sweep_override() else [value]
    texts = []
    for item in values:
        if not isinstance(item, str | int | float) or isinstance(item, bool) or item == "":
            return None
        if "${" in str(item):
            return None  # already a reference, not the secret itself
        texts.append(str(item))
    return texts


# --- the run's record -----------------------------------------------------------------------
# A resume or an evaluation never needs its training command typed again: the run's own
# overrides, from its record (`<run dir>/.hydra/overrides.yaml`), lead the command line's.
# - mode=eval of a checkpoint: what decides which examples and weights it is evaluated on (the
#   experiment, task, model, data and precision overrides, and EMA) comes from the training run.
# - A resume, from the run dir (`hydra.run.dir=<a run dir>`, a sweep's job dir too) or from a
#   checkpoint (`checkpoint.resume=<file>`): what defines the training (the experiment, its
#   groups and keys). Loggers and where they send, how and where the ranks start (launcher,
#   dist) and Hydra's node come from the command typed: a run dir may be someone else's copy,
#   and its record would otherwise choose where metrics go.
# Adopted lines are checked exactly as typed ones are (_check_typed), and the resume's first line
# names them.
# The command line may still set anything: an override of its own for a key the run set wins,
# and the checkpoint's settings are then compared with it (a resume refuses a change that alters
# training; an evaluation, one that alters the examples or the weights).

# What the training run chose that decides the examples and the weights an evaluation sees.
ADOPTED = ("experiment", "task", "model", "data", "precision", "trainer.ema_decay")
# What a resume never takes from the record: what this command does, how and where its ranks
# start (a node joining another node's job in the same run dir is no resume of it), and the
# loggers.
# The weights a run started from (init) are its checkpoint's now: a resume needs no init.path.
NOT_RESUMED = ("mode", "checkpoint.resume", "launcher", "dist", "hydra", "logger", "init")
RESUME_NOT_A_PATH = ("auto", "never", "last", "best")


def adopted_overrides(overrides: list[str]) -> tuple[Path | None, list[str]]:
    """The record a command evaluating or resuming a run continues from (else None), and the
    overrides it adopts from it: those the command line does not set itself."""
    parsed = parse(overrides)
    values = {o.key_or_group: o.value() for o in parsed if not o.is_sweep_override()}
    record, adopts = _record_of(values)
    if record is None:
        return None, []
    given = [override.key_or_group for override in parsed]
    return record, [line for line in _recorded(record, adopts) if not _overridden(line, given)]


def _record_of(values: dict[str, Any]) -> tuple[Path | None, Any]:
    """The record a command continues from, and what it adopts of it (a test on a key)."""
    resume, run_dir = values.get("checkpoint.resume"), values.get("hydra.run.dir")
    explicit = isinstance(resume, str) and resume not in RESUME_NOT_A_PATH
    if str(values.get("mode")) == "eval":
        record = training_record(Path(resume).expanduser()) if explicit else None
        return record, lambda key: matches_prefix(key, ADOPTED)
    if explicit:
        record = training_record(Path(resume).expanduser())
    elif isinstance(run_dir, str) and resume != "never":
        found = Path(run_dir).expanduser() / ".hydra" / "overrides.yaml"
        record = found if os.path.isfile(found) else None
    else:
        record = None
    return record, lambda key: not matches_prefix(key, NOT_RESUMED)


def training_record(checkpoint: Path) -> Path | None:
    """The overrides.yaml of the run dir holding `checkpoint` (its checkpoints/ folder's
    parent, or any folder above)."""
    for folder in Path(os.path.realpath(checkpoint)).parents:
        record = folder / ".hydra" / "overrides.yaml"
        if os.path.isfile(record):  # (False where the name cannot be looked up at all)
            return record
    return None


def _recorded(record: Path, adopts: Any) -> list[str]:
    try:
        lines = OmegaConf.to_container(OmegaConf.load(record))
    except Exception:  # noqa: BLE001 (a damaged record: nothing adopted, the evaluation compares as before)
        return []
    if not isinstance(lines, list):
        return []
    return [
        str(line)
        for line in lines
        if (parsed := parse([str(line)]))
        and adopts(parsed[0].key_or_group)
        and not parsed[0].is_sweep_override()
        and REDACTED not in str(line)
    ]


def _overridden(line: str, given: list[str]) -> bool:
    """Whether the command line sets the same key, or picks the group option it lies in
    (`model=mlp` replaces the training run's `model.width=16` too)."""
    [override] = parse([line])
    return any(matches_prefix(override.key_or_group, [mine]) for mine in given)
