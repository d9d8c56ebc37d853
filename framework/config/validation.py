"""The config's rules, checked once before torch is imported: what each key is (config/keys.py:
keys, types and bounds declared beside the key), then the facts between keys, in one table
(`RULES`). Each raises ConfigError naming the setting and the fix. Where a rule goes is
docs/architecture.md's "Where a rule goes"; what needs the built parts is the trial's
(framework/rank/preflight.py).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable
from pathlib import Path

from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.config import batch
from framework.config import schemas as s
from framework.config.keys import check_keys
from framework.config.registry import shipped_choice
from framework.config.resolvers import gpu_count
from framework.core import launch_context
from framework.core.data_dirs import outside_data_dirs
from framework.core.devices import visible_gpus
from framework.core.exits import ConfigError
from framework.core.path_text import path_text_problem
from framework.core.signatures import class_literal

__all__ = ["check_keys", "check_rules", "validate"]

PROCESSES_PER_CORE = 4  # beyond this a CPU run only thrashes (launcher.oversubscribe insists)
RUN_METRICS = {"samples_per_s": "max", "wall_s": "min"}  # objectives every run reports
# The shipped callables some rules name.
ALLREDUCE = "framework.components.comm.Comm"
AMP = "framework.components.precision.AMP"
FSDP = "framework.components.strategy.FSDP"
CSV = "framework.components.loggers.CsvSink"
TASKS = "framework.components.tasks."
LANGUAGE_MODEL = f"{TASKS}LanguageModel"
TEXT = "framework.components.data.text"
TEXT_STREAM = "framework.components.data_stream.text_stream"
MLFLOW = "framework.components.loggers.MLflowSink"
# Loggers whose library is an optional dependency (the `loggers` dependency group).
LOGGER_PACKAGES = {
    "framework.components.loggers.TensorBoardSink": "tensorboard",
    MLFLOW: "mlflow",
}
Rule = Callable[[DictConfig], str | None]  # the whole config -> what is wrong, or None


def validate(cfg: DictConfig) -> None:
    """Every key and every fact between keys. Raises ConfigError with the setting and the fix."""
    check_keys(cfg)
    check_rules(cfg)


def check_rules(cfg: DictConfig) -> None:
    """The facts between keys, once the keys are known good."""
    try:
        for rule in RULES:
            if (problem := rule(cfg)) is not None:
                raise ConfigError(problem)
    except OmegaConfBaseException as error:  # a value that is not of its key's type
        raise ConfigError(f"{error.full_key}: {str(error).splitlines()[0]}") from None


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# --- the facts between keys, one rule each ----------------------------------------------------
def evaluation_names_a_checkpoint(cfg: DictConfig) -> str | None:
    initial = initial_weights_path(cfg)
    resume = cfg.checkpoint.resume
    if cfg.mode == "eval" and resume in ("auto", "never") and initial is None:
        return (
            "mode=eval evaluates a checkpoint: set checkpoint.resume=<run dir>/checkpoints/"
            "last.pt (or best.pt, or any step_*.pt), or a file's weights: init=file "
            "init.path=<file>"
        )
    if cfg.mode == "eval" and resume not in ("auto", "never") and initial is not None:
        return (
            f"mode=eval evaluates one set of weights: checkpoint.resume={resume} or "
            f"init.path={initial}; leave the other out"
        )
    return None


def initial_weights_path(cfg: DictConfig) -> str | None:
    """init.path of an init option that names a file (init=file), else None."""
    return cfg.init.get("path") if isinstance(cfg.get("init"), DictConfig) else None


def initial_weights_exist(cfg: DictConfig) -> str | None:
    """Read only, never written; what it holds is judged by the trial (which reads it). Said
    here for a run in a new dir; where the dir exists (a resume reads no init file: its
    checkpoint holds the weights), or where Hydra's node is gone (a job, a SLURM task), the
    trial judges, knowing whether the ranks will read it (launch/trial.py)."""
    path = initial_weights_path(cfg)
    if path is None or os.path.exists(Path(path).expanduser()) or not _in_a_new_dir(cfg):
        return None
    return (
        f"init.path={path} does not exist: give a .safetensors file, a folder of them "
        "(Hugging Face's layout), or a checkpoint (<run dir>/checkpoints/last.pt)"
    )


def _in_a_new_dir(cfg: DictConfig) -> bool:
    multirun = OmegaConf.select(cfg, "hydra.mode") == RunMode.MULTIRUN
    folder = OmegaConf.select(cfg, "hydra.sweep.dir" if multirun else "hydra.run.dir")
    return folder is not None and not os.path.exists(Path(folder).expanduser())


def an_estimate_is_one_config(cfg: DictConfig) -> str | None:
    if cfg.mode == "estimate" and OmegaConf.select(cfg, "hydra.mode") == RunMode.MULTIRUN:
        return (
            "mode=estimate prints one config's memory per rank: run it without -m (one command "
            "per setting you would sweep)"
        )
    return None


def test_split_was_held_out(cfg: DictConfig) -> str | None:
    """(the training run's data settings: a resume or an evaluation takes its record's)"""
    if cfg.mode == "eval" and cfg.eval.split == "test" and cfg.data.get("test_fraction", 1) <= 0:
        return (
            "eval.split=test: the run was trained with data.test_fraction=0, so it held out no "
            "test split (every sample went to training or validation): use eval.split=val, or "
            "train a run with data.test_fraction > 0"
        )
    return None


def training_has_an_end(cfg: DictConfig) -> str | None:
    if cfg.trainer.max_steps is None and cfg.trainer.max_epochs is None:
        return "trainer.max_steps and trainer.max_epochs are both null: set at least one"
    return None


def early_stopping_counts_evaluations(cfg: DictConfig) -> str | None:
    if cfg.trainer.early_stopping.patience is not None and cfg.trainer.eval_every < 1:
        return (
            "trainer.early_stopping.patience counts evaluations: set trainer.eval_every "
            "(steps between evaluations) >= 1"
        )
    return None


def profiled_steps_are_a_range(cfg: DictConfig) -> str | None:
    steps = list(cfg.trainer.profile_steps)
    if steps == [] or (len(steps) == 2 and 1 <= steps[0] <= steps[1]):
        return None
    return (
        f"trainer.profile_steps={steps} is invalid: give [first, last] optimizer steps, e.g. "
        "[10, 12], or [] (off)"
    )


def global_batch_divides(cfg: DictConfig) -> str | None:
    """trainer.global_batch_size divides into per-rank batches at every number of ranks this
    job can have (an elastic range: each of them), so no round of it is refused mid-run."""
    wanted = cfg.trainer.global_batch_size
    if wanted is None:
        return None
    if cfg.trainer.grad_accum != 1:
        return (
            f"trainer.grad_accum={cfg.trainer.grad_accum} with trainer.global_batch_size="
            f"{wanted}: the accumulation is derived from the global batch; leave "
            "trainer.grad_accum at 1, or set trainer.global_batch_size=null"
        )
    batch.check(wanted, cfg.data.batch_size, *world_sizes(cfg))
    return None


def background_saves_write_shards(cfg: DictConfig) -> str | None:
    if cfg.checkpoint.async_save and not sharded_checkpoints(cfg):
        return (
            "checkpoint.async_save=true writes sharded checkpoints in the background, and this "
            "run writes one file from rank 0: add checkpoint.format=sharded (the default under "
            "strategy=fsdp)"
        )
    return None


def resume_names_a_checkpoint(cfg: DictConfig) -> str | None:
    resume = cfg.checkpoint.resume
    if resume in ("auto", "never"):
        return None
    path = Path(resume).expanduser()
    if os.path.isfile(path) or os.path.isfile(path / ".metadata"):  # DCP's index: sharded
        return None
    return (
        f"checkpoint.resume={resume} is no checkpoint: give a checkpoint file or folder "
        "(<run dir>/checkpoints/last.pt), auto or never"
    )


# Said here, where /proc tells, and by the rank, where only torch can (another vendor's GPUs).
NCCL_WITHOUT_GPU = (
    "dist.backend=nccl needs CUDA devices and none is visible: use dist.backend=auto (gloo on "
    "CPU) or dist.backend=gloo"
)


def nccl_has_a_gpu(cfg: DictConfig) -> str | None:
    """Where the ranks run (submitting to SLURM, they run elsewhere)."""
    if cfg.dist.backend == "nccl" and not _submitting(cfg) and visible_gpus() == 0:
        return NCCL_WITHOUT_GPU
    return None


def one_launcher_per_srun_step(cfg: DictConfig) -> str | None:
    """For launchers that start the ranks themselves: `srun -n 4 train` starts 4 launchers,
    each with its own ranks and run dir. One task per node running launcher=torchrun with
    launcher.nnodes = the step's nodes (or a range holding it) is a real job."""
    launcher, here = cfg.launcher, launch_context.current()
    if launcher.name not in ("local", "torchrun") or isinstance(
        here, launch_context.TorchElastic | launch_context.SubmititTask
    ):
        return None
    tasks, nodes = here.srun_step()
    if launcher.name == "torchrun" and tasks == nodes:
        low, high = node_range(launcher.nnodes)
        if low <= nodes <= high:  # one task per node
            return None
    if tasks <= 1:
        return None
    return (
        f"this is one of {tasks} tasks of an srun step: with launcher={launcher.name} each task "
        "would start its own ranks and run dir. Submit with launcher=slurm (one task per rank), "
        "or start one task per node that runs launchers/torchrun.sh"
    )


