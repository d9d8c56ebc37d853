"""One rank, start to end: every start path enters here (framework/launch/rank_entry.py) with
the same resolved config and run dir.

process group -> build (build.py) -> train: open the run, then fit it (loop.py); or, mode=eval,
evaluate (eval_mode.py) -> finish (finish.py). This module reads the whole config; what it builds
gets its own section.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from framework.components.data import epoch_coverage
from framework.components.initial_weights import LoadPlan
from framework.components.loggers import (
    build_sink,
    drop_held_console,
    release_held_console,
    release_held_log,
    setup_logging,
)
from framework.config import batch
from framework.config.redaction import redacted_container
from framework.config.registry import shipped_targets
from framework.config.resume_rules import changed_settings, training_settings
from framework.config.schemas import CheckpointConfig
from framework.config.validation import NCCL_WITHOUT_GPU, sharded_checkpoints
from framework.core import startup_clock
from framework.core.allowlist import check_targets
from framework.core.distributed import (
    broadcast_object,
    limit_cpu_threads,
    pick_backend,
    pick_device,
    process_group,
)
from framework.core.exits import ConfigError, NonFiniteLoss, Rejected, Stopped
from framework.core.launch_context import DistEnv
from framework.rank.build import (
    Parts,
    build_optimization,
    build_parts,
    build_training,
    compiled,
    load_initial_weights,
    seed_everything,
    step_limit,
)
from framework.rank.eval_mode import EvalRequest, evaluate_checkpoint, evaluate_initial_weights
from framework.rank.finish import final_line, finish
from framework.rank.loop import Outputs, Runner
from framework.rank.state import Optimization
from framework.rank.stopping import StopRequests
from framework.storage.checkpoint import Checkpointer
from framework.storage.run_dir import RunDir
from framework.storage.weights_file import file_record

log = logging.getLogger("framework")


def rank_main(cfg: DictConfig, run_dir: Path, env: DistEnv, store=None) -> dict[str, Any] | None:
    """Train (or, mode=eval, evaluate) on this rank. Returns the summary on rank 0, None
    elsewhere."""
    device = pick_device(env)
    limit_cpu_threads(env)
    backend = pick_backend(cfg.dist.backend, device)
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(NCCL_WITHOUT_GPU)
    # Installed first: a signal during start-up stops the run at its first step.
    requests = StopRequests(list(cfg.trainer.stop_signals)).install()
    try:
        with process_group(env, backend, cfg.dist.timeout_s, store):
            startup_clock.mark("process group")
            if env.composed_own_config and env.distributed:
                cfg, run_dir = broadcast_object((cfg, run_dir))  # rank 0's config runs
            run = RunDir(run_dir)
            setup_logging(env.is_main, env.rank, run.log)
            # The command judged each target from its source; what is built here is the
            # imported object, judged again before anything is instantiated.
            check_targets(cfg, shipped_targets(), by_import=True)
            log_layout(cfg, env, device, backend, run)
            return build_and_run(cfg, run, env, device, backend, requests)
    except Rejected:
        drop_held_console()  # its one line is all a refused start prints
        raise
    except Stopped as stop:
        if env.is_main:
            log.warning("%s. %s", stop, stop_hint(cfg, run_dir, env))
        raise
    except NonFiniteLoss as error:
        if env.is_main:
            log.error("%s", error)
        raise
    finally:
        release_held_console()
        requests.uninstall()


def build_and_run(
    cfg: DictConfig,
    run: RunDir,
    env: DistEnv,
    device: torch.device,
    backend: str,
    requests: StopRequests,
) -> dict[str, Any] | None:
    """Build the parts and train (or evaluate). What only this frame holds is freed as it
    returns, while the process group still exists: DDP's reducer freed after
    destroy_process_group drops the group's last reference and destroys it holding the GIL,
    while gloo's thread waits for the GIL to drop the tensors of its last work: a two-rank
    `mode=eval` command would hang at its end, its work done. Training's
    DDP sits in reference cycles, which no collection frees once the group is gone
    (core/distributed.py, process_group); a collection here would also shut down persistent
    DataLoader workers (15 s: three joins)."""
    parts = build_parts(cfg, env, device)
    if cfg.mode == "eval" and (initial := load_initial_weights(cfg.init, parts.model)):
        return evaluate_initial_weights(parts, eval_request(cfg, initial.source.path), run, env)
    if cfg.mode == "eval":
        return evaluate_checkpoint(parts, eval_request(cfg), run, env)
    return train(cfg, parts, run, env, backend, requests)


def stop_hint(cfg: DictConfig, run_dir: Path, env: DistEnv) -> str:
    """What comes after a stop. A worker of torch's elastic agent is also stopped this way when
    a node joins or leaves (or a peer failed and restarts are left): the agent then restarts
    the ranks itself, and this rank cannot tell that from a stop of the whole job."""
    hint = RunDir(run_dir).resume_hint(cfg)
    if env.source not in ("elastic", "torchrun"):
        return hint
    return (
        "When a node joins or leaves, torchrun's elastic agent stops the ranks this way and "
        "the agent restarts them by itself from this checkpoint: the job goes on. If the whole "
        f"job was stopped instead: {hint[0].lower()}{hint[1:]}"
    )


def log_layout(
    cfg: DictConfig, env: DistEnv, device: torch.device, backend: str, run: RunDir
) -> None:
    per_rank = cfg.data.batch_size
    accumulation = batch.grad_accum(cfg.trainer, per_rank, env.world_size)
    log.info(
        "world_size=%d backend=%s device=%s | global batch %d = %d per rank x %d ranks x %d "
        "accumulation steps | run dir %s",
        env.world_size,
        backend,
        device.type,
        per_rank * env.world_size * accumulation,
        per_rank,
        env.world_size,
        accumulation,
        run.path,
    )


def eval_request(cfg: DictConfig, weights: Path | None = None) -> EvalRequest:
    """mode=eval's settings; `weights`: the file evaluated, else checkpoint.resume."""
    return EvalRequest(
        split=cfg.eval.split,
        checkpoint=weights or Path(cfg.checkpoint.resume).expanduser(),
        record=redacted_container(cfg),
        objective=cfg.objective,
        data_target=cfg.data._target_,
    )


