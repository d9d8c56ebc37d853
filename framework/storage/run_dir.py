"""The run dir's files and lifecycle: created by Hydra, accepted or refused before anything is
written, resumed, trimmed after a restart, discarded after a rejected config. Only rank 0
writes here.

<run dir>/
    .hydra/          Hydra's record of the composition (redacted: framework/config/redaction.py)
    config.yaml      the resolved config every rank ran with (written once the run is accepted)
    metrics.jsonl    one JSON object per log event
    summary.json     the final metrics
    train.log        rank 0's console log
    curves.png       the curves of metrics.jsonl
    checkpoints/     step_<N>.pt + .json, last.pt (framework/storage/checkpoint.py)
    .lock            held by the run's rank 0 while it runs: a second run here is refused

Nothing of a user's is ever removed: a start that is refused removes only a dir that was empty
when it began (its own), and a dir that holds files but no run is refused before anything is
written into it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.core import launch_context
from framework.core.exits import ConfigError
from framework.storage.files import atomic_write, step_files

log = logging.getLogger("framework")

# Run dirs that were empty when this process began a run in them: only those may be removed.
_BEGUN_EMPTY: set[Path] = set()
# Folders that did not exist before this process's run: Hydra makes them (outputs/<date>/...).
_MADE_FOR_RUNS: set[Path] = set()
LOCK_MARK = b"pid "  # how the lock's line begins: "pid N on host, since ..."
# Run dirs whose lock this process holds: {resolved dir: the lock's file descriptor}.
_HELD: dict[Path, int] = {}
# The lock each job's start took, before anything was written, for the app to hold on to.
_TAKEN_AT_START: dict[Path, int] = {}


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def record(self) -> Path:
        return self.path / ".hydra"

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def log(self) -> Path:
        return self.path / "train.log"

    @property
    def curves(self) -> Path:
        return self.path / "curves.png"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def lock(self) -> Path:
        return self.path / ".lock"

    @property
    def init_record(self) -> Path:
        """The weights the run started from (init=file): their path and sha256, written once
        at the start; a resume takes its weights from a checkpoint and leaves it as it is."""
        return self.path / "init.json"

    # --- accept or refuse ---------------------------------------------------------------------
    def holds_run(self) -> bool:
        return self.metrics.exists() or self.summary.exists()

    def is_foreign(self) -> bool:
        """Holds files but no run: not a run dir of ours (a user's folder). A dir this process
        began empty holds only what this start wrote (the record of a sweep's job)."""
        if not self.path.is_dir() or not any(self.path.iterdir()):
            return False
        if self.path.resolve() in _BEGUN_EMPTY:
            return False
        return not (self.holds_our_lock() or self.holds_run() or step_files(self.checkpoints))

    def holds_our_lock(self) -> bool:
        """A .lock a run of ours wrote ("pid N on host, since ..."): a `.lock` of some other
        tool in a user's folder does not make it a run dir."""
        if self.lock.is_symlink() or not self.lock.is_file():
            return False
        with open(self.lock, "rb") as file:
            return file.read(4) == LOCK_MARK

    def links(self) -> list[str]:
        """The links in the dir and in its record (.hydra/): a run makes none there (last.pt
        lies in checkpoints/, whose files are written by rename), and every name in them is
        one the run may write into (its own files, a logger's, Hydra's record)."""
        found = []
        for folder in (self.path, self.record):
            if folder.is_dir() and not folder.is_symlink():
                found += [
                    entry.relative_to(self.path).as_posix()
                    for entry in folder.iterdir()
                    if entry.is_symlink()
                ]
        return sorted(found)

    def continues(self, cfg: DictConfig, overrides: list[str] | None = None) -> bool:
        """A run dir with a run in it is only reused to resume it: from its checkpoints, as a
        restart of the same job (torchrun's restart, a requeued SLURM job), or as the same
        command again after the run was stopped before its first checkpoint (it starts over)."""
        if cfg.checkpoint.resume == "never":
            return False
        if launch_context.current().restarted() or step_files(self.checkpoints):
            return True
        return not self.summary.exists() and self.started_by(overrides)

    def resumes_a_checkpoint(self, cfg: DictConfig) -> bool:
        """Training goes on from a checkpoint: the one checkpoint.resume names, else this
        dir's own (a resume, a restart, a requeued job)."""
        if cfg.mode != "train" or cfg.checkpoint.resume == "never":
            return False
        return cfg.checkpoint.resume != "auto" or bool(step_files(self.checkpoints))

    def started_by(self, overrides: list[str] | None) -> bool:
        """Whether the record of the command that started this dir's run holds `overrides`."""
        recorded = self.record / "overrides.yaml"
        if overrides is None or not recorded.is_file() or recorded.is_symlink():
            return False
        return list(OmegaConf.load(recorded) or []) == list(overrides)

    def check_reusable(
        self, cfg: DictConfig, sweep_job: bool, overrides: list[str] | None = None
    ) -> None:
        """Refuse a dir that holds a run this config would not continue, files that are not a
        run's, or a link where the run writes its own files: it stays untouched. `overrides`:
        the command's (Hydra's record), to continue a run stopped before its first checkpoint."""
        where, fix = (
            (str(self.path), "Choose a new hydra.sweep.dir")
            if sweep_job
            else (
                f"hydra.run.dir={self.path}",
                "Choose a new hydra.run.dir (or leave it unset for a fresh timestamped dir)",
            )
        )
        if self.is_foreign():
            names = sorted(entry.name for entry in self.path.iterdir())
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise ConfigError(
                f"{where} holds files that are not a run's ({shown}); it is left untouched. {fix}"
            )
        if links := self.links():
            raise ConfigError(
                f"{where} holds a link where a run writes its files ({', '.join(links)}); "
                f"a run never writes through one: it is left untouched. {fix}"
            )
        if not self.holds_run() or self.continues(cfg, overrides):
            return
        raise ConfigError(
            f"{where} already holds a run with no checkpoint to continue from (or "
            f"checkpoint.resume=never); it is left untouched. {fix}"
        )

    # --- a run's life -------------------------------------------------------------------------
    def save_config(self, record: dict[str, Any]) -> None:
        """config.yaml, written once the run is accepted: a refused resume changes nothing."""
        OmegaConf.save(OmegaConf.create(record), self.config)

    def save_init_record(self, record: dict[str, Any]) -> None:
        atomic_write(
            self.init_record, lambda file: file.write(json.dumps(record, indent=2).encode())
        )

    def trim_metrics(self, step: int) -> int:
        """Drop events after `step` (they are re-run after a resume); returns how many went."""
        if not self.metrics.exists():
            return 0
        lines = self.metrics.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _event_step(line) <= step]
        if len(kept) != len(lines):
            atomic_write(self.metrics, lambda file: file.write("".join(kept).encode()))
        return len(lines) - len(kept)

    def read_summary(self) -> dict[str, Any]:
        return json.loads(self.summary.read_text())

    def resume_hint(self, cfg: DictConfig) -> str:
        """How to continue a stopped run."""
        if cfg.launcher.name == "slurm":
            return "SLURM requeues the job if it was preempted or timed out; it then resumes here"
        hydra_record = self.record / "hydra.yaml"  # rank 0's record of the job: run or sweep
        if hydra_record.exists() and OmegaConf.load(hydra_record).hydra.mode == "MULTIRUN":
            # The job dir is <sweep dir>/<job number>; running the sweep again resumes every job.
            return f"To continue, run the same command with hydra.sweep.dir={self.path.parent}"
        return f"To continue, run the same command with hydra.run.dir={self.path}"

    def note_missing_folders(self) -> None:
        """Before Hydra makes the run dir: the folders it will make for it (the dated parents
        of outputs/<date>/<time>), which a rejected start may remove again."""
        for folder in (self.path, *self.path.parents):
            if _exists(folder):
                break
            _MADE_FOR_RUNS.add(folder.resolve())

    def note_start(self) -> None:
        """At the start of a job, before anything is written into the dir (Hydra has only
        made it): whether it is empty, so this start's own, which `discard` may remove."""
        if self.path.is_dir() and all(entry.name == ".lock" for entry in self.path.iterdir()):
            _BEGUN_EMPTY.add(self.path.resolve())
        else:  # an earlier start in this process began it empty; this one did not
            _BEGUN_EMPTY.discard(self.path.resolve())

    def discard(self, sweep_job: bool = False) -> None:
        """After a rejected or interrupted start: remove the run dir if this start made it (it
        was empty when the start began) and nothing trained there (no checkpoint, no metrics),
        then the folders Hydra made for it while they are empty. Any other dir keeps everything
        (a refused resume, a user's folder); a sweep's dir and its parents stay (the sweep's
        other jobs and summary go there)."""
        path = self.path.resolve()
        if path not in _BEGUN_EMPTY or step_files(self.checkpoints) or self._metrics_logged():
            return
        if path in _HELD:
            self._remove_begun_dir(path, sweep_job)
            return
        try:
            self.take()  # another start holding this dir: it stays as it is
        except ConfigError:
            return
        try:
            self._remove_begun_dir(path, sweep_job)
        finally:
            self.release()

    def _metrics_logged(self) -> bool:
        """A step was trained here (a refused start may have opened the file, empty)."""
        return self.metrics.exists() and self.metrics.stat().st_size > 0

    def _remove_begun_dir(self, path: Path, sweep_job: bool) -> None:
        if path == Path.cwd().resolve():  # an empty working dir the user ran in: empty it again
            for entry in path.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            return
        shutil.rmtree(path, ignore_errors=True)
        for folder in () if sweep_job else path.parents:
            with contextlib.suppress(OSError):  # another process may have removed or filled it
                if folder not in _MADE_FOR_RUNS or any(folder.iterdir()):
                    break
                folder.rmdir()

    @contextlib.contextmanager
    def held(self, adopt: bool = False) -> Iterator[None]:
        """Hold the run dir for the run's life: a second run here is refused, naming this one.
        `adopt`: the lock this job's start took (`take_at_start`), if it took one. The OS
        releases the lock when this process dies, so a restart of the same job (torchrun, a
        SLURM requeue) takes it again."""
        taken = _TAKEN_AT_START.pop(self.path.resolve(), None) if adopt else None
        if taken is None:
            self.take()
        try:
            yield
        finally:
            self.release()

    def take_at_start(self) -> bool:
        """Take the lock as a job starts, before anything is written into the dir (Hydra has
        only made it); False when another run holds it (the app then refuses the start)."""
        try:
            self.take()
        except ConfigError:
            return False
        _TAKEN_AT_START[self.path.resolve()] = _HELD[self.path.resolve()]
        return True

    def take(self) -> None:
        """The lock, atomically (flock on a file opened O_NOFOLLOW, checked to be a plain file
        of its own) and never through a link: a planted .lock link, symbolic or hard, would
        have the run overwrite the file it points to."""
        fd = _open_lock(self.lock)
        try:
            _check_own_file(fd, self.lock)
            _lock(fd, self)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        started = datetime.datetime.now().isoformat(timespec="seconds")
        holder = f"{os.getpid()} on {socket.gethostname()}, since {started}\n"
        os.pwrite(fd, LOCK_MARK + holder.encode(), 0)
        _HELD[self.path.resolve()] = fd

    def release(self) -> None:
        fd = _HELD.pop(self.path.resolve(), None)
        _TAKEN_AT_START.pop(self.path.resolve(), None)
        if fd is not None:
            os.close(fd)


def _open_lock(lock: Path) -> int:
    """The lock file, made new (O_EXCL) or opened as it is, never through a link (O_NOFOLLOW)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        try:
            return os.open(lock, flags | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:  # an earlier run's, or another start's at this moment
            return os.open(lock, flags)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise ConfigError(
            f"{lock} is a link: a run never writes through one; nothing was changed. "
            "Remove it, or choose another hydra.run.dir"
        ) from None


def _check_own_file(fd: int, lock: Path) -> None:
    """A hard link to a user's file (or a fifo, a device) opens like a lock file: only a plain
    file with no other name, empty or holding a run's line, is written into."""
    info = os.fstat(fd)
    ours = stat.S_ISREG(info.st_mode) and info.st_nlink == 1
    if not ours or (info.st_size and os.pread(fd, len(LOCK_MARK), 0) != LOCK_MARK):
        raise ConfigError(
            f"{lock} is not a run's lock file (another tool's, a link to another file, or not "
            "a plain file); nothing was changed. Remove it, or choose another hydra.run.dir"
        )


def _lock(fd: int, run: RunDir) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        raise ConfigError(
            f"hydra.run.dir={run.path} is in use by another run ({holder}); nothing was "
            "changed. Wait for it to end, or choose another hydra.run.dir"
        ) from None
    except OSError as error:  # a file system without locks (some cluster mounts)
        if error.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
        log.warning("%s cannot be locked (%s): a second run is not refused", run.lock, error)


def _event_step(line: str) -> float:
    try:
        return json.loads(line).get("step", -1)
    except json.JSONDecodeError:
        return float("inf")  # a line cut short by a kill: drop it


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long to look up: it does not exist (and cannot)
        return False


def make_folder(path: Path) -> str | None:
    """Make `path` and its missing parents, before Hydra would (whose mkdir ends in a
    traceback); why it cannot be made, or None. The file system is the judge (a file in the
    way, no permission, a name too long, a parent that cannot exist such as /proc/x): where it
    refuses, what was made for it is removed again."""
    missing = []
    while not _exists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    made: list[Path] = []
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        except OSError as error:
            for own in reversed(made):
                own.rmdir()
            return f"{folder}: {error.strerror}"
        made.append(folder)
    return None
