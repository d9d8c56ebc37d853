"""Pictures: a run's curves, one panel per metric (curves.png in the run dir), a sweep's jobs side
by side (sweep.png in the sweep dir), and image grids a task makes. matplotlib, headless."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from framework.storage.run_dir import RunDir

log = logging.getLogger("framework")
NOT_PLOTTED = {"train/nonfinite_skipped"}


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


def _panels(events: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(title, keys) per panel: the losses together, then one panel per other metric (its
    training and validation values together)."""
    keys = sorted(
        {
            key
            for event in events
            for key in event
            if key.startswith(("train/", "val/")) and key not in NOT_PLOTTED
        }
    )
    names = sorted({key.split("/", 1)[1] for key in keys}, key=lambda n: (n != "loss", n))
    return [
        (name, [key for key in (f"train/{name}", f"val/{name}") if key in keys]) for name in names
    ]


def plot_run(run_dir: Path) -> Path | None:
    """curves.png: one panel per metric in metrics.jsonl (training and validation values of the
    same metric share a panel) against the optimizer step."""
    figure = draw_curves(_events(run_dir), title="/".join(run_dir.parts[-3:]))
    if figure is None:
        return None
    path = RunDir(run_dir).curves
    figure.savefig(path, dpi=100)
    _pyplot().close(figure)
    return path


def draw_curves(events: list[dict[str, Any]], title: str):
    """The figure of plot_run, or None when no event holds a metric."""
    panels = _panels(events)
    if not panels:
        return None
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (name, keys) in zip(axes[0], panels, strict=True):
        for key in keys:
            steps, values = _series(events, key)
            label = "train (mean over ranks)" if key.startswith("train/") else "validation"
            ax.plot(steps, values, "o-" if len(steps) < 30 else "-", label=label)
            if len(steps) == 1:  # one evaluation (trainer.eval_every=0): say its value
                ax.annotate(
                    f"{label} {values[0]:.4g}",
                    (steps[0], values[0]),
                    textcoords="offset points",
                    xytext=(-6, 8),
                    ha="right",
                )
        ax.set(xlabel="optimizer step", ylabel=name, title=name)
        ax.legend(fontsize="small")
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def save_image_grid(images: Any, path: Path, columns: int = 16) -> Path:
    """Images [N, C, H, W] with values in [0, 1] as one PNG: rows of `columns` images, each
    framed by a 1-pixel gap, drawn pixel for pixel (scaled up, no smoothing)."""
    plt = _pyplot()
    images = images.detach().float().cpu().clamp(0, 1)
    count, channels, height, width = images.shape
    rows = -(-count // columns)
    grid = images.new_ones(channels, rows * (height + 1) + 1, columns * (width + 1) + 1) * 0.5
    for index, image in enumerate(images):
        top, left = 1 + (index // columns) * (height + 1), 1 + (index % columns) * (width + 1)
        grid[:, top : top + height, left : left + width] = image
    pixels = grid.permute(1, 2, 0).squeeze(-1).numpy()
    scale = max(1, 512 // grid.shape[2])
    plt.imsave(path, pixels.repeat(scale, 0).repeat(scale, 1), cmap="gray", vmin=0, vmax=1)
    return path


def plot_sweep(sweep_dir: Path, jobs: list[tuple[str, Path, float]], objective: str) -> Path | None:
    """sweep.png: every job's training loss against the step, and its final objective.
    `jobs`: (label, run dir, final objective) of each completed job."""
    runs = [
        (label, events, final) for label, run_dir, final in jobs if (events := _events(run_dir))
    ]
    if not runs:
        return None
    plt = _pyplot()
    figure, (loss_axes, objective_axes) = plt.subplots(1, 2, figsize=(11, 4))
    finals = []
    for label, events, final in runs:
        loss_axes.plot(*_series(events, "train/loss"), label=label)
        finals.append(final)
    loss_axes.set(xlabel="optimizer step", ylabel="train loss", title="training loss per job")
    loss_axes.legend(fontsize="small")
    objective_axes.barh([label for label, _, _ in runs], finals, color="tab:green")
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