def processes_fit_this_machine(cfg: DictConfig) -> str | None:
    """The launchers that start their ranks on this machine: processes it cannot hold (each
    rank, and each of its DataLoader workers, a process with a copy of the rank; on GPUs one
    device a rank) are refused before a single one is forked."""
    launcher = cfg.launcher
    if launcher.name not in ("local", "torchrun") or launcher.oversubscribe:
        return None
    nproc, workers = launcher.nproc_per_node, cfg.data.num_workers
    if (gpus := gpu_count()) and nproc > gpus:
        return (
            f"launcher.nproc_per_node={nproc}: this machine has {gpus} GPU(s) and each rank "
            f"drives one; use launcher.nproc_per_node<={gpus}, or launcher.oversubscribe=true "
            "to share them"
        )
    cores = len(os.sched_getaffinity(0))
    processes, most = nproc * (1 + workers), PROCESSES_PER_CORE * cores
    if processes <= most or (processes == nproc and nproc == 1):
        return None
    return (
        f"launcher.nproc_per_node={nproc} with data.num_workers={workers} is {processes} "
        f"processes (each rank and each of its DataLoader workers), far more than this "
        f"machine's {cores} CPU cores hold (at most {most}): lower them, or set "
        "launcher.oversubscribe=true to insist"
    )


