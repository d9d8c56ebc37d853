"""glibc's malloc in a rank: keep what a step frees for the next step (speed), or give it back
(memory), by two fixed thresholds set with `mallopt`. Python's cycle collector in a rank: the
training stack's objects kept out of its passes.

Both are left alone where the user set glibc's malloc thresholds (`MALLOC_TRIM_THRESHOLD_`,
`MALLOC_MMAP_THRESHOLD_`, `glibc.malloc.` in `GLIBC_TUNABLES`) and where the C library has no
mallopt.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import sys
from collections.abc import Callable, Mapping

# glibc's mallopt parameters (malloc.h), and the largest mmap threshold it accepts on 64-bit.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_LARGEST_MMAP_THRESHOLD = 32 << 20
_GLIBC_DEFAULT_THRESHOLD = 128 << 10  # both thresholds' initial values


def _mallopt(environ: Mapping[str, str]) -> Callable[[int, int], int] | None:
    chosen = {"MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"} & set(environ)
    if chosen or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return None
    return getattr(ctypes.CDLL(None), "mallopt", None)


def keep_freed_heap(environ: Mapping[str, str]) -> None:
    """glibc's malloc in this rank keeps what a training step frees for the next step, instead
    of giving it back to the OS and faulting it in again (docs/benchmarks.md, "run-to-run
    spread": measured with perf and strace on `train`'s ranks and a plain torchrun loop's).

    By default glibc trims the top of its heap once more than twice its (moving) mmap threshold
    lies free there. Whether a step's freed activations and gradients (blocks of 1 to 8 MB for
    the small CNN) end up there depends on where the small objects allocated meanwhile landed:
    ranks forked from the fork server's large heap flipped between trimming and growing their
    heap every step (thousands of page faults a second) and not at all, per rank and from one
    minute to the next, and DDP runs at the pace of the slower rank.

    Fixed thresholds (they also stop the threshold moving): blocks under 32 MB come from the heap,
    which is never trimmed, so it stays at the size of the busiest step; larger blocks are their
    own mappings, given back when freed, as before."""
    mallopt = _mallopt(environ)
    if mallopt is None:
        return
    mallopt(_M_MMAP_THRESHOLD, _LARGEST_MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, -1)  # -1: never trim


def give_back_freed_heap() -> bool:
    """Undo keep_freed_heap in this process: every block of 128 KiB or more is its own mapping,
    returned to the OS when freed, and the heap's free top is trimmed (glibc's initial
    thresholds, fixed). A sharded model gathers each block's parameters for a moment: kept,
    those blocks of a few MB never shrank the heap again, and it grew past the whole model's
    size (docs/strategies.md). Returns whether the thresholds were set."""
    mallopt = _mallopt(os.environ)
    if mallopt is None:
        return False
    mallopt(_M_MMAP_THRESHOLD, _GLIBC_DEFAULT_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, _GLIBC_DEFAULT_THRESHOLD)
    return True


def import_for_good(module: str) -> None:
    """`module` and what it imports (the training stack: a million objects) live as long as this
    process: imported with the cycle collector paused, then frozen out of its passes, which
    walked them all (a fifth of the stack's import). Only where first imported: a later freeze
    would keep for good what a sweep's earlier jobs left for the collector."""
    if module in sys.modules:
        return
    collecting = gc.isenabled()
    gc.disable()
    try:
        importlib.import_module(module)
    finally:
        gc.freeze()
        if collecting:
            gc.enable()
