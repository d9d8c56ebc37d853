"""The trial: every part of a run built from its settings and one micro-batch of the real data
pushed through the model and the task, before any rank starts. The third home of rules
(docs/architecture.md, "Where a rule goes"): what only the built parts can show, a model
against its data, sizes that do not fit, a constructor's own refusal, is found by running them
once, not by a rule per model, for a project's own components as for the shipped ones.

A part that refuses its settings (a ValueError of its own, torch's negative size, an
optimizer's invalid momentum) is one line naming the option, what it was given and why
(rank/build.py's `settings_refused`); a batch the model or the task cannot take is the task's
one line (its `check`); a training split smaller than one global batch, or an empty validation
split, names the keys that make it. The model is built on the device the ranks use and checked
on a real batch, where a value (a label beyond the classes, a token beyond the vocabulary)
decides; a strategy that shards (strategy=fsdp on several ranks) builds it on the meta device,
as its ranks do, and the batch runs through it there: its shapes are checked, its values by
the ranks' own check.
"""

from __future__ import annotations

import dataclasses

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from framework.components.data import to_device
from framework.components.optim import build_optimizer, freeze, scaled_lr
from framework.components.tasks import Task, first_batch
from framework.components.tasks.base import pick
from framework.config import batch
from framework.config.schemas import TrainerConfig
from framework.core.exits import ConfigError
from framework.core.launch_context import DistEnv
from framework.rank.build import (
    build_data,
    built,
    check_task,
    initial_plan,
    planned_steps,
    preserved_rng,
    refused_if_too_large,
    seed_everything,
    settings_refused,
)


def preflight(cfg: DictConfig, world_size: int, reads_initial_weights: bool = True) -> None:
    """Build every part of `cfg` as rank 0 of `world_size` ranks would, and run one micro-batch
    through the model and the task. Raises ConfigError (one line) for the first part that
    refuses its settings or does not fit. `reads_initial_weights`: False for a resume, whose
    ranks take the weights from its checkpoint, not from init's file."""
    env = DistEnv(world_size=world_size, local_world_size=world_size, source="trial")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with preserved_rng():
        trainer: TrainerConfig = OmegaConf.to_object(cfg.trainer)
        accumulation = batch.grad_accum(trainer, cfg.data.batch_size, world_size)
        trainer = dataclasses.replace(trainer, grad_accum=accumulation)
        global_batch_size = cfg.data.batch_size * world_size * accumulation
        seed_everything(trainer.seed)
        with settings_refused("task", cfg.task):
            task = instantiate(cfg.task)
        splits, loaders = build_data(cfg.data, trainer, env, device, global_batch_size)
        with settings_refused("precision", cfg.precision):
            instantiate(cfg.precision)(device=device)
        with settings_refused("strategy", cfg.strategy):
            strategy = instantiate(cfg.strategy)
        trial_batch = first_batch(splits.train, loaders.train.batch_size, loaders.train.collate_fn)
        check_described_shape(cfg.data, trial_batch)
        with refused_if_too_large(cfg.model, device):
            frozen = cfg.optimizer.freeze
            module, recipe = strategy.build(lambda: freeze(built("model", cfg.model), frozen), env)
            strategy.block_names(module)  # what it shards (or checkpoints) is the model's
            if reads_initial_weights:
                initial_plan(cfg.init, module)  # the weights it starts from fit it
            if recipe is None:
                check_task(task, module.to(device), trial_batch, device)
            else:
                _shapes_fit(task, module, trial_batch)
        if cfg.mode == "train":
            steps = planned_steps(trainer, len(loaders.train) // trainer.grad_accum)
            _optimization(cfg, env, module, scaled_lr(cfg.optimizer, global_batch_size), steps)


# The data's shape keys (schemas.DataConfig), which the models read by interpolation, and what a
# batch of images (N, C, H, W), of features (N, F) or of tokens (N, T) shows of each.
SHOWN_BY_A_BATCH = {
    "in_channels": lambda x: x.shape[1] if x.dim() == 4 else None,
    "image_size": lambda x: x.shape[-1] if x.dim() == 4 and x.shape[-1] == x.shape[-2] else None,
    "num_features": lambda x: x.shape[-1] if x.dim() == 2 and x.is_floating_point() else None,
    "block_size": lambda x: x.shape[-1] if x.dim() == 2 and not x.is_floating_point() else None,
}


def check_described_shape(data: DictConfig, trial_batch: object) -> None:
    """A data option's shape keys describe what it gives, for the models to read: a value
    other than what its batches show changes no sample and builds a model for other data
    (ResNet-50 trained to a loss of 4.8e7 on digits declared 32x32)."""
    inputs = pick(trial_batch, 0, "inputs")
    if not isinstance(inputs, torch.Tensor):
        return
    for key, shown_by in SHOWN_BY_A_BATCH.items():
        declared, shown = data.get(key), shown_by(inputs)
        if declared is not None and shown is not None and declared != shown:
            raise ConfigError(
                f"data.{key}={declared}, but the data's batches have {key} {shown} (inputs "
                f"{list(inputs.shape)}): the key describes the data for the model and changes "
                f"nothing in it: leave data.{key} at {shown}"
            )


def _shapes_fit(task: Task, module: torch.nn.Module, batch: object) -> None:
    """The task's loss on a model built on the meta device, the batch there too (shapes, no
    memory): a shape that does not fit fails as it would in a rank."""
    try:
        task.loss(module.train(), to_device(batch, torch.device("meta")))
    except Exception as error:  # noqa: BLE001 (any failure on the batch is a misfit)
        raise task.failed_on(batch, error, module) from None


def _optimization(
    cfg: DictConfig, env: DistEnv, module: torch.nn.Module, lr: float, steps: int
) -> None:
    """The comm hook, optimizer and schedule, each built from its settings."""
    with settings_refused("comm", cfg.comm):
        instantiate(cfg.comm)(env=env)
    with settings_refused("optimizer", cfg.optimizer):
        # (torch's fused kernels take no meta tensors: a model built there runs unfused)
        meta = any(parameter.is_meta for parameter in module.parameters())
        unfused = {"fused": False} if meta and "fused" in cfg.optimizer else {}
        optimizer = build_optimizer(cfg.optimizer, module, lr, unfused)
    with settings_refused("scheduler", cfg.scheduler):
        instantiate(cfg.scheduler)(optimizer=optimizer, total_steps=steps)
