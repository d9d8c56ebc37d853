"""What a checkpoint saves and restores: the run's stateful parts and the registry of them.

A checkpoint holds three kinds of state (torchtitan's `states={...}` registry):
- tensors: the model, optimizer and EMA. Whole tensors from rank 0 in a one-file checkpoint
  (gathered there under strategy=fsdp); each rank's own shards in a sharded one.
- shared: identical on every rank (scheduler, precision, the trainer's counters); rank 0's copy
  is saved.
- per rank: what differs between ranks (RNG streams, the loader's position, comm-hook memory,
  the log window); every rank's copy is saved, in rank order.
A new stateful component is one entry in `run_states`, the registry of a training run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from framework.components.comm import Comm
from framework.components.ema import EMA
from framework.components.precision import Precision
from framework.components.strategy import DDP
from framework.core.exits import CheckpointError, first_line
from framework.storage.checkpoint import restore_rng, rng_state


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Model:
    """The model in its three roles."""

    train: nn.Module  # what forward/backward run on (DDP-wrapped or sharded, compiled)
    module: nn.Module  # the model under it (sharded in place by FSDP): what is saved
    ema: EMA | None = None  # evaluated instead of `module` when set
    # how `module` is spread over ranks (whole, as built, where nothing else was chosen)
    strategy: DDP = dataclasses.field(default_factory=lambda: DDP(activation_checkpointing=False))

    @property
    def evaluated(self) -> nn.Module:
        """The weights evaluation uses: the EMA's when trainer.ema_decay is set."""
        return self.ema.module if self.ema is not None else self.module


@dataclass(frozen=True)
class Optimization:
    """What turns gradients into updates, each saved with the checkpoint."""

    optimizer: Optimizer
    scheduler: LRScheduler
    precision: Precision
    comm: Comm  # the DDP comm hook: its memory (PowerSGD's error feedback) is per rank
    schedule_steps: int  # the optimizer steps the schedule spans (total_steps, unless kept)


