"""Typed config schemas: the framework's own sections (trainer, checkpoint, dist, eval, the
launchers) and, for each group of options, the base schema of the keys the framework reads from
any option of it (data.batch_size, optimizer.lr_scaling, ...). framework/config/registry.py stores
them in Hydra's ConfigStore.

An option is two places: its YAML file in conf/<group>/ (extending its group's base, with
`_target_` and every value of its own, each with a comment) and its callable, whose signature
types those keys (config/keys.py, read from source). A typo, a wrong type or a value out of its
bounds fails at composition or validation and names the key; each default is in exactly one
place: an option's own values in its YAML file, the framework's keys here. A setting with a
fixed set of values is an enum here, a Literal in a callable's signature; a bound is part of the
type, here as in a signature (`Annotated[int, Ge(1)]`, annotated_types' bounds).

What a resumed run may change and what an evaluation must match are declared on the fields
themselves (`setting(..., resumable=True)`, `setting(..., eval_may_differ=True)`, and
`eval_must_match=True` on the groups an evaluation compares); framework/config/resume_rules.py
derives the lists from them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any

from annotated_types import Ge, Gt, Interval
from omegaconf import MISSING

# Field metadata keys (read by framework/config/resume_rules.py).
RESUMABLE = "resumable"  # a resumed run may change it: the next step computes the same
EVAL_MUST_MATCH = "eval_must_match"  # a group an evaluation compares with the training run's
EVAL_MAY_DIFFER = "eval_may_differ"  # in such a group, yet not which examples or weights are seen


def setting(
    default: Any = MISSING,
    *,
    resumable: bool = False,
    eval_must_match: bool = False,
    eval_may_differ: bool = False,
) -> Any:
    """A schema field that says what a resume and an evaluation may do with it."""
    metadata = {
        RESUMABLE: resumable,
        EVAL_MUST_MATCH: eval_must_match,
        EVAL_MAY_DIFFER: eval_may_differ,
    }
    if isinstance(default, list | dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    if isinstance(default, type):  # a nested schema
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


# --- choices ---------------------------------------------------------------------------------
class Mode(StrEnum):
    train = "train"
    eval = "eval"  # evaluate checkpoint.resume on eval.split, without training
    # print each rank's memory ledger (parameters, gradients, optimizer state, activations)
    # for this config and launcher.nproc_per_node, from a meta-device build; nothing is run
    estimate = "estimate"


class CheckpointFormat(StrEnum):
    auto = "auto"  # sharded under strategy=fsdp, file under strategy=ddp
    file = "file"  # step_<N>.pt: whole tensors, written by rank 0
    sharded = "sharded"  # step_<N>.dcp/: each rank writes its own shards (DCP)


class Split(StrEnum):
    val = "val"
    test = "test"


class OnNonFinite(StrEnum):
    stop = "stop"  # end the run at that step, saving nothing
    skip = "skip"  # drop that update and go on


class StopSignal(StrEnum):
    SIGTERM = "SIGTERM"
    SIGUSR1 = "SIGUSR1"
    SIGUSR2 = "SIGUSR2"
    SIGINT = "SIGINT"
    SIGHUP = "SIGHUP"


class Backend(StrEnum):
    auto = "auto"  # nccl on CUDA, else gloo
    gloo = "gloo"
    nccl = "nccl"


# --- the base schema of each group: the keys the framework reads from any option ---------------
@dataclass
class TaskConfig:
    _target_: str = MISSING  # a framework.components.tasks.Task subclass, or one of yours


@dataclass
class ModelConfig:
    _target_: str = MISSING  # an nn.Module class, or a function that returns one


@dataclass
class InitConfig:
    # Where the model's first weights come from: the model's own initialisation (init=none), a
    # file's (init=file, framework/components/initial_weights.py), or one of yours with plan().
    _target_: str = MISSING


# --- data -----------------------------------------------------------------------------------
@dataclass
class DataConfig:
    _target_: str = MISSING  # a function returning framework.components.data.Splits
    # per rank; global batch = batch_size * world_size * grad_accum (trainer.global_batch_size)
    batch_size: Annotated[int, Ge(1)] = setting(32, eval_may_differ=True)
    eval_batch_size: Annotated[int, Ge(1)] = setting(256, resumable=True, eval_may_differ=True)
    num_workers: Annotated[int, Ge(0)] = setting(0, resumable=True, eval_may_differ=True)
    pin_memory: bool = setting(True, resumable=True, eval_may_differ=True)  # CUDA only
    # only takes effect with num_workers > 0
    persistent_workers: bool = setting(True, resumable=True, eval_may_differ=True)
    shuffle: bool = setting(True, eval_may_differ=True)
    # training only; evaluation never drops or pads
    drop_last: bool = setting(True, eval_may_differ=True)
    # Batches samples that torch's default_collate cannot: {_target_: ...} naming a callable
    # (or a class, with _partial_ for arguments), e.g. framework.components.data.PadSequences.
    collate_fn: Any = None
    # The data's shape, which the models read by interpolation (model.num_classes:
    # ${data.num_classes}); each data option sets those it has.
    in_channels: int | None = None
    image_size: int | None = None
    num_classes: int | None = None
    num_features: int | None = None
    num_outputs: int | None = None
    vocab_size: int | None = None
    block_size: int | None = None  # tokens per sequence


# --- optimisation ---------------------------------------------------------------------------
class LrScaling(StrEnum):
    none = "none"
    linear = "linear"
    sqrt = "sqrt"


@dataclass
class OptimizerConfig:
    _target_: str = MISSING  # a torch.optim.Optimizer class; the runner gives it the parameters
    _partial_: bool = True
    lr: Annotated[float, Gt(0)] = MISSING  # each option's own
    weight_decay: Annotated[float, Ge(0)] = 0.0
    # lr is given for reference_batch_size; scale it to the actual global batch.
    lr_scaling: LrScaling = LrScaling.none
    reference_batch_size: Annotated[int, Ge(1)] = 256
    # Parameter groups: no weight decay on biases and normalisation weights (1-D parameters),
    # and lr multipliers by parameter name (fnmatch patterns: {"head.*": 10.0}; first match).
    no_weight_decay: bool = False
    lr_multipliers: dict[str, Annotated[float, Gt(0)]] = field(default_factory=dict)
    # Parameters that keep their values (fnmatch patterns: ["features.*"] freezes a trunk): no
    # gradient, not in the optimizer; DDP and FSDP are built knowing it (no
    # find_unused_parameters needed).
    freeze: list[str] = field(default_factory=list)


@dataclass
class SchedulerConfig:
    _target_: str = MISSING  # called with optimizer= and total_steps=: returns an LRScheduler
    _partial_: bool = True


@dataclass
class PrecisionConfig:
    _target_: str = MISSING  # a framework.components.precision.Precision, given device=
    _partial_: bool = True


@dataclass
class CommConfig:
    _target_: str = MISSING  # a framework.components.comm.Comm (a DDP comm hook), given env=
    _partial_: bool = True


@dataclass
class StrategyConfig:
    _target_: str = MISSING  # framework.components.strategy.DDP or FSDP


# --- launch, logging, trainer ---------------------------------------------------------------
# The launchers build nothing by `_target_`: these are their keys' types and bounds; every value,
# with what it does, is in the option's YAML (conf/launcher/<name>.yaml), as any option's is.
@dataclass
class LauncherConfig:
    name: str = MISSING
    nproc_per_node: Annotated[int, Ge(1)] = MISSING
    oversubscribe: bool = MISSING


@dataclass
class LocalLauncherConfig(LauncherConfig):
    """Ranks forked on this machine from the fork server the command started."""


@dataclass
class TorchrunLauncherConfig(LauncherConfig):
    """Workers started by torch.distributed's elastic agent (the engine behind `torchrun`)."""

    nnodes: str = MISSING  # N, or MIN:MAX (an int or a string)
    rdzv_endpoint: str = MISSING
    rdzv_host: bool = MISSING
    local_addr: str | None = MISSING
    max_restarts: Annotated[int, Ge(0)] = MISSING
    monitor_interval_s: Annotated[float, Gt(0)] = MISSING
    rdzv_last_call_s: Annotated[int, Ge(1)] = MISSING
    rdzv_keep_alive_s: Annotated[int, Ge(1)] = MISSING
    rdzv_keep_alive_attempts: Annotated[int, Ge(1)] = MISSING


