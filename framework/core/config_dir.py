"""Where the shipped config groups are, found without importing anything heavy (the starter,
framework/starter/create.py, reads them too)."""

from __future__ import annotations

from pathlib import Path


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
