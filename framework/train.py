"""`train` / `python -m framework.train`: compose the config once, start the ranks, wire a run.

config (Hydra) -> environment (DistEnv) -> components (instantiate) -> Runner -> sinks.
`run()` is the only place that wires objects together; each rank calls it with the same
resolved config and run directory.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from framework import data as data_lib
from framework.comm import build_comm
from framework.config import ConfigError, exit_with, validate
from framework.distributed import (
    DistEnv,
    broadcast_object,
    limit_cpu_threads,
    pick_backend,
    pick_device,
    process_group,
    started_by_torchrun,
    wrap_ddp,
)
from framework.metrics import build_sink, setup_logging
from framework.precision import build_precision
from framework.runner import Runner, planned_steps

log = logging.getLogger("framework")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def scaled_lr(optimizer_cfg: Any, global_batch_size: int) -> float:
    """optimizer.lr is meant for reference_batch_size; scale it to the real global batch."""
    ratio = global_batch_size / optimizer_cfg.reference_batch_size
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[optimizer_cfg.lr_scaling]
    return optimizer_cfg.lr * factor


def build_optimizer(optimizer_cfg: Any, params, lr: float) -> torch.optim.Optimizer:
    kwargs = OmegaConf.to_container(optimizer_cfg)
    for key in ("lr_scaling", "reference_batch_size"):  # ours, not the optimizer's
        kwargs.pop(key, None)
    kwargs["lr"] = lr
    return instantiate(kwargs)(params=params)


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
    with process_group(env, backend, cfg.dist.timeout_s, store):
        if env.source == "torchrun" and env.distributed:
            # Every torchrun rank composed its own config; rank 0's is the one that runs.
            cfg, run_dir = broadcast_object((cfg, run_dir))
        setup_logging(env.is_main, env.rank, run_dir)
        if env.is_main:
            OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
        return _train(cfg, run_dir, env, device, backend)


def _train(
    cfg: DictConfig, run_dir: Path, env: DistEnv, device: torch.device, backend: str
) -> dict[str, Any] | None:
    t = cfg.trainer
    global_batch_size = cfg.data.batch_size * env.world_size * t.grad_accum
    log.info(
        "world_size=%d backend=%s device=%s | global batch %d = %d per rank x %d ranks x %d "
        "accumulation steps | run dir %s",
        env.world_size, backend, device.type, global_batch_size, cfg.data.batch_size,
        env.world_size, t.grad_accum, run_dir,
    )  # fmt: skip
    seed_everything(t.seed)  # same seed on every rank: identical initial weights

    log.info("Instantiating data <%s>", cfg.data._target_)
    splits = instantiate(cfg.data)
    train_loader, train_sampler = data_lib.train_loader(splits.train, cfg.data, env, t.seed, device)
    val_loader = data_lib.eval_loader(splits.val, cfg.data, env, device)
    if len(train_loader) < t.grad_accum:
        raise ConfigError(
            f"the training set ({len(splits.train)} samples) is smaller than one global batch "
            f"({global_batch_size}): lower data.batch_size, trainer.grad_accum or "
            "launcher.nproc_per_node"
        )

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
    model = wrap_ddp(module, device, cfg.dist.ddp) if env.distributed else module
    ema = None
    if t.ema_decay is not None:
        ema = AveragedModel(
            module, multi_avg_fn=get_ema_multi_avg_fn(t.ema_decay), use_buffers=True
        )
    seed_everything(t.seed + env.rank)  # per-rank streams from here on (dropout, augmentation)

    precision = build_precision(cfg.precision, device)
    comm = build_comm(cfg.comm, env)
    comm.attach(model, module, grad_scale=precision.loss_scale)

    lr = scaled_lr(cfg.optimizer, global_batch_size)
    log.info("Instantiating optimizer <%s> lr=%g", cfg.optimizer._target_, lr)
    optimizer = build_optimizer(cfg.optimizer, module.parameters(), lr)

    total_steps = planned_steps(t, steps_per_epoch=len(train_loader) // t.grad_accum)
    scheduler = instantiate(cfg.scheduler)(optimizer=optimizer, total_steps=total_steps)

    sink = build_sink(
        env.is_main, cfg.logger, run_dir, OmegaConf.to_container(cfg, enum_to_str=True)
    )
    try:
        runner = Runner(
            env=env, device=device, model=model, module=module, optimizer=optimizer,
            scheduler=scheduler, precision=precision, comm=comm, train_loader=train_loader,
            train_sampler=train_sampler, val_loader=val_loader, sink=sink, trainer_cfg=t,
            global_batch_size=global_batch_size, ema=ema,
        )  # fmt: skip
        summary = runner.fit()
    finally:
        sink.close()
    if env.is_main:
        log.info(
            "done: val/accuracy=%.4f val/loss=%.4f steps=%d samples/s=%.0f wall=%.1fs run_dir=%s",
            summary["val/accuracy"], summary["val/loss"], summary["steps"],
            summary["samples_per_s"], summary["wall_s"], run_dir,
        )  # fmt: skip
        return summary
    return None


def discard_run_files(run_dir: Path) -> None:
    """After a rejected config: remove what this run wrote, and the dir if nothing else is in it."""
    shutil.rmtree(run_dir / ".hydra", ignore_errors=True)
    for name in ("config.yaml", "train.log"):
        (run_dir / name).unlink(missing_ok=True)
    # The run dir, then the dated folders Hydra made for it, while they are empty.
    for folder in (run_dir, *run_dir.parents):
        if not folder.is_dir() or any(folder.iterdir()) or folder == Path.cwd():
            break
        folder.rmdir()


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_app(cfg: DictConfig) -> float | None:
    """Hydra's task function: validated, resolved once, then handed to the launcher."""
    # Imported here: launch imports this module, and workers need no multiprocessing setup.
    from framework.launch import WorkerFailed, launch

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        validate(cfg)
        OmegaConf.resolve(cfg)
        if started_by_torchrun():
            env = DistEnv.from_environ()
            summary = run(cfg, run_dir, env)
        else:
            summary = launch(cfg, run_dir)
    except ConfigError as error:
        discard_run_files(run_dir)
        exit_with(error)
    except WorkerFailed as error:  # the failing rank printed its own traceback
        exit_with(error, code=1)
    return None if summary is None else summary["val/accuracy"]


def main() -> None:
    cleanup_dir = None
    if started_by_torchrun() and os.environ.get("RANK", "0") != "0":
        # Ranks > 0 compose the same config but adopt rank 0's; Hydra gets a throwaway dir.
        cleanup_dir = tempfile.mkdtemp(prefix="framework-rank")
        sys.argv += [f"hydra.run.dir={cleanup_dir}", "hydra.output_subdir=null"]
    try:
        hydra_app()
    finally:
        if cleanup_dir:
            shutil.rmtree(cleanup_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
