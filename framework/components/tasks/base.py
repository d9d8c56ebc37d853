"""The Task interface, and helpers to read batches of any shape."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, default_collate

from framework.core.exits import ConfigError, is_out_of_memory

Count = int | torch.Tensor  # an int when it follows from shapes, else a tensor on the device


class TaskLoss:
    """A micro-batch's loss over its items (`Task.count` of them), and optional cheap training
    metrics over the same items (logged as train/<name>, per item).

    Built as `TaskLoss.sum(total)` or `TaskLoss.mean(value, count)`, never directly: the runner
    adds up sums over micro-batches and ranks and divides once by the global count, so a mean
    passed where a sum belongs would shrink the loss and the learning rate by the batch size.
    `total` is always the sum."""

    total: torch.Tensor
    sums: dict[str, torch.Tensor]
    built_as: str  # "sum" or "mean": which the task said it is (the pre-flight check tests it)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "build a TaskLoss with TaskLoss.sum(total) or TaskLoss.mean(value, count): "
            "the runner needs to know which the loss is"
        )

    @classmethod
    def _made(
        cls, total: torch.Tensor, sums: Mapping[str, torch.Tensor], built_as: str
    ) -> TaskLoss:
        loss = object.__new__(cls)
        loss.total, loss.sums, loss.built_as = total, dict(sums), built_as
        return loss

    @classmethod
    def sum(cls, total: torch.Tensor, sums: Mapping[str, torch.Tensor] | None = None) -> TaskLoss:
        """`total` (and each of `sums`) added up over the micro-batch's items."""
        return cls._made(total, sums or {}, "sum")

    @classmethod
    def mean(
        cls, value: torch.Tensor, count: Count, means: Mapping[str, torch.Tensor] | None = None
    ) -> TaskLoss:
        """`value` (and each of `means`) averaged over `count` items (`Task.count(batch)`)."""
        means = means or {}
        sums = {key: item * count for key, item in means.items()}
        return cls._made(value * count, sums, "mean")


