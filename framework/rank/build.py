"""Every object of a rank, built from its config group (the one place objects are built).

`build_parts` builds what training and evaluation share (task, data, precision, model) and checks
the task on a real batch; `build_optimization` and `build_training` what training adds. The
Runner (loop.py) is built from these bundles: `Parts`, `TrainingParts` and loop.py's `Outputs`.
The components get their own section of the config (a node to instantiate, or a typed section),
never the whole config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import random
import re
import sysconfig
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Imported with this module, before any process group exists. DDP's constructor imports it
# anyway; imported there, after gloo's threads had started, it made successful ranks abort at
# exit ("terminate called without an active exception") in 3 of ~100 runs (torch 2.13).
import torch._dynamo
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

import framework
from framework.components.data import (
    Loaders,
    Splits,
    build_loaders,
    load_splits,
    map_tensors,
    to_device,
)
from framework.components.ema import EMA
from framework.components.initial_weights import LoadPlan
from framework.components.optim import build_optimizer, describe_groups, freeze, scaled_lr
from framework.components.precision import Precision
from framework.components.tasks import Task, first_batch
from framework.components.utilization import (
    UtilizationMeter,
    device_peak_tflops,
    micro_batch_flops,
)
from framework.config import batch
from framework.config.schemas import TrainerConfig
from framework.config.validation import resolve_monitor
from framework.core import startup_clock
from framework.core.distributed import host_group
from framework.core.exits import ConfigError, ExitCode, first_line, outcome_of
from framework.core.launch_context import DistEnv
from framework.rank.model_selection import ModelSelection
from framework.rank.pruning import TrialReports
from framework.rank.state import Model, Optimization
from framework.rank.stopping import SignalExchange, StopRequests
from framework.storage.checkpoint import restore_rng, rng_state

log = logging.getLogger("framework")


@dataclass(frozen=True)
class Parts:
    """What training and evaluation share, built once per rank."""

    trainer: TrainerConfig
    device: torch.device
    task: Task
    splits: Splits
    loaders: Loaders
    precision: Precision
    model: Model
    train_batch: Any  # the first training batch: the pre-flight check and the FLOPs count
    global_batch_size: int
    total_steps: int


@dataclass(frozen=True)
class TrainingParts:
    """What training adds to the shared parts."""

    optimization: Optimization  # optimizer, schedule, precision and comm hook
    selection: ModelSelection  # what evaluations decide: best K, early stopping, test weights
    signals: SignalExchange  # the stop signals every rank agrees on at the same step
    meter: UtilizationMeter  # FLOP/s, MFU and peak memory on logging steps


def build_parts(cfg: DictConfig, env: DistEnv, device: torch.device) -> Parts:
    """Task, data, precision and model, the same initial weights on every rank, and the task
    checked on a real training batch."""
    trainer: TrainerConfig = OmegaConf.to_object(cfg.trainer)
    # For this round's number of ranks: an elastic job that shrinks or grows keeps the global
    # batch trainer.global_batch_size asked for.
    accumulation = batch.grad_accum(trainer, cfg.data.batch_size, env.world_size)
    trainer = dataclasses.replace(trainer, grad_accum=accumulation)
    global_batch_size = cfg.data.batch_size * env.world_size * trainer.grad_accum
    seed_everything(trainer.seed)  # same seed on every rank: identical initial weights
    log.info("Instantiating task <%s>", cfg.task._target_)
    with settings_refused("task", cfg.task):
        task = instantiate(cfg.task)
    splits, loaders = build_data(cfg.data, trainer, env, device, global_batch_size)
    startup_clock.mark("data")
    total_steps = planned_steps(trainer, len(loaders.train) // trainer.grad_accum)
    log.info("Instantiating precision <%s>", cfg.precision._target_)
    with settings_refused("precision", cfg.precision):
        precision = instantiate(cfg.precision)(device=device)
    ddp_options = OmegaConf.to_container(cfg.dist.ddp)  # DistributedDataParallel's keywords
    with refused_if_too_large(cfg.model, device):
        model = build_model(
            cfg.model,
            cfg.strategy,
            trainer,
            ddp_options,
            env,
            device,
            precision.param_dtype,
            frozen=cfg.optimizer.freeze,
        )
        # Read once: the pre-flight check and the FLOPs count run on the same first batch.
        train_batch = first_batch(splits.train, loaders.train.batch_size, loaders.train.collate_fn)
        if (warning := check_task(task, model.module, train_batch, device)) and env.is_main:
            log.warning(warning)
    startup_clock.mark("model")
    return Parts(
        trainer=trainer,
        device=device,
        task=task,
        splits=splits,
        loaders=loaders,
        precision=precision,
        model=model,
        train_batch=train_batch,
        global_batch_size=global_batch_size,
        total_steps=total_steps,
    )


def initial_plan(init_cfg: DictConfig, module: torch.nn.Module) -> LoadPlan | None:
    """init=<option>'s plan for `module`: which file tensor fills which key, checked (None:
    the weights as built). A mismatch is one line naming it (every rank raises alike)."""
    with settings_refused("init", init_cfg):
        initial = instantiate(init_cfg)
    return initial.plan(module)


def load_initial_weights(init_cfg: DictConfig, model: Model) -> LoadPlan | None:
    """The weights a run that starts afresh (or mode=eval) begins with, into the model and its
    EMA on every rank. A resume reads none: its checkpoint holds the weights."""
    plan = initial_plan(init_cfg, model.module)
    if plan is None:
        return None
    modules = (model.module, *([model.ema.module] if model.ema else []))
    if model.strategy.shards:  # each rank reads its own rows only
        held = max(plan.load_into_shards(module) for module in modules)
    else:
        tensors = plan.tensors()
        for module in modules:
            model.strategy.load_initial(module, tensors)
        held = sum(tensor.nbytes for tensor in tensors.values())
        del tensors
    left = f"; left as built: {', '.join(plan.skipped)}" if plan.skipped else ""
    log.info(
        "init: %d tensors from %s (at most %.2f MiB of them held at once)%s",
        len(plan.names),
        plan.source.path,
        held / 2**20,
        left,
    )
    return plan


def planned_steps(trainer_cfg: Any, steps_per_epoch: int) -> int:
    """Optimizer steps until max_steps or max_epochs, whichever comes first (validate()
    guarantees at least one is set)."""
    limits = []
    if trainer_cfg.max_steps is not None:
        limits.append(trainer_cfg.max_steps)
    if trainer_cfg.max_epochs is not None:
        limits.append(trainer_cfg.max_epochs * steps_per_epoch)
    return min(limits)


def step_limit(trainer_cfg: Any, steps_per_epoch: int) -> tuple[str, str]:
    """Which of max_steps and max_epochs ends the run (as planned_steps chose), said for a
    user: (the setting with its value, the key to raise)."""
    steps, epochs = trainer_cfg.max_steps, trainer_cfg.max_epochs
    by_epochs = epochs * steps_per_epoch if epochs is not None else None
    if by_epochs is not None and (steps is None or by_epochs < steps):
        return (
            f"trainer.max_epochs={epochs} ({epochs} x {steps_per_epoch} steps)",
            "trainer.max_epochs",
        )
    if by_epochs == steps:
        return (
            f"trainer.max_steps={steps} and trainer.max_epochs={epochs}",
            "both trainer.max_steps and trainer.max_epochs",
        )
    return f"trainer.max_steps={steps}", "trainer.max_steps"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_data(
    data: DictConfig,
    trainer: TrainerConfig,
    env: DistEnv,
    device: torch.device,
    global_batch_size: int,
) -> tuple[Splits, Loaders]:
    log.info("Instantiating data <%s>", data._target_)
    with settings_refused("data", data):
        splits = load_splits(data)  # the loaders' collate_fn is built below
    collate_node = data.get("collate_fn")
    collate_fn = built("data.collate_fn", collate_node) if collate_node is not None else None
    for split, keys in (("training", "train"), ("validation", "val")):
        if len(getattr(splits, keys)) == 0:  # (evaluation would fail after training)
            raise ConfigError(f"data: the {split} split of {data._target_} is empty: {_more(data)}")
    loaders = build_loaders(splits, data, env, trainer.seed, device, collate_fn)
    if len(loaders.train) < trainer.grad_accum:
        raise ConfigError(
            f"the training set ({len(splits.train)} samples) is smaller than one global batch "
            f"({global_batch_size}): lower data.batch_size, trainer.grad_accum or "
            "launcher.nproc_per_node"
        )
    return splits, loaders


# The keys of the shipped data options that size their splits.
SPLIT_KEYS = r"\w+_fraction|train_size|val_size|files|val_files"


def _more(data: DictConfig) -> str:
    """The fix for an empty split, in this data option's own keys."""
    named = [f"data.{key}" for key in data if re.fullmatch(SPLIT_KEYS, str(key))]
    return f"give it samples ({', '.join(named) or 'your loader decides its splits'})"


