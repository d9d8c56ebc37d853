"""What the evaluations decide: which checkpoints are the best K (checkpoint.best), when training
stops early (trainer.early_stopping), and which weights the test split sees at the end.

All of it follows one validation metric, the monitor (the objective when it is a validation
metric, else the task's main one). Every rank has the same metrics (one all-reduce), so every
rank decides the same without an exchange. The loop calls `ModelSelection.after_evaluation`
after each evaluation and `ModelSelection.test_weights` before the test.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from framework.config.schemas import EarlyStoppingConfig
from framework.core.distributed import broadcast_object
from framework.rank.pruning import TrialReports
from framework.rank.state import Model
from framework.storage.checkpoint import Checkpointer
from framework.storage.checkpoint import read as read_checkpoint


def improves(score: float, than: float, maximize: bool, by: float = 0.0) -> bool:
    """Whether `score` is better than `than` by more than `by`, in the monitor's direction."""
    return score > than + by if maximize else score < than - by


class BestCheckpoints:
    """The `keep` best evaluations so far as [score, step], best first (checkpoint.best; 0: off).
    The checkpoint files themselves are the Checkpointer's; this decides which to write."""

    def __init__(self, keep: int, maximize: bool) -> None:
        self.keep, self.maximize = keep, maximize
        self.kept: list[list[float]] = []

    def admits(self, score: float) -> bool:
        """Whether a checkpoint with this score belongs among the best: while fewer than `keep`
        are kept, any; then one better than the worst kept."""
        if not self.keep:
            return False
        return len(self.kept) < self.keep or improves(score, self.kept[-1][0], self.maximize)

    def add(self, score: float, step: int) -> None:
        # Stable sort: of equal scores the earlier step ranks first and stays.
        ranked = sorted(
            [*self.kept, [score, step]], reverse=self.maximize, key=lambda entry: entry[0]
        )
        self.kept = ranked[: self.keep]


class EarlyStopping:
    """trainer.early_stopping: stop once the monitor has not improved by more than `min_delta`
    for `patience` evaluations in a row (patience None: never)."""

    def __init__(
        self, monitor: str, maximize: bool, patience: int | None, min_delta: float
    ) -> None:
        self.monitor, self.maximize = monitor, maximize
        self.patience, self.min_delta = patience, min_delta
        self.best_score: float | None = None  # the best so far
        self.stale_evaluations = 0  # evaluations since it last improved by min_delta
        self.stopped: str | None = None  # why, once it ended the run

    def update(self, score: float) -> None:
        if self.patience is None:
            return
        if self.best_score is None or improves(
            score, self.best_score, self.maximize, self.min_delta
        ):
            self.best_score, self.stale_evaluations = score, 0
            return
        self.stale_evaluations += 1
        if self.stale_evaluations >= self.patience:
            self.stopped = (
                f"early stopping: {self.monitor} did not improve by {self.min_delta:g} "
                f"for {self.patience} evaluations (best {self.best_score:.6g})"
            )


class ModelSelection:
    """Best-K checkpoints, early stopping (a pruning sweep's pruner too) and the test's
    weights, on one monitored metric. Saved in the checkpoint's "trainer" entry (keys best,
    best_score, stale_evaluations, stopped_early, pruned)."""

    def __init__(
        self,
        best: BestCheckpoints,
        early_stopping: EarlyStopping,
        trial: TrialReports | None = None,
    ) -> None:
        self.best, self.early_stopping, self.trial = best, early_stopping, trial
        self.monitor, self.maximize = early_stopping.monitor, early_stopping.maximize
        self.pruned: str | None = None  # why, once a pruning sweep's pruner ended the run

    @classmethod
    def build(
        cls,
        monitor: tuple[str, str],
        keep_best: int,
        early_stopping: EarlyStoppingConfig,
        trial: TrialReports | None = None,
    ) -> ModelSelection:
        """From (metric, "min" | "max"), checkpoint.best, trainer.early_stopping and, in a
        pruning sweep's trial, its reports to the study."""
        name, maximize = monitor[0], monitor[1] == "max"
        return cls(
            BestCheckpoints(keep_best, maximize),
            EarlyStopping(name, maximize, early_stopping.patience, early_stopping.min_delta),
            trial,
        )

    @property
    def stopped_early(self) -> str | None:
        return self.early_stopping.stopped or self.pruned

    def after_evaluation(
        self,
        step: int,
        metrics: dict[str, float],
        periodic: bool,
        save_best: Callable[[float], object],
    ) -> None:
        """Save a best checkpoint through `save_best(score)` (a collective) when the score
        belongs among the best, then count a periodic evaluation toward early stopping (the
        end's evaluation comes after the last step: nothing is left to stop). The checkpoint
        is saved before this evaluation is recorded: it holds the state as of before it."""
        score = metrics.get(self.monitor, math.nan)
        if math.isnan(score):
            return
        if self.best.admits(score):
            save_best(score)
            self.best.add(score, step)
        if periodic:
            self.early_stopping.update(score)
        if periodic and self.trial is not None and self.stopped_early is None:
            self.pruned = self.trial.judge(step, score)  # the same on every rank

    def test_weights(self, checkpointer: Checkpointer, is_main: bool, model: Model) -> str:
        """Collective: load the best checkpoint's weights (its EMA's with trainer.ema_decay)
        into the evaluated model when checkpoint.best kept one. Returns where the test's
        weights come from (test/weights)."""
        best: Path | None = broadcast_object(checkpointer.best_path() if is_main else None)
        if best is None:
            return "final weights"
        payload = read_checkpoint(best)
        weights = payload["ema" if model.ema is not None else "model"]
        model.strategy.load_weights(model.evaluated, weights)
        return f"best checkpoint ({best.resolve().name})"

    def state_dict(self) -> dict[str, Any]:
        stopping = self.early_stopping
        return {
            "best": [list(entry) for entry in self.best.kept],
            "best_score": stopping.best_score,
            "stale_evaluations": stopping.stale_evaluations,
            "stopped_early": stopping.stopped,
            "pruned": self.pruned,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        stopping = self.early_stopping
        self.best.kept = [list(entry) for entry in state.get("best", self.best.kept)]
        stopping.best_score = state.get("best_score", stopping.best_score)
        stopping.stale_evaluations = state.get("stale_evaluations", stopping.stale_evaluations)
        stopping.stopped = state.get("stopped_early", stopping.stopped)
        self.pruned = state.get("pruned", self.pruned)
