"""Where a pruning sweep's study lives and how a trial's rank 0 learns which trial of that study
it is (the pruners themselves: core/pruners.py).

The study is an Optuna SQLite file the framework names, in the sweep dir: no config names its
path. The job that starts a trial's ranks (launch/job.py) says which trial they run through
SWEEP_TRIAL, which every start path hands its ranks with the rest of its environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

STUDY_FILE = "optuna_study.db"  # in the sweep dir
SWEEP_TRIAL = "FRAMEWORK_SWEEP_TRIAL"  # "<job number>:<study file>", in a trial's ranks
JOB_ATTR = "job"  # a trial's user attribute: the Hydra job number that runs it
OVERRIDES_ATTR = "overrides"  # a trial's user attribute: its job's overrides, as launched
PRUNER_ATTR = "pruner"  # the study's user attribute: {"name": ..., "settings": {...}}


def study_path(sweep_dir: Path) -> Path:
    return Path(sweep_dir).resolve() / STUDY_FILE


def storage_url(study: Path) -> str:
    return f"sqlite:///{study}"


def trial_environment(job: int, study: Path) -> str:
    return f"{job}:{study}"


def sweep_trial(environ: Mapping[str, str] = os.environ) -> tuple[int, Path] | None:
    """(job number, study file) of the pruning sweep's trial this process runs; None outside
    one."""
    value = environ.get(SWEEP_TRIAL)
    if not value or ":" not in value:
        return None
    job, study = value.split(":", 1)
    return (int(job), Path(study)) if job.isdigit() else None
