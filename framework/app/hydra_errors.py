"""Hydra's own errors with our exit codes: a config mistake Hydra finds (an option that does not
exist, a value of the wrong type, an override it cannot parse) exits 2, like every config mistake
we find (framework/core/exits.py), as one `error:` line.

Hydra runs the app inside its `run_and_report`, which prints any exception and exits 1: it has no
hook for the exit code. It re-raises instead when HYDRA_FULL_ERROR=1, its documented switch for
full tracebacks, so `run_with_exit_codes` sets that switch while the app runs and prints what
Hydra would have. A user who sets HYDRA_FULL_ERROR=1 still gets Hydra's traceback.
tests/integration/test_cli.py holds this to Hydra's behaviour: the exit code and the message of
each kind.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import yaml
from hydra.errors import (
    CompactHydraException,
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf.errors import OmegaConfBaseException

from framework.core.exits import ExitCode
from framework.core.secrets import scrub

FULL_ERROR = "HYDRA_FULL_ERROR"
CONFIG_MISTAKES = (ConfigCompositionException, MissingConfigException, OverrideParseException)
# What composing raises for a config mistake: Hydra's, a file that is not YAML, and OmegaConf's
# (a missing key, a wrong type).
COMPOSITION_MISTAKES = (*CONFIG_MISTAKES, yaml.YAMLError, OmegaConfBaseException)


def run_with_exit_codes(app: Callable[[], Any]) -> None:
    """Run a `@hydra.main` app: Hydra's config mistakes exit 2, its other reports exit 1."""
    wants_traceback = wants_hydras_traceback()
    try:
        with _environment(FULL_ERROR, "1"):
            app()
    except COMPOSITION_MISTAKES as error:
        if wants_traceback:
            raise
        _leave(_mistake_line(error), ExitCode.CONFIG_REJECTED)
    except CompactHydraException as error:  # a message, not a bug (a failed job of a sweep)
        if wants_traceback:
            raise
        _leave(describe(error), ExitCode.FAILED)


def wants_hydras_traceback() -> bool:
    """The user asked for Hydra's traceback of an error (HYDRA_FULL_ERROR=1)."""
    return os.environ.get(FULL_ERROR) == "1"


def config_mistake(error: Exception) -> str | None:
    """The one line of a composition's error that is a config mistake (exit 2): an option that
    does not exist, a value of the wrong type, an override or a file that does not parse, a
    missing key. None for any other error."""
    return _mistake_line(error) if isinstance(error, COMPOSITION_MISTAKES) else None


def _mistake_line(error: Exception) -> str:
    return describe(_yaml_mistake(error) if isinstance(error, yaml.YAMLError) else error)


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


def _leave(message: str, code: ExitCode) -> NoReturn:
    print(scrub(f"error: {message}"), file=sys.stderr, flush=True)
    raise SystemExit(code) from None


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