@dataclass
class SubmititLauncherConfig(LauncherConfig):
    """One job per run (per sweep job) through hydra-submitit-launcher; one task per rank."""

    tasks_per_node: Annotated[int, Ge(1)] = MISSING
    gpus_per_node: Annotated[int, Ge(0)] = MISSING
    cpus_per_task: Annotated[int | None, Ge(1)] = MISSING
    mem_gb: Annotated[int | None, Ge(1)] = MISSING
    timeout_min: Annotated[int, Ge(1)] = MISSING
    signal_delay_s: Annotated[int, Ge(0)] = MISSING
    max_num_timeout: Annotated[int, Ge(0)] = MISSING
    master_port: Annotated[int | None, Ge(1)] = MISSING


@dataclass
class SlurmLauncherConfig(SubmititLauncherConfig):
    nodes: Annotated[int, Ge(1)] = MISSING
    partition: str | None = MISSING
    account: str | None = MISSING
    qos: str | None = MISSING
    constraint: str | None = MISSING


@dataclass
class SlurmLocalLauncherConfig(SubmititLauncherConfig):
    """submitit's local executor: the same job as launcher=slurm, on this machine, no cluster."""


@dataclass
class LoggerConfig:
    """A logger next to console + metrics.jsonl + summary.json (always written by rank 0)."""

    _target_: str = MISSING  # a framework.components.loggers sink (or one of yours)
    _partial_: bool = True


