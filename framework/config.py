"""Typed config schemas (registered in Hydra's ConfigStore) and cross-field validation.

Every shipped group option's YAML starts with `defaults: [/schema/<group>/<option>@_here_]`, so
a typo or a wrong type fails at composition and names the key. Rules that span several keys
live in `validate()`, which runs before Hydra creates the run directory.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from omegaconf import MISSING, DictConfig, OmegaConf


class ConfigError(ValueError):
    """A user-facing configuration mistake: one line naming the setting and the fix."""


class ReportedConfigError(ConfigError):
    """A rank rejected the config and already printed why (exit code 2)."""


# --- models ---------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    _target_: str = MISSING
    num_classes: int = "${data.num_classes}"  # type: ignore[assignment]
    in_channels: int = "${data.in_channels}"  # type: ignore[assignment]


@dataclass
class MLPConfig(ModelConfig):
    _target_: str = "framework.models.MLP"
    image_size: int = "${data.image_size}"  # type: ignore[assignment]
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 128])


@dataclass
class CNNConfig(ModelConfig):
    _target_: str = "framework.models.SmallCNN"
    width: int = 32


@dataclass
class ResNet18Config(ModelConfig):
    _target_: str = "framework.models.resnet18_cifar"


@dataclass
class ResNet50Config(ModelConfig):
    _target_: str = "framework.models.resnet50"


# --- data -----------------------------------------------------------------------------------
@dataclass
class DataConfig:
    _target_: str = MISSING  # a function returning framework.data.Splits
    batch_size: int = 32  # per rank; global batch = batch_size * world_size * grad_accum
    eval_batch_size: int = 256
    num_workers: int = 0
    pin_memory: bool = True  # only takes effect on CUDA
    persistent_workers: bool = True  # only takes effect with num_workers > 0
    shuffle: bool = True
    drop_last: bool = True  # training only; evaluation never drops or pads
    in_channels: int = 3
    image_size: int = 32
    num_classes: int = 10


@dataclass
class DigitsConfig(DataConfig):
    _target_: str = "framework.data.digits"
    in_channels: int = 1
    image_size: int = 8
    val_fraction: float = 0.2
    split_seed: int = 0


@dataclass
class SyntheticConfig(DataConfig):
    _target_: str = "framework.data.synthetic"
    train_size: int = 2048
    val_size: int = 512
    seed: int = 0


@dataclass
class Cifar10Config(DataConfig):
    _target_: str = "framework.data.cifar10"
    root: str | None = None
    download: bool = False
    augment: bool = True


# --- optimisation ---------------------------------------------------------------------------
class LrScaling(StrEnum):
    none = "none"
    linear = "linear"
    sqrt = "sqrt"


@dataclass
class OptimizerConfig:
    _target_: str = MISSING
    _partial_: bool = True
    lr: float = 0.1
    weight_decay: float = 0.0
    # lr is given for reference_batch_size; scale it to the actual global batch.
    lr_scaling: LrScaling = LrScaling.none
    reference_batch_size: int = 256


@dataclass
class SGDConfig(OptimizerConfig):
    _target_: str = "torch.optim.SGD"
    momentum: float = 0.9
    nesterov: bool = False


@dataclass
class AdamWConfig(OptimizerConfig):
    _target_: str = "torch.optim.AdamW"
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8


@dataclass
class SchedulerConfig:
    _target_: str = MISSING
    _partial_: bool = True


@dataclass
class ConstantSchedulerConfig(SchedulerConfig):
    _target_: str = "framework.schedulers.constant"


@dataclass
class CosineSchedulerConfig(SchedulerConfig):
    _target_: str = "framework.schedulers.cosine_with_warmup"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclass
class StepSchedulerConfig(SchedulerConfig):
    _target_: str = "framework.schedulers.step"
    step_size: int = 100
    gamma: float = 0.1


# --- precision and communication ------------------------------------------------------------
@dataclass
class PrecisionConfig:
    name: str = "fp32"


@dataclass
class AmpConfig(PrecisionConfig):
    """float16 autocast + GradScaler (dynamic loss scaling)."""

    name: str = "amp"
    init_scale: float = 65536.0
    growth_factor: float = 2.0  # scale *= this after growth_interval clean steps
    backoff_factor: float = 0.5  # scale *= this after a step with inf/NaN gradients
    growth_interval: int = 2000


@dataclass
class CommConfig:
    name: str = "allreduce"


@dataclass
class PowerSGDConfig(CommConfig):
    name: str = "powersgd"
    rank: int = 2  # matrix_approximation_rank: higher = more accurate, more bytes
    start_iter: int = 10  # plain allreduce for this many steps first (torch's default: 1000)
    min_compression_rate: float = 2.0  # compress a matrix only if it shrinks by this much
    error_feedback: bool = True  # carry each rank's compression error into its next step
    warm_start: bool = True  # reuse last step's Q instead of a fresh random one
    orthogonalization_epsilon: float = 0.0  # > 0: Gram-Schmidt with this epsilon; 0: QR
    compress: str | None = None  # fp16 | bf16: wire dtype of the uncompressed part
    seed: int = 0  # random projections, identical on every rank


# --- launch, logging, trainer ---------------------------------------------------------------
@dataclass
class LauncherConfig:
    name: str = MISSING
    nproc_per_node: int = 2  # ranks started on this machine (conf: one per GPU, else 2)


@dataclass
class LocalLauncherConfig(LauncherConfig):
    name: str = "local"


@dataclass
class TorchrunLauncherConfig(LauncherConfig):
    """Workers started by torch.distributed's elastic agent (the engine behind `torchrun`)."""

    name: str = "torchrun"
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = "localhost:0"  # host:port of node 0; port 0 picks a free one (1 node)
    max_restarts: int = 0  # restart the whole group this many times after a worker dies
    monitor_interval_s: float = 0.5