def an_elastic_range_restarts(cfg: DictConfig) -> str | None:
    launcher = cfg.launcher
    if launcher.name != "torchrun":
        return None
    low, high = node_range(launcher.nnodes)
    if low == high or launcher.max_restarts >= 1:
        return None
    return (
        f"launcher.nnodes={launcher.nnodes} is an elastic range, which goes on after a lost node "
        "by restarting on the nodes left: set launcher.max_restarts>=1 (or a fixed "
        f"launcher.nnodes={high})"
    )


def every_node_finds_the_rendezvous(cfg: DictConfig) -> str | None:
    """host:port, or [IPv6]:port, with a port torch's rendezvous takes (it would refuse it only
    once the run dir exists), and on several nodes a port every node can name."""
    launcher = cfg.launcher
    if launcher.name != "torchrun":
        return None
    endpoint = str(launcher.rdzv_endpoint)
    if endpoint.startswith("["):
        rest = endpoint.partition("]")[2]
        port = rest[1:] if rest.startswith(":") else None
    else:
        port = endpoint.partition(":")[2] if endpoint.count(":") == 1 else None
    if port is not None and not (re.fullmatch(r"[0-9]{1,5}", port) and int(port) <= 65535):
        return (
            f"launcher.rdzv_endpoint={endpoint}: give host:port with a port from 0 to 65535 "
            "(0 picks a free one, on one node)"
        )
    if node_range(launcher.nnodes)[1] > 1 and endpoint.endswith(":0"):
        return (
            f"launcher.rdzv_endpoint={endpoint} with launcher.nnodes={launcher.nnodes}: port 0 "
            "picks a free port on one node, which no other node can find: give node 0's "
            "address and a port every node uses (e.g. launcher.rdzv_endpoint=node0:29500)"
        )
    return None


