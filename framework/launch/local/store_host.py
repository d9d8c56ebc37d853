"""The rendezvous store of launcher=local's ranks, hosted by a process of its own that is forked
from the fork server (which has torch imported), so that the launcher never imports torch: it
only waits, and torch cost it about 3 s of CPU at start and 620 MB held for the whole run
(docs/benchmarks.md, the suite's fifth round). The host outlives a failed rank, so the reason
that rank left in the store (failure_store.py) still reaches the launcher's root cause.

The host talks to the launcher through a pipe: it sends the store's port, then answers one
question (what did the ranks say before they failed?) and leaves. It leaves as soon as the
launcher is gone, too: the launcher's end of the pipe closes with it.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from framework.core.exits import WorkerFailed
from framework.launch.failure_store import failure_messages


class StoreHost:
    """The launcher's side of the host: the store's port, and the ranks' failure messages."""

    def __init__(self, port: int, connection: Connection) -> None:
        self.port = port
        self._connection = connection

    def failure_messages(self, world_size: int) -> dict[int, str]:
        """What the ranks told the store before they failed (nothing if the host is gone)."""
        try:
            self._connection.send(world_size)
            return self._connection.recv()
        except (EOFError, OSError):
            return {}


@contextlib.contextmanager
def hosted_store(context: Any, signals: list[str]) -> Iterator[StoreHost]:
    """A store host forked from `context`'s fork server for as long as the block runs.
    `signals`: the stop signals, which are the ranks' to act on (the host ignores them)."""
    ours, theirs = context.Pipe()
    process = context.Process(target=host_store, args=(theirs, signals), name="rank store")
    process.start()
    theirs.close()  # the host's end lives in the host alone: its exit is our EOF
    try:
        yield StoreHost(_port_or_exit(ours, process), ours)
    finally:
        ours.close()  # the host reads EOF and leaves
        process.join(timeout=5.0)
        if process.exitcode is None:
            process.kill()
            process.join()


def _port_or_exit(connection: Connection, process: Any) -> int:
    try:
        return connection.recv()
    except EOFError:
        raise WorkerFailed(
            f"the ranks' store did not start (its process exited with code {process.exitcode})"
        ) from None


def host_store(connection: Connection, signals: list[str]) -> None:
    """In the host: the store (master, any free port), until the launcher's last question or
    its end. A Ctrl-C reaches every process of the terminal's group, this one too: the ranks
    stop on it and may still need the store, so the host ignores the stop signals."""
    for name in signals:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    # Imported here, in the host: the fork server has it loaded, the launcher must not import it.
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with contextlib.suppress(EOFError, OSError):  # EOF: the launcher is gone
        connection.send(store.port)
        world_size = connection.recv()
        connection.send(failure_messages(store, world_size))