@dataclass
class DDPConfig:
    bucket_cap_mb: Annotated[float, Gt(0)] = 25.0  # DDP's default
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False


@dataclass
class DistConfig:
    backend: Backend = Backend.auto
    timeout_s: Annotated[float, Gt(0)] = setting(600.0, resumable=True)
    ddp: DDPConfig = field(default_factory=DDPConfig)


@dataclass
class EarlyStoppingConfig:
    """Stop when the objective has not improved for `patience` evaluations (trainer.eval_every)."""

    # evaluations without improvement; null: never stop early
    patience: Annotated[int | None, Ge(1)] = None
    min_delta: Annotated[float, Ge(0)] = 0.0  # an improvement smaller than this counts as none


@dataclass
class TrainerConfig:
    # optimizer steps; whichever of max_steps/max_epochs ends first
    max_steps: Annotated[int | None, Ge(1)] = setting(None, resumable=True)
    max_epochs: Annotated[int | None, Ge(1)] = setting(15, resumable=True)
    grad_accum: Annotated[int, Ge(1)] = 1  # micro-batches per optimizer step
    # Samples per optimizer step over all ranks; null: data.batch_size x ranks x grad_accum.
    # Set, grad_accum is derived from it for the job's number of ranks (leave grad_accum at 1),
    # so an elastic job that loses or gains a node keeps it (framework/config/batch.py).
    global_batch_size: Annotated[int | None, Ge(1)] = None
    clip_grad_norm: Annotated[float | None, Gt(0)] = None  # null: no clipping
    # steps between evaluations; 0 = only at the end
    eval_every: Annotated[int, Ge(0)] = setting(0, resumable=True)
    # At most this many batches per rank (data.eval_batch_size each) in every validation of a
    # training run, the final one included: the metrics are then those of the first batches of
    # each rank's shard. null: the whole split. The test split and mode=eval always see it all.
    eval_batches: Annotated[int | None, Ge(1)] = setting(None, resumable=True)
    log_every: Annotated[int, Ge(1)] = setting(10, resumable=True)  # steps between metric events
    seed: Annotated[int, Interval(ge=0, lt=2**32)] = 0  # what numpy's generator takes
    sync_batchnorm: bool = False
    # NHWC weights and images: faster convolutions on recent GPUs
    channels_last: bool = setting(False, resumable=True)
    # torch.compile the DDP model (DDP's optimizer splits graphs at bucket boundaries so
    # communication still overlaps): pays a compile at start-up for faster steps after.
    compile: bool = setting(False, resumable=True)
    # e.g. 0.999; evaluation then uses the averaged weights
    ema_decay: Annotated[float | None, Interval(gt=0, lt=1)] = None
    progress_bar: bool = setting(True, resumable=True)  # rank 0, only when stderr is a terminal
    # A non-finite loss (or, outside amp, gradient) on any rank: every rank sees it at the
    # same step. stop: end the run there, saving nothing; skip: drop that update and go on.
    on_nonfinite: OnNonFinite = setting(OnNonFinite.stop, resumable=True)
    # Signals that stop the run at the next step with a checkpoint (exit code 75, resumable).
    # SIGINT (Ctrl-C) always does.
    stop_signals: list[StopSignal] = setting(
        [StopSignal.SIGTERM, StopSignal.SIGUSR1, StopSignal.SIGUSR2], resumable=True
    )
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    # torch.profiler trace of these optimizer steps on rank 0 ([first, last], e.g. [10, 12]) into
    # <run dir>/profile/ (TensorBoard's profiler plugin or Perfetto open it); []: off.
    profile_steps: list[int] = field(default_factory=list)
    # Count the model's FLOPs once (one micro-batch's forward + backward, on the meta device
    # where it runs there) for the logged tflops_per_s and mfu; false: neither is logged.
    count_flops: bool = setting(True, resumable=True)
    # One device's dense peak TFLOP/s, for mfu. null: the GPU's from the table in
    # framework/components/utilization.py (by its name and the precision); on a CPU, or a GPU the
    # table lacks, no mfu is logged unless this is set.
    peak_tflops: Annotated[float | None, Gt(0)] = setting(None, resumable=True)