@dataclass
class SubmititLauncherConfig(LauncherConfig):
    """One job per run (per sweep job) through hydra-submitit-launcher; one task per rank."""

    name: str = MISSING
    tasks_per_node: int = 2  # ranks per node (one per GPU on GPU nodes)
    gpus_per_node: int = 0
    cpus_per_task: int | None = None
    mem_gb: int | None = None
    timeout_min: int = 60
    # SIGUSR2 arrives this long before the time limit: the ranks save and submitit requeues.
    signal_delay_s: int = 120
    max_num_timeout: int = 3  # requeues after hitting the time limit (preemptions are free)
    master_port: int | None = None  # rank 0's rendezvous port; null: derived from the job id


@dataclass
class SlurmLauncherConfig(SubmititLauncherConfig):
    name: str = "slurm"
    nodes: int = 1
    partition: str | None = None  # null: the cluster's default partition
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    # Other sbatch options go to hydra.launcher directly: additional_parameters={mail-type:END},
    # setup=[shell lines run before srun] (hydra-submitit-launcher's keys).


@dataclass
class SlurmLocalLauncherConfig(SubmititLauncherConfig):
    """submitit's local executor: the same job as launcher=slurm, on this machine, no cluster."""

    name: str = "slurm_local"


@dataclass
class LoggerConfig:
    name: str = "none"


@dataclass
class WandbLoggerConfig(LoggerConfig):
    name: str = "wandb"
    project: str = "framework"
    entity: str | None = None
    group: str | None = None  # null: in a sweep, the sweep dir (one group per sweep)
    run_name: str | None = None  # null: the run dir's name (in a sweep: job number + overrides)
    tags: list[str] = field(default_factory=list)
    # auto: online when credentials exist (WANDB_API_KEY or `wandb login`), else offline.
    mode: str = "auto"


@dataclass
class DDPConfig:
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False


@dataclass
class DistConfig:
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 600.0
    ddp: DDPConfig = field(default_factory=DDPConfig)


