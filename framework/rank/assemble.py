"""What one rank does: the one place that wires objects together.

config -> process group -> components (instantiated from their groups) -> Runner -> sinks.
Every launcher calls `run()` on every rank with the same resolved config and run directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

# Imported with this module, before any process group exists. DDP's constructor imports it
# anyway; imported there, after gloo's threads had started, it made successful ranks abort at
# exit ("terminate called without an active exception") in 3 of ~100 runs (torch 2.13).
import torch._dynamo  # noqa: F401
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from framework.components.data import Loaders, Splits, build_loaders, load_splits, to_device
from framework.components.ema import EMA
from framework.components.loggers import build_sink, setup_logging
from framework.components.optim import build_optimizer, scaled_lr
from framework.components.precision import Precision
from framework.components.tasks import Task, first_batch
from framework.components.utilization import UtilizationMeter, device_peak_tflops, micro_batch_flops
from framework.config.redaction import redacted_container
from framework.config.resume_rules import training_settings
from framework.config.validation import resolve_monitor, resolve_objective, sharded_checkpoints
from framework.core import startup_clock
from framework.core.distributed import (
    broadcast_object,
    host_group,
    limit_cpu_threads,
    pick_backend,
    pick_device,
    process_group,
)
from framework.core.exits import ConfigError, NonFiniteLoss, Stopped
from framework.core.launch_context import DistEnv
from framework.rank.evaluation import evaluate_checkpoint
from framework.rank.loop import Outputs, Runner, planned_steps
from framework.rank.model_selection import ModelSelection
from framework.rank.plots import plot_run, save_image_grid, try_plot
from framework.rank.state import Model, Optimization
from framework.rank.stopping import SignalExchange, StopRequests
from framework.storage.checkpoint import Checkpointer, restore_rng, rng_state
from framework.storage.run_dir import RunDir

log = logging.getLogger("framework")


def run(cfg: DictConfig, run_dir: Path, env: DistEnv, store=None) -> dict[str, Any] | None:
    """Train on this rank. Returns the summary on rank 0, None elsewhere."""
    device = pick_device(env)
    limit_cpu_threads(env)
    backend = pick_backend(cfg.dist.backend, device)
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            "dist.backend=nccl needs CUDA devices and none is visible: use dist.backend=auto "
            "(gloo on CPU) or dist.backend=gloo"
        )
    # Installed first: a signal during start-up stops the run at its first step.
    requests = StopRequests(list(cfg.trainer.stop_signals)).install()
    try:
        with process_group(env, backend, cfg.dist.timeout_s, store):
            startup_clock.mark("process group")
            if env.composed_own_config and env.distributed:
                cfg, run_dir = broadcast_object((cfg, run_dir))  # rank 0's config runs
            setup_logging(env.is_main, env.rank, RunDir(run_dir).log)
            return _train(cfg, RunDir(run_dir), env, device, backend, requests)
    except Stopped as stop:
        if env.is_main:
            log.warning("%s. %s", stop, RunDir(run_dir).resume_hint(cfg))
        raise
    except NonFiniteLoss as error:
        if env.is_main:
            log.error("%s", error)
        raise
    finally:
        requests.uninstall()


def _train(
    cfg: DictConfig,
    run: RunDir,
    env: DistEnv,
    device: torch.device,
    backend: str,
    requests: StopRequests,
) -> dict[str, Any] | None:
    t = cfg.trainer
    global_batch_size = cfg.data.batch_size * env.world_size * t.grad_accum
    log.info(
        "world_size=%d backend=%s device=%s | global batch %d = %d per rank x %d ranks x %d "
        "accumulation steps | run dir %s",
        env.world_size,
        backend,
        device.type,
        global_batch_size,
        cfg.data.batch_size,
        env.world_size,
        t.grad_accum,
        run.path,
    )
    seed_everything(t.seed)  # same seed on every rank: identical initial weights
    log.info("Instantiating task <%s>", cfg.task._target_)
    task = instantiate(cfg.task)
    splits, loaders = build_data(cfg, env, device, global_batch_size)
    startup_clock.mark("data")
    total_steps = planned_steps(t, steps_per_epoch=len(loaders.train) // t.grad_accum)
    log.info("Instantiating precision <%s>", cfg.precision._target_)
    precision = instantiate(cfg.precision)(device=device)
    model = build_model(cfg, env, device, precision.param_dtype)
    # Read once: the pre-flight check and the FLOPs count run on the same first batch.
    train_batch = first_batch(splits.train, loaders.train.batch_size, loaders.train.collate_fn)
    check_task(task, model.module, train_batch, device)
    startup_clock.mark("model")
    if cfg.mode == "eval":
        return evaluate_checkpoint(cfg, run, env, device, task, loaders, model)
    seed_everything(t.seed + env.rank)  # per-rank streams from here on (dropout, augmentation)
    optimization = build_optimization(cfg, env, model, precision, global_batch_size, total_steps)
    if t.compile:
        # After the comm hook is registered on the DDP wrapper, which is what gets compiled;
        # checkpoints keep the bare module's keys.
        model = dataclasses.replace(model, train=torch.compile(model.train))

    # Redacted once: config.yaml, W&B and the checkpoints never carry a secret (and a rotated
    # key still resumes).
    record = redacted_container(cfg)
    checkpointer = Checkpointer(
        cfg.checkpoint, run.checkpoints, env, training_settings(record), sharded_checkpoints(cfg)
    )
    resumed = checkpointer.find_resume()
    if resumed and is_complete(resumed[1], total_steps) and run.summary.exists():
        log.info(
            "%s is complete at step %d (%s): nothing to do; raise trainer.max_steps or "
            "trainer.max_epochs to train further",
            run.path,
            resumed[1]["step"],
            resumed[1]["trainer"].get("stopped_early") or f"the planned {total_steps} steps",
        )
        return run.read_summary() if env.is_main else None
    if env.is_main:
        accept_run(run, record, kept_step=resumed[1]["step"] if resumed else 0)
    sink = build_sink(
        env.is_main,
        cfg.logger,
        run,
        record,
        resume_ids=resumed[1]["logger_ids"] if resumed else {},
        resume_step=resumed[1]["step"] if resumed else 0,
    )
    checkpointer.logger_ids = sink.run_ids
    try:
        trainer = SimpleNamespace(**OmegaConf.to_container(t))
        meter = build_meter(cfg, env, device, task, train_batch, precision.name)
        runner = Runner(
            env=env,
            device=device,
            trainer=trainer,
            task=task,
            model=model,
            optimization=optimization,
            loaders=loaders,
            outputs=Outputs(sink, checkpointer, profile_dir=run.path / "profile"),
            selection=ModelSelection.build(
                resolve_monitor(cfg.objective, task.directions()),
                keep_best=cfg.checkpoint.best,
                early_stopping=trainer.early_stopping,
            ),
            # Stop signals travel on a CPU (gloo) group, also when training uses NCCL.
            signals=SignalExchange(env, requests, host_group(env, backend)),
            meter=meter,
        )
        if resumed:
            path, payload = resumed
            runner.load_checkpoint(path, payload)
            log.info(
                "resumed from %s at step %d (epoch %d)", path, runner.state.step, runner.state.epoch
            )
        startup_clock.mark("setup")
        summary = runner.fit()
        objective, direction = resolve_objective(cfg.objective, task.directions())
        summary.update(objective=objective, objective_direction=direction)
        sink.summary(summary)
        # A sharded model's forward is a collective: every rank makes them, rank 0 writes.
        if env.is_main or model.strategy.shards:
            model.strategy.gather_around(model.evaluated, task.model_methods)
            made = write_artifacts(
                task, model.evaluated, splits, loaders, device, run, write=env.is_main
            )
        if env.is_main:
            try_plot(plot_run, run.path)
            sink.add_files([*made, run.curves] if run.curves.exists() else made)
    finally:
        checkpointer.close()
        sink.close()
    if not env.is_main:
        return None
    log.info("done: %s", final_line(summary, task, run))
    return summary


def is_complete(payload: dict[str, Any], total_steps: int) -> bool:
    """A checkpoint at the planned last step, or of a run that early stopping ended."""
    return payload["step"] >= total_steps or bool(payload["trainer"].get("stopped_early"))


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


def accept_run(run: RunDir, record: dict[str, Any], kept_step: int) -> None:
    """The run goes ahead in this dir (a refused resume has changed nothing before this)."""
    run.save_config(record)
    # A resume, or a restart (torchrun, SLURM requeue) that found no checkpoint: from 0.
    dropped = run.trim_metrics(kept_step)
    if dropped:
        log.info(
            "metrics.jsonl: %d events after step %d dropped; they are re-run", dropped, kept_step
        )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_data(
    cfg: DictConfig, env: DistEnv, device: torch.device, global_batch_size: int
) -> tuple[Splits, Loaders]:
    log.info("Instantiating data <%s>", cfg.data._target_)
    splits = load_splits(cfg.data)  # the loaders' collate_fn is built below
    collate_node = cfg.data.get("collate_fn")
    collate_fn = instantiate(collate_node) if collate_node is not None else None
    if len(splits.val) == 0:  # evaluation would fail at its first batch, after training
        raise ConfigError(
            f"data: the validation split of {cfg.data._target_} is empty: give it samples "
            "(data.val_size, data.val_fraction or your loader's own split)"
        )
    loaders = build_loaders(splits, cfg.data, env, cfg.trainer.seed, device, collate_fn)
    if len(loaders.train) < cfg.trainer.grad_accum:
        raise ConfigError(
            f"the training set ({len(splits.train)} samples) is smaller than one global batch "
            f"({global_batch_size}): lower data.batch_size, trainer.grad_accum or "
            "launcher.nproc_per_node"
        )
    return splits, loaders


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Whatever runs inside draws nothing from the streams training uses."""
    state = rng_state()
    try:
        yield
    finally:
        restore_rng(state)


