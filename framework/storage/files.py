"""Writing a run dir's files so that a kill never leaves one half-written, and naming its
checkpoints: what reading or preparing a run dir needs, without the training stack."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

STEP_FILE = re.compile(r"^step_(\d+)\.(?:pt|dcp)$")
THROWAWAY_PREFIX = "framework-rank"  # the temporary Hydra dir of torchrun ranks > 0


@contextlib.contextmanager
def throwaway_dir() -> Iterator[Path]:
    """Hydra's dir for a torchrun rank > 0, which adopts rank 0's run dir: removed once the rank
    has it (a rank killed later leaves nothing behind), and however the process leaves before:
    refused, or stopped by torchrun's agent (SIGTERM) when rank 0 refused or failed."""
    folder = Path(tempfile.mkdtemp(prefix=THROWAWAY_PREFIX))

    def removed_then_default(signum: int, _frame: object) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    before = signal.signal(signal.SIGTERM, removed_then_default)  # (a rank's stop replaces it)
    try:
        yield folder
    finally:
        signal.signal(signal.SIGTERM, before)
        shutil.rmtree(folder, ignore_errors=True)


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
