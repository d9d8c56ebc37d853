"""A fork server that has imported the training stack: local ranks start from it in tens of
milliseconds instead of importing torch and the rest. `train` (cli.py) starts it first, so its
imports overlap this process's own (Hydra) and the composition. The ranks of launcher=local and
torchrun, forked from it, take over the launcher's environment, working dir, streams (forked.py)
and import path; the launcher never imports the stack."""

from __future__ import annotations

import atexit
import contextlib
import gc
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import tempfile
from collections.abc import Iterator

from framework.core import launch_context
from framework.core.exits import ConfigError, end
from framework.core.parent_death import die_with_parent

START_METHOD = "forkserver"
# What every rank needs (the per-rank wiring, all under it, rank 0's plots). This module first:
# its copy of the server's environment is what a rank compares with (adopt).
PRELOAD = ["framework.launch.forkserver", "framework.launch.rank_entry", "matplotlib.pyplot"]
# A pruning sweep's rank 0 reports to its study through Optuna (3 s to import in a rank here):
# preloaded for a command naming that sweeper (skipped if missing: then that sweep won't compose).
PRUNING_SWEEP = "hydra/sweeper=optuna_prune"
PRUNING_PRELOAD = ["optuna"]
# Set in this process's environment only while it starts the fork server: the server finds
# it when it imports this module (PRELOAD), and no other process does.
_SERVER_MARK = "FRAMEWORK_FORK_SERVER"
# Hydra's flags that print instead of running (-c: --cfg), and the launchers that submit jobs.
PRINTING_FLAGS = ("--cfg", "--help", "-h", "--info", "--hydra-help", "-c", "--shell-", "-sc")
SUBMITTING = ("launcher=slurm", "launcher=slurm_local")


def _leave_without_teardown() -> None:
    """The server's last act (it holds the launcher's streams): no teardown, 1.3 s for nothing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_launcher = os.environ.pop(_SERVER_MARK, None)  # set, in the server, to the launcher's pid
if _launcher:
    # The server ends the moment its launcher does, even mid-import (a refused command exits at
    # once; the streams it holds keep a caller waiting); children watch it (launcher_watch.py).
    die_with_parent(int(_launcher))
    # Preloads import uncollected (a fifth of their CPU); each child freezes them, then collects.
    gc.disable()
    os.register_at_fork(after_in_child=lambda: (gc.freeze(), gc.enable()))
    # Registered first, so run last (atexit's order): the preloads' handlers, then no teardown.
    atexit.register(_leave_without_teardown)
# In the fork server: the environment its children start with (launch/forked.py compares).
SERVER_ENVIRON = dict(os.environ)


def warm_up(extra: list[str] | None = None) -> None:
    """Start the fork server now, in the background (it imports PRELOAD, and `extra`, once)."""
    multiprocessing.set_forkserver_preload([*PRELOAD, *(extra or [])])
    os.environ[_SERVER_MARK] = str(os.getpid())
    try:
        with started_without_the_working_dir():
            multiprocessing.forkserver.ensure_running()
    except OSError as error:  # its socket lies in the temp dir, in a path of at most 107 bytes
        if "AF_UNIX path too long" not in str(error):
            raise
        end(ConfigError(f"TMPDIR={tempfile.gettempdir()}: {error}: set a shorter TMPDIR"))
    finally:
        os.environ.pop(_SERVER_MARK, None)


@contextlib.contextmanager
def started_without_the_working_dir() -> Iterator[bool]:
    """Python processes started meanwhile take nothing from the working dir first (PYTHONSAFEPATH,
    unless the user set it; yields whether this set it): a project's `random` shadows nothing."""
    before = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = before or "1"  # (empty: unset, to Python)
    try:
        yield not before
    finally:
        os.environ.pop("PYTHONSAFEPATH")
        os.environ.update({} if before is None else {"PYTHONSAFEPATH": before})


def warm_up_if_forking(argv: list[str]) -> None:
    """Start the fork server now when this command will fork local ranks from it."""
    standalone = isinstance(launch_context.current(), launch_context.Standalone)
    if standalone and will_start_local_ranks(argv):
        warm_up(PRUNING_PRELOAD if PRUNING_SWEEP in argv else None)


def will_start_local_ranks(argv: list[str]) -> bool:
    """From the command line alone (before Hydra composes): does this command start ranks on
    this machine? Not for a submission to SLURM, one process of the local launcher, or a
    command that prints."""
    if any(arg.startswith(PRINTING_FLAGS) or arg in SUBMITTING for arg in argv):
        return False
    # One process under the local launcher; torch's elastic agent forks even one rank per node
    # from the server.
    return "launcher.nproc_per_node=1" not in argv or "launcher=torchrun" in argv
