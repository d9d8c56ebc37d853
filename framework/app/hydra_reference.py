"""Hydra's node as the framework ships it, and what a composition changed of it.

The node a run will use is composed from the user's config folders, the command line and the
shipped files; the reference is composed from the shipped files alone (Hydra's, its plugins',
conf/), with the same options picked where the shipped files have them. Every key that differs
must be on core/hydra_settings.py's positive list, and its value, resolved as Hydra will
resolve it, must pass that list's rules. So whichever door a config file finds into Hydra's
node (a value, an interpolation, a sweep parameter, a deletion, a group option of its own), it
meets the same wall.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.config_search_path_impl import ConfigSearchPathImpl
from hydra._internal.utils import create_automatic_config_search_path
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobRuntime
from hydra.types import RunMode
from omegaconf import Container, DictConfig, OmegaConf, open_dict

from framework.app.config_search_path import PROJECT_PROVIDER, USER_PROVIDER
from framework.config import CONF_DIR
from framework.core.allowlist import hydra_target_problem
from framework.core.exits import ConfigError, first_line
from framework.core.hydra_settings import (
    CALLBACKS,
    ENV_SET,
    SAFE_ENV,
    SAFE_SBATCH,
    SBATCH_OPTIONS,
    SWEEPER_PARAMS,
    VALIDATE,
    callback_problem,
    refusal,
    settable,
    value_problem,
)

# Keys Hydra itself writes over whatever a file said, while it composes or starts a job.
HYDRA_WRITES = (
    "hydra.overrides",
    "hydra.runtime",
    "hydra.job.override_dirname",
    "hydra.job.config_name",
)
# Settable keys that hold a mapping of names to values: the names allowed in each.
NAMED_VALUES = {ENV_SET: SAFE_ENV, SBATCH_OPTIONS: SAFE_SBATCH}
_ABSENT = object()


def check_hydra_settings(cfg: DictConfig, overrides: list[str], trusted: tuple[str, ...]) -> None:
    """Raise ConfigError unless every key of cfg's Hydra node that differs from the shipped
    node is settable, with a value its rule allows once resolved; and unless Hydra's record of
    the overrides is what `overrides` make it (a config file cannot write it)."""
    _check_override_record(cfg, overrides)
    real = _plain_node(cfg)
    reference = shipped_node(_choices(cfg))
    changed = [path for path in _changed(real, reference) if not _hydra_writes(path)]
    for path in changed:
        if not settable(path):
            raise ConfigError(refusal(path))
    resolving = _Resolver(cfg)
    for area in sorted({_area(path) for path in changed}):
        problem = _area_problem(area, resolving.value(area), trusted)
        if problem:
            raise ConfigError(problem)


def _choices(cfg: DictConfig) -> dict[str, Any]:
    """group: option as composed; None for a group whose default is missing (`???`), which
    Hydra skips while it composes a sweep's master config and refuses in each job."""
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices, resolve=False)
    assert isinstance(choices, dict)
    for group, option in choices.items():
        if option == "???" and group.startswith("hydra/"):  # (Hydra's node would lack it)
            raise ConfigError(f"{group} is left ??? by a config file: pick one, {group}=<option>")
    return {group: None if option == "???" else option for group, option in choices.items()}


def _hydra_writes(path: str) -> bool:
    return any(path == key or path.startswith(key + ".") for key in HYDRA_WRITES)


def _check_override_record(cfg: DictConfig, overrides: list[str]) -> None:
    parsed = OverridesParser.create().parse_overrides(overrides)
    expected = {
        "hydra": [o.input_line for o in parsed if o.is_hydra_override()],
        "task": [o.input_line for o in parsed if not o.is_hydra_override()],
    }
    recorded = OmegaConf.to_container(cfg.hydra.overrides, resolve=False)
    if recorded != expected:
        raise ConfigError(
            "hydra.overrides cannot be set from a config file: it is Hydra's record of the "
            "command line"
        )


def _plain_node(cfg: DictConfig) -> dict[str, Any]:
    node = OmegaConf.to_container(cfg.hydra, resolve=False, enum_to_str=True)
    assert isinstance(node, dict)
    return node


