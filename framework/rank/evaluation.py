"""Evaluation: the task's metrics over a whole split, exact on any world size, and mode=eval
(a checkpoint's weights on one split, without training)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from framework.components.data import Loaders, to_device
from framework.components.precision import Precision
from framework.components.tasks import Task
from framework.components.tasks.base import pack_states, unpack_states
from framework.config.redaction import redacted_container
from framework.config.resume_rules import must_match_in_eval, training_settings
from framework.config.validation import resolve_objective
from framework.core.distributed import all_reduce_sum
from framework.core.exits import CheckpointError, ConfigError
from framework.core.launch_context import DistEnv
from framework.rank.state import Model
from framework.storage.checkpoint import check_model_keys
from framework.storage.checkpoint import read as read_checkpoint
from framework.storage.run_dir import RunDir

log = logging.getLogger("framework")


@torch.no_grad()
def evaluate(
    task: Task,
    model: nn.Module,
    loader: DataLoader,
    precision: Precision,
    to_device: Callable[[Any], Any],
    split: str = "val",
    lockstep: bool = False,
) -> dict[str, float]:
    """The task's metrics over a whole split: every rank adds up the task's sum states over its
    shard (no padding, no duplicates) on the device, packed into one vector whatever their
    shapes (task.state_shapes), then one all-reduce of all of them.
    `lockstep`: a forward is a collective (strategy=fsdp gathers parameters), so a rank with
    fewer batches runs its last one again, uncounted, until every rank has run as many."""
    model.eval()
    shapes = {name: task.state_shapes.get(name, ()) for name in task.states}
    device = next(model.parameters()).device
    totals = pack_states(task, {name: torch.zeros(shapes[name]) for name in shapes}, shapes, device)
    # Counted before any forward: the count's all-reduce must not meet another rank's gather.
    missing = _missing_forwards(len(loader), device) if lockstep else 0
    batch = None
    for batch in loader:
        batch = to_device(batch)
        with precision.forward_context():
            states = task.evaluate(model, batch)
        totals += pack_states(task, states, shapes, device)
    _run_uncounted(task, model, batch, precision, missing)
    reduced = unpack_states(task, all_reduce_sum(totals), shapes)
    return {f"{split}/{name}": float(value) for name, value in task.compute(reduced).items()}


def _missing_forwards(batches: int, device: torch.device) -> int:
    """How many fewer batches this rank has than the rank with the most (one all-reduce)."""
    most = torch.tensor(batches, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most) - batches


def _run_uncounted(
    task: Task, model: nn.Module, batch: Any, precision: Precision, times: int
) -> None:
    if times and batch is None:
        raise ConfigError(
            "strategy=fsdp: this rank's shard of the evaluation split is empty, and every rank "
            "must run each forward: use fewer ranks or a larger split"
        )
    for _ in range(times):
        with precision.forward_context():
            task.evaluate(model, batch)


def evaluate_checkpoint(
    cfg: DictConfig,
    run: RunDir,
    env: DistEnv,
    device: torch.device,
    task: Task,
    loaders: Loaders,
    model: Model,
) -> dict[str, Any] | None:
    """mode=eval: the checkpoint's weights (its EMA's with trainer.ema_decay) on eval.split,
    reduced exactly over the ranks, into this run dir (inside the checkpoint's run dir)."""
    split = cfg.eval.split
    loader = loaders.val if split == "val" else loaders.test
    if loader is None:
        raise ConfigError(
            f"eval.split=test: data={cfg.data._target_} has no test split here "
            "(set data.test_fraction, for the data options that have one)"
        )
    path = Path(cfg.checkpoint.resume).expanduser()
    payload = read_checkpoint(path)
    _check_same_experiment(path, payload, redacted_container(cfg))
    evaluated = model.ema.module if model.ema is not None and payload["ema"] else model.module
    check_model_keys(path, payload["ema" if evaluated is not model.module else "model"], evaluated)
    model.strategy.load_weights(
        evaluated, payload["ema" if evaluated is not model.module else "model"]
    )
    precision = instantiate(cfg.precision)(device=device)
    metrics = evaluate(
        task,
        evaluated,
        loader,
        precision,
        lambda batch: to_device(batch, device, cfg.trainer.channels_last),
        split,
        lockstep=model.strategy.shards,
    )
    if not env.is_main:
        return None
    name, direction = resolve_objective(cfg.objective, task.directions())
    summary = {
        "mode": "eval",
        "checkpoint": str(path.resolve()),
        "step": payload["step"],
        "split": split,
        **metrics,
        "world_size": env.world_size,
        "objective": name.replace("val/", f"{split}/", 1),
        "objective_direction": direction,
    }
    run.save_config(redacted_container(cfg))
    run.summary.write_text(json.dumps(summary, indent=2) + "\n")
    values = " ".join(f"{key}={value:.4f}" for key, value in metrics.items())
    log.info(
        "done: evaluated %s (step %d) on %s: %s run_dir=%s",
        path,
        payload["step"],
        split,
        values,
        run.path,
    )
    return summary


def _check_same_experiment(path: Path, payload: dict[str, Any], record: dict[str, Any]) -> None:
    """The task, model and data settings must be the training run's: the keys differing are
    named, with the overrides the run was started with (its .hydra/overrides.yaml)."""
    now = training_settings(record)
    differing = sorted(
        key
        for key in payload["config"].keys() | now.keys()
        if must_match_in_eval(key) and payload["config"].get(key) != now.get(key)
    )
    if not differing:
        return
    shown = "; ".join(
        f"{key}: {payload['config'].get(key, '(absent)')} in the checkpoint, "
        f"{now.get(key, '(absent)')} now"
        for key in differing[:4]
    )
    overrides = next(
        (
            folder / ".hydra" / "overrides.yaml"
            for folder in path.resolve().parents
            if (folder / ".hydra" / "overrides.yaml").exists()
        ),
        None,
    )
    started = (
        f" (the run was started with: {' '.join(OmegaConf.load(overrides))})"
        if overrides is not None
        else ""
    )
    raise CheckpointError(
        f"{path} was trained with other task, model or data settings: "
        f"{shown}. Evaluate with the training command's settings{started}"
    )