@dataclass
class TrainState:
    """Everything that advances as training goes; small and explicit."""

    step: int = 0
    epoch: int = 0
    samples_seen: int = 0
    samples_in_epoch: int = 0  # of the current epoch, all ranks together: where its data resume
    train_seconds: float = 0.0
    nonfinite_skipped: int = 0

    def advance(self, samples: int) -> None:
        """One optimizer step of `samples` samples (all ranks together) is done."""
        self.step += 1
        self.samples_seen += samples
        self.samples_in_epoch += samples

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class FlatStates:
    """Several states saved as one flat dict under one checkpoint key, each getting back the
    keys it saved. The checkpoint's "trainer" entry holds the train state and the selection's
    (best checkpoints, early stopping) side by side, as it did when one object held both."""

    def __init__(self, *parts: Stateful) -> None:
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        return {key: value for part in self.parts for key, value in part.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts:
            owned = part.state_dict().keys()
            part.load_state_dict({key: value for key, value in state.items() if key in owned})


class RNGStreams:
    """This process's python, numpy, torch and CUDA streams. A restored state is applied only
    after the next epoch's iterator exists: building it draws from the global stream."""

    def __init__(self) -> None:
        self._restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restored = state

    def apply_restored(self) -> None:
        if self._restored is not None:
            restore_rng(self._restored)
            self._restored = None


class LoaderPosition:
    """The training loader's generator as the current epoch began (shuffling and workers' seeds
    come from it); the sampler's skip count comes from the step."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator
        self._restored: torch.Tensor | None = None
        self._epoch_start = generator.get_state()

    def start_epoch(self) -> None:
        if self._restored is not None:
            self.generator.set_state(self._restored)
            self._restored = None
        self._epoch_start = self.generator.get_state()

    def state_dict(self) -> torch.Tensor:
        return self._epoch_start

    def load_state_dict(self, state: torch.Tensor) -> None:
        self._restored = state


class DataIdentity:
    """What the training data was: a checkpoint's position counts its samples (a stream's
    windows of its files), so a resume on other data would read some twice and skip others."""

    def __init__(self, dataset: Any) -> None:
        if hasattr(dataset, "identity"):  # a stream: its files and their sizes
            self.identity = dataset.identity()
        else:
            self.identity = {"samples": len(dataset)} if hasattr(dataset, "__len__") else {}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.identity)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state != self.identity:
            changed = ", ".join(key for key in state if state[key] != self.identity.get(key))
            raise CheckpointError(
                f"the training data changed since the checkpoint was saved (its {changed}): "
                "put it back to resume exactly, or start a new run in another dir"
            )


class TensorState(Stateful, Protocol):
    def shard_state_dict(self) -> dict[str, Any]: ...


class StateRegistry:
    """The states a checkpoint holds, by the key each is saved under. A tensor or shared entry
    may be None (no EMA): it is saved as None and skipped on load. `constants` are saved beside
    the shared states and never loaded into anything; `gathers`: building the whole tensors is a
    collective (strategy=fsdp gathers them on rank 0)."""

    def __init__(
        self,
        tensors: Mapping[str, TensorState | None],
        shared: Mapping[str, Stateful],
        per_rank: Mapping[str, Stateful],
        constants: Mapping[str, Any] | None = None,
        gathers: bool = False,
    ) -> None:
        self.tensors, self.per_rank = dict(tensors), dict(per_rank)
        self.shared: dict[str, Stateful | None] = {**self.tensors, **shared}  # loaded in order
        self.small = dict(shared)
        self.constants = dict(constants or {})
        self.gathers = gathers

    def shared_state_dict(self) -> dict[str, Any]:
        """A one-file checkpoint's states, whole, with the constants. Built on rank 0 only
        (unless `gathers`): the other ranks' copies are the same."""
        states = {
            key: None if item is None else item.state_dict() for key, item in self.shared.items()
        }
        return {**states, **self.constants}

    def shard_state_dicts(self) -> dict[str, Any]:
        """A sharded checkpoint's tensors: this rank's own part of each (every rank calls it)."""
        return {
            key: None if item is None else item.shard_state_dict()
            for key, item in self.tensors.items()
        }

    def small_state_dict(self) -> dict[str, Any]:
        """A sharded checkpoint's other shared states (rank 0's), with the constants."""
        return {**{key: item.state_dict() for key, item in self.small.items()}, **self.constants}

    def rank_state_dict(self) -> dict[str, Any]:
        return {key: item.state_dict() for key, item in self.per_rank.items()}

    def load_state_dict(
        self, shared: Mapping[str, Any], rank_state: Mapping[str, Any] | None
    ) -> None:
        """`shared`: the checkpoint's top level; `rank_state`: this rank's entry of its ranks
        (None: a checkpoint of another number of ranks, whose per-rank states stay as built).
        A part that does not fit (another optimizer, another scaler) is one CheckpointError
        naming it, not a traceback."""
        for key, item in self.shared.items():
            if item is not None and shared.get(key) is not None:
                _load(key, item, shared[key])
        if rank_state is None:
            return
        for key, item in self.per_rank.items():
            _load(key, item, rank_state.get(key))


def run_states(
    model: Model,
    optimization: Optimization,
    train_state: TrainState,
    selection: Stateful,
    per_rank: Mapping[str, Stateful],
    steps_per_epoch: int,
    data: DataIdentity,
) -> StateRegistry:
    """What a training run's checkpoint holds. `per_rank`: the loop's own per-rank states (RNG
    streams, the loader's position, the log window), beside the comm hook's."""
    strategy = model.strategy
    return StateRegistry(
        tensors={  # whole from rank 0 (gathered there under fsdp), or each rank's shards
            "model": strategy.model_state(model.module),
            "optimizer": strategy.optimizer_state(model.module, optimization.optimizer),
            "ema": None if model.ema is None else strategy.model_state(model.ema.module),
        },
        shared={  # the same on every rank: rank 0's is saved
            "scheduler": optimization.scheduler,
            "precision": optimization.precision,
            "trainer": FlatStates(train_state, selection),
            "data": data,
        },
        per_rank={**per_rank, "comm": optimization.comm},
        # schedule_steps: the steps the schedule was built for, which a run extended after it
        # finished keeps (main.schedule_steps).
        constants={
            "steps_per_epoch": steps_per_epoch,
            "schedule_steps": optimization.schedule_steps,
        },
        gathers=strategy.shards,
    )


def _load(key: str, item: Stateful, state: Any) -> None:
    try:
        if state is None:
            raise KeyError("absent")
        item.load_state_dict(state)
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as error:
        raise CheckpointError(
            f"the checkpoint's {key} state does not fit this run ({first_line(error)}): resume "
            "with the settings it was trained with, or start from scratch with "
            "checkpoint.resume=never"
        ) from None
