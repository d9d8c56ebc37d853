"""A pruning sweep's trial (hydra/sweeper=optuna_prune): at each periodic evaluation rank 0
reports the objective to the sweep's study and asks its pruner whether the trial goes on; the
answer is broadcast, so every rank stops at the same step (model_selection.py ends the run there
as early stopping does: a final checkpoint, the metrics so far, the summary marked pruned).

Rank 0 learns which trial it runs from its job (core/sweep_study.py: sweep_trial); the pruner is
rebuilt from the settings the sweeper stored in the study, Optuna's own."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from framework.core.distributed import broadcast_object
from framework.core.launch_context import DistEnv
from framework.core.pruners import build_pruner
from framework.core.sweep_study import JOB_ATTR, PRUNER_ATTR, storage_url, sweep_trial

log = logging.getLogger("framework")


class TrialReports:
    """Collective: `judge` on every rank after each periodic evaluation; rank 0 alone holds the
    study."""

    def __init__(self, env: DistEnv, trial: Any | None, pruner_name: str) -> None:
        self.env, self.trial, self.pruner_name = env, trial, pruner_name

    @classmethod
    def build(cls, env: DistEnv) -> TrialReports | None:
        """Collective: the trial's reports where this run is a pruning sweep's trial (rank 0's
        job says so), else None on every rank."""
        found = sweep_trial() if env.is_main else None
        opened = open_trial(*found) if found else None
        name = broadcast_object(opened[1] if opened else None)
        if name is None:
            return None
        return cls(env, opened[0] if opened else None, str(name))

    def judge(self, step: int, value: float) -> str | None:
        """Collective: why the trial stops at this step (its pruner's word), None to go on."""
        verdict = None
        if self.trial is not None:
            self.trial.report(value, step)
            if self.trial.should_prune():
                verdict = (
                    f"pruned by the sweep's {self.pruner_name} pruner at step {step} "
                    f"(objective {value:.6g})"
                )
        return broadcast_object(verdict)


def open_trial(job: int, study_file: Path) -> tuple[Any, str] | None:
    """Rank 0: the study's trial that job `job` runs, with the study's pruner; None where the
    study holds no running trial of that job (a run outside the sweep)."""
    import optuna  # (hydra-optuna-sweeper's dependency: only a pruning sweep needs it)

    if not study_file.is_file():
        return None
    # Opening a study migrates its schema (alembic) and says so at INFO: not the run's news.
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    storage = optuna.storages.RDBStorage(storage_url(study_file))  # opened once: it checks
    [summary] = optuna.study.get_all_study_summaries(storage)  # its schema each time
    pruner = summary.user_attrs[PRUNER_ATTR]
    study = optuna.load_study(
        study_name=summary.study_name,
        storage=storage,
        pruner=build_pruner(pruner["name"], pruner["settings"]),
    )
    running = [
        trial
        for trial in study.get_trials(deepcopy=False)
        if trial.user_attrs.get(JOB_ATTR) == job and trial.state.name == "RUNNING"
    ]
    if not running:
        log.warning("no running trial of job %d in %s: this run is not pruned", job, study_file)
        return None
    return optuna.trial.Trial(study, running[-1]._trial_id), str(pruner["name"])