@torch.no_grad()
def check_task(task: Task, module: torch.nn.Module, batch: Any, device: torch.device) -> None:
    """The task on a real training batch, before anything is written: a task that cannot read
    the data, or a model whose outputs do not fit it, is a ConfigError naming the fix (every
    rank sees the same batch and raises alike). Eval mode and saved RNG: training is unchanged."""
    module.eval()
    with preserved_rng():
        task.check(module, to_device(batch, device))
    module.train()


def build_meter(
    cfg: DictConfig,
    env: DistEnv,
    device: torch.device,
    task: Task,
    batch: Any,
    precision: str,
) -> UtilizationMeter:
    """The logged hardware metrics: the FLOPs of one optimizer step of the whole job
    (trainer.count_flops) and one device's peak for MFU (trainer.peak_tflops or the table)."""
    t = cfg.trainer
    step_flops = step_flops_of(cfg, env, device, task, batch) if t.count_flops else None
    peak = device_peak_tflops(t.peak_tflops, device, precision)
    return UtilizationMeter(step_flops, peak, device, env.rank, env.world_size)


def step_flops_of(
    cfg: DictConfig,
    env: DistEnv,
    device: torch.device,
    task: Task,
    batch: Any,
) -> int | None:
    """One micro-batch's FLOPs (forward + backward, on the first training batch and a fresh copy
    of the model: the trained model, the optimizer and the RNG streams stay as they were) x
    micro-batches per step x ranks."""
    with preserved_rng():
        flops, where = micro_batch_flops(
            task,
            lambda: instantiate(cfg.model),
            batch,
            device,
            lambda batch, to: to_device(batch, to, False),
        )
    if flops is None:
        return None
    step_flops = flops * cfg.trainer.grad_accum * env.world_size
    log.info(
        "model FLOPs per optimizer step: %.4g = %.4g per micro-batch of %d x %d micro-batches x "
        "%d ranks (forward + backward, counted on %s)",
        step_flops,
        flops,
        cfg.data.batch_size,
        cfg.trainer.grad_accum,
        env.world_size,
        where,
    )
    return step_flops


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


