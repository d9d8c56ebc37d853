"""Typed config schemas: the one source of every default (framework/config/registry.py
stores them in Hydra's ConfigStore).

Every shipped group option's YAML is `defaults: [/schema/<group>/<option>@_here_]` and nothing
else, so a typo or a wrong type fails at composition and names the key, and a default lives in
exactly one place: here (tests/unit/test_config.py checks that YAML files and constructors hold
no copy). A setting with a fixed set of values is an enum, so a wrong value fails at composition
too. Components are built by `_target_`; those that need runtime arguments (the optimizer its
parameters, precision its device) are `_partial_`.

What a resumed run may change and what an evaluation must match are declared on the fields
themselves (`setting(..., resumable=True)`, `setting(..., eval_may_differ=True)`, and
`eval_must_match=True` on the groups an evaluation compares); framework/config/resume_rules.py
derives the lists from them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

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


class WireDtype(StrEnum):
    fp16 = "fp16"
    bf16 = "bf16"


class Reconstruction(StrEnum):
    mse = "mse"
    bce = "bce"  # Bernoulli likelihood of inputs in [0, 1]


class WandbMode(StrEnum):
    auto = "auto"  # online when credentials exist, else offline
    online = "online"
    offline = "offline"
    disabled = "disabled"


# --- models ---------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    _target_: str = MISSING
    num_classes: int = "${data.num_classes}"  # type: ignore[assignment]
    in_channels: int = "${data.in_channels}"  # type: ignore[assignment]


@dataclass
class MLPConfig(ModelConfig):
    """Flatten + Linear/ReLU blocks; no BatchNorm or dropout (exact DDP parity tests)."""

    _target_: str = "framework.components.models.MLP"
    image_size: int = "${data.image_size}"  # type: ignore[assignment]
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 128])


@dataclass
class CNNConfig(ModelConfig):
    """Three 3x3 conv layers + global average pooling; fits 8x8 digits and 32x32 CIFAR."""

    _target_: str = "framework.components.models.SmallCNN"
    width: int = 32


@dataclass
class ResNet18Config(ModelConfig):
    _target_: str = "framework.components.models.resnet18_cifar"


@dataclass
class ResNet50Config(ModelConfig):
    _target_: str = "framework.components.models.resnet50"


@dataclass
class FeedForwardConfig:
    """Linear-GELU blocks from data.num_features to data.num_outputs (tables)."""

    _target_: str = "framework.components.models.FeedForward"
    in_features: int = "${data.num_features}"  # type: ignore[assignment]
    out_features: int = "${data.num_outputs}"  # type: ignore[assignment]
    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    dropout: float = 0.0


@dataclass
class VAEModelConfig:
    """MLP encoder to a Gaussian latent, MLP decoder to one logit per pixel."""

    _target_: str = "framework.components.models.VAE"
    in_channels: int = "${data.in_channels}"  # type: ignore[assignment]
    image_size: int = "${data.image_size}"  # type: ignore[assignment]
    latent_dim: int = 8
    hidden_size: int = 256
    sample: bool = True  # false: the latent is its mean (deterministic, for parity tests)


@dataclass
class GPTConfig:
    """A nanoGPT-style decoder-only transformer over data.vocab_size tokens."""

    _target_: str = "framework.components.models.GPT"
    vocab_size: int = "${data.vocab_size}"  # type: ignore[assignment]
    block_size: int = "${data.block_size}"  # type: ignore[assignment]
    layers: int = 4
    heads: int = 4
    width: int = 128
    dropout: float = 0.0


# --- data -----------------------------------------------------------------------------------
@dataclass
class DataConfig:
    _target_: str = MISSING  # a function returning framework.components.data.Splits
    # per rank; global batch = batch_size * world_size * grad_accum
    batch_size: int = setting(32, eval_may_differ=True)
    eval_batch_size: int = setting(256, resumable=True, eval_may_differ=True)
    num_workers: int = setting(0, resumable=True, eval_may_differ=True)
    pin_memory: bool = setting(True, resumable=True, eval_may_differ=True)  # CUDA only
    # only takes effect with num_workers > 0
    persistent_workers: bool = setting(True, resumable=True, eval_may_differ=True)
    shuffle: bool = setting(True, eval_may_differ=True)
    # training only; evaluation never drops or pads
    drop_last: bool = setting(True, eval_may_differ=True)
    # Batches samples that torch's default_collate cannot: {_target_: ...} naming a callable
    # (or a class, with _partial_ for arguments), e.g. framework.components.data.PadSequences.
    collate_fn: Any = None
    in_channels: int = 3
    image_size: int = 32
    num_classes: int = 10


@dataclass
class DigitsConfig(DataConfig):
    """scikit-learn's bundled digits: 1,797 real 8x8 grey images, 10 classes. No download."""

    _target_: str = "framework.components.data.digits"
    in_channels: int = 1
    image_size: int = 8
    val_fraction: float = 0.2  # held-out share (360 images)
    test_fraction: float = 0.0  # a further held-out test split (0: none)
    split_seed: int = 0
    normalize: bool = True  # pixels in [-1, 1]; false: [0, 1] (for task.reconstruction=bce)


