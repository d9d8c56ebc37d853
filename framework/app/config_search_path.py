"""The user's own config folders on Hydra's search path (a search path plugin, named to Hydra in
hydra_plugins/framework_launchers): the working directory's conf/, then $FRAMEWORK_CONFIG_PATH."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

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
    app/hydra_node.py's check_config_folders refuses an entry that does not exist, and an option
    that a shipped one of the same name hides."""

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