@dataclass
class CheckpointConfig:
    every: Annotated[int, Ge(0)] = (
        500  # optimizer steps between checkpoints; 0 = only the final one
    )
    keep: Annotated[int, Ge(1)] = 3  # newest checkpoints kept in <run dir>/checkpoints
    # auto: continue from the newest valid checkpoint in the run dir, if any; never; or a path.
    resume: str = "auto"
    final: bool = True  # also save when the run ends or stops on a signal / Ctrl-C
    # Keep the best K checkpoints by the objective (at every evaluation) in checkpoints/best/,
    # best.pt -> the best; 0: off. A data option with a test split is tested with the best.
    best: Annotated[int, Ge(0)] = 0
    format: CheckpointFormat = CheckpointFormat.auto
    # sharded only: periodic saves copy the shards to host memory and write them in the
    # background while the next steps train (sealed, and linked as last.pt, once written).
    async_save: bool = False


@dataclass
class EvalConfig:
    """mode=eval: evaluate checkpoint.resume without training."""

    split: Split = Split.val  # test: a data option with a test split


@dataclass
class Config:
    # train, or eval: evaluate the checkpoint checkpoint.resume on eval.split, writing into
    # <its run dir>/eval/ (never over the training run's own files), or estimate: print each
    # rank's memory ledger and exit (no run dir).
    mode: Mode = Mode.train
    eval: EvalConfig = field(default_factory=EvalConfig)
    task: Any = setting(MISSING, eval_must_match=True)
    model: Any = setting(MISSING, eval_must_match=True)
    # The weights training starts from. A resume takes them from its checkpoint instead, so
    # it may leave init out (the run records the file it started from in init.json).
    init: Any = setting(MISSING, resumable=True)
    data: Any = setting(MISSING, eval_must_match=True)
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    precision: Any = MISSING
    comm: Any = MISSING
    strategy: Any = MISSING
    launcher: Any = setting(MISSING, resumable=True)
    # Any number of loggers, each under its name: logger=[wandb,tensorboard,csv,mlflow].
    logger: dict[str, Any] = setting({}, resumable=True)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = setting(CheckpointConfig, resumable=True)
    dist: DistConfig = field(default_factory=DistConfig)
    # The summary metric the app returns to Hydra (sweepers such as optuna optimise it) and the
    # sweep summary lists first: val/<a metric of the task>, samples_per_s or wall_s. Null: the
    # task's main metric (val/accuracy for classification, val/r2, val/loss, val/elbo ...).
    objective: str | None = setting(None, resumable=True)
    # Module prefixes `_target_` may name, on top of torch, torchvision, framework and
    # experiments (framework/core/allowlist.py). Config files only: the command line cannot set it.
    allowed_targets: list[str] = setting([], resumable=True)