def build_model(
    model_cfg: DictConfig,
    strategy_cfg: DictConfig,
    trainer: TrainerConfig,
    ddp_options: Any,
    env: DistEnv,
    device: torch.device,
    param_dtype: torch.dtype | None = None,
    frozen: Iterable[str] = (),
) -> Model:
    """The model on the device, what forward runs on (DDP-wrapped or sharded by
    strategy=<option>), and its EMA. `param_dtype`: what FSDP gathers parameters in. A strategy
    that shards builds the model on the meta device and initialises each rank's shards after
    sharding: no rank holds the whole model. `frozen`: optimizer.freeze's patterns, applied
    before the strategy wraps it."""
    log.info("Instantiating strategy <%s>", strategy_cfg._target_)
    with settings_refused("strategy", strategy_cfg):
        strategy = instantiate(strategy_cfg)
    log.info("Instantiating model <%s>", model_cfg._target_)
    module, recipe = strategy.build(lambda: freeze(built("model", model_cfg), frozen), env)
    if trainer.sync_batchnorm and env.distributed:
        if device.type != "cuda":
            raise ConfigError(
                "trainer.sync_batchnorm=true needs CUDA devices (torch's SyncBatchNorm is "
                "GPU-only): set trainer.sync_batchnorm=false on CPU"
            )
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if recipe is None:  # on the meta device, it gets room on the device once sharded
        module = module.to(device)
    if trainer.channels_last:
        module = module.to(memory_format=torch.channels_last)
    ema = EMA(module, trainer.ema_decay) if trainer.ema_decay is not None else None
    train = strategy.wrap(module, ema and ema.module, env, device, ddp_options, param_dtype)
    if recipe is not None:
        strategy.materialize(recipe, [module, *([ema.module] if ema else [])], device)
    return Model(train, module, ema, strategy)


