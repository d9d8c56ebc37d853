"""Where the shipped config groups are, and which files there the framework shipped: those whose
content is recorded in conf/SHA256SUMS (written by `python -m framework.core.config_dir` when
the files change; a test compares it with git). A file added to conf/ or experiments/, or edited
there, is the user's (or a colleague's): trusted by nothing a shipped file is trusted by. Found
without importing anything heavy (the starter, framework/starter/create.py, reads them too)."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from framework.core.leaving import when_leaving


def _conf_dir() -> Path:
    """The copy a wheel carries inside the package (pyproject.toml's force-include), else, in a
    clone, the repository's conf/."""
    package = Path(__file__).resolve().parents[1]
    packaged = package / "conf"
    return packaged if packaged.is_dir() else package.parent / "conf"


CONF_DIR = _conf_dir()
# Where Hydra's search path is made from: the module that runs the app (its primary config dir is
# CONF_DIR, given by path).
APP_FILE = Path(__file__).resolve().parents[1] / "train.py"
# `sha256sum` format, so `cd conf && sha256sum -c SHA256SUMS` checks a copy too.
MANIFEST = CONF_DIR / "SHA256SUMS"
PRIMARY = "config.yaml"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def present_files(root: Path = CONF_DIR) -> dict[str, Path]:
    """Every YAML file Hydra would read under `root` (experiment/ is a link to experiments/ in a
    clone, a folder in a wheel): relative name -> file."""
    found = {}
    for folder, _, names in os.walk(root, followlinks=True):
        for name in names:
            if name.endswith(".yaml"):
                path = Path(folder, name)
                found[path.relative_to(root).as_posix()] = path
    return found


def recorded_digests() -> dict[str, str]:
    """conf/SHA256SUMS: relative name -> sha256 of the file as shipped."""
    if not MANIFEST.is_file():
        return {}
    lines = (line.split(maxsplit=1) for line in MANIFEST.read_text().splitlines() if line)
    return {name.strip(): digest for digest, name in lines}


@functools.cache
def shipped_files() -> dict[str, Path]:
    """The files under CONF_DIR whose content is the shipped content: relative name -> file."""
    recorded = recorded_digests()
    return {
        name: path
        for name, path in present_files().items()
        if name in recorded and _digest(path) == recorded[name]
    }


def is_shipped(path: Path) -> bool:
    return path in shipped_files().values()


@functools.cache
def shipped_conf_dir() -> Path | None:
    """A folder of the shipped files alone: CONF_DIR when nothing there was added or edited, else
    a copy of them, removed as the process leaves; None when the primary config is not shipped."""
    shipped = shipped_files()
    if PRIMARY not in shipped:
        return None
    if shipped.keys() == present_files().keys():
        return CONF_DIR
    copy = Path(tempfile.mkdtemp(prefix="framework-shipped-conf-"))
    when_leaving(functools.partial(shutil.rmtree, copy, ignore_errors=True))
    for name, path in shipped.items():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy / name)
    return copy


def write_manifest() -> None:
    """Record the files as they are now as the shipped ones (a change of conf/ or experiments/
    that is meant to ship)."""
    lines = [f"{_digest(path)}  {name}" for name, path in sorted(present_files().items())]
    MANIFEST.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    write_manifest()
    print(f"recorded {len(present_files())} files in {MANIFEST}")