@dataclass
class DiabetesConfig(DataConfig):
    """scikit-learn's bundled diabetes: 442 patients, 10 features, a real-valued target."""

    _target_: str = "framework.components.data.diabetes"
    batch_size: int = setting(16, eval_may_differ=True)
    num_features: int = 10
    num_outputs: int = 1
    val_fraction: float = 0.2  # held-out share (88 patients)
    test_fraction: float = 0.0  # a further held-out test split (0: none)
    split_seed: int = 0


@dataclass
class TextConfig(DataConfig):
    """English text shipped with Python (pydoc_data.topics), one token per ASCII character."""

    _target_: str = "framework.components.data.text"
    batch_size: int = setting(16, eval_may_differ=True)
    eval_batch_size: int = setting(64, resumable=True, eval_may_differ=True)
    block_size: int = 128  # tokens of context per sequence
    stride: int = 128  # training windows start every `stride` tokens
    val_fraction: float = 0.1  # the last 10% of the text
    vocab_size: int = 128


@dataclass
class SyntheticConfig(DataConfig):
    """Random CIFAR-shaped tensors with learnable labels; sized by config, for throughput."""

    _target_: str = "framework.components.data.synthetic"
    train_size: int = 2048
    val_size: int = 512
    seed: int = 0


@dataclass
class Cifar10Config(DataConfig):
    """CIFAR-10 from a local folder in torchvision's format (data.root)."""

    _target_: str = "framework.components.data.cifar10"
    batch_size: int = setting(128, eval_may_differ=True)
    eval_batch_size: int = setting(512, resumable=True, eval_may_differ=True)
    num_workers: int = setting(2, resumable=True, eval_may_differ=True)
    # .../cifar-10-batches-py, or its parent folder
    root: str | None = setting(None, resumable=True, eval_may_differ=True)
    # fetch it (needs internet access)
    download: bool = setting(False, resumable=True, eval_may_differ=True)
    augment: bool = True  # random crop + horizontal flip on the training split


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
    # Parameter groups: no weight decay on biases and normalisation weights (1-D parameters),
    # and lr multipliers by parameter name (fnmatch patterns: {"head.*": 10.0}; first match).
    no_weight_decay: bool = False
    lr_multipliers: dict[str, float] = field(default_factory=dict)


@dataclass
class SGDConfig(OptimizerConfig):
    _target_: str = "torch.optim.SGD"
    weight_decay: float = 5e-4
    momentum: float = 0.9
    nesterov: bool = False
    # torch's fused kernel: one kernel per step, and a non-finite step is dropped on the device
    # (trainer.on_nonfinite=skip, amp's GradScaler) without reading it on the host.
    fused: bool = True


@dataclass
class AdamWConfig(OptimizerConfig):
    _target_: str = "torch.optim.AdamW"
    lr: float = 1e-3
    weight_decay: float = 0.01
    no_weight_decay: bool = True  # decoupled decay is meant for weight matrices
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    fused: bool = True  # as SGDConfig.fused


@dataclass
class SchedulerConfig:
    _target_: str = MISSING
    _partial_: bool = True


