"""The pruners a pruning sweep (hydra/sweeper=optuna_prune) may use, each a function whose
signature declares its settings' defaults and bounds (config/keys.py reads them at composition),
and the command line's words for their keys. Where the sweep's study lives and how a trial's
ranks learn which trial they run: core/sweep_study.py.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Annotated, Any

from annotated_types import Ge

PRUNING_SWEEPER = "hydra_plugins.framework_launchers.pruning_sweeper.PruningSweeper"


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
