"""A process that must not outlive the one that started it asks the kernel to end it the moment
its parent does (Linux's PR_SET_PDEATHSIG): the fork server with its launcher, each DataLoader
worker with its rank. A worker otherwise notices only between items (torch checks every 5 s),
and one busy with an item, or blocked on a full pipe, outlives its rank, holding its memory and
the resource tracker it shares."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent(parent: int, *_: object) -> None:
    """End this process (SIGKILL) when `parent` ends; at once where it has ended already.
    (`*_`: a DataLoader passes the worker's id.)"""
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the signal was asked for
        os._exit(0)
