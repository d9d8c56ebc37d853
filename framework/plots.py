"""Pictures of what metrics.jsonl holds: a run's loss and accuracy curves (curves.png in the run
dir) and a sweep's jobs side by side (sweep.png in the sweep dir). matplotlib, headless."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from framework.rundir import RunDir

log = logging.getLogger("framework")


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = RunDir(run_dir).metrics
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(events: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(event["step"], event[key]) for event in events if key in event]
    return [step for step, _ in points], [value for _, value in points]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display; a file is the output
    import matplotlib.pyplot as plt

    return plt


def plot_run(run_dir: Path) -> Path | None:
    """curves.png: train and validation loss, and validation accuracy, against the step."""
    events = _events(run_dir)
    if not events:
        return None
    plt = _pyplot()
    figure, (loss_axes, accuracy_axes) = plt.subplots(1, 2, figsize=(10, 3.8))
    loss_axes.plot(*_series(events, "train/loss"), label="train (mean over ranks)")
    loss_axes.plot(*_series(events, "val/loss"), "o-", label="validation")
    loss_axes.set(xlabel="optimizer step", ylabel="loss", title="loss")
    loss_axes.legend()
    accuracy_axes.plot(*_series(events, "val/accuracy"), "o-", color="tab:green")
    accuracy_axes.set(xlabel="optimizer step", ylabel="accuracy", title="validation accuracy")
    figure.suptitle("/".join(run_dir.parts[-3:]))
    figure.tight_layout()
    path = RunDir(run_dir).curves
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def plot_sweep(sweep_dir: Path, jobs: list[tuple[str, Path]], objective: str) -> Path | None:
    """sweep.png: every job's training loss against the step, and its final objective.
    `jobs`: (label, run dir) of each job that has metrics."""
    runs = [(label, events) for label, run_dir in jobs if (events := _events(run_dir))]
    if not runs:
        return None
    plt = _pyplot()
    figure, (loss_axes, objective_axes) = plt.subplots(1, 2, figsize=(11, 4))
    finals = []
    for label, events in runs:
        loss_axes.plot(*_series(events, "train/loss"), label=label)
        _, values = _series(events, objective)
        finals.append(values[-1] if values else float("nan"))
    loss_axes.set(xlabel="optimizer step", ylabel="train loss", title="training loss per job")
    loss_axes.legend(fontsize="small")
    objective_axes.barh([label for label, _ in runs], finals, color="tab:green")
    objective_axes.set(xlabel=objective, title=f"final {objective}")
    objective_axes.invert_yaxis()
    figure.suptitle(str(sweep_dir))
    figure.tight_layout()
    path = sweep_dir / "sweep.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def try_plot(plot, *args: Any) -> None:
    """A picture is a convenience: a failure to draw one is a warning, never a failed run."""
    try:
        plot(*args)
    except Exception as error:  # noqa: BLE001
        log.warning("could not draw %s: %s: %s", plot.__name__, type(error).__name__, error)
