"""Writing a run dir's files so that a kill never leaves one half-written, and naming its
checkpoints: what reading or preparing a run dir needs, without the training stack."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

STEP_FILE = re.compile(r"^step_(\d+)\.(?:pt|dcp)$")
THROWAWAY_PREFIX = "framework-rank"  # the temporary Hydra dir of torchrun ranks > 0


def throwaway_dir() -> Path:
    """Hydra's dir for a torchrun rank > 0, which adopts rank 0's run dir: removed again once
    the rank has it (so a rank killed later leaves nothing behind)."""
    return Path(tempfile.mkdtemp(prefix=THROWAWAY_PREFIX))


def is_throwaway(path: Path) -> bool:
    return path.name.startswith(THROWAWAY_PREFIX)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """`write(file)` into a temporary file beside `path`, flushed to disk, then renamed over it:
    `path` is the old file or the new one, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a leftover (or a planted link): made anew, never followed
    try:
        with open(tmp, "xb") as file:  # O_CREAT|O_EXCL: a link in its place is not followed
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def step_files(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step_*.pt file and step_*.dcp folder, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := STEP_FILE.match(p.name))]
    return sorted(found, reverse=True)
