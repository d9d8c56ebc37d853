"""The user's own config folders on Hydra's search path (a search path plugin, named to Hydra in
hydra_plugins/framework_launchers): the working directory's conf/, then $FRAMEWORK_CONFIG_PATH."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra._internal.sources_registry import SourcesRegistry
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import DictConfig

from framework.core.exits import ConfigError

# Config folders of the user's own packages, set once (a shell profile, a .env):
#   FRAMEWORK_CONFIG_PATH=pkg://my_research.conf,file:///home/me/more_conf
CONFIG_PATH_VARIABLE = "FRAMEWORK_CONFIG_PATH"
PROJECT_PROVIDER = "framework-project"  # the working directory's conf/
USER_PROVIDER = "framework-user"  # the folders in $FRAMEWORK_CONFIG_PATH


class UserConfigPath(SearchPathPlugin):
    """Adds the user's config folders after the shipped conf/: the working directory's conf/ (a
    user project keeps its own conf/ beside its package and runs `train` from there), then the
    folders in $FRAMEWORK_CONFIG_PATH (comma-separated pkg:// or file:// paths). Their group
    options (task/my_task.yaml, experiment/...) join the shipped ones without an edit of conf/;
    check_config_folders refuses an entry that does not exist, and an option that a shipped one
    of the same name hides."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        project = project_config_dir(search_path)
        if project is not None:
            search_path.append(provider=PROJECT_PROVIDER, path=project)
        for entry in os.environ.get(CONFIG_PATH_VARIABLE, "").split(","):
            if entry.strip():
                search_path.append(provider=USER_PROVIDER, path=entry.strip())


def project_config_dir(search_path: ConfigSearchPath) -> str | None:
    """file://<working dir>/conf when it is a folder and not on the search path already (in
    the clone, the working dir's conf/ is the shipped one)."""
    folder = Path.cwd() / "conf"
    if not folder.is_dir():
        return None
    on_path = {  # (the primary config dir comes as a bare path)
        Path(entry.path.removeprefix("file://")).resolve()
        for entry in search_path.get_path()
        if entry.path.startswith("file://") or "://" not in entry.path
    }
    return None if folder.resolve() in on_path else f"file://{folder.resolve()}"


def check_config_folders(config: DictConfig) -> None:
    """Every folder on the config search path exists: Hydra skips a missing one silently, and
    the options the user meant to add would then be 'not found' with no hint why. No option of
    the user's own folders is hidden by a shipped option of the same name, which Hydra would
    pick instead, silently."""
    sources = {}
    for source in config.hydra.runtime.config_sources:
        kind = SourcesRegistry.instance().resolve(source.schema)
        sources[source.provider] = found = kind(source.provider, f"{source.schema}://{source.path}")
        if not found.available():
            where = (
                "FRAMEWORK_CONFIG_PATH" if source.provider == USER_PROVIDER else "hydra.searchpath"
            )
            raise ConfigError(
                f"{where}: {source.schema}://{source.path} is not a folder of config files (it "
                "does not exist, or the package does not import): give file:///absolute/path "
                "or pkg://importable.package.folder"
            )
        if source.provider in (PROJECT_PROVIDER, USER_PROVIDER) and "main" in sources:
            check_not_hidden(found, sources["main"])


def check_not_hidden(user: ConfigSource, shipped: ConfigSource) -> None:
    for group in user.list("", ObjectType.GROUP):
        if not shipped.is_group(group):
            continue
        for option in set(user.list(group, ObjectType.CONFIG)) & set(
            shipped.list(group, ObjectType.CONFIG)
        ):
            name = option.removesuffix(".yaml")
            raise ConfigError(
                f"{user.full_path()}/{group}/{name}.yaml is hidden: {group}={name} picks the "
                "shipped option of that name; rename yours"
            )


def searchpath_problem(value: Any) -> str | None:
    """Why hydra.searchpath's entries are refused: a pkg:// entry imports the package it
    names as the config is composed (FRAMEWORK_CONFIG_PATH, the environment, may)."""
    entries = value if isinstance(value, list | tuple) else [value]
    for entry in entries:
        if not isinstance(entry, str) or not entry.startswith("file://"):
            return (
                f"hydra.searchpath entry {entry!r} is refused: give file:///absolute/path "
                "(pkg:// would import the package it names; FRAMEWORK_CONFIG_PATH may)"
            )
    return None
