"""Where start-up time goes: the command and each rank mark the moments a phase ends, and rank 0
logs them once, at its first step:

    start-up: 17.9 s to the first step (imports 4.2, compose 0.6, start ranks 0.1, ...)

The marks travel to the ranks in FRAMEWORK_STARTUP (ranks started by `train` take its
environment); a rank started by an external torchrun or SLURM logs only its own phases.
"""

from __future__ import annotations

import json
import os
import time

from framework import IMPORTED_AT

VARIABLE = "FRAMEWORK_STARTUP"


def mark(phase: str) -> None:
    """The end of `phase`, now."""
    marks = json.loads(os.environ.get(VARIABLE) or json.dumps({"began": IMPORTED_AT}))
    marks[phase] = time.time()
    os.environ[VARIABLE] = json.dumps(marks)


def count_from_now() -> None:
    """A new run in a process that has run one before (the benchmark pool, a test running
    several jobs in one pair of ranks): its start-up counts from here."""
    os.environ[VARIABLE] = json.dumps({"began": time.time()})


def count_from_this_process() -> None:
    """A SLURM task: the submitting command's marks came along in the job's environment, but
    the job may have waited in the queue since; its start-up counts from its own start."""
    os.environ[VARIABLE] = json.dumps({"began": IMPORTED_AT})


def count_from_now_unless_marked() -> None:
    """In a process forked from the long-lived fork server: its import time says nothing about
    this run, so a rank whose launcher left no marks (a test, a script) counts from its fork."""
    os.environ.setdefault(VARIABLE, json.dumps({"began": time.time()}))


def summary() -> str | None:
    """'17.9 s to the first step (imports 4.2, compose 0.6, ...)', or None without marks."""
    marks = json.loads(os.environ.get(VARIABLE) or "null")
    if not marks:
        return None
    moments = sorted(marks.items(), key=lambda item: item[1])
    phases = [
        f"{name} {end - start:.1f}"
        for (_, start), (name, end) in zip(moments, moments[1:], strict=False)
    ]
    return f"{moments[-1][1] - moments[0][1]:.1f} s to the first step ({', '.join(phases)})"
