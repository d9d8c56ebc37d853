"""`train` / `python -m framework.train`: compose the config once, start the ranks, wire a run.

config (Hydra) -> environment (DistEnv) -> components (instantiate) -> Runner -> sinks.
`run()` is the only place that wires objects together; each rank calls it with the same
resolved config and run directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import secrets
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from framework import data as data_lib
from framework.checkpoint import Checkpointer, training_settings, trim_metrics
from framework.comm import build_comm
from framework.config import ConfigError, continues_run, exit_with, validate
from framework.distributed import (
    DistEnv,
    broadcast_object,
    launched_rank,
    limit_cpu_threads,
    pick_backend,
    pick_device,
    process_group,
    started_by_torchrun,
    wrap_ddp,
)
from framework.metrics import build_sink, setup_logging
from framework.plots import plot_run, try_plot
from framework.precision import build_precision
from framework.runner import Runner, planned_steps
from framework.security import check_command_line, hide_command_line_secrets, redacted_container
from framework.stopping import NonFiniteLoss, StepAgreement, StopRequests, StopRun
from framework.sweep import JobFailed
from framework.workers import CONFIG_REJECTED, FAILED, ReportedStop, WorkerFailed, run_worker

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
    # Installed first: a signal during start-up stops the run at its first step.
    requests = StopRequests(list(cfg.trainer.stop_signals)).install()
    try:
        with process_group(env, backend, cfg.dist.timeout_s, store):
            if env.source in ("torchrun", "slurm") and env.distributed:
                # Every torchrun rank / SLURM task composed its own config; rank 0's runs.
                cfg, run_dir = broadcast_object((cfg, run_dir))
            setup_logging(env.is_main, env.rank, run_dir)
            return _train(cfg, run_dir, env, device, backend, requests)
    except StopRun as stop:
        if env.is_main:
            log.warning("%s. %s", stop, resume_hint(cfg, run_dir))
        raise
    except NonFiniteLoss as error:
        if env.is_main:
            log.error("%s", error)
        raise
    finally:
        requests.uninstall()


def resume_hint(cfg: DictConfig, run_dir: Path) -> str:
    if cfg.launcher.name == "slurm":
        return "SLURM requeues the job if it was preempted or timed out; it then resumes here"
    record = run_dir / ".hydra" / "hydra.yaml"  # rank 0's record of the job: run or sweep
    if record.exists() and OmegaConf.load(record).hydra.mode == "MULTIRUN":
        # The job dir is <sweep dir>/<job number>; running the sweep again resumes every job.
        return f"To continue, run the same command with hydra.sweep.dir={run_dir.parent}"
    return f"To continue, run the same command with hydra.run.dir={run_dir}"


def _train(
    cfg: DictConfig,
    run_dir: Path,
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
    if t.channels_last:
        module = module.to(memory_format=torch.channels_last)
    model = wrap_ddp(module, device, cfg.dist.ddp) if env.distributed else module
    ema = None
    if t.ema_decay is not None:
        ema = AveragedModel(
            module, multi_avg_fn=get_ema_multi_avg_fn(t.ema_decay), use_buffers=True
        )
    seed_everything(t.seed + env.rank)  # per-rank streams from here on (dropout, augmentation)

    precision = build_precision(cfg.precision, device)
    comm = build_comm(cfg.comm, env)
    comm.guard_nonfinite = t.on_nonfinite == "skip"
    comm.attach(model, module, grad_scale=precision.loss_scale)
    if t.compile:
        # The DDP wrapper (hooks attached) is compiled; checkpoints keep the bare module's keys.
        model = torch.compile(model)

    lr = scaled_lr(cfg.optimizer, global_batch_size)
    log.info("Instantiating optimizer <%s> lr=%g", cfg.optimizer._target_, lr)
    optimizer = build_optimizer(cfg.optimizer, module.parameters(), lr)

    total_steps = planned_steps(t, steps_per_epoch=len(train_loader) // t.grad_accum)
    scheduler = instantiate(cfg.scheduler)(optimizer=optimizer, total_steps=total_steps)

    # Redacted once: config.yaml, W&B and the checkpoints never carry a secret (and a rotated
    # key still resumes).
    record = redacted_container(cfg)
    checkpointer = Checkpointer(cfg.checkpoint, run_dir, env, training_settings(record))
    resumed = checkpointer.find_resume()
    if resumed and resumed[1]["step"] >= total_steps and (run_dir / "summary.json").exists():
        log.info(
            "%s is complete at step %d (the planned %d steps): nothing to do; raise "
            "trainer.max_steps or trainer.max_epochs to train further", run_dir,
            resumed[1]["step"], total_steps,
        )  # fmt: skip
        return _read_summary(run_dir) if env.is_main else None
    if env.is_main:  # written once the run is accepted: a refused resume changes nothing
        OmegaConf.save(OmegaConf.create(record), run_dir / "config.yaml")
    if env.is_main and (run_dir / "metrics.jsonl").exists():
        # A resume, or a restart (torchrun, SLURM requeue) that found no checkpoint: from 0.
        kept_step = resumed[1]["step"] if resumed else 0
        dropped = trim_metrics(run_dir / "metrics.jsonl", kept_step)
        if dropped:
            log.info("metrics.jsonl: %d events after step %d dropped; they are re-run",
                     dropped, kept_step)  # fmt: skip
    checkpointer.wandb_run_id = (resumed and resumed[1]["wandb_run_id"]) or new_wandb_id()

    sink = build_sink(
        env.is_main, cfg.logger, run_dir, record,
        run_id=checkpointer.wandb_run_id,
    )  # fmt: skip
    try:
        runner = Runner(
            env=env, device=device, model=model, module=module, optimizer=optimizer,
            scheduler=scheduler, precision=precision, comm=comm, train_loader=train_loader,
            train_sampler=train_sampler, val_loader=val_loader, sink=sink, trainer_cfg=t,
            global_batch_size=global_batch_size, agreement=StepAgreement(env, device, requests),
            checkpointer=checkpointer, ema=ema,
        )  # fmt: skip
        if resumed:
            path, payload = resumed
            runner.load_checkpoint(path, payload)
            log.info("resumed from %s at step %d (epoch %d)", path, runner.state.step,
                     runner.state.epoch)  # fmt: skip
        summary = runner.fit()
    finally:
        sink.close()
    if env.is_main:
        try_plot(plot_run, run_dir)
        log.info(
            "done: val/accuracy=%.4f val/loss=%.4f steps=%d samples/s=%.0f wall=%.1fs run_dir=%s",
            summary["val/accuracy"], summary["val/loss"], summary["steps"],
            summary["samples_per_s"], summary["wall_s"], run_dir,
        )  # fmt: skip
        return summary
    return None


def new_wandb_id() -> str:
    """W&B run ids are short lowercase alphanumerics; saved in checkpoints for resume."""
    return secrets.token_hex(4)


def _read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def discard_run_files(run_dir: Path, sweep_job: bool = False) -> None:
    """After a rejected config: remove what this run wrote, and the dir if nothing else is in it.
    A run dir that holds an earlier run (a refused resume) keeps everything; a sweep's dir and
    its parents stay (the sweep's other jobs and summary go there)."""
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        return
    shutil.rmtree(run_dir / ".hydra", ignore_errors=True)
    for name in ("config.yaml", "train.log"):
        (run_dir / name).unlink(missing_ok=True)
    # The run dir, then the dated folders Hydra made for it, while they are empty.
    for folder in (run_dir,) if sweep_job else (run_dir, *run_dir.parents):
        with contextlib.suppress(OSError):  # another process may have removed or filled it
            if not folder.is_dir() or any(folder.iterdir()) or folder == Path.cwd():
                break
            folder.rmdir()


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
THROWAWAY_PREFIX = "framework-rank"  # the temporary Hydra dir of torchrun ranks > 0


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_app(cfg: DictConfig) -> float | None:
    """Hydra's task function: validated, resolved once, then handed to the launcher."""
    # Imported here: launch imports this module, and workers need no multiprocessing setup.
    from framework.launch import launch

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    sweep_job = hydra_cfg.mode == RunMode.MULTIRUN
    if launched_rank() != 0 and "SUBMITIT_EXECUTOR" in os.environ:
        return _run_submitit_follower(cfg, run_dir)
    try:
        validate(cfg)
        if sweep_job:
            join_sweep(cfg, run_dir, hydra_cfg)
        OmegaConf.resolve(cfg)
        if started_by_torchrun() and "SUBMITIT_EXECUTOR" not in os.environ:
            summary = _run_torchrun_rank(cfg, run_dir)
        else:
            summary = launch(cfg, run_dir)
    except ConfigError as error:
        discard_run_files(run_dir, sweep_job)
        _end_job(error, CONFIG_REJECTED, sweep_job)
    except (StopRun, ReportedStop) as stop:  # rank 0 said where the checkpoint is
        raise SystemExit(stop.exit_code) from None  # a stop (Ctrl-C) ends a whole sweep too
    except NonFiniteLoss as error:  # rank 0 said where it happened
        _end_job(error, FAILED, sweep_job, printed=True)
    except WorkerFailed as error:
        _end_job(error, FAILED, sweep_job)
    return None if summary is None else summary[cfg.objective]


def _run_submitit_follower(cfg: DictConfig, run_dir: Path) -> None:
    """Rank > 0 of a submitit job: it runs rank 0's config (broadcast at the start) and writes
    nothing, so it neither judges the sweep dir nor discards files; a config it rejects ends
    it quietly (rank 0 rejects the same config and reports it)."""
    from framework.launch import launch

    try:
        validate(cfg)
        OmegaConf.resolve(cfg)
        launch(cfg, run_dir)
    except ConfigError:
        raise SystemExit(CONFIG_REJECTED) from None


def _end_job(error: Exception, code: int, sweep_job: bool, printed: bool = False) -> NoReturn:
    """A run ends with a message and an exit code; a sweep job with JobFailed, which Hydra
    records before it goes on with the next job (the summary shows the message)."""
    if sweep_job:
        detail = getattr(error, "detail", None)  # what the failing rank said
        raise JobFailed(f"{error}: {detail}" if detail else str(error)) from None
    if printed:
        raise SystemExit(code) from None
    exit_with(error, code)
    raise AssertionError("unreachable")


def join_sweep(cfg: DictConfig, run_dir: Path, hydra_cfg: DictConfig) -> None:
    """A job of a sweep: its dir is only reused to resume it (a sweep run again with the same
    hydra.sweep.dir resumes every job), and its W&B run joins the sweep's group."""
    holds_run = any((run_dir / name).exists() for name in ("metrics.jsonl", "summary.json"))
    if holds_run and not continues_run(run_dir, cfg):
        raise ConfigError(
            f"{run_dir} already holds a run with no checkpoint to continue from (or "
            "checkpoint.resume=never); it is left untouched. Choose a new hydra.sweep.dir"
        )
    if cfg.logger.name == "wandb":
        job = hydra_cfg.job
        cfg.logger.group = cfg.logger.group or str(hydra_cfg.sweep.dir)
        cfg.logger.run_name = cfg.logger.run_name or f"{job.num}-{job.override_dirname}"[:128]


def _run_torchrun_rank(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """A rank started by an external torchrun: exit codes as for our own launchers."""
    if run_dir.name.startswith(THROWAWAY_PREFIX):
        # Rank > 0: Hydra needed a dir; this rank adopts rank 0's. Gone now, so a rank that is
        # killed later leaves nothing behind.
        shutil.rmtree(run_dir, ignore_errors=True)
    try:
        return run_worker(cfg, run_dir, DistEnv.from_environ())
    except SystemExit as exit_:
        if exit_.code == CONFIG_REJECTED:
            discard_run_files(run_dir)
        raise


def main() -> None:
    # Hydra instantiates its own node (callbacks, launcher, sweeper, logging factories) before
    # any callback of ours can look at it: check the command line before Hydra starts.
    try:
        check_command_line(sys.argv[1:])
    except ConfigError as error:
        if os.environ.get("RANK", "0") != "0":  # under torchrun rank 0 says it once
            raise SystemExit(2) from None
        exit_with(error)
    # Secrets typed as overrides move to environment variables: Hydra's records, its console
    # log and W&B's copy of argv then hold ${oc.env:NAME}, never the value.
    sys.argv[1:] = hide_command_line_secrets(sys.argv[1:], os.environ)
    cleanup_dir = None
    if started_by_torchrun() and os.environ.get("RANK", "0") != "0":
        # Ranks > 0 compose the same config but adopt rank 0's; Hydra gets a throwaway dir, and
        # no record of the job is written.
        cleanup_dir = tempfile.mkdtemp(prefix=THROWAWAY_PREFIX)
        sys.argv += [f"hydra.run.dir={cleanup_dir}", "hydra.callbacks.validate.output_subdir=null"]
    try:
        hydra_app()
    finally:
        if cleanup_dir:
            shutil.rmtree(cleanup_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
