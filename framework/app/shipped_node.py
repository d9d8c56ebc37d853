"""Hydra's node as the framework ships it: composed from the shipped files alone (Hydra's, its
plugins' and those of conf/ whose content is as shipped: core/config_dir.py), with the same
options picked where those files have them. What a
composition changed of it is judged by app/hydra_node.py."""

from __future__ import annotations

import copy
import functools
from typing import Any

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.config_search_path_impl import ConfigSearchPathImpl
from hydra._internal.utils import create_automatic_config_search_path
from hydra.core.utils import JobRuntime
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from framework.app.config_search_path import PROJECT_PROVIDER, USER_PROVIDER
from framework.core.config_dir import APP_FILE, CONF_DIR, PRIMARY, shipped_conf_dir
from framework.core.exits import ConfigError, first_line


def plain_node(cfg: DictConfig) -> dict[str, Any]:
    node = OmegaConf.to_container(cfg.hydra, resolve=False, enum_to_str=True)
    assert isinstance(node, dict)
    return node


@functools.cache
def _shipped_loader() -> ConfigLoaderImpl:
    """Hydra's, its plugins' and the framework's config sources: none of the user's, and none
    of the files added to or edited in conf/ or experiments/ (a colleague's file there is a
    config like any other)."""
    conf = shipped_conf_dir()
    if conf is None:
        raise ConfigError(
            f"{CONF_DIR / PRIMARY} is not the file this framework shipped (its content is not "
            "the one conf/SHA256SUMS records): restore it (git checkout), and put your defaults "
            "in an experiment (experiments/<name>.yaml, picked with experiment=<name>)"
        )
    found = create_automatic_config_search_path(str(APP_FILE), None, str(conf))
    shipped = ConfigSearchPathImpl()
    for element in found.get_path():
        if element.provider not in (PROJECT_PROVIDER, USER_PROVIDER):
            shipped.append(element.provider, element.path)
    return ConfigLoaderImpl(config_search_path=shipped)


def _ships(loader: ConfigLoaderImpl, group: str, option: Any) -> bool:
    return isinstance(option, str) and loader.repository.config_exists(f"{group}/{option}")


def shipped_node(choices: dict[str, Any], config_name: str | None = "config") -> dict[str, Any]:
    """Hydra's node composed from the shipped files alone (from the shipped primary config, or
    none: Hydra's own help composes Hydra's config alone), with `choices` (group: option)
    picked where those files have the group and the option. A Hydra group's option must be a
    shipped one: an option file of the user's would write Hydra's node."""
    loader = _shipped_loader()
    for group, option in choices.items():
        if group.startswith("hydra/") and option is not None and not _ships(loader, group, option):
            raise ConfigError(
                f"{group}={option} is not an option that Hydra, its plugins or this framework "
                "ship: Hydra's node may only be composed from those"
            )
    # Only shipped options pick anything in the shipped files, and of those only the ones that
    # write Hydra's node change it: the node of a run that picks its own experiment, or another
    # model, is the node of every other run with the same such options (composed once).
    shipped = tuple(
        (group, option)
        for group, option in choices.items()
        if _ships(loader, group, option) and _writes_hydras_node(group, option)
    )
    return copy.deepcopy(_shipped_node(shipped, _job_name(), config_name))


@functools.cache
def _writes_hydras_node(group: str, option: str) -> bool:
    """An option of one of Hydra's groups, or a shipped option whose file sets `hydra:` (a
    launcher's). An option it picks in its own defaults list is a choice of its own."""
    if group.startswith("hydra/"):
        return True
    found = _shipped_loader().repository.load_config(f"{group}/{option}")
    return found is not None and "hydra" in found.config


def _job_name() -> str | None:
    """The job's name Hydra composes into the node (hydra.job.name), set when Hydra starts."""
    try:
        return str(JobRuntime.instance().get("name"))
    except KeyError:
        return None


@functools.cache
def _shipped_node(
    choices: tuple[tuple[str, str], ...], job_name: str | None, config_name: str | None
) -> dict[str, Any]:
    """(choices: shipped options only. job_name: hydra.job.name comes from Hydra's
    process-wide state, a key of the cache.)"""
    loader = _shipped_loader()
    picked = [f"{group}={option}" for group, option in choices]
    try:
        return plain_node(loader.load_configuration(config_name, picked, run_mode=RunMode.RUN))
    except Exception:  # noqa: BLE001 (a group only a user's file brings in: picked below)
        pass
    return plain_node(_composed_in_rounds(loader, dict(choices), config_name))


def _composed_in_rounds(
    loader: ConfigLoaderImpl, picked: dict[str, str], config_name: str | None
) -> DictConfig:
    """The shipped config with each picked group that its defaults list holds: each round may
    bring a nested group into the list."""
    cfg, overrides = loader.load_configuration(config_name, [], run_mode=RunMode.RUN), None
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
            cfg = loader.load_configuration(config_name, wanted, run_mode=RunMode.RUN)
        except Exception as error:  # noqa: BLE001 (any composition error: refused, named)
            raise ConfigError(
                f"Hydra's node cannot be checked against the shipped one ({first_line(error)})"
            ) from None
    return cfg
