"""What a process forked from the fork server (launch/forkserver.py) does first: it takes over
its launcher's environment, working dir and output streams (the server's are the ones it started
with), keeps what its starter set on top (the elastic agent's RANK, WORLD_SIZE, ...), and from
then on ends when its launcher does (launch/launcher_watch.py)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import sys
from multiprocessing import reduction

from framework.core import startup_clock
from framework.core.heap import keep_freed_heap
from framework.core.leaving import run_leaving_tasks
from framework.launch import launcher_watch
from framework.launch.forkserver import SERVER_ENVIRON


class _LaunchersFd:
    """One of the launcher's file descriptors, sent to the rank as it is started (a fork
    server's child would otherwise write to the server's stdout and stderr)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(duplicate) -> int:
    return duplicate.detach()


def launcher_context() -> tuple[dict[str, str], str, list[_LaunchersFd]]:
    """What a rank takes over from the process that starts it: environment, working dir,
    stdout and stderr."""
    environ = {**os.environ, launcher_watch.LAUNCHER_PID: str(os.getpid())}
    return environ, os.getcwd(), [_LaunchersFd(1), _LaunchersFd(2)]


def adopt(environ: dict[str, str], cwd: str, stdio: list[int]) -> None:
    """In the rank, first thing: the launcher's environment, working dir and output streams,
    plus what was set in this process since its fork (the elastic agent's variables), and a
    heap that keeps what a step frees (keep_freed_heap). From now on it ends when the launcher
    does (framework/launch/launcher_watch.py)."""
    keep_freed_heap(environ)
    set_since_fork = {
        name: value for name, value in os.environ.items() if SERVER_ENVIRON.get(name) != value
    }
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(set_since_fork)
    launcher_watch.leave_with(int(environ[launcher_watch.LAUNCHER_PID]))
    # multiprocessing ends this process without the interpreter's shutdown: what it was to do
    # as it leaves (core/leaving.py: W&B's temp folders) runs as multiprocessing ends it.
    multiprocessing.util.Finalize(None, run_leaving_tasks, exitpriority=0)
    # A fork server's child inherits its start method: the rank's DataLoader workers would each
    # start from a new fork server that imports torch from scratch (seconds per rank). They
    # start as in a process started directly (the platform's default: fork on Linux).
    multiprocessing.set_start_method(None, force=True)
    startup_clock.count_from_now_unless_marked()
    os.chdir(cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in zip((1, 2), stdio, strict=True):
        os.dup2(fd, target)
        os.close(fd)
