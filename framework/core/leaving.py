"""What a process does as it leaves: at shutdown, in exit_now, or as multiprocessing ends it."""

import atexit
from collections.abc import Callable

_TASKS: list[Callable[[], None]] = []


def when_leaving(task: Callable[[], None]) -> None:
    _TASKS.append(task)


@atexit.register
def run_leaving_tasks() -> None:
    while _TASKS:  # each once, the newest first
        _TASKS.pop()()