# What torch's allocators say when a request cannot be met (CPU: "can't allocate memory" or
# "not enough memory"; CUDA raises torch.OutOfMemoryError).
OUT_OF_MEMORY = re.compile(r"allocate memory|not enough memory|out of memory", re.IGNORECASE)
REQUESTED = re.compile(r"tried to allocate ([0-9.]+) ?(bytes|[KMGT]iB)", re.IGNORECASE)


@contextlib.contextmanager
def refused_if_too_large(model_cfg: DictConfig, device: torch.device) -> Iterator[None]:
    """A model too large for the device's memory is a config mistake: one line naming its
    largest setting, not the allocator's traceback. Nothing was trained, so its run dir goes."""
    try:
        yield
    except Exception as error:
        said = _out_of_memory(error)
        if said is None:
            raise
        amount = REQUESTED.search(said)
        asked = f": it asked for {_amount(amount)} at once" if amount else ""
        raise ConfigError(
            f"model: {model_cfg._target_} is too large for the {device.type} memory of this "
            f"machine{asked}; make it smaller ({_largest_setting(model_cfg)}), or shard it over "
            "the ranks with strategy=fsdp (built on the meta device, no rank holds it whole)"
        ) from None


# What a constructor raises when its settings are wrong: a ValueError of its own, a keyword it
# cannot take, torch's RuntimeError on a negative size, an assert. Any other exception (a
# NameError, an ImportError, a missing file) is a fault in code or files and keeps its traceback.
SETTINGS_ERRORS = (ValueError, TypeError, RuntimeError, AssertionError, ArithmeticError)
# Where a line would not tell a user what to change: installed libraries, Python's own, and the
# framework's wiring. A component's own file is named wherever it is (a shipped model's too).
LIBRARIES = tuple(
    str(Path(sysconfig.get_paths()[name]).resolve()) for name in ("stdlib", "purelib", "platlib")
)
FRAMEWORK = str(Path(framework.__file__).parent.resolve())


@contextlib.contextmanager
def settings_refused(path: str, node: DictConfig) -> Iterator[None]:
    """A component whose constructor refuses its settings is a config mistake, as if a rule had
    caught it before start-up: one line naming the option, what it was given, the error and
    the line of code that raised it (every rank raises alike; nothing was trained, so the run
    dir goes). The trial (rank/preflight.py) meets it before any rank starts; a rank, where
    only its device differs. A ConfigError of the component's own is its line as it is."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as error:
        cause = error.__cause__ if isinstance(error, InstantiationException) else error
        if isinstance(cause, ConfigError):
            raise cause from None
        # Out of memory, a peer lost, a timeout: each has its own exit (core/exits.py).
        if not isinstance(cause, SETTINGS_ERRORS) or outcome_of(cause).code is not ExitCode.FAILED:
            raise
        raise ConfigError(
            f"{path}: {node._target_}({_settings(node)}) refused its settings: "
            f"{type(cause).__name__}: {first_line(cause, 200).rstrip('.')}"
            f"{_raised_at(cause, str(node._target_))}: check {path}'s settings"
        ) from None


def built(path: str, node: DictConfig) -> Any:
    """The option at `path` instantiated, its constructor's refusal one line."""
    with settings_refused(path, node):
        return instantiate(node)


