"""What a pruning sweep (hydra/sweeper=optuna_prune) shares between its sweeper and its trials:
the pruners it may use, each a function whose signature declares its settings' defaults and
bounds (config/keys.py reads them at composition), where the sweep's study lives, and how a
trial's rank 0 learns which trial of that study it is.

The study is an Optuna SQLite file the framework names, in the sweep dir: no config names its
path. The job that starts a trial's ranks (launch/job.py) says which trial they run through
SWEEP_TRIAL, which every start path hands its ranks with the rest of its environment.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from annotated_types import Ge

PRUNING_SWEEPER = "hydra_plugins.framework_launchers.pruning_sweeper.PruningSweeper"
STUDY_FILE = "optuna_study.db"  # in the sweep dir
SWEEP_TRIAL = "FRAMEWORK_SWEEP_TRIAL"  # "<job number>:<study file>", in a trial's ranks
JOB_ATTR = "job"  # a trial's user attribute: the Hydra job number that runs it
OVERRIDES_ATTR = "overrides"  # a trial's user attribute: its job's overrides, as launched
PRUNER_ATTR = "pruner"  # the study's user attribute: {"name": ..., "settings": {...}}


# --- the pruners: optuna's, by name (hydra.sweeper.pruner) -----------------------------------
# A step is an optimizer step: each evaluation (trainer.eval_every) reports one.
def median(
    n_startup_trials: Annotated[int, Ge(0)] = 5,
    n_warmup_steps: Annotated[int, Ge(0)] = 0,
    interval_steps: Annotated[int, Ge(1)] = 1,
) -> Any:
    """A trial worse than the median of earlier trials at the same step is pruned."""
    import optuna  # (hydra-optuna-sweeper's dependency: only a pruning sweep needs it)

    return optuna.pruners.MedianPruner(
        n_startup_trials=n_startup_trials,
        n_warmup_steps=n_warmup_steps,
        interval_steps=interval_steps,
    )


def asha(
    min_resource: Annotated[int, Ge(1)] = 1,
    reduction_factor: Annotated[int, Ge(2)] = 4,
    min_early_stopping_rate: Annotated[int, Ge(0)] = 0,
) -> Any:
    """Asynchronous successive halving: at steps min_resource * reduction_factor ** k, only the
    best 1 / reduction_factor of the trials that got there go on."""
    import optuna  # (as above)

    return optuna.pruners.SuccessiveHalvingPruner(
        min_resource=min_resource,
        reduction_factor=reduction_factor,
        min_early_stopping_rate=min_early_stopping_rate,
    )


def hyperband(
    min_resource: Annotated[int, Ge(1)] = 1,
    max_resource: Annotated[int, Ge(1)] | None = None,
    reduction_factor: Annotated[int, Ge(2)] = 3,
) -> Any:
    """Several successive halvings, each with its own minimum; max_resource null: the last
    step a completed trial reported ("auto")."""
    import optuna  # (as above)

    return optuna.pruners.HyperbandPruner(
        min_resource=min_resource,
        max_resource="auto" if max_resource is None else max_resource,
        reduction_factor=reduction_factor,
    )


PRUNERS = {"median": median, "asha": asha, "hyperband": hyperband}
PRUNER_KEYS = ("pruner", *PRUNERS)  # hydra.sweeper.<key> that only a pruning sweep takes
OPTION = "hydra/sweeper=optuna_prune"


def pruner_target(name: str) -> str:
    return f"{__name__}.{name}"


def pruner_defaults(name: str) -> dict[str, Any]:
    """The pruner's settings as its signature declares them: the option's defaults."""
    parameters = inspect.signature(PRUNERS[name]).parameters
    return {key: parameter.default for key, parameter in parameters.items()}


def build_pruner(name: str, settings: Mapping[str, Any]) -> Any:
    return PRUNERS[name](**dict(settings))


# --- the study and a trial's place in it -----------------------------------------------------
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


# --- the command line's words for them (a refused key names what takes it) ----------------------
def pruner_elsewhere(key: str) -> str:
    return (
        f"{key} is a setting of {OPTION} (Optuna with a pruner): add {OPTION}; the basic and "
        "optuna sweepers run every trial to its end"
    )


def unknown_pruner_key(key: str) -> str | None:
    """What to say of `key` (one Hydra could not override: the node lacks it) where it is a
    pruning sweep's: a setting no pruner takes, or one given to a sweeper without pruners."""
    parts = key.lstrip("+~").split(".")
    if parts[:2] != ["hydra", "sweeper"] or len(parts) < 3 or parts[2] not in PRUNER_KEYS:
        return None
    if len(parts) == 4 and parts[2] in PRUNERS and parts[3] not in pruner_defaults(parts[2]):
        takes = ", ".join(pruner_defaults(parts[2]))
        return f"{key} is not a setting of the {parts[2]} pruner: it takes {takes}"
    return pruner_elsewhere(key.lstrip("+~"))