@dataclass
class TrainerConfig:
    max_steps: int | None = None  # optimizer steps; whichever of max_steps/max_epochs ends first
    max_epochs: int | None = 1
    grad_accum: int = 1  # micro-batches per optimizer step
    clip_grad_norm: float | None = None
    eval_every: int = 0  # steps between evaluations; 0 = only at the end
    log_every: int = 10  # steps between metric events
    seed: int = 0
    sync_batchnorm: bool = False
    channels_last: bool = False  # NHWC weights and images: faster convolutions on recent GPUs
    # torch.compile the DDP model (DDP's optimizer splits graphs at bucket boundaries so
    # communication still overlaps): pays a compile at start-up for faster steps after.
    compile: bool = False
    ema_decay: float | None = None  # e.g. 0.999; evaluation then uses the averaged weights
    progress_bar: bool = True  # rank 0, only when stderr is a terminal
    # A non-finite loss (or, outside amp, gradient) on any rank: every rank sees it at the
    # same step. stop: end the run there, saving nothing; skip: drop that update and go on.
    on_nonfinite: str = "stop"
    # Signals that stop the run at the next step with a checkpoint (exit code 75, resumable).
    # SIGINT (Ctrl-C) always does.
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGUSR2"])


@dataclass
class CheckpointConfig:
    every: int = 500  # optimizer steps between checkpoints; 0 = only the final one
    keep: int = 3  # newest checkpoints kept in <run dir>/checkpoints (>= 1)
    # auto: continue from the newest valid checkpoint in the run dir, if any; never; or a path.
    resume: str = "auto"
    final: bool = True  # also save when the run ends or stops on a signal / Ctrl-C


@dataclass
class Config:
    model: Any = MISSING
    data: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    precision: Any = MISSING
    comm: Any = MISSING
    launcher: Any = MISSING
    logger: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    # The summary metric the app returns to Hydra (sweepers such as optuna optimise it) and the
    # sweep summary lists first.
    objective: str = "val/accuracy"
    # Module prefixes `_target_` may name, on top of torch, torchvision, framework and
    # experiments (framework/security.py). Config files only: the command line cannot set it.
    allowed_targets: list[str] = field(default_factory=list)


SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"base": ModelConfig, "mlp": MLPConfig, "cnn": CNNConfig, "resnet18": ResNet18Config,
              "resnet50": ResNet50Config},
    "data": {
        "base": DataConfig,
        "digits": DigitsConfig,
        "synthetic": SyntheticConfig,
        "cifar10": Cifar10Config,
    },
    "optimizer": {"sgd": SGDConfig, "adamw": AdamWConfig},
    "scheduler": {
        "constant": ConstantSchedulerConfig,
        "cosine": CosineSchedulerConfig,
        "step": StepSchedulerConfig,
    },
    "precision": {"base": PrecisionConfig, "amp": AmpConfig},
    "comm": {"base": CommConfig, "powersgd": PowerSGDConfig},
    "launcher": {
        "local": LocalLauncherConfig,
        "torchrun": TorchrunLauncherConfig,
        "slurm": SlurmLauncherConfig,
        "slurm_local": SlurmLocalLauncherConfig,
    },
    "logger": {"none": LoggerConfig, "wandb": WandbLoggerConfig},
}


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, options in SCHEMAS.items():
        for name, schema in options.items():
            cs.store(group=f"schema/{group}", name=name, node=schema)


def run_stamp() -> str:
    """The run dir below outputs/: date/time, or under an external torchrun the job's
    rendezvous id, which every restart of the job shares, so a restarted rank 0 comes back
    to the run dir (and checkpoints) of the first attempt."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return f"torchrun/{run_id}"
    return datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f")


OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True, replace=True)


def default_ranks() -> int:
    """launcher.nproc_per_node's default: one rank per visible GPU, else 2 ranks on CPU."""
    import torch

    return torch.cuda.device_count() or 2


OmegaConf.register_new_resolver("default_ranks", default_ranks, use_cache=True, replace=True)


register_configs()