def _settings(node: DictConfig, limit: int = 120) -> str:
    """The keys the callable takes, as it got them (the framework's own keys left out)."""
    given = OmegaConf.to_container(node, resolve=True)
    takes = _parameters(str(node._target_))
    text = ", ".join(
        f"{key}={value!r}"
        for key, value in given.items()
        if key[:1] != "_" and (takes is None or key in takes)
    )
    return text if len(text) <= limit else text[:limit].rsplit(",", 1)[0] + ", ..."


def _parameters(target: str) -> set[str] | None:
    """The callable's keywords; None when it takes any (or cannot be read)."""
    try:
        parameters = inspect.signature(get_object(target)).parameters.values()
    except (ImportError, ValueError, TypeError, AttributeError):
        return None
    if any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters):
        return None
    return {parameter.name for parameter in parameters}


def _raised_at(error: BaseException, target: str) -> str:
    """The line that raised it, in the component's own code (a project's model, a shipped
    model's file); nothing when it was raised in torch or the framework's wiring."""
    own = _source_file(target)
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if (path := str(Path(frame.filename).resolve())) == own
        or not path.startswith((*LIBRARIES, FRAMEWORK))
    ]
    if not frames:
        return ""
    where = Path(frames[-1].filename).resolve()
    with contextlib.suppress(ValueError):
        where = where.relative_to(Path.cwd())
    return f" (raised at {where}:{frames[-1].lineno})"


def _source_file(target: str) -> str | None:
    """The file that defines the component, unless a library installed beside the framework
    (torch's optimizers) does."""
    try:
        path = str(Path(inspect.getsourcefile(get_object(target)) or "").resolve())
    except (ImportError, ValueError, TypeError, AttributeError):
        return None
    return None if path.startswith(LIBRARIES) and not path.startswith(FRAMEWORK) else path


def _out_of_memory(error: BaseException | None) -> str | None:
    """torch's message when `error` (or what caused it: Hydra wraps it) is an allocation
    that failed."""
    while error is not None:
        if isinstance(error, torch.OutOfMemoryError) or (
            isinstance(error, RuntimeError) and OUT_OF_MEMORY.search(str(error))
        ):
            return str(error)
        error = error.__cause__ or error.__context__
    return None


def _amount(amount: re.Match) -> str:
    """The allocator's request in GB, or in MiB below a GB (a capped rank's is often a few)."""
    scale = {"bytes": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    size = float(amount.group(1)) * scale[amount.group(2).lower()]
    return f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 2**20:.1f} MiB"