@dataclass
class ConstantSchedulerConfig(SchedulerConfig):
    _target_: str = "framework.components.schedulers.constant"


@dataclass
class CosineSchedulerConfig(SchedulerConfig):
    """Linear warmup for warmup_steps, then cosine decay to min_lr_ratio * lr at the end."""

    _target_: str = "framework.components.schedulers.cosine_with_warmup"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclass
class StepSchedulerConfig(SchedulerConfig):
    """Multiply the lr by gamma every step_size optimizer steps."""

    _target_: str = "framework.components.schedulers.step"
    step_size: int = 100
    gamma: float = 0.1


# --- precision and communication (built with the device / the rank's DistEnv) ---------------
@dataclass
class PrecisionConfig:
    """fp32: plain float32."""

    _target_: str = "framework.components.precision.Precision"
    _partial_: bool = True


@dataclass
class BF16Config(PrecisionConfig):
    """Autocast to bfloat16 (fp32's exponent range: no loss scaling). Runs on CPU and CUDA."""

    _target_: str = "framework.components.precision.BF16"


@dataclass
class AmpConfig(PrecisionConfig):
    """float16 autocast + GradScaler (dynamic loss scaling)."""

    _target_: str = "framework.components.precision.AMP"
    init_scale: float = 65536.0
    growth_factor: float = 2.0  # scale *= this after growth_interval clean steps
    backoff_factor: float = 0.5  # scale *= this after a step with inf/NaN gradients
    growth_interval: int = 2000


@dataclass
class CommConfig:
    """DDP's built-in bucketed allreduce of fp32 gradients."""

    _target_: str = "framework.components.comm.Comm"
    _partial_: bool = True


@dataclass
class FP16CommConfig(CommConfig):
    """Gradients cast to float16 for the allreduce (half the bytes), cast back after."""

    _target_: str = "framework.components.comm.CompressedAllreduce"
    wire: WireDtype = WireDtype.fp16


@dataclass
class BF16CommConfig(FP16CommConfig):
    """Gradients cast to bfloat16 for the allreduce (half the bytes), cast back after."""

    wire: WireDtype = WireDtype.bf16


@dataclass
class PowerSGDConfig(CommConfig):
    """PowerSGD low-rank gradient compression (gloo-safe: framework/components/comm.py)."""

    _target_: str = "framework.components.comm.PowerSGD"
    rank: int = 2  # matrix_approximation_rank: higher = more accurate, more bytes
    start_iter: int = 10  # plain allreduce for this many steps first (torch's default: 1000)
    min_compression_rate: float = 2.0  # compress a matrix only if it shrinks by this much
    error_feedback: bool = True  # carry each rank's compression error into its next step
    warm_start: bool = True  # reuse last step's Q instead of a fresh random one
    orthogonalization_epsilon: float = 0.0  # > 0: Gram-Schmidt with this epsilon; 0: QR
    compress: WireDtype | None = None  # wire dtype of the uncompressed part (null: fp32)
    seed: int = 0  # random projections, identical on every rank


# --- strategy: how the model is spread over the ranks (framework/components/strategy.py) ----
@dataclass
class StrategyConfig:
    """DDP: every rank holds the whole model and optimizer; gradients are all-reduced (with
    comm=<option>'s hook and dist.ddp.*)."""

    _target_: str = "framework.components.strategy.DDP"


@dataclass
class FSDPConfig(StrategyConfig):
    """FSDP2 (torch.distributed.fsdp.fully_shard): parameters, gradients and optimizer state
    sharded over the ranks of a 1-D mesh (a 2-D (replicate, shard) mesh is HSDP, not built yet)."""

    _target_: str = "framework.components.strategy.FSDP"
    # Module classes sharded one by one (class names, or module.ClassName), then the root.
    # null: the model's own blocks (GPT: TransformerBlock; ResNets: BasicBlock, Bottleneck;
    # others: only the root, one unit).
    block_classes: list[str] | None = None
    # true: free each unit's gathered parameters after its forward, gather again for backward
    # (less memory); false: keep them to the backward (one all-gather less per unit).
    reshard_after_forward: bool = True