def _flat(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(path, value) of every leaf; lists and empty mappings are leaves."""
    if isinstance(node, Mapping) and node:
        for key, value in node.items():
            yield from _flat(value, f"{path}.{key}")
    else:
        yield path, node


def _changed(real: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    ours, shipped = dict(_flat(real, "hydra")), dict(_flat(reference, "hydra"))
    return sorted(
        path
        for path in ours.keys() | shipped.keys()
        if ours.get(path, _ABSENT) != shipped.get(path, _ABSENT)
    )


def _area(path: str) -> str:
    """The key whose resolved value a changed `path` is judged with: a whole callback, all of
    the sweeper's params or env_set, or the key itself."""
    for whole in (SWEEPER_PARAMS, *NAMED_VALUES):
        if path == whole or path.startswith(whole + "."):
            return whole
    if path.startswith(CALLBACKS + ".") and not path.startswith(VALIDATE + "."):
        return ".".join(path.split(".")[:3])
    return path


def _area_problem(area: str, value: Any, trusted: tuple[str, ...]) -> str | None:
    if area == SWEEPER_PARAMS:
        return _params_problem(value)
    if area in NAMED_VALUES:
        return _named_values_problem(area, value)
    if area.startswith(CALLBACKS + ".") and area != f"{VALIDATE}.output_subdir":
        if problem := callback_problem(area, value):
            return problem
        target = value.get("_target_")
        found = hydra_target_problem(target, trusted)
        return f"{area}._target_={target} {found}" if found else None
    return value_problem(area, value)


def _params_problem(params: Any) -> str | None:
    """The sweeper applies each parameter to every job as `key=value`: plain values, and a
    key of Hydra's node only where an override may set it."""
    if params is None:
        return None
    if not isinstance(params, Mapping):
        return f"{SWEEPER_PARAMS}={params}: give a mapping of keys to plain values"
    for key, value in params.items():
        name = str(key).lstrip("+~")
        if name.startswith("hydra.") and not settable(name):
            return refusal(name)
        if problem := value_problem(f"{SWEEPER_PARAMS}.{key}", value):
            return problem
        if isinstance(value, Mapping):
            return f"{SWEEPER_PARAMS}.{key}: give a plain value"
    return None


def _named_values_problem(area: str, value: Any) -> str | None:
    if not isinstance(value, Mapping):
        return f"{area}={value}: give a mapping of names to plain values"
    for name in value:
        if name not in NAMED_VALUES[area]:
            return refusal(f"{area}.{name}")
    return value_problem(area, value)


class _Resolver:
    """Values of the node as Hydra resolves them in a job (its number and id set), read on a
    copy: resolving must not change the config Hydra is about to use."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = copy.deepcopy(cfg)
        with open_dict(self.cfg.hydra.job):
            for key, value in (("num", 0), ("id", "0")):
                if OmegaConf.is_missing(self.cfg.hydra.job, key):
                    self.cfg.hydra.job[key] = value

    def value(self, path: str) -> Any:
        hydra_config = HydraConfig.instance()
        before = hydra_config.cfg
        try:
            hydra_config.set_config(self.cfg)  # for ${hydra:...}
            node = OmegaConf.select(self.cfg, path, throw_on_resolution_failure=True)
            if isinstance(node, Container):
                return OmegaConf.to_container(node, resolve=True, enum_to_str=True)
            return node.name if isinstance(node, Enum) else node
        except Exception as error:  # noqa: BLE001 (any resolver's failure: refused, named)
            raise ConfigError(
                f"{path} cannot be resolved before the run ({first_line(error)}): give it a "
                "plain value"
            ) from None
        finally:
            hydra_config.cfg = before


# --- the shipped node ------------------------------------------------------------------------
APP_FILE = Path(__file__).resolve().parents[1] / "train.py"  # where @hydra.main is
USER_PROVIDERS = (PROJECT_PROVIDER, USER_PROVIDER)


@functools.cache
def _shipped_loader() -> ConfigLoaderImpl:
    """Hydra's, its plugins' and the framework's config sources: none of the user's."""
    found = create_automatic_config_search_path(str(APP_FILE), None, str(CONF_DIR))
    shipped = ConfigSearchPathImpl()
    for element in found.get_path():
        if element.provider not in USER_PROVIDERS:
            shipped.append(element.provider, element.path)
    return ConfigLoaderImpl(config_search_path=shipped)


def _ships(loader: ConfigLoaderImpl, group: str, option: Any) -> bool:
    return isinstance(option, str) and loader.repository.config_exists(f"{group}/{option}")


def shipped_node(choices: dict[str, Any]) -> dict[str, Any]:
    """Hydra's node composed from the shipped files alone, with `choices` (group: option)
    picked where those files have the group and the option. A Hydra group's option must be a
    shipped one: an option file of the user's would write Hydra's node."""
    loader = _shipped_loader()
    for group, option in choices.items():
        if group.startswith("hydra/") and option is not None and not _ships(loader, group, option):
            raise ConfigError(
                f"{group}={option} is not an option that Hydra, its plugins or this framework "
                "ship: Hydra's node may only be composed from those"
            )
    # Only shipped options pick anything in the shipped files: the node of a run that picks
    # its own experiment is the node of every other run with the same shipped options.
    shipped = tuple(
        (group, option) for group, option in choices.items() if _ships(loader, group, option)
    )
    return copy.deepcopy(_shipped_node(shipped, _job_name()))


def _job_name() -> str | None:
    """The job's name Hydra composes into the node (hydra.job.name), set when Hydra starts."""
    try:
        return str(JobRuntime.instance().get("name"))
    except KeyError:
        return None


@functools.cache
def _shipped_node(choices: tuple[tuple[str, str], ...], job_name: str | None) -> dict[str, Any]:
    """(choices: shipped options only. job_name: hydra.job.name comes from Hydra's
    process-wide state, a key of the cache.)"""
    loader = _shipped_loader()
    picked = [f"{group}={option}" for group, option in choices]
    try:
        return _plain_node(loader.load_configuration("config", picked, run_mode=RunMode.RUN))
    except Exception:  # noqa: BLE001 (a group only a user's file brings in: picked below)
        pass
    return _plain_node(_composed_in_rounds(loader, dict(choices)))


def _composed_in_rounds(loader: ConfigLoaderImpl, picked: dict[str, str]) -> DictConfig:
    """The shipped config with each picked group that its defaults list holds: each round may
    bring a nested group into the list."""
    cfg, overrides = loader.load_configuration("config", [], run_mode=RunMode.RUN), None
    for _ in range(len(picked) + 1):
        present = cfg.hydra.runtime.choices
        wanted = [
            f"{group}={option}"
            for group, option in picked.items()
            if group in present and _ships(loader, group, option)
        ]
        if wanted == overrides:
            break
        overrides = wanted
        try:
            cfg = loader.load_configuration("config", wanted, run_mode=RunMode.RUN)
        except Exception as error:  # noqa: BLE001 (any composition error: refused, named)
            raise ConfigError(
                f"Hydra's node cannot be checked against the shipped one ({first_line(error)})"
            ) from None
    return cfg