def _largest_setting(model_cfg: DictConfig) -> str:
    sizes = {
        key: value
        for key, value in model_cfg.items()
        if isinstance(value, int) and not isinstance(value, bool)
    }
    if not sizes:
        return "its size settings"
    key = max(sizes, key=lambda name: sizes[name])
    return f"its largest setting is model.{key}={sizes[key]}"


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Whatever runs inside draws nothing from the streams training uses."""
    state = rng_state()
    try:
        yield
    finally:
        restore_rng(state)


@torch.no_grad()
def check_task(task: Task, module: torch.nn.Module, batch: Any, device: torch.device) -> str | None:
    """The task on a real training batch, before anything is written: a task that cannot read
    the data, or a model whose outputs do not fit it, is a ConfigError naming the fix (every
    rank sees the same batch and raises alike); what only looks wrong is returned, a warning.
    Eval mode and saved RNG: training is unchanged."""
    module.eval()
    with preserved_rng():
        on_device = to_device(batch, device)
        once = OneForwardPerInput(module)
        task.check(once, on_device)
        warning = task.undeclared_probabilities(once, on_device)
    module.train()
    return warning


class OneForwardPerInput(torch.nn.Module):
    """The model as the pre-flight check calls it: a call with the very objects an earlier call
    was given returns a copy of that call's outputs instead of running the model again (a task
    may change its outputs in place). The check's looks at the outputs, the loss and evaluate()
    all feed the model the same batch; under a sharding strategy each forward gathers the whole
    model. Anything else (a method such as a VAE's decode, .modules()) is the model's own."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.calls: dict[tuple, tuple[tuple, dict, Any]] = {}  # ids -> (args, kwargs, outputs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ids = (*map(id, args), *((name, id(value)) for name, value in kwargs.items()))
        if ids not in self.calls:  # the inputs are kept with the outputs: their ids stay theirs
            self.calls[ids] = (args, kwargs, self.module(*args, **kwargs))
        return map_tensors(self.calls[ids][2], torch.Tensor.clone)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def build_optimization(
    cfg: DictConfig, env: DistEnv, parts: Parts, schedule_steps: int | None = None
) -> Optimization:
    """The DDP comm hook (registered on the model), optimizer and schedule, with precision.
    `schedule_steps`: the steps the schedule spans (default: the run's planned steps)."""
    schedule_steps = parts.total_steps if schedule_steps is None else schedule_steps
    model, precision = parts.model, parts.precision
    with settings_refused("comm", cfg.comm):
        comm = instantiate(cfg.comm)(env=env)
    comm.guard_nonfinite = parts.trainer.on_nonfinite == "skip"
    comm.attach(model.train, model.module, grad_scale=precision.loss_scale)
    comm.sharded = model.strategy.wire_bytes(model.module, parts.trainer.grad_accum)
    lr = scaled_lr(cfg.optimizer, parts.global_batch_size)
    log.info("Instantiating optimizer <%s> lr=%g", cfg.optimizer._target_, lr)
    overrides = model.strategy.optimizer_overrides(cfg.optimizer)
    with settings_refused("optimizer", cfg.optimizer):
        optimizer = build_optimizer(cfg.optimizer, model.module, lr, overrides)
    log.info("optimizer parameters: %s", describe_groups(optimizer, model.module))
    with settings_refused("scheduler", cfg.scheduler):
        scheduler = instantiate(cfg.scheduler)(optimizer=optimizer, total_steps=schedule_steps)
    return Optimization(optimizer, scheduler, precision, comm, schedule_steps)


def compiled(model: Model, compile: bool) -> Model:
    """trainer.compile: after the comm hook is registered on the DDP wrapper, which is what
    gets compiled; checkpoints keep the bare module's keys."""
    return dataclasses.replace(model, train=torch.compile(model.train)) if compile else model


def build_training(
    cfg: DictConfig,
    parts: Parts,
    optimization: Optimization,
    env: DistEnv,
    backend: str,
    requests: StopRequests,
) -> TrainingParts:
    """What training adds to the shared parts: the optimization (built earlier, before the
    model is compiled), what evaluations decide, the stop-signal exchange and the meter."""
    return TrainingParts(
        optimization=optimization,
        selection=ModelSelection.build(
            resolve_monitor(cfg.objective, parts.task.directions()),
            keep_best=cfg.checkpoint.best,
            early_stopping=parts.trainer.early_stopping,
            trial=TrialReports.build(env),
        ),
        # Stop signals travel on a CPU (gloo) group, also when training uses NCCL.
        signals=SignalExchange(env, requests, host_group(env, backend)),
        meter=build_meter(cfg.model, parts, env, parts.device),
    )


def build_meter(
    model_cfg: DictConfig, parts: Parts, env: DistEnv, device: torch.device
) -> UtilizationMeter:
    """The logged utilization: the FLOPs of one optimizer step of the whole job
    (trainer.count_flops) and one device's peak for MFU (trainer.peak_tflops or the table)."""
    trainer = parts.trainer
    step_flops = (
        step_flops_of(lambda: instantiate(model_cfg), parts, env, device)
        if trainer.count_flops
        else None
    )
    peak = device_peak_tflops(trainer.peak_tflops, device, parts.precision.name)
    return UtilizationMeter(step_flops, peak, device, env.rank, env.world_size)


def step_flops_of(
    new_model: Callable[[], torch.nn.Module], parts: Parts, env: DistEnv, device: torch.device
) -> int | None:
    """One micro-batch's FLOPs (forward + backward, on the first training batch and a fresh copy
    of the model: the trained model, the optimizer and the RNG streams stay as they were) x
    micro-batches per step x ranks."""
    with preserved_rng():
        flops, where = micro_batch_flops(
            parts.task,
            new_model,
            parts.train_batch,
            device,
            lambda batch, to: to_device(batch, to, False),
        )
    if flops is None:
        return None
    accumulation = parts.trainer.grad_accum
    step_flops = flops * accumulation * env.world_size
    log.info(
        "model FLOPs per optimizer step: %.4g = %.4g per micro-batch of %d x %d micro-batches x "
        "%d ranks (forward + backward, counted on %s)",
        step_flops,
        flops,
        parts.loaders.train.batch_size,
        accumulation,
        env.world_size,
        where,
    )
    return step_flops