@dataclasses.dataclass(frozen=True)
class OpenedRun:
    """A training run opened in its run dir: what fitting it starts from."""

    parts: Parts  # the model compiled where trainer.compile asks
    optimization: Optimization  # its comm hook is registered before DDP is compiled
    outputs: Outputs  # open sinks and the Checkpointer, closed once fitting ends either way
    resumed: tuple[Path, dict[str, Any]] | None  # the checkpoint to resume and what it holds


def train(
    cfg: DictConfig,
    parts: Parts,
    run: RunDir,
    env: DistEnv,
    backend: str,
    requests: StopRequests,
) -> dict[str, Any] | None:
    """Train from scratch or from the checkpoint to resume, then finish; a run that is
    already complete is left as it is."""
    opened = open_run(cfg, parts, run, env)
    if opened is None:  # already complete: its summary stands
        return run.read_summary() if env.is_main else None
    try:
        summary = fit_run(cfg, opened, run, env, backend, requests)
    finally:
        opened.outputs.checkpointer.close()
        opened.outputs.sink.close()
    if summary is not None:
        log.info("done: %s", final_line(summary, opened.parts.task, run))
    return summary


def open_run(cfg: DictConfig, parts: Parts, run: RunDir, env: DistEnv) -> OpenedRun | None:
    """The checkpoint to resume found, the optimization and the compiled model, the run dir
    accepted and the sinks open. None for a run that is already complete: it is left as it is."""
    seed_everything(parts.trainer.seed + env.rank)  # per-rank streams from here on
    # Redacted once: config.yaml, W&B and the checkpoints never carry a secret (and a rotated
    # key still resumes).
    record = redacted_container(cfg)
    checkpoint: CheckpointConfig = OmegaConf.to_object(cfg.checkpoint)
    checkpointer = Checkpointer(
        checkpoint,
        run.checkpoints,
        env,
        training_settings(record),
        sharded_checkpoints(cfg),
        compare=changed_settings,
    )
    resumed = checkpointer.find_resume()
    if resumed and is_complete(resumed[1], parts.total_steps) and run.summary.exists():
        log_already_complete(run, resumed[1], parts)
        return None
    # Read only where the run starts afresh: a resume's weights are its checkpoint's, and the
    # file may be gone by then (a requeued job's scratch space).
    initial = None if resumed else load_initial_weights(cfg.init, parts.model)
    steps = schedule_steps(resumed, parts.total_steps, env)
    optimization = build_optimization(cfg, env, parts, steps)
    parts = dataclasses.replace(parts, model=compiled(parts.model, parts.trainer.compile))
    if env.is_main:
        accept_run(run, record, kept_step=resumed[1]["step"] if resumed else 0)
        record_initial_weights(run, initial, cfg.init.get("path") if resumed else None)
    sink = build_sink(
        env.is_main,
        cfg.logger,
        run,
        record,
        resume_ids=resumed[1]["logger_ids"] if resumed else {},
        resume_step=resumed[1]["step"] if resumed else 0,
    )
    checkpointer.logger_ids = sink.run_ids
    outputs = Outputs(sink, checkpointer, profile_dir=run.path / "profile")
    return OpenedRun(parts, optimization, outputs, resumed)


