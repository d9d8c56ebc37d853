"""What a SLURM or slurm_local task unpickles (framework/launch/slurm/sweep.py's InTask), as
submitit dumps and loads it: the task's interpreter starts with PYTHONSAFEPATH (no working dir
on its path); the launcher's own state, where a project's objects live, loads only once the
working dir is last on the path and the variable is gone again; a requeue's dump keeps that."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import cloudpickle
from submitit.core.utils import DelayedSubmission

from framework.launch.slurm.sweep import InTask

SEEN: list[tuple[list[str], str | None]] = []


def _as_a_projects_object_loads() -> str:
    SEEN.append((list(sys.path), os.environ.get("PYTHONSAFEPATH")))
    return "the project's object"


class ProjectObject:
    """Stands in for a project's Hydra callback in the launcher's state: it records the path and
    the environment it was unpickled with."""

    def __reduce__(self):
        return _as_a_projects_object_loads, ()


class Launcher:
    def __init__(self) -> None:
        self.callbacks = ProjectObject()

    def __call__(self, job: str) -> tuple[str, object]:
        return job, self.callbacks


def _in_a_task(dumped: bytes, folder: Path, monkeypatch) -> DelayedSubmission:
    """submitit's load in a task started in `folder` with PYTHONSAFEPATH=1."""
    monkeypatch.chdir(folder)
    monkeypatch.setattr(
        sys, "path", [entry for entry in sys.path if entry not in ("", str(folder))]
    )
    monkeypatch.setenv("PYTHONSAFEPATH", "1")
    return pickle.loads(dumped)


def test_the_launcher_loads_with_the_working_dir_last_and_the_users_environment(
    tmp_path, monkeypatch
):
    SEEN.clear()
    submitted = cloudpickle.dumps(DelayedSubmission(InTask(Launcher(), unset_safe_path=True), "0"))
    delayed = _in_a_task(submitted, tmp_path, monkeypatch)
    assert SEEN == []  # the launcher's state is still a pickle of its own
    assert sys.path[-1] == str(tmp_path) and "PYTHONSAFEPATH" not in os.environ

    assert delayed.result() == ("0", "the project's object")
    [(path, safe_path)] = SEEN
    assert path[-1] == str(tmp_path) and safe_path is None

    # submitit's requeue (SIGUSR2): the same call again, dumped and loaded in the next task.
    requeued = cloudpickle.dumps(delayed._checkpoint_function())
    again = _in_a_task(requeued, tmp_path, monkeypatch)
    assert "PYTHONSAFEPATH" not in os.environ
    assert again.result() == ("0", "the project's object")


def test_a_users_own_pythonsafepath_stays_in_the_task(tmp_path, monkeypatch):
    submitted = cloudpickle.dumps(DelayedSubmission(InTask(Launcher(), unset_safe_path=False), "0"))
    _in_a_task(submitted, tmp_path, monkeypatch).result()
    assert os.environ["PYTHONSAFEPATH"] == "1"
