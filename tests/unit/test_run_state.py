"""What a checkpoint saves and restores (framework/rank/state.py): the registry's round trip, the
trainer entry's keys, and the per-rank RNG streams and loader position."""

from __future__ import annotations

import io
import random

import numpy as np
import torch
from torch import nn

from framework.components.strategy import WholeModule, WholeOptimizer
from framework.config.schemas import EarlyStoppingConfig
from framework.rank.model_selection import ModelSelection
from framework.rank.state import (
    FlatStates,
    LoaderPosition,
    RNGStreams,
    StateRegistry,
    TrainState,
)

# The checkpoint's "trainer" entry, as files written before the selection had its own module
# hold it (tests/distributed/test_resume.py and assemble.is_complete read it).
TRAINER_KEYS = [
    "step",
    "epoch",
    "samples_seen",
    "samples_in_epoch",
    "train_seconds",
    "nonfinite_skipped",
    "best",
    "best_score",
    "stale_evaluations",
    "stopped_early",
    "pruned",  # a pruning sweep's pruner ended the run (framework/rank/pruning.py)
]


def parts(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, TrainState, ModelSelection]:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    selection = ModelSelection.build(
        ("val/accuracy", "max"), keep_best=2, early_stopping=EarlyStoppingConfig(patience=3)
    )
    return model, optimizer, TrainState(), selection


def registry(seed: int) -> tuple[StateRegistry, nn.Module, torch.optim.Optimizer]:
    model, optimizer, train_state, selection = parts(seed)
    states = StateRegistry(
        tensors={
            "model": WholeModule(model),
            "optimizer": WholeOptimizer(model, optimizer),
            "ema": None,
        },
        shared={"trainer": FlatStates(train_state, selection)},
        per_rank={"loader_generator": LoaderPosition(torch.Generator().manual_seed(seed))},
    )
    return states, model, optimizer


def through_a_file(state: dict) -> dict:
    """As a checkpoint stores it: torch.save, then the weights-only load that reads it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_the_registry_round_trips_every_state_into_fresh_objects():
    saved, model, optimizer = registry(seed=0)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()  # momentum buffers: optimizer state worth restoring
    trainer = saved.shared["trainer"]
    trainer.parts[0].load_state_dict({"step": 12, "epoch": 1, "samples_seen": 384})
    selection = trainer.parts[1]
    selection.after_evaluation(10, {"val/accuracy": 0.7}, True, save_best=lambda score: None)
    saved.per_rank["loader_generator"].generator.manual_seed(99)
    saved.per_rank["loader_generator"].start_epoch()  # the epoch began from seed 99's state

    shared = through_a_file(saved.shared_state_dict())
    rank_state = through_a_file(saved.rank_state_dict())
    restored, fresh_model, fresh_optimizer = registry(seed=1)
    assert not torch.equal(fresh_model.weight, model.weight)
    restored.load_state_dict(shared, rank_state)

    assert torch.equal(fresh_model.weight, model.weight)
    assert torch.equal(fresh_model.bias, model.bias)
    momentum = optimizer.state[model.weight]["momentum_buffer"]
    assert torch.equal(fresh_optimizer.state[fresh_model.weight]["momentum_buffer"], momentum)
    assert shared["ema"] is None  # an absent component is saved as None and skipped on load
    assert restored.shared["trainer"].state_dict() == {
        "step": 12,
        "epoch": 1,
        "samples_seen": 384,
        "samples_in_epoch": 0,
        "train_seconds": 0.0,
        "nonfinite_skipped": 0,
        "best": [[0.7, 10]],
        "best_score": 0.7,
        "stale_evaluations": 0,
        "stopped_early": None,
        "pruned": None,
    }
    position = restored.per_rank["loader_generator"]
    position.start_epoch()  # the restored position applies when the next epoch begins
    assert torch.equal(
        position.generator.get_state(), torch.Generator().manual_seed(99).get_state()
    )


def test_the_trainer_entry_keeps_its_keys_and_gives_each_part_back_its_own():
    _, _, train_state, selection = parts(seed=0)
    entry = FlatStates(train_state, selection)
    assert list(entry.state_dict()) == TRAINER_KEYS
    entry.load_state_dict(
        {
            "step": 40,
            "epoch": 3,
            "best": [[0.9, 30]],
            "stopped_early": "early stopping: ...",
            "gone": 1,  # a key no part saves any more is dropped
        }
    )
    assert (train_state.step, train_state.epoch, train_state.samples_seen) == (40, 3, 0)
    assert selection.best.kept == [[0.9, 30]]
    assert selection.stopped_early == "early stopping: ..."
    assert not hasattr(train_state, "gone") and not hasattr(selection, "gone")


def draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_rng_streams_restore_only_when_applied():
    streams = RNGStreams()
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    saved = streams.state_dict()
    expected = draws()
    streams.load_state_dict(saved)
    after_load = draws()  # loading alone changes nothing: these continue the streams
    assert after_load[0] != expected[0] and not torch.equal(after_load[2], expected[2])
    streams.apply_restored()
    again = draws()
    assert again[:2] == expected[:2] and torch.equal(again[2], expected[2])
    streams.apply_restored()  # applied once: a second call restores nothing
    assert draws()[0] != expected[0]


def test_the_loader_position_is_the_generator_as_the_epoch_began():
    generator = torch.Generator().manual_seed(5)
    position = LoaderPosition(generator)
    position.start_epoch()
    order = torch.randperm(10, generator=generator)  # the epoch's shuffle
    saved = position.state_dict()  # mid-epoch: still the state the epoch began from
    torch.randperm(10, generator=generator)  # the next epoch's draws
    resumed = LoaderPosition(torch.Generator().manual_seed(123))
    resumed.load_state_dict(saved)
    resumed.start_epoch()
    assert torch.equal(torch.randperm(10, generator=resumed.generator), order)