def fit_run(
    cfg: DictConfig,
    opened: OpenedRun,
    run: RunDir,
    env: DistEnv,
    backend: str,
    requests: StopRequests,
) -> dict[str, Any] | None:
    """The Runner built (and loaded, resuming), trained to the end and finished. Returns the
    summary on rank 0, None elsewhere."""
    parts, outputs = opened.parts, opened.outputs
    training = build_training(cfg, parts, opened.optimization, env, backend, requests)
    runner = Runner(parts, training, outputs, env)
    if env.is_main and (dropped := epoch_coverage(parts.loaders.train, cfg.trainer.grad_accum)):
        log.info("%s", dropped)
    if opened.resumed:
        runner.load_checkpoint(*opened.resumed)
        state = runner.state
        log.info(
            "resumed from %s at step %d (epoch %d)", opened.resumed[0], state.step, state.epoch
        )
    # Built, and the checkpoint to resume taken: nothing is left to refuse the start.
    release_held_console()
    startup_clock.mark("setup")
    return finish(runner.fit(), cfg.objective, parts, outputs.sink, run, env)


def is_complete(payload: dict[str, Any], total_steps: int) -> bool:
    """A checkpoint at the planned last step, or of a run that early stopping (or a pruning
    sweep's pruner) ended."""
    trainer = payload["trainer"]
    return payload["step"] >= total_steps or bool(
        trainer.get("stopped_early") or trainer.get("pruned")
    )


def log_already_complete(run: RunDir, payload: dict[str, Any], parts: Parts) -> None:
    ended = payload["trainer"].get("stopped_early") or payload["trainer"].get("pruned")
    if ended:
        log.info("%s is complete at step %d (%s): nothing to do", run.path, payload["step"], ended)
        return
    steps_per_epoch = len(parts.loaders.train) // parts.trainer.grad_accum
    limit, setting = step_limit(parts.trainer, steps_per_epoch)
    log.info(
        "%s is complete at step %d (the planned %d steps, set by %s): nothing to do; raise %s "
        "to train further",
        run.path,
        payload["step"],
        parts.total_steps,
        limit,
        setting,
    )


def schedule_steps(
    resumed: tuple[Path, dict[str, Any]] | None, total_steps: int, env: DistEnv
) -> int:
    """The steps the learning-rate schedule spans. A run whose schedule had ended (a finished
    run given more steps) keeps it: the added steps continue at its final learning rate, where
    a longer schedule would jump the rate back up. A run resumed before the end follows the
    longer (or shorter) schedule from where it stands. A checkpoint from before the field
    ("schedule_steps") is treated as the planned steps."""
    ended = resumed[1].get("schedule_steps") if resumed else None
    if ended is None or ended == total_steps:
        return total_steps
    step = resumed[1]["step"]
    if step >= ended:
        if env.is_main:
            log.info(
                "the learning-rate schedule ended at step %d: the %d added steps continue at "
                "its final rate (for a new schedule, start a new run from these weights: "
                "init=file init.path=%s)",
                ended,
                total_steps - step,
                resumed[0],
            )
        return ended
    if env.is_main:
        log.info(
            "the learning-rate schedule now spans %d steps instead of %d: from step %d the rate "
            "follows the new length",
            total_steps,
            ended,
            step,
        )
    return total_steps


def record_initial_weights(run: RunDir, initial: LoadPlan | None, unread: str | None) -> None:
    """init.json names the file the weights came from and its checksums, once: a resume
    continues from its checkpoint's weights and leaves `unread` (init.path) unread."""
    if unread is not None:
        log.info("init: %s not read: the checkpoint resumed holds the weights", unread)
    if initial is not None:
        run.save_init_record(file_record(initial.source))


def accept_run(run: RunDir, record: dict[str, Any], kept_step: int) -> None:
    """The run goes ahead in this dir (a refused resume has changed nothing before this)."""
    release_held_log()
    run.save_config(record)
    # A resume, or a restart (torchrun, SLURM requeue) that found no checkpoint: from 0.
    dropped = run.trim_metrics(kept_step)
    if dropped:
        log.info(
            "metrics.jsonl: %d events after step %d dropped; they are re-run", dropped, kept_step
        )
