"""A pruning sweep's trial on real gloo ranks (framework/rank/pruning.py): rank 0 alone holds
the study and reports to it; the pruner's answer reaches every rank at the same evaluation."""

from __future__ import annotations

import json
import os
from pathlib import Path

import optuna
import pytest

from framework.core.launch_context import DistEnv
from framework.core.pruners import build_pruner
from framework.core.sweep_study import (
    JOB_ATTR,
    PRUNER_ATTR,
    STUDY_FILE,
    SWEEP_TRIAL,
    storage_url,
    trial_environment,
)
from framework.rank.pruning import TrialReports
from tests.conftest import spawn_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
MEDIAN = {"n_startup_trials": 1, "n_warmup_steps": 0, "interval_steps": 1}


def study_with_one_finished_trial(folder: Path) -> Path:
    """A study as the sweeper leaves it: trial 0 reported 0.9 at step 2 and 0.99 at step 4 and
    completed; trial 1 asked for job 1."""
    study_file = folder / STUDY_FILE
    study = optuna.create_study(
        study_name="sweep",
        storage=storage_url(study_file),
        direction="maximize",
        pruner=build_pruner("median", MEDIAN),
    )
    study.set_user_attr(PRUNER_ATTR, {"name": "median", "settings": MEDIAN})
    first = study.ask()
    first.set_user_attr(JOB_ATTR, 0)
    first.report(0.9, 2)
    first.report(0.99, 4)
    study.tell(first, 0.99)
    study.ask().set_user_attr(JOB_ATTR, 1)
    return study_file


def _judge_two_evaluations(rank: int, world_size: int, study_file: Path, out: Path) -> None:
    if rank == 0:  # only rank 0's job says which trial it is
        os.environ[SWEEP_TRIAL] = trial_environment(1, study_file)
    else:
        os.environ.pop(SWEEP_TRIAL, None)
    env = DistEnv(rank=rank, world_size=world_size, local_world_size=world_size, source="local")
    reports = TrialReports.build(env)
    assert reports is not None
    # The median pruner compares a trial's best so far with the others' at that step: 0.95
    # beats 0.9 at step 2; at step 4 it is below 0.99.
    verdicts = [reports.judge(2, 0.95), reports.judge(4, 0.1)]
    (out / f"rank{rank}.json").write_text(json.dumps(verdicts))


def test_the_pruners_answer_reaches_every_rank_at_the_same_evaluation(tmp_path):
    study_file = study_with_one_finished_trial(tmp_path)
    spawn_ranks(_judge_two_evaluations, study_file, tmp_path)
    said = "pruned by the sweep's median pruner at step 4 (objective 0.1)"
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [None, said]
    storage = storage_url(study_file)
    [_, trial] = optuna.load_study(study_name="sweep", storage=storage).trials
    assert trial.intermediate_values == {2: 0.95, 4: 0.1}  # reported once, by rank 0


def _outside_a_sweep(rank: int, world_size: int, out: Path) -> None:
    os.environ.pop(SWEEP_TRIAL, None)
    env = DistEnv(rank=rank, world_size=world_size, local_world_size=world_size, source="local")
    (out / f"rank{rank}.json").write_text(json.dumps(TrialReports.build(env) is None))


def test_a_run_outside_a_pruning_sweep_has_no_reports_on_any_rank(tmp_path):
    spawn_ranks(_outside_a_sweep, tmp_path)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [True, True]
