"""What the evaluations decide (framework/rank/model_selection.py): the best K checkpoints in the
monitor's direction, early stopping's patience and min_delta, and the test's weights."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from framework.config.schemas import EarlyStoppingConfig
from framework.core.launch_context import DistEnv
from framework.rank.model_selection import BestCheckpoints, EarlyStopping, ModelSelection
from framework.rank.state import Model
from framework.storage.checkpoint import Checkpointer
from framework.storage.files import step_files


def kept_after(best: BestCheckpoints, scores: list[float]) -> list[list[float]]:
    """Offer scores at steps 1, 2, ... as the loop does: add only what is admitted."""
    for step, score in enumerate(scores, start=1):
        if best.admits(score):
            best.add(score, step)
    return best.kept


def test_best_k_keeps_the_k_lowest_losses_best_first_and_drops_the_rest():
    best = BestCheckpoints(keep=2, maximize=False)
    assert kept_after(best, [0.9, 0.5, 0.7, 0.3, 0.8]) == [[0.3, 4], [0.5, 2]]
    assert not best.admits(0.6)  # worse than the worst kept (0.5)
    assert best.admits(0.4)


def test_best_k_keeps_the_k_highest_accuracies_when_the_monitor_is_maximised():
    best = BestCheckpoints(keep=3, maximize=True)
    assert kept_after(best, [0.1, 0.4, 0.2, 0.3, 0.05]) == [[0.4, 2], [0.3, 4], [0.2, 3]]
    assert not best.admits(0.2)  # equal to the worst kept is not better


def test_best_k_admits_everything_until_full_and_keeps_the_earlier_of_equal_scores():
    best = BestCheckpoints(keep=2, maximize=False)
    assert best.admits(10.0)
    assert kept_after(best, [1.0, 1.0, 1.0]) == [[1.0, 1], [1.0, 2]]


def test_best_k_off_admits_nothing():
    best = BestCheckpoints(keep=0, maximize=False)
    assert not best.admits(0.0)
    assert kept_after(best, [3.0, 2.0]) == []


def evaluations_until_stop(stopping: EarlyStopping, scores: list[float]) -> int | None:
    """The evaluation (1-based) at which early stopping ended the run, if any."""
    for index, score in enumerate(scores, start=1):
        stopping.update(score)
        if stopping.stopped:
            return index
    return None


def test_early_stopping_counts_evaluations_that_do_not_beat_the_best_by_min_delta():
    stopping = EarlyStopping("val/loss", maximize=False, patience=2, min_delta=0.1)
    # 1.0 best; 0.95 too small (stale 1); 0.85 beats 1.0 by 0.15 (reset); 0.8, 0.79 stale 1, 2.
    assert evaluations_until_stop(stopping, [1.0, 0.95, 0.85, 0.8, 0.79, 0.1]) == 5
    assert (stopping.best_score, stopping.stale_evaluations) == (0.85, 2)
    assert stopping.stopped == (
        "early stopping: val/loss did not improve by 0.1 for 2 evaluations (best 0.85)"
    )


def test_early_stopping_needs_more_than_min_delta_and_follows_a_maximised_metric():
    stopping = EarlyStopping("val/accuracy", maximize=True, patience=3, min_delta=0.25)
    # +0.25 exactly is no improvement; a lower accuracy is none either.
    assert evaluations_until_stop(stopping, [0.5, 0.75, 0.3, 0.74]) == 4
    assert stopping.best_score == 0.5
    stopping = EarlyStopping("val/accuracy", maximize=True, patience=3, min_delta=0.25)
    assert evaluations_until_stop(stopping, [0.5, 0.76, 0.3, 0.9, 1.02, 1.0, 0.99]) is None
    assert (stopping.best_score, stopping.stale_evaluations) == (1.02, 2)


def test_early_stopping_without_patience_never_stops():
    stopping = EarlyStopping("val/loss", maximize=False, patience=None, min_delta=0.0)
    assert evaluations_until_stop(stopping, [1.0] * 50) is None
    assert stopping.best_score is None  # nothing is followed


def selection(keep: int = 2, patience: int | None = 2) -> ModelSelection:
    return ModelSelection.build(
        ("val/loss", "min"), keep_best=keep, early_stopping=EarlyStoppingConfig(patience=patience)
    )


def test_a_best_checkpoint_is_saved_before_its_evaluation_is_recorded():
    chosen = selection(keep=1)
    saved: list[tuple[float, dict]] = []

    def save_best(score: float) -> None:  # what the checkpoint's "trainer" entry would hold
        saved.append((score, chosen.state_dict()))

    chosen.after_evaluation(5, {"val/loss": 2.0}, periodic=True, save_best=save_best)
    chosen.after_evaluation(10, {"val/loss": 3.0}, periodic=True, save_best=save_best)
    chosen.after_evaluation(15, {"val/loss": 1.0}, periodic=True, save_best=save_best)
    assert [score for score, _ in saved] == [2.0, 1.0]
    assert saved[1][1]["best"] == [[2.0, 5]] and saved[1][1]["stale_evaluations"] == 1
    assert chosen.state_dict() == {
        "best": [[1.0, 15]],
        "best_score": 1.0,
        "stale_evaluations": 0,
        "stopped_early": None,
        "pruned": None,
    }


def test_only_periodic_evaluations_count_toward_early_stopping_and_nan_counts_for_nothing():
    chosen = selection(keep=0, patience=1)
    never = pytest.fail  # keep=0: no best checkpoint is ever saved
    chosen.after_evaluation(5, {"val/loss": 1.0}, periodic=True, save_best=never)
    chosen.after_evaluation(10, {"val/loss": math.nan}, periodic=True, save_best=never)
    chosen.after_evaluation(12, {"val/accuracy": 0.5}, periodic=True, save_best=never)
    chosen.after_evaluation(12, {"val/loss": 5.0}, periodic=False, save_best=never)
    assert chosen.stopped_early is None
    chosen.after_evaluation(15, {"val/loss": 5.0}, periodic=True, save_best=never)
    assert chosen.stopped_early is not None and "for 1 evaluations (best 1)" in chosen.stopped_early


def test_selection_state_round_trips_into_a_fresh_selection():
    chosen = selection(keep=2, patience=3)
    for step, loss in ((5, 2.0), (10, 1.5), (15, 1.7), (20, 1.6)):
        chosen.after_evaluation(step, {"val/loss": loss}, periodic=True, save_best=lambda s: None)
    restored = selection(keep=2, patience=3)
    restored.load_state_dict(chosen.state_dict())
    assert restored.state_dict() == {
        "best": [[1.5, 10], [1.6, 20]],
        "best_score": 1.5,
        "stale_evaluations": 2,
        "stopped_early": None,
        "pruned": None,
    }
    # The restored one carries on where the first stopped: one more stale evaluation stops it.
    restored.after_evaluation(25, {"val/loss": 1.55}, periodic=True, save_best=lambda s: None)
    assert restored.best.kept == [[1.5, 10], [1.55, 25]]
    assert restored.stopped_early is not None


def checkpointer(directory: Path, best: int) -> Checkpointer:
    cfg = OmegaConf.create({"every": 0, "keep": 1, "resume": "never", "final": True, "best": best})
    return Checkpointer(cfg, directory, DistEnv(), settings={})


def test_the_test_split_sees_the_best_checkpoints_weights(tmp_path):
    """Best-K on disk through the real Checkpointer; test_weights loads the best of them."""
    saver = checkpointer(tmp_path, best=2)
    model = Model(train=nn.Linear(2, 1), module=nn.Linear(2, 1))
    chosen = selection(keep=2, patience=None)

    def save_best(score: float) -> None:
        with torch.no_grad():
            model.module.weight.fill_(score)  # weights that say which evaluation they were
        state = {"model": model.module.state_dict(), "ema": None}
        saver.write_file(step, lambda: state, {}, best=(score, chosen.maximize))

    for step, loss in ((1, 3.0), (2, 2.0), (3, 2.5), (4, 4.0), (5, 1.0)):
        chosen.after_evaluation(step, {"val/loss": loss}, periodic=True, save_best=save_best)
    assert chosen.best.kept == [[1.0, 5], [2.0, 2]]
    assert sorted(step for step, _ in step_files(tmp_path / "best")) == [2, 5]
    with torch.no_grad():
        model.module.weight.fill_(-7.0)  # the final weights
    assert chosen.test_weights(saver, is_main=True, model=model) == (
        "best checkpoint (step_00000005.pt)"
    )
    assert torch.equal(model.module.weight, torch.full((1, 2), 1.0))


def test_without_best_checkpoints_the_test_uses_the_final_weights(tmp_path):
    model = Model(train=nn.Linear(2, 1), module=nn.Linear(2, 1))
    final = model.module.weight.detach().clone()
    source = selection(keep=0).test_weights(checkpointer(tmp_path, best=0), True, model)
    assert source == "final weights"
    assert torch.equal(model.module.weight, final)


def test_a_run_its_pruner_stopped_is_complete_and_keeps_why():
    """A pruning sweep's trial whose job ended but whose sweeper was killed before it told the
    study runs again as the same job: its checkpoint must say the run is over."""
    from framework.rank.main import is_complete

    chosen = ModelSelection.build(("val/loss", "min"), 0, EarlyStoppingConfig())
    chosen.pruned = "pruned by the sweep's asha pruner at step 4 (objective 2.3)"
    saved = chosen.state_dict()
    assert is_complete({"step": 4, "trainer": saved}, total_steps=8)
    assert not is_complete({"step": 4, "trainer": {**saved, "pruned": None}}, total_steps=8)
    restored = ModelSelection.build(("val/loss", "min"), 0, EarlyStoppingConfig())
    restored.load_state_dict(saved)
    assert restored.stopped_early == restored.pruned == chosen.pruned