def build_model(
    cfg: DictConfig, env: DistEnv, device: torch.device, param_dtype: torch.dtype | None = None
) -> Model:
    """The model on the device, what forward runs on (DDP-wrapped or sharded by
    strategy=<option>), and its EMA. `param_dtype`: what FSDP gathers parameters in."""
    t = cfg.trainer
    log.info("Instantiating model <%s>", cfg.model._target_)
    module = instantiate(cfg.model)
    if t.sync_batchnorm and env.distributed:
        if device.type != "cuda":
            raise ConfigError(
                "trainer.sync_batchnorm=true needs CUDA devices (torch's SyncBatchNorm is "
                "GPU-only): set trainer.sync_batchnorm=false on CPU"
            )
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    module = module.to(device)
    if t.channels_last:
        module = module.to(memory_format=torch.channels_last)
    ema = EMA(module, t.ema_decay) if t.ema_decay is not None else None
    log.info("Instantiating strategy <%s>", cfg.strategy._target_)
    strategy = instantiate(cfg.strategy)
    train = strategy.wrap(
        module, ema and ema.module, env, device, cfg.dist.ddp, param_dtype=param_dtype
    )
    return Model(train, module, ema, strategy)


def build_optimization(
    cfg: DictConfig,
    env: DistEnv,
    model: Model,
    precision: Precision,
    global_batch_size: int,
    total_steps: int,
) -> Optimization:
    """The DDP comm hook (registered on the model), optimizer and schedule, with precision."""
    comm = instantiate(cfg.comm)(env=env)
    comm.guard_nonfinite = cfg.trainer.on_nonfinite == "skip"
    comm.attach(model.train, model.module, grad_scale=precision.loss_scale)
    lr = scaled_lr(cfg.optimizer, global_batch_size)
    log.info("Instantiating optimizer <%s> lr=%g", cfg.optimizer._target_, lr)
    overrides = model.strategy.optimizer_overrides(cfg.optimizer)
    optimizer = build_optimizer(cfg.optimizer, model.module, lr, overrides)
    scheduler = instantiate(cfg.scheduler)(optimizer=optimizer, total_steps=total_steps)
    return Optimization(optimizer, scheduler, precision, comm)
