"""What files a config may make a run read (data.files): a trained model and its samples carry
their text into the run dir, so a colleague's config must not point them at ~/.ssh or ~/.aws.
Files lie under the working directory (the project) or under a folder that the environment
(trusted, unlike a config) names in $FRAMEWORK_DATA_DIRS; the default corpus (the standard
library's source) is the framework's own choice."""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from pathlib import Path

DATA_DIRS = "FRAMEWORK_DATA_DIRS"  # folders, os.pathsep between them


def data_dirs(cwd: Path, environ: Mapping[str, str]) -> list[Path]:
    named = [Path(name) for name in environ.get(DATA_DIRS, "").split(os.pathsep) if name]
    return [cwd.resolve(), *(folder.resolve() for folder in named if folder.is_absolute())]


def literal_folder(pattern: str) -> tuple[str, list[str]]:
    """The folder every match of a glob lies under (its parts before the first wildcard), and
    the parts after it."""
    parts = list(Path(pattern).parts)
    first = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    return (os.path.join(*parts[:first]) if first else "."), parts[first:]


def outside_data_dirs(pattern: str, cwd: Path, environ: Mapping[str, str]) -> str | None:
    """Why the files `pattern` (a glob or a path) names may not be read; None when they may.
    Below an allowed folder, a hidden file or folder is not data either: keys and tokens live
    there (.ssh, .aws, .env, .netrc), and `train` may run in a home directory."""
    literal, rest = literal_folder(pattern)
    folder = (cwd / literal).resolve()
    for top in data_dirs(cwd, environ) if ".." not in rest else ():
        if folder == top or top in folder.parents:
            below = [*folder.relative_to(top).parts, *rest]
            if any(part.startswith(".") for part in below):
                return (
                    "names a hidden file or folder, where keys rather than data live: move the "
                    "text out of it, or name that folder itself in $FRAMEWORK_DATA_DIRS"
                )
            return None
    return (
        "lies outside the working directory and the folders $FRAMEWORK_DATA_DIRS names: move "
        "the files under the project, or add their folder to $FRAMEWORK_DATA_DIRS "
        "(data.files=null streams the standard library's source)"
    )