# --- validation -----------------------------------------------------------------------------
def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(cfg: DictConfig | dict) -> None:
    """Check rules that span keys. Raises ConfigError with the setting and the fix."""
    # Imported here: security imports ConfigError from this module.
    from framework.security import check_targets

    c = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    check_targets(c)
    nproc = c.launcher.nproc_per_node
    _require(
        nproc >= 1,
        f"launcher.nproc_per_node={nproc} is invalid: it must be >= 1 "
        "(1 = one process, 2 = two local ranks, ...)",
    )
    t = c.trainer
    _require(t.grad_accum >= 1, f"trainer.grad_accum={t.grad_accum} is invalid: must be >= 1")
    _require(t.log_every >= 1, f"trainer.log_every={t.log_every} is invalid: must be >= 1")
    _require(
        t.eval_every >= 0, f"trainer.eval_every={t.eval_every} is invalid: use 0 (end only) or >= 1"
    )
    _require(
        t.max_steps is not None or t.max_epochs is not None,
        "trainer.max_steps and trainer.max_epochs are both null: set at least one",
    )
    _require(
        t.max_steps is None or t.max_steps >= 1, f"trainer.max_steps={t.max_steps} must be >= 1"
    )
    _require(
        t.max_epochs is None or t.max_epochs >= 1, f"trainer.max_epochs={t.max_epochs} must be >= 1"
    )
    _require(
        t.clip_grad_norm is None or t.clip_grad_norm > 0,
        f"trainer.clip_grad_norm={t.clip_grad_norm} must be > 0 (or null to disable clipping)",
    )
    _require(
        t.ema_decay is None or 0.0 < t.ema_decay < 1.0,
        f"trainer.ema_decay={t.ema_decay} must be in (0, 1), e.g. 0.999 (or null to disable)",
    )
    _validate_stopping_and_checkpoints(c)
    _require(c.data.batch_size >= 1, f"data.batch_size={c.data.batch_size} must be >= 1")
    _require(c.data.num_workers >= 0, f"data.num_workers={c.data.num_workers} must be >= 0")
    _require(c.optimizer.lr > 0, f"optimizer.lr={c.optimizer.lr} must be > 0")
    _require(
        c.dist.backend in ("auto", "gloo", "nccl"),
        f"dist.backend={c.dist.backend!r} is invalid: choose auto, gloo or nccl",
    )
    _require(c.dist.timeout_s > 0, f"dist.timeout_s={c.dist.timeout_s} must be > 0")
    if c.launcher.name == "torchrun":
        _require(c.launcher.nnodes >= 1, f"launcher.nnodes={c.launcher.nnodes} must be >= 1")
        _require(
            c.launcher.max_restarts >= 0,
            f"launcher.max_restarts={c.launcher.max_restarts} must be >= 0",
        )
    if c.launcher.name in ("slurm", "slurm_local"):
        _validate_submitit(c)
    else:
        _reject_srun_steps(c)
    _require(
        c.objective in OBJECTIVES,
        f"objective={c.objective!r} is not a summary metric: choose one of {', '.join(OBJECTIVES)}",
    )
    _validate_precision_and_comm(c)
    submitting = c.launcher.name == "slurm" and "SUBMITIT_EXECUTOR" not in os.environ
    if "root" in c.data and not c.data.get("download", False) and not submitting:
        _validate_data_root(c.data.root)  # (on a login node the compute nodes' mounts may lack)
    if c.logger.name == "wandb":
        _require(
            c.logger.mode in ("auto", "online", "offline", "disabled"),
            f"logger.mode={c.logger.mode!r} is invalid: choose auto, online, offline or disabled",
        )


def _validate_stopping_and_checkpoints(c: DictConfig) -> None:
    t, ck = c.trainer, c.checkpoint
    _require(
        t.on_nonfinite in ("stop", "skip"),
        f"trainer.on_nonfinite={t.on_nonfinite!r} is invalid: choose stop or skip",
    )
    for name in t.stop_signals:
        _require(
            name in STOP_SIGNALS,
            f"trainer.stop_signals: {name!r} is not a signal a run can stop on: "
            f"choose from {', '.join(STOP_SIGNALS)}",
        )
    _require(ck.every >= 0, f"checkpoint.every={ck.every} must be >= 0 (0 = final only)")
    _require(ck.keep >= 1, f"checkpoint.keep={ck.keep} must be >= 1")
    if ck.resume not in ("auto", "never"):
        path = Path(ck.resume).expanduser()
        _require(
            path.is_file(),
            f"checkpoint.resume={ck.resume} is not a file: give a checkpoint file "
            "(<run dir>/checkpoints/last.pt), auto or never",
        )


STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")
OBJECTIVES = ("val/accuracy", "val/loss", "samples_per_s", "wall_s")


def _validate_submitit(c: DictConfig) -> None:
    launcher = c.launcher
    for key in ("tasks_per_node", "timeout_min") + (("nodes",) if "nodes" in launcher else ()):
        _require(launcher[key] >= 1, f"launcher.{key}={launcher[key]} must be >= 1")
    _require(
        launcher.max_num_timeout >= 0,
        f"launcher.max_num_timeout={launcher.max_num_timeout} must be >= 0",
    )
    gpus, tasks = launcher.gpus_per_node, launcher.tasks_per_node
    _require(
        gpus == 0 or tasks == gpus,
        f"launcher.tasks_per_node={tasks} with launcher.gpus_per_node={gpus}: each rank drives "
        f"one GPU, so set launcher.tasks_per_node={gpus} (or launcher.gpus_per_node={tasks})",
    )
    _require(
        "SIGUSR2" in c.trainer.stop_signals,
        f"launcher={launcher.name} needs SIGUSR2 in trainer.stop_signals: SLURM sends it "
        "launcher.signal_delay_s before the time limit so the ranks save before the job is "
        "requeued",
    )
    _require(
        not _under_torchrun(),
        f"launcher={launcher.name} under torchrun: SLURM starts one task per rank itself. Run "
        f"`train launcher={launcher.name} ...` directly (on the login node), not under torchrun",
    )


def _under_torchrun() -> bool:
    if "SUBMITIT_EXECUTOR" in os.environ:  # a task of our own job (a prolog may set LOCAL_RANK)
        return False
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _reject_srun_steps(c: DictConfig) -> None:
    """`srun -n 4 train` starts 4 launchers, each with its own ranks and run dir. One task per
    node running launcher=torchrun with launcher.nnodes = the step's nodes is a real job."""
    launcher = c.launcher.name
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))
    nodes = int(os.environ.get("SLURM_STEP_NUM_NODES", "1"))
    one_per_node = launcher == "torchrun" and tasks == nodes == c.launcher.nnodes
    if tasks > 1 and not one_per_node and not _under_torchrun() \
            and "SUBMITIT_EXECUTOR" not in os.environ:  # fmt: skip
        raise ConfigError(
            f"this is one of {tasks} tasks of an srun step: with launcher={launcher} each task "
            "would start its own ranks and run dir. Submit with launcher=slurm (one task per "
            "rank), or start one task per node that runs launchers/torchrun.sh"
        )


def _validate_precision_and_comm(c: DictConfig) -> None:
    if c.precision.name == "amp":
        p = c.precision
        _require(p.init_scale > 0, f"precision.init_scale={p.init_scale} must be > 0")
        _require(p.growth_factor > 1, f"precision.growth_factor={p.growth_factor} must be > 1")
        _require(
            0 < p.backoff_factor < 1,
            f"precision.backoff_factor={p.backoff_factor} must be in (0, 1)",
        )
        _require(
            p.growth_interval >= 1, f"precision.growth_interval={p.growth_interval} must be >= 1"
        )
    if c.comm.name != "powersgd":
        return
    comm = c.comm
    _require(
        comm.rank >= 1,
        f"comm.rank={comm.rank} is invalid: the PowerSGD rank must be >= 1 (1, 2 and 4 are usual)",
    )
    _require(
        comm.start_iter >= 0,
        f"comm.start_iter={comm.start_iter} is invalid: steps of plain allreduce must be >= 0",
    )
    _require(
        comm.min_compression_rate >= 0,
        f"comm.min_compression_rate={comm.min_compression_rate} must be >= 0",
    )
    _require(
        comm.orthogonalization_epsilon >= 0,
        f"comm.orthogonalization_epsilon={comm.orthogonalization_epsilon} must be >= 0",
    )
    _require(
        comm.compress in (None, "fp16", "bf16"),
        f"comm.compress={comm.compress!r} is invalid: choose fp16, bf16 or null (no wrapper)",
    )