class Task:
    """How a batch feeds the model, and what the loss and the metrics are.

    Subclasses set `metrics` ({name: "min" | "max"}, reported as val/<name>; the first is the
    run's default objective) and `states` (the sums evaluation adds up), and implement `count`,
    `loss`, `evaluate` and `compute`.
    """

    name: ClassVar[str] = "task"  # the option name, for messages (task=<name>)
    metrics: dict[str, str] = {}
    states: tuple[str, ...] = ()  # each a tensor of any fixed shape (a count, a confusion matrix)
    train_sums: tuple[str, ...] = ()  # keys of TaskLoss.sums logged during training
    # Each state's shape, as the pre-flight batch gave it (`check` sets it; evaluation packs
    # the states of every rank into one vector of these shapes, even on a rank with no batch).
    state_shapes: dict[str, tuple[int, ...]] = {}
    # Methods besides forward that `artifacts` calls on the model (a VAE's decode): a sharding
    # strategy gathers the parameters around them as it does around forward.
    model_methods: ClassVar[tuple[str, ...]] = ()
    # The loss that loss() applies to the model's outputs when it takes logits ("cross-entropy",
    # "bce"): the pre-flight check then refuses outputs that are all in [0, 1] (a model ending
    # in softmax or sigmoid trains badly, in silence). None: the outputs are not logits.
    logits_loss: str | None = None
    logits_dim: int = 1  # the class dimension of the logits (-1 for [batch, time, vocabulary])
    # What a batch must look like, for the message when it does not.
    reads: ClassVar[str] = "a batch"
    fix: ClassVar[str] = "pick a data option this task can read"

    def count(self, batch: Any) -> Count:
        """How many items the loss of this batch sums over (called on the batch before it moves
        to the device). An int must follow from the batch size, so that it is the same on every
        rank for full batches (the runner then needs no collective); a count that depends on
        the data (tokens that are not padding) is a tensor."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Any) -> TaskLoss:
        raise NotImplementedError

    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """This batch's contribution to every sum in `states`: tensors on the device, each of
        the same shape for every batch (a scalar count, per-class counts, a confusion matrix)."""
        raise NotImplementedError

    def compute(self, totals: dict[str, Any]) -> dict[str, float]:
        """The metrics from the states summed over the whole validation set: a float for a
        scalar state, a float64 CPU tensor of the state's shape otherwise."""
        raise NotImplementedError

    def check(self, model: nn.Module, batch: Any) -> None:
        """Raise ConfigError naming the task and the fix when it cannot train this model on
        this data. Called once, on a real batch, before the first step (eval mode, no grad):
        the loss, and what evaluation runs (evaluate, the states packed for the all-reduce,
        compute)."""
        try:
            loss = self.loss(model, batch)
            states = self.evaluate(model, batch)
            self.count(batch)
        except ConfigError:
            raise
        except Exception as error:  # noqa: BLE001 (any failure on a real batch is a misfit)
            raise self.failed_on(batch, error, model) from None
        if not isinstance(loss, TaskLoss):
            raise ConfigError(
                f"task={self.name}: loss() returned a {type(loss).__name__}: return "
                "TaskLoss.sum(total) or TaskLoss.mean(value, count)"
            )
        if loss.total.dim() != 0:
            raise ConfigError(
                f"task={self.name}: the loss of a batch must be a scalar (a sum over its items), "
                f"got shape {list(loss.total.shape)}: reduce it with .sum()"
            )
        self._check_logits(model, batch)
        self._check_loss_is_a_sum(model, batch, loss)
        self._check_states_compute(states)

    def _check_logits(self, model: nn.Module, batch: Any) -> None:
        """`logits_loss` declared: the model's outputs (the first tensor it returns) must not be
        probabilities."""
        if self.logits_loss is None:
            return
        outputs = first_output(model, batch)
        if outputs is not None:
            require_logits(self.name, outputs, self.logits_loss, self.logits_dim)

    def undeclared_probabilities(self, model: nn.Module, batch: Any) -> str | None:
        """A warning where a task that never says whether its loss takes logits (no
        `logits_loss` of its own, None included) gets probabilities from the model: a loss
        that applies softmax or sigmoid itself then trains to worse numbers, in silence. None
        otherwise. Collective under a sharding strategy (a forward), like `check`."""
        declared = "logits_loss" in vars(self) or any(
            "logits_loss" in vars(cls) for cls in type(self).__mro__ if cls is not Task
        )
        outputs = None if declared else first_output(model, batch)
        ending = None if outputs is None else final_activation(outputs, self.logits_dim)
        if ending is None:
            return None
        return (
            f"task={self.name}: the model's outputs on the first batch are all in [0, 1] (a "
            f"final {ending}?): if the loss takes logits (cross-entropy, BCE with logits), drop "
            "that activation; say which in the task: logits_loss = 'cross-entropy' (checked), "
            "or logits_loss = None (the outputs are not logits: no warning)"
        )

    def _check_loss_is_a_sum(self, model: nn.Module, batch: Any, loss: TaskLoss) -> None:
        """A sum over a batch doubles when the batch is repeated; a mean stays the same. So
        TaskLoss.sum of a mean stays the same, and TaskLoss.mean of a sum (times the count,
        which doubles too) grows four times."""
        try:
            doubled = self.loss(model, repeated(batch)).total
        except Exception:  # noqa: BLE001 (a batch that cannot be repeated: nothing to compare)
            return
        single = float(loss.total)
        if abs(single) < 1e-12 or not math.isfinite(single):
            return
        if abs(float(doubled) - single) <= 1e-3 * abs(single):
            raise ConfigError(
                f"task={self.name}: loss() gave the same value for the batch repeated twice, so "
                "it is a mean, not a sum: return TaskLoss.mean(value, count) (or a sum, "
                "reduction='sum', as TaskLoss.sum)"
            )
        if loss.built_as == "mean" and abs(float(doubled) - 4 * single) <= 4e-3 * abs(single):
            raise ConfigError(
                f"task={self.name}: loss() gave 4 times the value for the batch repeated twice, "
                "so the value given to TaskLoss.mean(value, count) is a sum, not a mean: return "
                "TaskLoss.sum(value) (or the mean, reduction='mean', as TaskLoss.mean)"
            )

    def _check_states_compute(self, states: Mapping[str, Any]) -> None:
        missing = set(self.states) - set(states)
        if missing:
            raise ConfigError(f"task={self.name}: evaluate() does not return {sorted(missing)}")
        try:
            shapes = state_shapes(self, states)
            flat = pack_states(self, states, shapes, torch.device("cpu"))
            metrics = self.compute(unpack_states(self, flat, shapes))
        except ConfigError:
            raise
        except Exception as error:  # noqa: BLE001 (what evaluation would crash on, later)
            raise ConfigError(
                f"task={self.name}: compute() fails on one batch's states "
                f"({type(error).__name__}: {error}): fix compute() or evaluate()"
            ) from None
        missing_metrics = set(self.metrics) - set(metrics)
        if missing_metrics:
            raise ConfigError(
                f"task={self.name}: compute() does not return {sorted(missing_metrics)}, which "
                "`metrics` names"
            )
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() != 1:
                raise ConfigError(
                    f"task={self.name}: compute() returned a tensor of shape "
                    f"{list(value.shape)} for {name!r}: metrics are numbers (log one per class "
                    "under its own name)"
                )
        self.state_shapes = shapes

    def failed_on(self, batch: Any, error: Exception, model: nn.Module) -> Exception:
        """What a failure on a real batch means: the model's input settings where a layer of
        the model raised it (a Linear given the wrong width), else a task that does not fit
        this data; an allocation that failed is the rank's memory, and stays itself (exit 5,
        core/exits.py)."""
        if is_out_of_memory(error):
            return error
        layer = failing_layer(error, model)
        if layer is None:
            return self.misfit(batch, f"{type(error).__name__}: {error}")
        return ConfigError(
            f"the model cannot take this data's inputs, {batch_shapes(batch)}: its "
            f"{type(layer).__name__} raised {type(error).__name__}: {error}: match the model's "
            "input settings (model.in_features, model.in_channels, model.image_size) to the "
            "data's, or pick a model for this data"
        )

    def misfit(self, batch: Any, problem: str) -> ConfigError:
        return ConfigError(
            f"task={self.name} reads {self.reads}; this data gives {batch_shapes(batch)} "
            f"({problem}): {self.fix}"
        )

    def one_tensor(self, outputs: Any, what: str) -> torch.Tensor:
        """The model's outputs, where this task reads a single tensor of `what` from it; a
        ConfigError naming what it returned otherwise."""
        if isinstance(outputs, torch.Tensor):
            return outputs
        raise ConfigError(
            f"task={self.name} reads one tensor of {what} from the model, which returns "
            f"{batch_shapes(outputs)}: return one tensor from forward() (a VAE's (reconstruction, "
            "mu, logvar) goes with task=autoencoder task.vae=true)"
        )

    def artifacts(
        self, model: nn.Module, val_batch: Any, decode: Callable | None = None
    ) -> dict[str, torch.Tensor | str]:
        """What the trained model makes, by file name: images [N, C, H, W] in [0, 1] (`*.png`,
        drawn as a grid) or text (`*.txt`). Rank 0 writes them into the run dir at the end;
        `decode` turns token ids into text when the data gives it."""
        return {}

    def directions(self) -> dict[str, str]:
        return {f"val/{name}": direction for name, direction in self.metrics.items()}


