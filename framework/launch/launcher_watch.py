"""No rank outlives its launcher. A rank forked from the fork server is the server's child, not
the launcher's, so the kernel's parent-death signal would follow the wrong process; and a rank of
an external torchrun whose agent is SIGKILLed would wait on the agent's store forever. Each rank
watches its launcher's process instead (a pidfd, readable once that process has ended):

1. the launcher is gone: the rank sends itself SIGTERM, which stops it at the next step with a
   checkpoint where SIGTERM is a stop signal (the default; every rank sees the same death), and
   ends it at once where it is not;
2. if it is still alive GRACE_S later (stuck in a collective with a rank that already left),
   it leaves with exit code 3 (a peer vanished: framework/core/exits.py).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time

from framework.core.exits import ExitCode

log = logging.getLogger("framework")

LAUNCHER_PID = "FRAMEWORK_LAUNCHER_PID"  # set by the launcher in the environment it hands over
GRACE_S = 15.0


def launcher_pid() -> int | None:
    value = os.environ.get(LAUNCHER_PID)
    return int(value) if value else None


def leave_with(pid: int) -> None:
    """From now on, this process ends soon after process `pid` ends (see the module docstring)."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:  # already gone: nothing of this rank has started yet
        log.warning("the launcher (pid %d) is gone: this rank does not start", pid)
        os._exit(ExitCode.PEER_LOST)
    except OSError:  # no pidfds (a kernel older than 5.3): poll instead
        handle = None
    threading.Thread(target=_watch, args=(pid, handle), name="launcher-watch", daemon=True).start()


def _watch(pid: int, handle: int | None) -> None:
    if handle is not None:
        select.select([handle], [], [])
    else:
        while _alive(pid):
            time.sleep(1.0)
    _leave(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leave(pid: int) -> None:
    log.warning("the launcher (pid %d) is gone: this rank stops", pid)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    sys.stderr.flush()
    os._exit(ExitCode.PEER_LOST)
