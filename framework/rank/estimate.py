"""`train ... mode=estimate`: the memory ledger a run of this config would log, per rank, before
anything is launched (no process group, no run dir, no training).

The model is built on the meta device (no memory, no compute). Each rank's parameters are the
shards strategy=fsdp gives it (FSDP2 splits every parameter along its first dimension as
torch.chunk does) or whole under strategy=ddp; its gradients are as large; its optimizer state
is what the configured optimizer makes on its first step, run on meta tensors of the shards'
shapes. Activations: one micro-batch of the real data, forward on fake tensors of this
machine's device (no memory, the device's own kernels), counting the bytes it keeps for backward
(strategy.activation_checkpointing applied as in training).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from framework.components.data import load_splits, to_device
from framework.components.ledger import MIB, Ledger, activation_bytes, local_bytes
from framework.components.ledger import optimizer_tensors as state_tensors
from framework.components.optim import build_optimizer
from framework.components.tasks import first_batch
from framework.rank.build import built, preserved_rng, seed_everything

META = torch.device("meta")


def world_size_of(launcher: DictConfig) -> int:
    """The ranks the launcher would start: nproc_per_node on each node (torchrun's nnodes, the
    most an elastic MIN:MAX allows; SLURM's nodes)."""
    nodes = str(launcher.get("nnodes", launcher.get("nodes", 1))).split(":")[-1]
    return int(launcher.nproc_per_node) * int(nodes)


def shard_rows(rows: int, rank: int, world_size: int) -> int:
    """Rows of a first dimension of `rows` that FSDP2 gives `rank` (torch.chunk's split)."""
    chunk = math.ceil(rows / world_size)
    return max(0, min(chunk, rows - rank * chunk))


def estimate_ledgers(cfg: DictConfig, world_size: int) -> tuple[list[Ledger], int, int]:
    """Each rank's ledger, the forward's peak bytes of one micro-batch, and the model's
    parameter count."""
    seed_everything(cfg.trainer.seed)
    with torch.device(META):
        module = built("model", cfg.model)
    strategy = built("strategy", cfg.strategy)
    saved, peak = micro_batch_activations(cfg, strategy)
    sharded = strategy.name == "fsdp" and world_size > 1
    whole = {id(p): tuple(p.shape) for p in module.parameters()}
    count = sum(p.numel() for p in module.parameters())
    ledgers = []
    for rank in range(world_size if sharded else 1):
        for parameter in module.parameters():
            shape = whole[id(parameter)]
            if sharded and shape:
                shape = (shard_rows(shape[0], rank, world_size), *shape[1:])
            parameter.data = torch.empty(shape, dtype=parameter.dtype, device=META)
        ledgers.append(_with_optimizer(cfg, module, saved))
    return (ledgers if sharded else ledgers * world_size), peak, count


def _with_optimizer(cfg: DictConfig, module: nn.Module, activations: int) -> Ledger:
    """The ledger of `module`'s (meta) parameters after one step of the configured optimizer."""
    parameters = [p for p in module.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg.optimizer, module, 1.0, {"fused": False})  # meta: unfused
    for parameter in parameters:
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    ledger = Ledger(
        parameters=local_bytes(module.parameters()),
        gradients=local_bytes(p.grad for p in parameters if p.grad is not None),
        optimizer=local_bytes(state_tensors(optimizer)),
        activations=activations,
    )
    for parameter in parameters:
        parameter.grad = None
    return ledger


def micro_batch_activations(cfg: DictConfig, strategy: Any) -> tuple[int, int]:
    """Bytes one micro-batch of the real data keeps for backward, and its forward's peak, on
    this machine's device. Fake tensors (a model and a batch with shapes, devices and kernels
    chosen as the real ones, and no memory): the meta device would pick other kernels (its
    attention keeps the whole attention matrix where the CPU's fused kernel keeps a row sum)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    task = built("task", cfg.task)
    splits = load_splits(cfg.data)
    collate_node = cfg.data.get("collate_fn")
    collate = instantiate(collate_node) if collate_node is not None else None
    batch = first_batch(splits.train, cfg.data.batch_size, collate)
    fake = FakeTensorMode()
    with preserved_rng(), fake, torch.device(device):
        module = built("model", cfg.model)
        strategy.checkpoint_activations(module)
        inputs = tree_map(fake.from_tensor, to_device(batch, device))
        return activation_bytes(lambda: task.loss(module.train(), inputs).total)


def estimate_text(cfg: DictConfig) -> str:
    """What `train ... mode=estimate` prints."""
    world_size = world_size_of(cfg.launcher)
    ledgers, peak, count = estimate_ledgers(cfg, world_size)
    lines = [
        f"memory estimate per rank: strategy={_strategy_name(cfg)} on {world_size} rank(s), "
        f"{cfg.model._target_} ({count / 1e6:.2f}M parameters), exact tensor bytes",
    ]
    shown = list(enumerate(ledgers))
    if len(shown) > 8:  # the most and the least any rank holds
        shown = [shown[0], shown[-1]]
    for rank, ledger in shown:
        total = ledger.states() + (ledger.activations or 0)
        lines.append(f"  rank {rank}: {ledger.line()}; total {total / MIB:.2f} MiB")
    lines.append(
        f"  activations: one micro-batch of data.batch_size={cfg.data.batch_size}, kept for "
        f"backward (its forward peaks at {peak / MIB:.2f} MiB); nothing was launched"
    )
    return "\n".join(lines)


def _strategy_name(cfg: DictConfig) -> str:
    return str(cfg.strategy._target_).rsplit(".", 1)[-1].lower()
