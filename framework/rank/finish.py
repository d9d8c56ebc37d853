"""The end of a rank's training: the summary to the sinks, what the task makes from the trained
model (pictures, text), the curves, and the one summary line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from framework.components.data import Loaders, Splits, to_device
from framework.components.loggers import MetricSink
from framework.components.tasks import Task, first_batch
from framework.config.validation import resolve_objective
from framework.core.launch_context import DistEnv
from framework.rank.build import Parts, preserved_rng
from framework.rank.plots import plot_run, save_image_grid, try_plot
from framework.storage.run_dir import RunDir


def finish(
    summary: dict[str, Any],
    objective: str | None,
    parts: Parts,
    sink: MetricSink,
    run: RunDir,
    env: DistEnv,
) -> dict[str, Any] | None:
    """Rank 0's summary (None elsewhere), written with what the run leaves besides. The
    summary line (`final_line`) is logged once the sinks are closed."""
    task, model = parts.task, parts.model
    name, direction = resolve_objective(objective, task.directions())
    summary.update(objective=name, objective_direction=direction)
    sink.summary(summary)
    # A sharded model's forward is a collective: every rank makes them, rank 0 writes.
    if env.is_main or model.strategy.shards:
        model.strategy.gather_around(model.evaluated, task.model_methods)
        made = write_artifacts(
            task, model.evaluated, parts.splits, parts.loaders, parts.device, run, env.is_main
        )
    if not env.is_main:
        return None
    try_plot(plot_run, run.path)
    sink.add_files([*made, run.curves] if run.curves.exists() else made)
    return summary


def final_line(summary: dict[str, Any], task: Task, run: RunDir) -> str:
    """The objective first, then the task's other metrics, then how the run went."""
    names = [
        summary["objective"],
        *(name for name in task.directions() if name != summary["objective"]),
        *(name for name in summary if name.startswith("test/") and name != "test/weights"),
    ]
    metrics = " ".join(f"{name}={summary[name]:.4f}" for name in names)
    return (
        f"{metrics} steps={summary['steps']} samples/s={summary['samples_per_s']:.0f} "
        f"wall={summary['wall_s']:.1f}s run_dir={run.path}"
    )


def write_artifacts(
    task: Task,
    model: torch.nn.Module,
    splits: Splits,
    loaders: Loaders,
    device: torch.device,
    run: RunDir,
    write: bool = True,
) -> list[Path]:
    """What the task makes from the trained model (pictures, text), into the run dir (made
    and not written where `write` is false)."""
    batch = first_batch(splits.val, loaders.val.batch_size, loaders.val.collate_fn)
    model.eval()
    with preserved_rng(), torch.no_grad():
        made = task.artifacts(model, to_device(batch, device), splits.decode)
    if not write:
        return []
    for name, content in made.items():
        if isinstance(content, str):
            (run.path / name).write_text(content)
        else:
            try_plot(save_image_grid, content, run.path / name)
    return [run.path / name for name in made if (run.path / name).exists()]
