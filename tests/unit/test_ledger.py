"""The memory ledger (framework/components/ledger.py), `train ... mode=estimate`'s figures
(framework/rank/estimate.py) against what a real model and optimizer hold, and activation
checkpointing's saving (strategy.activation_checkpointing)."""

from __future__ import annotations

import copy

import pytest
import torch
from hydra.utils import instantiate

from framework.components.data import load_splits
from framework.components.ledger import activation_bytes, held
from framework.components.optim import build_optimizer
from framework.components.strategy import DDP
from framework.components.tasks import first_batch
from framework.core.exits import ConfigError
from framework.rank.estimate import estimate_ledgers, shard_rows, world_size_of
from tests.conftest import PADDED_GPT, make_cfg

GPT = (
    *PADDED_GPT,
    "data.batch_size=4",
    "optimizer=adamw",
)


@pytest.fixture(scope="module")
def gpt():
    cfg = make_cfg(*GPT)
    task = instantiate(cfg.task)
    batch = first_batch(load_splits(cfg.data).train, cfg.data.batch_size)
    return cfg, task, batch


def test_the_estimate_of_one_rank_is_what_the_real_model_and_optimizer_hold(gpt):
    cfg, task, batch = gpt
    (estimated,), _, count = estimate_ledgers(cfg, world_size=1)
    torch.manual_seed(0)
    module = instantiate(cfg.model)
    optimizer = build_optimizer(cfg.optimizer, module, 1e-3)
    task.loss(module, batch).total.backward()
    optimizer.step()
    measured = held(module, optimizer)
    assert count == sum(p.numel() for p in module.parameters())
    assert estimated.parameters == measured.parameters == count * 4
    assert estimated.gradients == measured.gradients == count * 4
    # AdamW: exp_avg and exp_avg_sq per element, a float32 step per parameter tensor.
    tensors = len(list(module.parameters()))
    assert estimated.optimizer == measured.optimizer == count * 8 + tensors * 4


def test_the_estimate_measures_activations_on_meta_exactly_as_on_the_host(gpt):
    cfg, task, batch = gpt
    (estimated,), _, _ = estimate_ledgers(cfg, world_size=1)
    torch.manual_seed(0)
    module = instantiate(cfg.model)
    saved, _ = activation_bytes(lambda: task.loss(module, batch).total)
    assert estimated.activations == saved > 0


def test_activation_checkpointing_keeps_a_fraction_of_the_activations_and_the_same_gradients(gpt):
    cfg, task, batch = gpt
    torch.manual_seed(0)
    plain = instantiate(cfg.model)
    checkpointed = copy.deepcopy(plain)
    DDP(activation_checkpointing=True).checkpoint_activations(checkpointed)
    measured = {}
    for name, module in (("plain", plain), ("checkpointed", checkpointed)):
        torch.manual_seed(1)  # the same dropout masks for both
        measured[name], _ = activation_bytes(lambda m=module: task.loss(m, batch).total)
        torch.manual_seed(1)
        task.loss(module, batch).total.backward()
    # Two blocks keep only their inputs: the embeddings, the head and the loss stay.
    assert measured["checkpointed"] * 2 < measured["plain"]
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_activation_checkpointing_of_a_model_without_known_blocks_is_refused():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"^strategy.activation_checkpointing=true: Sequential"):
        DDP(activation_checkpointing=True).checkpoint_activations(module)


@pytest.mark.parametrize(
    ("overrides", "ranks"),
    [
        (("launcher.nproc_per_node=3",), 3),
        (("launcher=torchrun", "launcher.nproc_per_node=2", "launcher.nnodes=1:4"), 8),
        (("launcher=slurm", "launcher.nproc_per_node=4", "launcher.nodes=2"), 8),
    ],
)
def test_the_estimate_is_for_the_ranks_the_launcher_would_start(overrides, ranks):
    assert world_size_of(make_cfg(*overrides).launcher) == ranks


def test_fsdp_rows_per_rank_are_torch_chunks():
    for rows in (1, 7, 33, 128):
        for world in (1, 2, 3, 4, 8):
            chunks = [len(c) for c in torch.arange(rows).chunk(world)]
            chunks += [0] * (world - len(chunks))
            assert [shard_rows(rows, rank, world) for rank in range(world)] == chunks
