"""One piece of work in a process of its own, forked from this one: a crash, a poisoned CUDA
context or a hang ends that process, never the caller, and a time limit kills it with
everything it started.

Forked rather than started afresh: the caller has imported torch, torch._dynamo and the
framework once (several seconds per process on a GPU machine, 15 to 20 s on 2 shared cores),
and the child has them already. That is safe only while the caller has not initialised CUDA
(a forked child cannot use a CUDA context its parent created): `run_forked` refuses then. Like
the framework's fork server, the caller imports torch but never touches a device.

The work writes what it has found so far through `report` (an atomic JSON file), so a child
killed at its limit still leaves its partial figures behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Report = Callable[[dict[str, Any]], None]
Work = Callable[[Report], dict[str, Any]]


@dataclass
class Outcome:
    finished: bool  # the work returned (it may still have found a problem: see its result)
    result: dict[str, Any] | None  # what it returned, else what it last reported
    error: str | None  # the traceback's tail, the signal that ended it, or the time limit
    seconds: float


def write_json(path: Path, value: Any) -> None:
    """Atomically: a reader never sees half a file."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(json.dumps(value, indent=2, default=str) + "\n")
    os.replace(temporary, path)


def run_forked(
    work: Work, log: Path, timeout_s: float, env: Mapping[str, str] | None = None
) -> Outcome:
    """`work(report)` in a forked child whose stdout and stderr go to `log` (appended), with
    `env` applied in the child first; killed with its process group after `timeout_s`."""
    _refuse_after_cuda_init()
    result_file = log.with_name(f"{log.name}.result.json")
    result_file.unlink(missing_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(work, log, result_file, env or {})
    # Also here: the group exists before the parent may kill it (or the child got there first).
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)
    error = _wait(pid, started + timeout_s)
    kill_group(pid)  # what the work started and left behind (a fork server, compile workers)
    seconds = time.monotonic() - started
    found = json.loads(result_file.read_text()) if result_file.exists() else {}
    result_file.unlink(missing_ok=True)
    if "error" in found:
        error = found["error"]
    finished = error is None and found.get("finished", False)
    if error is None and not finished:
        error = "the process ended without a result"
    return Outcome(finished, found.get("result"), error, seconds)


def _refuse_after_cuda_init() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA is initialised in this process: a forked child could not use the GPU"
        )


def _child(work: Work, log: Path, result_file: Path, env: Mapping[str, str]) -> None:
    """Never returns: the child leaves with os._exit, running none of the parent's exit
    handlers."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: the time limit kills what it starts too
        descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(descriptor, 1)
        os.dup2(descriptor, 2)
        # Onto the descriptors, whatever the parent had put in their place (pytest does); open
        # for the child's whole life, hence no context manager.
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.update(env)

        def report(partial: dict[str, Any]) -> None:
            write_json(result_file, {"finished": False, "result": partial})

        result = work(report)
        write_json(result_file, {"finished": True, "result": result})
        code = 0
    except BaseException:  # noqa: BLE001 (everything is the parent's to report)
        text = traceback.format_exc()
        print(text, file=sys.stderr)
        previous = json.loads(result_file.read_text()) if result_file.exists() else {}
        write_json(result_file, {**previous, "error": _tail(text)})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, deadline: float) -> str | None:
    """None when the child exited by itself with code 0; else why it did not."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return _status_error(status)
        if time.monotonic() > deadline:
            kill_group(pid)
            os.waitpid(pid, 0)
            return "stopped at its time limit"
        time.sleep(0.1)


def _status_error(status: int) -> str | None:
    if os.WIFSIGNALED(status):
        return f"killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
    code = os.WEXITSTATUS(status)
    return None if code == 0 else f"exited with code {code}"


def kill_group(pid: int) -> None:
    """SIGKILL to the process group `pid` leads (that child and what it started)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
