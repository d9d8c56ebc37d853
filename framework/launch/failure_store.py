"""What a failing rank tells its launcher through the launcher's store: its one-line reason,
which the launcher's root cause (and a sweep's summary) then shows."""

from __future__ import annotations

import contextlib

FAILURE_KEY = "framework/failure"  # + /<rank>


def tell_launcher(store, rank: int, reason: str) -> None:
    with contextlib.suppress(Exception):  # best effort: the store may be gone too
        store.set(f"{FAILURE_KEY}/{rank}", reason)


def failure_messages(store, world_size: int) -> dict[int, str]:
    """What the ranks told the launcher's store before they failed."""
    keys = {rank: f"{FAILURE_KEY}/{rank}" for rank in range(world_size)}
    return {rank: store.get(key).decode() for rank, key in keys.items() if store.check([key])}
