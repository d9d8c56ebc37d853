"""The baseline: the DDP loop a user writes by hand in plain PyTorch, and its Lightning peer.

Both do exactly the benchmark's `Work`: the same model class, the same in-memory synthetic data
(framework.components.data.synthetic), DistributedSampler, per-rank batch, SGD with the momentum
and weight decay of conf/optimizer/sgd.yaml, and DDP with the bucket settings `train` uses by
default (conf: dist.ddp), so a ratio measures the loop around the work and nothing else. Neither
logs per step; throughput is timed from the end of the warm-up steps to the end of the last step.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.common import Trial, TrialContext, Work, build_model

MOMENTUM, WEIGHT_DECAY = 0.9, 5.0e-4  # conf/optimizer/sgd.yaml
DDP_OPTIONS = {"bucket_cap_mb": 25.0, "gradient_as_bucket_view": True}  # conf: dist.ddp


def dataset(work: Work, world_size: int):
    from framework.components.data import synthetic
    from framework.config.registry import option_values

    values = option_values(
        "data",
        "synthetic",
        train_size=work.train_size(world_size),
        val_size=work.val_size,
        image_size=work.image_size,
    )
    return synthetic(**values).train


def plain_loop(trial: Trial, ctx: TrialContext) -> dict[str, Any] | None:
    work = trial.work
    device = torch.device(work.device)
    ctx.init_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)
    data = dataset(work, ctx.world_size)
    sampler = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, seed=0)
    loader = DataLoader(
        data,
        batch_size=work.batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=work.num_workers,
        persistent_workers=work.num_workers > 0,
        pin_memory=device.type == "cuda",
    )
    memory_format = torch.channels_last if work.channels_last else torch.contiguous_format
    model = build_model(work).to(device, memory_format=memory_format)
    if ctx.world_size > 1:
        device_ids = [device.index or 0] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids, **DDP_OPTIONS)
    if work.compile:
        model = torch.compile(model)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=work.lr, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY
    )
    autocast_dtype = {"bf16": torch.bfloat16, "amp": torch.float16}.get(work.precision)
    scaler = torch.amp.GradScaler(device.type, enabled=work.precision == "amp")
    started = None
    for step, (inputs, targets) in enumerate(loader, start=1):
        inputs = inputs.to(device, non_blocking=True, memory_format=memory_format)
        targets = targets.to(device, non_blocking=True)
        autocast = (
            torch.autocast(device.type, dtype=autocast_dtype)
            if autocast_dtype
            else contextlib.nullcontext()
        )
        with autocast:
            loss = F.cross_entropy(model(inputs), targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step == work.warmup:
            loss.item()  # the warm-up steps are done (a GPU runs ahead otherwise)
            started = time.perf_counter()
        if step == work.total_steps:
            loss.item()
            break
    elapsed = time.perf_counter() - started
    if ctx.rank != 0:
        return None
    return {
        "samples_per_s": work.steps * work.batch_size * ctx.world_size / elapsed,
        "final_loss": loss.item(),
    }


def lightning_available() -> bool:
    try:
        import lightning  # noqa: F401
    except ImportError:
        return False
    return True


def lightning_fit(trial: Trial, ctx: TrialContext) -> dict[str, Any] | None:
    """PyTorch Lightning on the same work: a LightningModule, Trainer(strategy=DDPStrategy),
    no validation, checkpointing or progress bar (ours runs none of these per step either), a
    CSV logger writing every `warmup` steps as ours does."""
    import os

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy

    work = trial.work
    # Lightning sees ranks started by someone else (LOCAL_RANK set) and a process group that
    # already exists (ours, on this trial's store), and joins them instead of spawning.
    os.environ.update(
        {
            "LOCAL_RANK": str(ctx.rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(ctx.world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29400",
        }
    )
    ctx.init_group()
    torch.manual_seed(0)

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.started = self.elapsed = None

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == work.warmup:
                outputs["loss"].item()
                self.started = time.perf_counter()
            elif trainer.global_step == work.total_steps:
                outputs["loss"].item()
                self.elapsed = time.perf_counter() - self.started

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(work)

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            loss = F.cross_entropy(self.model(inputs), targets)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(
                self.parameters(), lr=work.lr, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY
            )

    timer = Timer()
    loader = DataLoader(
        dataset(work, ctx.world_size), batch_size=work.batch_size, shuffle=True, drop_last=True
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ctx.world_size,
        num_nodes=1,
        strategy=DDPStrategy(**DDP_OPTIONS) if ctx.world_size > 1 else "auto",
        max_steps=work.total_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=CSVLogger(ctx.scratch),
        log_every_n_steps=work.warmup,
        callbacks=[timer],
    )
    trainer.fit(Classifier(), loader)
    if ctx.rank != 0:
        return None
    return {"samples_per_s": work.steps * work.batch_size * ctx.world_size / timer.elapsed}