# --- tasks (framework/components/tasks/) ----------------------------------------------------
@dataclass
class TaskConfig:
    _target_: str = MISSING  # a framework.components.tasks.Task subclass


@dataclass
class ClassificationConfig(TaskConfig):
    """Cross-entropy over class logits; val/accuracy, val/loss."""

    _target_: str = "framework.components.tasks.Classification"
    label_smoothing: float = 0.0  # training loss only; val/loss is the plain cross-entropy
    ignore_index: int | None = None  # a label to skip (per-pixel labels with a void class)


@dataclass
class RegressionConfig(TaskConfig):
    """Squared error; val/r2, val/mse, val/mae."""

    _target_: str = "framework.components.tasks.Regression"


@dataclass
class LanguageModelConfig(TaskConfig):
    """Next-token cross-entropy per token; val/loss, val/perplexity, val/bits_per_char."""

    _target_: str = "framework.components.tasks.LanguageModel"
    ignore_index: int = -100  # target value of padding: no loss, not counted
    chars_per_token: float = 1.0  # for bits_per_char (1: one token per character)
    sample_tokens: int = 300  # text generated into samples.txt at the end (0: none)


@dataclass
class AutoencoderConfig(TaskConfig):
    """Reconstruct the inputs; vae=true adds the KL term and reports val/elbo."""

    _target_: str = "framework.components.tasks.Autoencoder"
    vae: bool = False
    reconstruction: Reconstruction = Reconstruction.mse
    kl_weight: float = 1.0  # beta of a beta-VAE (1: the ELBO)


# --- launch, logging, trainer ---------------------------------------------------------------
@dataclass
class LauncherConfig:
    name: str = MISSING
    nproc_per_node: int = 2  # ranks started on this machine
    # Start more ranks than this machine holds (CPU: 4 per core; GPU: one per visible device):
    # refused unless true.
    oversubscribe: bool = False


@dataclass
class LocalLauncherConfig(LauncherConfig):
    """Spawn nproc_per_node ranks on this machine from the process Hydra started."""

    name: str = "local"
    nproc_per_node: int = "${default_ranks:}"  # type: ignore[assignment]  (one per GPU, else 2)


@dataclass
class TorchrunLauncherConfig(LauncherConfig):
    """Workers started by torch.distributed's elastic agent (the engine behind `torchrun`)."""

    name: str = "torchrun"
    nproc_per_node: int = "${default_ranks:}"  # type: ignore[assignment]  (one per GPU, else 2)
    # Nodes: N, or MIN:MAX (as torchrun's --nnodes) for an elastic job that goes on with the
    # nodes left after one is lost (needs max_restarts >= 1; docs/launchers.md). An int or a
    # string; node ranks are assigned by the rendezvous.
    nnodes: str = "1"
    rdzv_endpoint: str = "localhost:0"  # host:port of node 0; port 0 picks a free one (1 node)
    # Several nodes: true on the node at rdzv_endpoint, which hosts the rendezvous (and the run
    # dir's lock and record); every other node joins it. One node: ignored (it always hosts).
    rdzv_host: bool = False
    # This node's address as the other nodes reach it (null: its hostname, as torchrun).
    local_addr: str | None = None
    max_restarts: int = 0  # restart the whole group this many times after a worker dies
    monitor_interval_s: float = 0.5
    # c10d rendezvous timing (torch's defaults). Once MIN nodes have joined, a round waits
    # last_call_s for more before it starts; a node that sent no keep-alive for
    # keep_alive_s x keep_alive_attempts is dropped, and only then can a restart after a lost
    # node form its round: the survivors restart after about the sum of the two.
    rdzv_last_call_s: int = 30
    rdzv_keep_alive_s: int = 5
    rdzv_keep_alive_attempts: int = 3


@dataclass
class SubmititLauncherConfig(LauncherConfig):
    """One job per run (per sweep job) through hydra-submitit-launcher; one task per rank."""

    name: str = MISSING
    nproc_per_node: int = "${launcher.tasks_per_node}"  # type: ignore[assignment]
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
    """A logger next to console + metrics.jsonl + summary.json (always written by rank 0)."""

    _target_: str = MISSING  # a framework.components.loggers sink (or one of yours)
    _partial_: bool = True