def pick(batch: Any, position: int, key: str) -> Any:
    """An element of a batch: by `key` in a mapping, else by `position` in a sequence."""
    if isinstance(batch, Mapping):
        return batch[key]
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return batch[position]
    if position == 0:
        return batch  # a bare tensor is the inputs
    raise TypeError(f"no element {position} in a {type(batch).__name__}")


def batch_shapes(batch: Any) -> str:
    """`(float32 [32, 1, 8, 8], int64 [32])`: a batch's structure, for messages."""
    if isinstance(batch, torch.Tensor):
        return f"{str(batch.dtype).removeprefix('torch.')} {list(batch.shape)}"
    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{k!r}: {batch_shapes(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return "(" + ", ".join(batch_shapes(item) for item in batch) + ")"
    return type(batch).__name__


def first_output(model: nn.Module, batch: Any) -> torch.Tensor | None:
    """The first tensor the model returns for the batch's inputs (in a tuple, list or dict)."""
    outputs = model(pick(batch, 0, "inputs"))
    while not isinstance(outputs, torch.Tensor):
        if isinstance(outputs, Mapping) and outputs:
            outputs = next(iter(outputs.values()))
        elif isinstance(outputs, list | tuple) and outputs:
            outputs = outputs[0]
        else:
            return None
    return outputs


def final_activation(outputs: torch.Tensor, class_dim: int = 1) -> str | None:
    """ "softmax" or "sigmoid" where the outputs look like probabilities (all in [0, 1], rows
    summing to 1 for softmax), else None: raw logits of an untrained model are almost never
    all in [0, 1]."""
    values = outputs.detach().float()
    if values.numel() < 8 or values.min() < 0 or values.max() > 1:
        return None
    rows_sum_to_one = values.dim() > class_dim and torch.allclose(
        values.sum(dim=class_dim), torch.ones(()), atol=1e-3
    )
    return "softmax" if rows_sum_to_one else "sigmoid"


def require_logits(task: str, outputs: torch.Tensor, loss: str, class_dim: int = 1) -> None:
    """Refuse probabilities where a loss takes logits (a model ending in sigmoid or softmax
    trains badly in silence). Called by a task's `check` on the pre-flight batch."""
    ending = final_activation(outputs, class_dim)
    if ending is None:
        return
    raise ConfigError(
        f"task={task}: the model's outputs are all in [0, 1] (a final {ending}?), but {loss} "
        "takes logits: drop the model's last activation (the loss applies it, more stably)"
    )


def state_sum(values: torch.Tensor) -> torch.Tensor:
    """A sum state from per-item values, added up in float64: evaluation sums the same items on
    any number of ranks, only in other batches, and float32 sums of other batches round
    differently (float64 keeps the difference below what the metrics show)."""
    return values.double().sum()


def repeated(batch: Any) -> Any:
    """The batch twice over, along its first dimension (every tensor, any nesting)."""
    if isinstance(batch, torch.Tensor):
        return torch.cat([batch, batch])
    if isinstance(batch, Mapping):
        return {key: repeated(value) for key, value in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(repeated(item) for item in batch)
    return batch


def state_shapes(task: Task, states: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(torch.as_tensor(states[name]).shape) for name in task.states}


def pack_states(
    task: Task, states: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], device: Any
) -> torch.Tensor:
    """Every state flattened into one float64 vector on `device`, in `task.states` order: one
    all-reduce sums them all, whatever their shapes."""
    parts = []
    for name in task.states:
        value = torch.as_tensor(states[name], device=device).double()
        if tuple(value.shape) != tuple(shapes.get(name, ())):
            raise ConfigError(
                f"task={task.name}: evaluate() returned {name!r} of shape {list(value.shape)}, "
                f"not {list(shapes.get(name, ()))} as on the first batch: a state keeps one "
                "shape on every batch and rank"
            )
        parts.append(value.reshape(-1))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)


def unpack_states(
    task: Task, flat: torch.Tensor, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, Any]:
    """The summed vector back into states: a float per scalar, a CPU tensor otherwise."""
    totals, start, flat = {}, 0, flat.cpu()
    for name in task.states:
        shape = tuple(shapes.get(name, ()))
        size = math.prod(shape)
        value = flat[start : start + size].reshape(shape)
        totals[name] = value.item() if not shape else value
        start += size
    return totals


def first_batch(dataset: Dataset, size: int, collate: Callable | None = None) -> Any:
    """The first `size` samples as one batch, read without a loader (no generator is drawn).
    Samples that cannot be batched are a ConfigError naming where they differ. A streamed
    split (an IterableDataset) gives its first `size` samples."""
    if isinstance(dataset, IterableDataset):
        items = list(itertools.islice(dataset, size))
    else:
        items = [dataset[index] for index in range(min(size, len(dataset)))]
    try:
        return (collate or default_collate)(items)
    except Exception as error:  # noqa: BLE001 (whatever the collate function raises)
        detail = sample_difference(items) or f"{type(error).__name__}: {error}".splitlines()[0]
        raise ConfigError(
            f"data: the samples cannot be batched ({detail}): give every sample the same keys "
            "and shapes, or set data.collate_fn to a callable that batches them"
        ) from None


def sample_difference(items: Sequence[Any], path: str = "sample") -> str | None:
    """Where the first two samples that differ in structure differ: a key one lacks, a tensor
    of another shape, another type."""
    first = items[0] if items else None
    for index, item in enumerate(items[1:], start=1):
        problem = _difference(first, item, path, index)
        if problem:
            return problem
    return None


def _difference(a: Any, b: Any, path: str, index: int) -> str | None:
    if type(a) is not type(b):
        return f"{path} is a {type(a).__name__} in sample 0, a {type(b).__name__} in {index}"
    if isinstance(a, torch.Tensor) and a.shape != b.shape:
        return f"{path} has shape {list(a.shape)} in sample 0, {list(b.shape)} in sample {index}"
    if isinstance(a, Mapping):
        for key in a.keys() ^ b.keys():
            where = "0" if key in a else str(index)
            return f"only sample {where} has the key {key!r}" + (
                f" in {path}" if "[" in path else ""
            )
        for key in a:
            if problem := _difference(a[key], b[key], f"{path}[{key!r}]", index):
                return problem
    if isinstance(a, list | tuple):
        if len(a) != len(b):
            return f"{path} has {len(a)} elements in sample 0, {len(b)} in sample {index}"
        for position, (x, y) in enumerate(zip(a, b, strict=True)):
            if problem := _difference(x, y, f"{path}[{position}]", index):
                return problem
    return None


def mean(total: float, count: float) -> float:
    return total / count if count else math.nan


def failing_layer(error: BaseException, model: nn.Module) -> nn.Module | None:
    """The innermost module of `model` whose own code `error` was raised in (a Linear given the
    wrong width), or None when it came from elsewhere (the task's loss, its metrics)."""
    ours = {id(module) for module in model.modules()}
    found = None
    trace = error.__traceback__
    while trace is not None:
        owner = trace.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in ours:
            found = owner
        trace = trace.tb_next
    return found
