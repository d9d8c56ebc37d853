"""mode=eval: a checkpoint's weights on one split, without training, into a run dir of its own
inside the checkpoint's run dir; refused when the task, model or data differ from training's."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from framework.components.data import to_device
from framework.components.loggers import release_held_console
from framework.config.resume_rules import changed_settings, must_match_in_eval, training_settings
from framework.config.validation import resolve_objective
from framework.core.exits import CheckpointError, ConfigError
from framework.core.launch_context import DistEnv
from framework.rank.build import Parts
from framework.rank.evaluation import evaluate
from framework.storage.checkpoint import check_model_keys
from framework.storage.checkpoint import read as read_checkpoint
from framework.storage.run_dir import RunDir

log = logging.getLogger("framework")


@dataclass(frozen=True)
class EvalRequest:
    """mode=eval's settings."""

    split: str  # eval.split
    checkpoint: Path  # checkpoint.resume, or init.path (the weights evaluated)
    record: dict[str, Any]  # the resolved, redacted config (redaction.redacted_container)
    objective: str | None
    data_target: str  # data._target_, named when it has no test split


def evaluate_checkpoint(
    parts: Parts, request: EvalRequest, run: RunDir, env: DistEnv
) -> dict[str, Any] | None:
    """mode=eval: the checkpoint's weights (its EMA's with trainer.ema_decay) on eval.split,
    reduced exactly over the ranks, into this run dir (inside the checkpoint's run dir)."""
    path, model = request.checkpoint, parts.model
    loader = _loader(parts, request)
    payload = read_checkpoint(path)
    _check_same_experiment(path, payload, request.record)
    weights = "ema" if model.ema is not None and payload["ema"] else "model"
    evaluated = model.ema.module if weights == "ema" else model.module
    check_model_keys(path, payload[weights], evaluated)
    model.strategy.load_weights(evaluated, payload[weights])
    return _evaluated(parts, request, evaluated, loader, payload["step"], run, env)


def evaluate_initial_weights(
    parts: Parts, request: EvalRequest, run: RunDir, env: DistEnv
) -> dict[str, Any] | None:
    """mode=eval init=file: the file's weights (loaded as training would start from them) on
    eval.split, without a training run."""
    return _evaluated(parts, request, parts.model.module, _loader(parts, request), 0, run, env)


def _loader(parts: Parts, request: EvalRequest) -> Any:
    loader = parts.loaders.val if request.split == "val" else parts.loaders.test
    if loader is None:
        raise ConfigError(
            f"eval.split=test: data={request.data_target} has no test split here "
            "(set data.test_fraction, for the data options that have one)"
        )
    return loader


def _evaluated(
    parts: Parts,
    request: EvalRequest,
    evaluated: Any,
    loader: Any,
    step: int,
    run: RunDir,
    env: DistEnv,
) -> dict[str, Any] | None:
    release_held_console()  # the weights fit: nothing is left to refuse the evaluation
    metrics = evaluate(
        parts.task,
        evaluated,
        loader,
        parts.precision,
        lambda batch: to_device(batch, parts.device, parts.trainer.channels_last),
        request.split,
        lockstep=parts.model.strategy.shards,
    )
    if not env.is_main:
        return None
    return _write_summary(request, parts, metrics, step, run, env)


def _write_summary(
    request: EvalRequest,
    parts: Parts,
    metrics: dict[str, float],
    step: int,
    run: RunDir,
    env: DistEnv,
) -> dict[str, Any]:
    split, path = request.split, request.checkpoint
    name, direction = resolve_objective(request.objective, parts.task.directions())
    summary = {
        "mode": "eval",
        "checkpoint": str(path.resolve()),
        "step": step,
        "split": split,
        **metrics,
        "world_size": env.world_size,
        "objective": name.replace("val/", f"{split}/", 1),
        "objective_direction": direction,
    }
    run.save_config(request.record)
    run.summary.write_text(json.dumps(summary, indent=2) + "\n")
    values = " ".join(f"{key}={value:.4f}" for key, value in metrics.items())
    log.info(
        "done: evaluated %s (step %d) on %s: %s run_dir=%s",
        path,
        step,
        split,
        values,
        run.path,
    )
    return summary


def _check_same_experiment(path: Path, payload: dict[str, Any], record: dict[str, Any]) -> None:
    """The task, model and data settings must be the training run's: the keys differing are
    named, with the overrides the run was started with (its .hydra/overrides.yaml)."""
    now = training_settings(record)
    differing = [key for key in changed_settings(payload["config"], now) if must_match_in_eval(key)]
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
        f"{shown}. Evaluate with the training command's settings{started}: `train mode=eval "
        f"checkpoint.resume={path}` takes them from the run's record"
    )