def slurm_tasks_drive_one_gpu_each(cfg: DictConfig) -> str | None:
    launcher = cfg.launcher
    if launcher.name not in ("slurm", "slurm_local"):
        return None
    gpus, tasks = launcher.gpus_per_node, launcher.tasks_per_node
    if gpus == 0 or tasks == gpus:
        return None
    return (
        f"launcher.tasks_per_node={tasks} with launcher.gpus_per_node={gpus}: each rank drives "
        f"one GPU, so set launcher.tasks_per_node={gpus} (or launcher.gpus_per_node={tasks})"
    )


def slurm_warns_before_its_time_limit(cfg: DictConfig) -> str | None:
    launcher = cfg.launcher
    if launcher.name not in ("slurm", "slurm_local") or "SIGUSR2" in cfg.trainer.stop_signals:
        return None
    return (
        f"launcher={launcher.name} needs SIGUSR2 in trainer.stop_signals: SLURM sends it "
        "launcher.signal_delay_s before the time limit so the ranks save before the job is "
        "requeued"
    )


def slurm_starts_its_own_tasks(cfg: DictConfig) -> str | None:
    launcher = cfg.launcher
    if launcher.name not in ("slurm", "slurm_local") or not isinstance(
        launch_context.current(), launch_context.TorchElastic
    ):
        return None
    return (
        f"launcher={launcher.name} under torchrun: SLURM starts one task per rank itself. Run "
        f"`train launcher={launcher.name} ...` directly (on the login node), not under torchrun"
    )


def fsdp_reduces_gradients_itself(cfg: DictConfig) -> str | None:
    """What FSDP's sharded gradients rule out: DDP's comm hooks, and a GradScaler that reads
    whole gradients on each rank."""
    if cfg.strategy._target_ != FSDP:
        return None
    if cfg.comm._target_ != ALLREDUCE:
        return (
            f"comm={shipped_choice('comm', cfg.comm)} is a DDP comm hook and strategy=fsdp "
            "reduce-scatters gradients itself: use comm=allreduce with strategy=fsdp, or "
            "strategy=ddp"
        )
    if cfg.precision._target_ == AMP:
        return (
            "precision=amp's GradScaler needs whole gradients on every rank and strategy=fsdp "
            "shards them: use precision=bf16 (or fp32) with strategy=fsdp, or strategy=ddp"
        )
    return None


def loggers_are_installed(cfg: DictConfig) -> str | None:
    for name, logger in cfg.logger.items():
        if not isinstance(logger, DictConfig) or "_target_" not in logger:
            return f"logger.{name} is not a logger: pick loggers by name, logger=[wandb,csv,...]"
        package = LOGGER_PACKAGES.get(logger._target_)
        if package is not None and importlib.util.find_spec(package) is None:
            return (
                f"logger={name} needs the {package} package, which is not installed: "
                "uv sync --group loggers (uv run pytest installs it with the dev group)"
            )
    return None