def _validate_data_root(root: str | None) -> None:
    fix = "set data.root=/path/to/cifar-10-batches-py (or data.download=true with internet access)"
    _require(root is not None, f"data.root is not set: {fix}")
    path = Path(root).expanduser()
    _require(path.is_dir(), f"data.root={root} is not a directory: {fix}")
    folder = path if (path / "data_batch_1").exists() else path / "cifar-10-batches-py"
    _require(
        (folder / "data_batch_1").exists() and (folder / "test_batch").exists(),
        f"data.root={root} holds no CIFAR-10 python batches (data_batch_1 ... test_batch): {fix}",
    )


def exit_with(error: Exception, code: int = 2) -> None:
    if not isinstance(error, ReportedConfigError):
        print(f"error: {error}", file=sys.stderr)
    raise SystemExit(code)


def continues_run(run_dir: Path, config: DictConfig) -> bool:
    """A run dir with a run in it is only reused to resume it: from its checkpoints, or as a
    torchrun restart of the same job (which may not have saved one yet)."""
    if config.checkpoint.resume == "never":
        return False
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 or (
        "SUBMITIT_EXECUTOR" in os.environ and int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0
    )  # a requeued SLURM job, which may have been killed before its first checkpoint
    return restarted or any((run_dir / "checkpoints").glob("step_*.pt"))


class ValidateBeforeRun(Callback):
    """Hydra callback: reject a bad config before Hydra creates or writes any output dir, and
    write Hydra's record of the job (config, hydra, overrides) with secrets redacted."""

    def __init__(self, output_subdir: str | None = ".hydra") -> None:
        # Hydra's own hydra.output_subdir stays null: Hydra saves its record before any
        # callback runs, secrets included. This is where the redacted record goes instead.
        self.output_subdir = output_subdir

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config)
        run_dir = Path(config.hydra.run.dir)
        holds_run = any((run_dir / name).exists() for name in ("metrics.jsonl", "summary.json"))
        if holds_run and not continues_run(run_dir, config):
            exit_with(
                ConfigError(
                    f"hydra.run.dir={run_dir} already holds a run with no checkpoint to continue "
                    "from (or checkpoint.resume=never); it is left untouched. Choose a new "
                    "hydra.run.dir (or leave it unset for a fresh timestamped dir)"
                )
            )

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from framework.security import redact_multirun_master
        from framework.slurm import check_cluster

        self._check(config)
        try:  # before anything is submitted
            check_cluster(config.launcher)
        except ConfigError as error:
            exit_with(error)
        redact_multirun_master(config)  # the sweeper saves it next, as multirun.yaml

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        from framework.distributed import launched_rank
        from framework.security import write_hydra_record

        if self.output_subdir is None or launched_rank() != 0:  # only rank 0 writes the record
            return
        record = Path(config.hydra.runtime.output_dir, self.output_subdir)
        # A resumed run dir keeps the record of the command that created it: a resume that is
        # then refused must not have changed anything.
        if not (record / "config.yaml").exists():
            write_hydra_record(config, record)

    @staticmethod
    def _check(config: DictConfig) -> None:
        try:
            validate(config)
            _require(
                config.hydra.output_subdir is None,
                f"hydra.output_subdir={config.hydra.output_subdir} would make Hydra write its "
                "records with secrets unredacted: leave it null and set "
                "hydra.callbacks.validate.output_subdir instead",
            )
        except ConfigError as error:
            from framework.distributed import launched_rank

            if launched_rank() != 0:  # rank 0 says it once
                raise SystemExit(2) from None
            exit_with(error)