@dataclass
class WandbLoggerConfig(LoggerConfig):
    """Weights & Biases, from rank 0 only; files under $WANDB_DIR when set, else the run dir."""

    _target_: str = "framework.components.loggers.WandbSink"
    project: str = "framework"
    entity: str | None = None
    group: str | None = None  # null: in a sweep, the sweep dir (one group per sweep)
    run_name: str | None = None  # null: the run dir's name (in a sweep: job number + overrides)
    tags: list[str] = field(default_factory=list)
    # auto: online when credentials exist (WANDB_API_KEY or `wandb login`), else offline
    # (then `wandb sync <run_dir>/wandb/offline-run-*` uploads later).
    mode: WandbMode = WandbMode.auto


@dataclass
class TensorBoardLoggerConfig(LoggerConfig):
    """TensorBoard event files in <run dir>/tensorboard."""

    _target_: str = "framework.components.loggers.TensorBoardSink"


@dataclass
class CsvLoggerConfig(LoggerConfig):
    """<run dir>/metrics.csv: one row per event, one column per metric."""

    _target_: str = "framework.components.loggers.CsvSink"
    filename: str = "metrics.csv"


@dataclass
class MLflowLoggerConfig(LoggerConfig):
    """An MLflow run in a tracking store: params, metrics by step, artifacts."""

    _target_: str = "framework.components.loggers.MLflowSink"
    tracking_uri: str | None = None  # null: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here
    experiment: str = "framework"
    run_name: str | None = None  # null: the run dir's name


@dataclass
class DDPConfig:
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False


@dataclass
class DistConfig:
    backend: Backend = Backend.auto
    timeout_s: float = setting(600.0, resumable=True)
    ddp: DDPConfig = field(default_factory=DDPConfig)


@dataclass
class EarlyStoppingConfig:
    """Stop when the objective has not improved for `patience` evaluations (trainer.eval_every)."""

    patience: int | None = None  # evaluations without improvement; null: never stop early
    min_delta: float = 0.0  # an improvement smaller than this counts as none


@dataclass
class TrainerConfig:
    # optimizer steps; whichever of max_steps/max_epochs ends first
    max_steps: int | None = setting(None, resumable=True)
    max_epochs: int | None = setting(15, resumable=True)
    grad_accum: int = 1  # micro-batches per optimizer step
    clip_grad_norm: float | None = None
    eval_every: int = setting(0, resumable=True)  # steps between evaluations; 0 = only at the end
    log_every: int = setting(10, resumable=True)  # steps between metric events
    seed: int = 0
    sync_batchnorm: bool = False
    # NHWC weights and images: faster convolutions on recent GPUs
    channels_last: bool = setting(False, resumable=True)
    # torch.compile the DDP model (DDP's optimizer splits graphs at bucket boundaries so
    # communication still overlaps): pays a compile at start-up for faster steps after.
    compile: bool = setting(False, resumable=True)
    ema_decay: float | None = None  # e.g. 0.999; evaluation then uses the averaged weights
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
    peak_tflops: float | None = setting(None, resumable=True)


@dataclass
class CheckpointConfig:
    every: int = 500  # optimizer steps between checkpoints; 0 = only the final one
    keep: int = 3  # newest checkpoints kept in <run dir>/checkpoints (>= 1)
    # auto: continue from the newest valid checkpoint in the run dir, if any; never; or a path.
    resume: str = "auto"
    final: bool = True  # also save when the run ends or stops on a signal / Ctrl-C
    # Keep the best K checkpoints by the objective (at every evaluation) in checkpoints/best/,
    # best.pt -> the best; 0: off. A data option with a test split is tested with the best.
    best: int = 0
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
    # <its run dir>/eval/ (never over the training run's own files).
    mode: Mode = Mode.train
    eval: EvalConfig = field(default_factory=EvalConfig)
    task: Any = setting(MISSING, eval_must_match=True)
    model: Any = setting(MISSING, eval_must_match=True)
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
