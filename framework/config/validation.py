"""Rules that span keys, checked before the run dir exists. Each raises ConfigError naming the
setting and the fix.

Rules for one option's own knobs (PowerSGD's rank, AMP's scaler) are registered in CHECKS by
the callable the option names (`_target_`; a launcher by its schema), so a user's option that
names the same callable is checked like the shipped one.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from framework.config import batch
from framework.config import schemas as s
from framework.config.data_sizes import check_data_sizes
from framework.config.option_keys import check_target_keys
from framework.config.registry import LAUNCHERS, shipped_choice, shipped_targets
from framework.config.resolvers import gpu_count
from framework.config.value_rules import VALUE_RULES, Check, every, require
from framework.core import launch_context
from framework.core.allowlist import check_targets, trusted_prefixes
from framework.core.devices import visible_gpus
from framework.core.exits import ConfigError
from framework.core.signatures import class_literal

CPU_RANKS_PER_CORE = 4  # beyond this a CPU run only thrashes (launcher.oversubscribe insists)
RUN_METRICS = {"samples_per_s": "max", "wall_s": "min"}  # objectives every run reports
GROUPS = (
    "task",
    "model",
    "data",
    "optimizer",
    "scheduler",
    "precision",
    "comm",
    "strategy",
    "launcher",
)
# The shipped callables some rules name.
ALLREDUCE = "framework.components.comm.Comm"
AMP = "framework.components.precision.AMP"
FSDP = "framework.components.strategy.FSDP"
# Loggers whose library is an optional dependency (the `loggers` dependency group).
LOGGER_PACKAGES = {
    "framework.components.loggers.TensorBoardSink": "tensorboard",
    "framework.components.loggers.MLflowSink": "mlflow",
}


# The framework's own sections: every key is a field of their schema (`+trainer.max_step=...`
# would otherwise be accepted and never read).
TYPED_SECTIONS = {
    "trainer": s.TrainerConfig,
    "trainer.early_stopping": s.EarlyStoppingConfig,
    "checkpoint": s.CheckpointConfig,
    "dist": s.DistConfig,
    "dist.ddp": s.DDPConfig,
    "eval": s.EvalConfig,
}


def validate(cfg: DictConfig) -> None:
    """Check rules that span keys. Raises ConfigError with the setting and the fix."""
    trusted_prefixes(cfg)  # first: an allowed_targets that does not resolve says so, by name
    _check_groups_name_their_builder(cfg)
    _check_nothing_missing(cfg)
    _check_keys_and_targets(cfg)
    _check_mode(cfg)
    _check_trainer(cfg.trainer)
    _check_checkpoint(cfg.checkpoint, sharded_checkpoints(cfg))
    nproc = cfg.launcher.nproc_per_node
    require(
        nproc >= 1,
        f"launcher.nproc_per_node={nproc} is invalid: it must be >= 1 "
        "(1 = one process, 2 = two local ranks, ...)",
    )
    require(cfg.data.batch_size >= 1, f"data.batch_size={cfg.data.batch_size} must be >= 1")
    require(
        cfg.data.eval_batch_size >= 1,
        f"data.eval_batch_size={cfg.data.eval_batch_size} must be >= 1",
    )
    _check_global_batch(cfg)
    require(cfg.data.num_workers >= 0, f"data.num_workers={cfg.data.num_workers} must be >= 0")
    require(cfg.optimizer.lr > 0, f"optimizer.lr={cfg.optimizer.lr} must be > 0")
    decay = cfg.optimizer.weight_decay
    require(decay >= 0, f"optimizer.weight_decay={decay} must be >= 0")
    reference = cfg.optimizer.reference_batch_size
    require(reference >= 1, f"optimizer.reference_batch_size={reference} must be >= 1")
    for pattern, multiplier in (cfg.optimizer.get("lr_multipliers") or {}).items():
        require(multiplier > 0, f"optimizer.lr_multipliers.{pattern}={multiplier} must be > 0")
    require(cfg.dist.timeout_s > 0, f"dist.timeout_s={cfg.dist.timeout_s} must be > 0")
    _check_backend(cfg)
    bucket = cfg.dist.ddp.bucket_cap_mb
    require(bucket > 0, f"dist.ddp.bucket_cap_mb={bucket} must be > 0 (25 is DDP's default)")
    for group in GROUPS:
        for check in checks_for(cfg[group]):
            check(cfg[group], cfg)
    check_data_sizes(cfg.data, fewest_ranks(cfg.launcher), cfg.trainer.grad_accum)
    for name, logger in cfg.logger.items():
        _check_logger(str(name), logger, cfg)
    directions = task_directions(cfg.task)
    if directions is not None:  # (else the rank checks it, once it has built the task)
        resolve_objective(cfg.objective, directions)


def check_keys(cfg: DictConfig) -> None:
    """What is wrong in every job of a sweep that has it: a key that no schema or callable
    takes, a value not of its key's type, a callable that may not be named. A sweep's jobs are
    checked with it before the first starts; the rules about values (validate's others) fail a
    job alone, and the sweep goes on (docs/launchers.md)."""
    trusted_prefixes(cfg)
    _check_groups_name_their_builder(cfg)
    _check_keys_and_targets(cfg)


def _check_keys_and_targets(cfg: DictConfig) -> None:
    _check_no_unknown_keys(cfg)
    check_targets(cfg, shipped_targets())
    check_target_keys(cfg)  # (after the allowlist: it reads the targets' source)


def _check_nothing_missing(cfg: DictConfig) -> None:
    """A mandatory value (??? in a schema) that no option or override set."""
    # Hydra's own node holds values that exist only inside a job (hydra.job.num): not walked.
    missing = sorted(
        key
        for section in cfg
        if section != "hydra" and isinstance(cfg[section], DictConfig)
        for key in OmegaConf.missing_keys(cfg[section])
    )
    if not missing:
        return
    key = missing[0]
    if key.endswith("_target_"):
        group = key.rsplit(".", 1)[0]
        raise ConfigError(
            f"{key} is not set: the {group} option must name what builds it (`_target_: "
            f"my_package.module.name` in its YAML file; see docs/tasks.md)"
        )
    raise ConfigError(f"{key} is not set: give it a value ({key}=...)")


BUILT_GROUPS = ("task", "model", "data", "optimizer", "scheduler")


def _check_groups_name_their_builder(cfg: DictConfig) -> None:
    """A user's option written without its schema's defaults has no `_target_` at all; its
    other keys' interpolations would fail first, naming a key the user never wrote."""
    for group in BUILT_GROUPS:
        node = cfg.get(group)
        if isinstance(node, DictConfig) and "_target_" not in node:
            raise ConfigError(
                f"{group}._target_ is not set: the {group} option must name what builds it "
                "(`_target_: my_package.module.name` in its YAML file; see docs/tasks.md)"
            )


def _check_no_unknown_keys(cfg: DictConfig) -> None:
    sections = dict(TYPED_SECTIONS)
    if (launcher := LAUNCHERS.get(str(cfg.launcher.get("name")))) is not None:
        sections["launcher"] = launcher  # its keys: its start method's schema
    for section, schema in sections.items():
        known = [field.name for field in dataclasses.fields(schema)]
        node = OmegaConf.select(cfg, section)
        for key in node.keys() if node is not None else ():
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = (
                    f"did you mean {section}.{close[0]}?"
                    if close
                    else f"the keys are {', '.join(known)}"
                )
                raise ConfigError(f"{section}.{key} is not a setting: {hint}")


def task_directions(task: DictConfig) -> dict[str, str] | None:
    """{val/<metric>: min | max} of a task, from the `metrics` its class writes in its source,
    or from its `metrics_by_setting` ({setting: {value: metrics}}: task=autoencoder's follow
    task.vae); None for a task whose source says neither."""
    target = str(task._target_)
    metrics = class_literal(target, "metrics")
    by_setting = class_literal(target, "metrics_by_setting")
    if metrics is None and isinstance(by_setting, dict) and len(by_setting) == 1:
        ((setting, choices),) = by_setting.items()
        metrics = choices.get(task.get(setting)) if isinstance(choices, dict) else None
    if not isinstance(metrics, dict) or not metrics:
        return None
    return {f"val/{name}": str(direction) for name, direction in metrics.items()}


def resolve_objective(objective: str | None, directions: dict[str, str]) -> tuple[str, str]:
    """(name, min | max) of `objective`; None picks the task's main metric (its first)."""
    known = {**directions, **RUN_METRICS}
    main = next(iter(directions))
    name = main if objective is None else objective
    require(
        name in known,
        f"objective={objective!r} is not a metric this run reports: choose "
        f"one of {', '.join(known)} (or null for {main})",
    )
    return name, known[name]


def resolve_monitor(objective: str | None, directions: dict[str, str]) -> tuple[str, str]:
    """What best checkpoints and early stopping follow: the objective when it is a validation
    metric, else the task's main metric."""
    name, direction = resolve_objective(objective, directions)
    return (name, direction) if name in directions else next(iter(directions.items()))


def _check_backend(cfg: DictConfig) -> None:
    """dist.backend=nccl where the ranks run and no GPU is (the rank would refuse it after
    start-up); submitting to SLURM, the ranks run elsewhere."""
    require(cfg.dist.backend != "nccl" or _submitting(cfg) or visible_gpus() != 0, NCCL_WITHOUT_GPU)


# Said here, where /proc tells, and by the rank, where only torch can (another vendor's GPUs).
NCCL_WITHOUT_GPU = (
    "dist.backend=nccl needs CUDA devices and none is visible: use dist.backend=auto (gloo on "
    "CPU) or dist.backend=gloo"
)


def _submitting(cfg: DictConfig) -> bool:
    """launcher=slurm from the submitting machine: the ranks will run on other nodes."""
    return cfg.launcher.name == "slurm" and not isinstance(
        launch_context.current(), launch_context.SubmititTask
    )


def _check_mode(cfg: DictConfig) -> None:
    if cfg.mode == "eval":
        require(
            cfg.checkpoint.resume not in ("auto", "never"),
            "mode=eval evaluates a checkpoint: set checkpoint.resume=<run dir>/checkpoints/"
            "last.pt (or best.pt, or any step_*.pt)",
        )
        # (the training run's data settings: its recorded overrides are taken)
        require(
            cfg.eval.split != "test" or cfg.data.get("test_fraction", 1) > 0,
            "eval.split=test: the run was trained with data.test_fraction=0, so it held out no "
            "test split (every sample went to training or validation): use eval.split=val, or "
            "train a run with data.test_fraction > 0",
        )


def _check_trainer(t: DictConfig) -> None:
    require(t.grad_accum >= 1, f"trainer.grad_accum={t.grad_accum} is invalid: must be >= 1")
    require(
        0 <= t.seed < 2**32,
        f"trainer.seed={t.seed} must be in [0, 2**32 - 1] (what numpy's generator takes)",
    )
    require(
        t.peak_tflops is None or t.peak_tflops > 0,
        f"trainer.peak_tflops={t.peak_tflops} must be > 0 (or null: the device's own figure)",
    )
    require(t.log_every >= 1, f"trainer.log_every={t.log_every} is invalid: must be >= 1")
    require(
        t.eval_every >= 0, f"trainer.eval_every={t.eval_every} is invalid: use 0 (end only) or >= 1"
    )
    require(
        t.eval_batches is None or t.eval_batches >= 1,
        f"trainer.eval_batches={t.eval_batches} is invalid: use >= 1, or null (the whole split)",
    )
    require(
        t.max_steps is not None or t.max_epochs is not None,
        "trainer.max_steps and trainer.max_epochs are both null: set at least one",
    )
    require(
        t.max_steps is None or t.max_steps >= 1, f"trainer.max_steps={t.max_steps} must be >= 1"
    )
    require(
        t.max_epochs is None or t.max_epochs >= 1, f"trainer.max_epochs={t.max_epochs} must be >= 1"
    )
    require(
        t.clip_grad_norm is None or t.clip_grad_norm > 0,
        f"trainer.clip_grad_norm={t.clip_grad_norm} must be > 0 (or null to disable clipping)",
    )
    require(
        t.ema_decay is None or 0.0 < t.ema_decay < 1.0,
        f"trainer.ema_decay={t.ema_decay} must be in (0, 1), e.g. 0.999 (or null to disable)",
    )
    patience = t.early_stopping.patience
    if patience is not None:
        require(
            patience >= 1, f"trainer.early_stopping.patience={patience} must be >= 1 (or null: off)"
        )
        require(
            t.eval_every >= 1,
            "trainer.early_stopping.patience counts evaluations: set "
            "trainer.eval_every (steps between evaluations) >= 1",
        )
    require(
        t.early_stopping.min_delta >= 0,
        f"trainer.early_stopping.min_delta={t.early_stopping.min_delta} must be >= 0",
    )
    steps = list(t.profile_steps)
    require(
        steps == [] or (len(steps) == 2 and 1 <= steps[0] <= steps[1]),
        f"trainer.profile_steps={steps} is invalid: give [first, last] optimizer steps, "
        "e.g. [10, 12], or [] (off)",
    )


def _check_global_batch(cfg: DictConfig) -> None:
    """trainer.global_batch_size divides into per-rank batches at every number of ranks this
    job can have (an elastic range: each of them), so no round of it is refused mid-run."""
    wanted, per_rank = cfg.trainer.global_batch_size, cfg.data.batch_size
    if wanted is None:
        return
    require(wanted >= 1, f"trainer.global_batch_size={wanted} must be >= 1 (or null)")
    require(
        cfg.trainer.grad_accum == 1,
        f"trainer.grad_accum={cfg.trainer.grad_accum} with trainer.global_batch_size={wanted}: "
        "the accumulation is derived from the global batch; leave trainer.grad_accum at 1, or "
        "set trainer.global_batch_size=null",
    )
    batch.check(wanted, per_rank, *world_sizes(cfg))


def world_sizes(cfg: DictConfig) -> tuple[list[int], str]:
    """The numbers of ranks the job can run on, and where they come from (for a message)."""
    here = launch_context.current()
    if isinstance(here, launch_context.TorchElastic | launch_context.SubmititTask):
        return [here.dist_env().world_size], "this job's WORLD_SIZE"
    launcher = cfg.launcher
    nproc = launcher.nproc_per_node
    if launcher.name == "torchrun":
        low, high = node_range(launcher.nnodes)
        where = f"launcher.nnodes={launcher.nnodes} x launcher.nproc_per_node={nproc}"
        return [nodes * nproc for nodes in range(low, high + 1)], where
    nodes = launcher.get("nodes", 1)
    return [nodes * nproc], f"launcher.nproc_per_node={nproc}" + (
        f" x launcher.nodes={nodes}" if nodes > 1 else ""
    )


def sharded_checkpoints(cfg: DictConfig) -> bool:
    """checkpoint.format resolved: auto is sharded under strategy=fsdp."""
    chosen = cfg.checkpoint.format
    if chosen == s.CheckpointFormat.auto:
        return cfg.strategy._target_ == FSDP
    return chosen == s.CheckpointFormat.sharded


def _check_checkpoint(ck: DictConfig, sharded: bool) -> None:
    require(ck.every >= 0, f"checkpoint.every={ck.every} must be >= 0 (0 = final only)")
    require(ck.keep >= 1, f"checkpoint.keep={ck.keep} must be >= 1")
    require(ck.best >= 0, f"checkpoint.best={ck.best} must be >= 0 (0: off)")
    require(
        sharded or not ck.async_save,
        "checkpoint.async_save=true writes sharded checkpoints in the background, and this run "
        "writes one file from rank 0: add checkpoint.format=sharded (the default under "
        "strategy=fsdp)",
    )
    if ck.resume not in ("auto", "never"):
        path = Path(ck.resume).expanduser()
        require(
            path.is_file() or (path / ".metadata").is_file(),  # DCP's index: a sharded one
            f"checkpoint.resume={ck.resume} is no checkpoint: give a checkpoint file or folder "
            "(<run dir>/checkpoints/last.pt), auto or never",
        )


def _reject_srun_steps(launcher: DictConfig, cfg: DictConfig) -> None:
    """For launchers that start the ranks themselves: `srun -n 4 train` starts 4 launchers,
    each with its own ranks and run dir. One task per node running launcher=torchrun with
    launcher.nnodes = the step's nodes (or a range holding it) is a real job."""
    here = launch_context.current()
    if isinstance(here, launch_context.TorchElastic | launch_context.SubmititTask):
        return
    tasks, nodes = here.srun_step()
    if launcher.name == "torchrun" and tasks == nodes:
        low, high = node_range(launcher.nnodes)
        if low <= nodes <= high:  # one task per node
            return
    if tasks > 1:
        raise ConfigError(
            f"this is one of {tasks} tasks of an srun step: with launcher={launcher.name} each "
            "task would start its own ranks and run dir. Submit with launcher=slurm (one task per "
            "rank), or start one task per node that runs launchers/torchrun.sh"
        )


# --- one option's own knobs ------------------------------------------------------------------
def _check_ranks_fit_this_machine(launcher: DictConfig, cfg: DictConfig) -> None:
    """The launchers that start their ranks on this machine: a rank count it cannot hold
    (each rank a process with its own model; on GPUs one device each) is refused before a
    single process is forked."""
    nproc = launcher.nproc_per_node
    if launcher.oversubscribe or nproc <= 1:
        return
    gpus = gpu_count()
    if gpus:
        require(
            nproc <= gpus,
            f"launcher.nproc_per_node={nproc}: this machine has {gpus} GPU(s) and each rank "
            f"drives one; use launcher.nproc_per_node<={gpus}, or launcher.oversubscribe=true "
            "to share them",
        )
        return
    cores = len(os.sched_getaffinity(0))
    require(
        nproc <= CPU_RANKS_PER_CORE * cores,
        f"launcher.nproc_per_node={nproc} is far more ranks than this machine's {cores} CPU "
        f"cores hold (at most {CPU_RANKS_PER_CORE * cores}): lower it, or set "
        "launcher.oversubscribe=true to insist",
    )


def _check_local(launcher: DictConfig, cfg: DictConfig) -> None:
    _reject_srun_steps(launcher, cfg)
    _check_ranks_fit_this_machine(launcher, cfg)


def fewest_ranks(launcher: DictConfig) -> int:
    """The fewest ranks the launcher may start: nodes (the low end of an elastic range) x
    ranks per node."""
    nodes = node_range(launcher.nnodes)[0] if "nnodes" in launcher else launcher.get("nodes", 1)
    return launcher.nproc_per_node * nodes


def node_range(nnodes: str | int) -> tuple[int, int]:
    """launcher.nnodes as (min, max): `N` is (N, N), `MIN:MAX` an elastic range."""
    parts = str(nnodes).split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        low = high = 0
    require(
        1 <= low <= high,
        f"launcher.nnodes={nnodes} is not a number of nodes: give N >= 1, or MIN:MAX with "
        "1 <= MIN <= MAX for an elastic job (e.g. launcher.nnodes=1:2)",
    )
    return low, high


def spans_nodes(launcher: DictConfig) -> bool:
    """launcher=torchrun on (possibly) several nodes: they share one run dir (hydra.run.dir, on
    a shared file system), whose name is the rendezvous id."""
    return launcher.name == "torchrun" and node_range(launcher.nnodes)[1] > 1


def joins_other_node(launcher: DictConfig) -> bool:
    """A node of a multi-node launcher=torchrun job that does not host its rendezvous: the
    host holds the shared run dir's lock and writes its record."""
    return spans_nodes(launcher) and not launcher.rdzv_host


def _check_torchrun(launcher: DictConfig, cfg: DictConfig) -> None:
    _reject_srun_steps(launcher, cfg)
    _check_ranks_fit_this_machine(launcher, cfg)
    low, high = node_range(launcher.nnodes)
    require(
        launcher.max_restarts >= 0, f"launcher.max_restarts={launcher.max_restarts} must be >= 0"
    )
    require(
        low == high or launcher.max_restarts >= 1,
        f"launcher.nnodes={launcher.nnodes} is an elastic range, which goes on after a lost node "
        "by restarting on the nodes left: set launcher.max_restarts>=1 (or a fixed "
        f"launcher.nnodes={high})",
    )
    for key in ("rdzv_last_call_s", "rdzv_keep_alive_s", "rdzv_keep_alive_attempts"):
        require(launcher[key] >= 1, f"launcher.{key}={launcher[key]} must be >= 1")
    interval = launcher.monitor_interval_s
    require(interval > 0, f"launcher.monitor_interval_s={interval} must be > 0")
    _check_rdzv_endpoint(str(launcher.rdzv_endpoint))
    require(
        high == 1 or not str(launcher.rdzv_endpoint).endswith(":0"),
        f"launcher.rdzv_endpoint={launcher.rdzv_endpoint} with launcher.nnodes="
        f"{launcher.nnodes}: port 0 picks a free port on one node, which no other node can "
        "find: give node 0's address and a port every node uses (e.g. "
        "launcher.rdzv_endpoint=node0:29500)",
    )


def _check_rdzv_endpoint(endpoint: str) -> None:
    """host:port, or [IPv6]:port, with a port torch's rendezvous takes (it would refuse it only
    once the run dir exists); a bare host or IPv6 address takes torch's default port."""
    if endpoint.startswith("["):
        rest = endpoint.partition("]")[2]
        port = rest[1:] if rest.startswith(":") else None
    else:
        port = endpoint.partition(":")[2] if endpoint.count(":") == 1 else None
    require(
        port is None or (re.fullmatch(r"[0-9]{1,5}", port) is not None and int(port) <= 65535),
        f"launcher.rdzv_endpoint={endpoint}: give host:port with a port from 0 to 65535 "
        "(0 picks a free one, on one node)",
    )


def _check_submitit(launcher: DictConfig, cfg: DictConfig) -> None:
    for key in ("tasks_per_node", "timeout_min") + (("nodes",) if "nodes" in launcher else ()):
        require(launcher[key] >= 1, f"launcher.{key}={launcher[key]} must be >= 1")
    require(
        launcher.max_num_timeout >= 0,
        f"launcher.max_num_timeout={launcher.max_num_timeout} must be >= 0",
    )
    gpus, tasks = launcher.gpus_per_node, launcher.tasks_per_node
    require(
        gpus == 0 or tasks == gpus,
        f"launcher.tasks_per_node={tasks} with launcher.gpus_per_node={gpus}: each rank drives "
        f"one GPU, so set launcher.tasks_per_node={gpus} (or launcher.gpus_per_node={tasks})",
    )
    require(
        "SIGUSR2" in cfg.trainer.stop_signals,
        f"launcher={launcher.name} needs SIGUSR2 in trainer.stop_signals: SLURM sends it "
        "launcher.signal_delay_s before the time limit so the ranks save before the job is "
        "requeued",
    )
    require(
        not isinstance(launch_context.current(), launch_context.TorchElastic),
        f"launcher={launcher.name} under torchrun: SLURM starts one task per rank itself. Run "
        f"`train launcher={launcher.name} ...` directly (on the login node), not under torchrun",
    )


def _check_amp(p: DictConfig, cfg: DictConfig) -> None:
    require(p.init_scale > 0, f"precision.init_scale={p.init_scale} must be > 0")
    require(p.growth_factor > 1, f"precision.growth_factor={p.growth_factor} must be > 1")
    require(
        0 < p.backoff_factor < 1, f"precision.backoff_factor={p.backoff_factor} must be in (0, 1)"
    )
    require(p.growth_interval >= 1, f"precision.growth_interval={p.growth_interval} must be >= 1")


def _check_powersgd(comm: DictConfig, cfg: DictConfig) -> None:
    require(
        comm.rank >= 1,
        f"comm.rank={comm.rank} is invalid: the PowerSGD rank must be >= 1 (1, 2 and 4 are usual)",
    )
    require(
        comm.start_iter >= 0,
        f"comm.start_iter={comm.start_iter} is invalid: steps of plain allreduce must be >= 0",
    )
    require(
        comm.min_compression_rate >= 0,
        f"comm.min_compression_rate={comm.min_compression_rate} must be >= 0",
    )
    require(
        comm.orthogonalization_epsilon >= 0,
        f"comm.orthogonalization_epsilon={comm.orthogonalization_epsilon} must be >= 0",
    )


def _check_fsdp(strategy: DictConfig, cfg: DictConfig) -> None:
    """What FSDP's sharded gradients rule out: DDP's comm hooks, and a GradScaler that reads
    whole gradients on each rank."""
    require(
        cfg.comm._target_ == ALLREDUCE,
        f"comm={shipped_choice('comm', cfg.comm)} is a DDP comm hook and strategy=fsdp "
        "reduce-scatters gradients itself: use comm=allreduce with strategy=fsdp, or strategy=ddp",
    )
    require(
        cfg.precision._target_ != AMP,
        "precision=amp's GradScaler needs whole gradients on every rank and strategy=fsdp shards "
        "them: use precision=bf16 (or fp32) with strategy=fsdp, or strategy=ddp",
    )
    for name in strategy.block_classes or ():
        require(
            bool(name) and all(part.isidentifier() for part in str(name).split(".")),
            f"strategy.block_classes: {name!r} is not a class name: give names such as "
            "TransformerBlock or torch.nn.Linear",
        )


def _check_cifar10(data: DictConfig, cfg: DictConfig) -> None:
    # Submitting from a login node: the compute nodes' mounts may be missing here.
    if data.download or _submitting(cfg):
        return
    fix = "set data.root=/path/to/cifar-10-batches-py (or data.download=true with internet access)"
    require(data.root is not None, f"data.root is not set: {fix}")
    path = Path(data.root).expanduser()
    require(path.is_dir(), f"data.root={data.root} is not a directory: {fix}")
    folder = path if (path / "data_batch_1").exists() else path / "cifar-10-batches-py"
    require(
        (folder / "data_batch_1").exists() and (folder / "test_batch").exists(),
        f"data.root={data.root} holds no CIFAR-10 python batches (data_batch_1 ... test_batch): "
        f"{fix}",
    )


# What the run itself writes in its dir (storage/run_dir.py, the loggers' folders): a logger's
# file may not replace one. Names starting with "." are the run's too (.lock, temporary files).
RUN_DIR_NAMES = frozenset(
    {
        "config.yaml",
        "metrics.jsonl",
        "summary.json",
        "train.log",
        "curves.png",
        "checkpoints",
        "wandb",
        "tensorboard",
        "profile",
        "eval",
    }
)


def file_name_problem(filename: str) -> str | None:
    """Why `filename` does not name a file of its own directly in the run dir; None when it
    does."""
    if not filename or Path(filename).name != filename or filename in (".", ".."):
        return "must be a file name in the run dir (no folder, no ..)"
    if filename in RUN_DIR_NAMES or filename.startswith("."):
        return "is a file the run writes itself: choose another name (metrics.csv)"
    return None


# MLflow stores a config may name: servers. A local store (a path, file: or sqlite:) comes
# from $MLFLOW_TRACKING_URI or the default, never from a config (it would write anywhere).
MLFLOW_SERVER_SCHEMES = ("http://", "https://", "databricks")


def tracking_uri_problem(uri: str | None) -> str | None:
    if uri is None or uri.startswith(MLFLOW_SERVER_SCHEMES):
        return None
    return (
        "is a local store, which only $MLFLOW_TRACKING_URI may name: set that variable, or "
        "an http(s) server here"
    )


def _check_csv_logger(logger: DictConfig, cfg: DictConfig) -> None:
    problem = file_name_problem(logger.filename)
    require(problem is None, f"logger.csv.filename={logger.filename} {problem}")


def _check_mlflow_logger(logger: DictConfig, cfg: DictConfig) -> None:
    problem = tracking_uri_problem(logger.tracking_uri)
    require(problem is None, f"logger.mlflow.tracking_uri={logger.tracking_uri} {problem}")
    require(
        logger.get("experiment") is None or str(logger.experiment).strip() != "",
        "logger.mlflow.experiment is empty: name the MLflow experiment (or null for the default)",
    )


def _check_autoencoder(task: DictConfig, cfg: DictConfig) -> None:
    require(task.kl_weight >= 0, f"task.kl_weight={task.kl_weight} must be >= 0")


def _check_classification(task: DictConfig, cfg: DictConfig) -> None:
    require(
        0 <= task.label_smoothing < 1,
        f"task.label_smoothing={task.label_smoothing} must be in [0, 1)",
    )


def _check_logger(name: str, logger: DictConfig, cfg: DictConfig) -> None:
    require(
        isinstance(logger, DictConfig) and "_target_" in logger,
        f"logger.{name} is not a logger: pick loggers by name, logger=[wandb,csv,...]",
    )
    package = LOGGER_PACKAGES.get(logger._target_)
    require(
        package is None or importlib.util.find_spec(package) is not None,
        f"logger={name} needs the {package} package, which is not installed: "
        "uv sync --group loggers (uv run pytest installs it with the dev group)",
    )
    for check in checks_for(logger):
        check(logger, cfg)


_OWN_CHECKS: dict[str | type, Check] = {
    s.LocalLauncherConfig: _check_local,
    s.TorchrunLauncherConfig: _check_torchrun,
    s.SubmititLauncherConfig: _check_submitit,
    AMP: _check_amp,
    "framework.components.comm.PowerSGD": _check_powersgd,
    FSDP: _check_fsdp,
    "framework.components.data.cifar10": _check_cifar10,
    "framework.components.tasks.Autoencoder": _check_autoencoder,
    "framework.components.tasks.Classification": _check_classification,
    "framework.components.loggers.CsvSink": _check_csv_logger,
    "framework.components.loggers.MLflowSink": _check_mlflow_logger,
}
# A callable with checks in both tables gets both (data=cifar10: its folder, and its shape).
CHECKS: dict[str | type, Check] = {
    key: every(_OWN_CHECKS[key], rule) if key in _OWN_CHECKS else rule
    for key, rule in VALUE_RULES.items()
} | {key: check for key, check in _OWN_CHECKS.items() if key not in VALUE_RULES}


def checks_for(node: DictConfig) -> list[Check]:
    """The checks of the callable an option names, or of a launcher's schema and the schemas
    it extends."""
    if "_target_" in node:
        check = CHECKS.get(str(node._target_))
        return [check] if check is not None else []
    schema = OmegaConf.get_type(node)
    return [CHECKS[kind] for kind in getattr(schema, "__mro__", ()) if kind in CHECKS]
