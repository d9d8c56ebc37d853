"""framework/core/pruners.py: each pruner a pruning sweep names is Optuna's, built with the
settings the sweep gives it (the option's defaults are its signature's)."""

from __future__ import annotations

import optuna
import pytest
from omegaconf import OmegaConf

from framework.core.pruners import build_pruner, pruner_defaults
from framework.core.sweep_study import sweep_trial, trial_environment


@pytest.mark.parametrize(
    ("name", "settings", "kind", "held"),
    [
        (
            "median",
            {"n_startup_trials": 2, "n_warmup_steps": 10, "interval_steps": 5},
            optuna.pruners.MedianPruner,
            {"_n_startup_trials": 2, "_n_warmup_steps": 10, "_interval_steps": 5},
        ),
        (
            "asha",
            {"min_resource": 22, "reduction_factor": 3, "min_early_stopping_rate": 1},
            optuna.pruners.SuccessiveHalvingPruner,
            {"_min_resource": 22, "_reduction_factor": 3, "_min_early_stopping_rate": 1},
        ),
        (
            "hyperband",
            {"min_resource": 2, "max_resource": None, "reduction_factor": 2},
            optuna.pruners.HyperbandPruner,
            {"_min_resource": 2, "_max_resource": "auto", "_reduction_factor": 2},
        ),
    ],
)
def test_each_pruner_is_optunas_with_the_settings_given(name, settings, kind, held):
    pruner = build_pruner(name, settings)
    assert type(pruner) is kind
    assert {key: getattr(pruner, key) for key in held} == held
    assert set(pruner_defaults(name)) == set(settings)


def test_the_sweepers_option_holds_each_pruners_defaults():
    from hydra_plugins.framework_launchers.pruning_sweeper import PruningSweeperConf

    node = OmegaConf.structured(PruningSweeperConf)
    assert node.pruner == "median"
    for name in ("median", "asha", "hyperband"):
        assert OmegaConf.to_container(node[name]) == pruner_defaults(name)
        assert type(build_pruner(name, node[name])).__name__.endswith("Pruner")


def test_a_trials_ranks_read_which_trial_they_run(tmp_path):
    study = tmp_path / "optuna_study.db"
    environ = {"FRAMEWORK_SWEEP_TRIAL": trial_environment(7, study)}
    assert sweep_trial(environ) == (7, study)
    assert sweep_trial({}) is None
    assert sweep_trial({"FRAMEWORK_SWEEP_TRIAL": "x:/elsewhere"}) is None