def loggers_write_into_the_run_dir(cfg: DictConfig) -> str | None:
    """A logger's file is a file of the run dir; a local MLflow store, which would write
    anywhere, comes only from the environment."""
    for name, logger in cfg.logger.items():
        if logger._target_ == CSV and (problem := file_name_problem(logger.filename)):
            return f"logger.{name}.filename={logger.filename} {problem}"
        if logger._target_ == MLFLOW and (problem := tracking_uri_problem(logger.tracking_uri)):
            return f"logger.{name}.tracking_uri={logger.tracking_uri} {problem}"
    return None


def data_files_lie_in_data_dirs(cfg: DictConfig) -> str | None:
    """A data option's `files` (data=text_stream's glob, a user's stream) chooses files the
    run reads, whose text a trained model and its samples carry into the run dir."""
    files = cfg.data.get("files")
    if not isinstance(files, str):
        return None
    if problem := outside_data_dirs(files, Path.cwd(), os.environ):
        return f"data.files={files} {problem}"
    return None


def a_classifier_reads_no_token_sequences(cfg: DictConfig) -> str | None:
    """A special case: a user who picks data=text and keeps the default classifier. Its
    windows are 128 tokens of a 128-token vocabulary, so GPT's logits [batch, time,
    vocabulary] have the shape a classifier's [batch, classes, time] would, and the time axis
    is taken for the classes: it trains, to nonsense, and no shape says so."""
    task = str(cfg.task._target_)
    text = cfg.data._target_ in (TEXT, TEXT_STREAM)
    if not text or task == LANGUAGE_MODEL or not task.startswith(TASKS):
        return None
    return (
        f"data={shipped_choice('data', cfg.data)} gives token sequences, which only "
        "task=language_model reads, not "
        f"task={shipped_choice('task', cfg.task)}: add task=language_model model=gpt "
        "(experiment=char_gpt has them)"
    )


def the_objective_is_reported(cfg: DictConfig) -> str | None:
    directions = task_directions(cfg.task)
    if directions is not None:  # (else the rank checks it, once it has built the task)
        resolve_objective(cfg.objective, directions)
    return None


# In order: what a run is asked to do, then how its steps are counted, where it saves, how its
# ranks start, how they communicate, what they write.
RULES: tuple[Rule, ...] = (
    evaluation_names_a_checkpoint,
    an_estimate_is_one_config,
    test_split_was_held_out,
    training_has_an_end,
    early_stopping_counts_evaluations,
    profiled_steps_are_a_range,
    global_batch_divides,
    background_saves_write_shards,
    resume_names_a_checkpoint,
    initial_weights_exist,
    nccl_has_a_gpu,
    one_launcher_per_srun_step,
    processes_fit_this_machine,
    an_elastic_range_restarts,
    every_node_finds_the_rendezvous,
    slurm_tasks_drive_one_gpu_each,
    slurm_warns_before_its_time_limit,
    slurm_starts_its_own_tasks,
    fsdp_reduces_gradients_itself,
    loggers_are_installed,
    loggers_write_into_the_run_dir,
    data_files_lie_in_data_dirs,
    a_classifier_reads_no_token_sequences,
    the_objective_is_reported,
)


# --- what the rules, the launchers and the ranks read of the config -------------------------
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


def sharded_checkpoints(cfg: DictConfig) -> bool:
    """checkpoint.format resolved: auto is sharded under strategy=fsdp."""
    chosen = cfg.checkpoint.format
    if chosen == s.CheckpointFormat.auto:
        return cfg.strategy._target_ == FSDP
    return chosen == s.CheckpointFormat.sharded


def _submitting(cfg: DictConfig) -> bool:
    """launcher=slurm from the submitting machine: the ranks will run on other nodes."""
    return cfg.launcher.name == "slurm" and not isinstance(
        launch_context.current(), launch_context.SubmititTask
    )


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


# What the run itself writes in its dir (storage/run_dir.py, the loggers' folders): a logger's
# file may not replace one. Names starting with "." are the run's too (.lock, temporary files).
RUN_DIR_NAMES = frozenset(
    {
        "config.yaml",
        "metrics.jsonl",
        "summary.json",
        "init.json",
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
    if problem := path_text_problem(filename):
        return problem
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
