"""hydra/sweeper=optuna_prune's settings, checked with the rest of the config before any trial
starts: the pruner is one of core/pruners.py's, its settings within their bounds, the objective
a validation metric each evaluation reports (in the direction the study optimises), and the
runs evaluate during training. Pruner settings under another sweeper are refused too (it would
run every trial to its end), as are changed settings of a pruner the sweep does not use."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from framework.config.keys import check_call_settings
from framework.config.validation import resolve_objective, task_directions
from framework.core.exits import ConfigError
from framework.core.pruners import (
    OPTION,
    PRUNER_KEYS,
    PRUNERS,
    PRUNING_SWEEPER,
    pruner_defaults,
    pruner_elsewhere,
    pruner_target,
)


def check_pruning(cfg: DictConfig) -> None:
    sweeper = OmegaConf.select(cfg, "hydra.sweeper")
    if not isinstance(sweeper, DictConfig):
        return
    if sweeper.get("_target_") != PRUNING_SWEEPER:
        if set(map(str, sweeper)) & set(PRUNER_KEYS):
            raise ConfigError(pruner_elsewhere("hydra.sweeper.pruner"))
        return
    name = sweeper.pruner
    if name not in PRUNERS:
        raise ConfigError(f"hydra.sweeper.pruner={name} is not one of {', '.join(PRUNERS)}")
    for pruner in PRUNERS:  # (the others' too: a value set is a value judged)
        check_call_settings(f"hydra.sweeper.{pruner}", sweeper[pruner], pruner_target(pruner))
    if problem := _setting_of_another_pruner(sweeper, name):
        raise ConfigError(problem)
    if cfg.trainer.eval_every < 1:
        raise ConfigError(
            f"{OPTION} prunes at evaluations: set trainer.eval_every (steps between "
            "evaluations) >= 1"
        )
    directions = task_directions(cfg.task)
    if directions is None:  # (a task whose source does not say: its rank checks the objective)
        return
    objective, direction = resolve_objective(cfg.objective, directions)
    if objective not in directions:
        raise ConfigError(
            f"objective={objective} is not reported at each evaluation, so {OPTION} cannot "
            f"prune on it: choose one of {', '.join(directions)}"
        )
    wanted = "maximize" if direction == "max" else "minimize"
    given = str(sweeper.direction).removeprefix("Direction.")
    if given != wanted:
        raise ConfigError(
            f"hydra.sweeper.direction={given} but {objective} is better when "
            f"{'higher' if direction == 'max' else 'lower'}: set "
            f"hydra.sweeper.direction={wanted}"
        )


def _setting_of_another_pruner(sweeper: DictConfig, chosen: str) -> str | None:
    """What to say of the first setting changed from its default of a pruner the sweep does not
    use (it would change nothing). Read unresolved: an interpolation there is a change too, and
    Hydra's values (${hydra:job.num}) are only a job's."""
    for pruner in PRUNERS:
        if pruner == chosen:
            continue
        defaults = pruner_defaults(pruner)
        settings = OmegaConf.to_container(sweeper[pruner], resolve=False)
        assert isinstance(settings, dict)
        for key, value in settings.items():
            if value != defaults.get(str(key)):
                return (
                    f"hydra.sweeper.{pruner}.{key}={value} sets the {pruner} pruner, but this "
                    f"sweep prunes with hydra.sweeper.pruner={chosen}: set "
                    f"hydra.sweeper.pruner={pruner}, or leave {pruner}'s settings at their defaults"
                )
    return None
