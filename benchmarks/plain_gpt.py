"""The plain peer of the GPU check's GPT measurement (benchmarks/gpu.py): the loop a user writes
by hand in the style of nanoGPT's train.py, with nothing but torch around the model.

It does exactly the work of `train experiment=char_gpt` at the sizes of `GPTWork`: the same
model class (framework.components.models.GPT), the same character windows of Python's own help
text (framework.components.data.text), per-step batch, fused AdamW with weight decay on the
matrices only, the preset's linear-warmup cosine schedule, gradient clipping at 1.0, bf16
autocast, and optionally torch.compile of the model. Like nanoGPT it reads the loss every
`log_every` steps; throughput is timed from the end of the warm-up steps to the end of the last
step, the device synchronised at both ends.

Also here: the FLOPs of one step as the framework counts them (torch.utils.flop_counter on the
meta device), nanoGPT's analytic estimate of the same, and MFU by hand.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

MIB = 2**20
# experiments/char_gpt.yaml (tests/integration/test_gpu_check.py holds them equal).
LR, WEIGHT_DECAY, BETAS, LR_WARMUP, CLIP = 3.0e-3, 0.1, (0.9, 0.99), 50, 1.0
VOCAB_SIZE = 128  # data.vocab_size of data=text: one token per ASCII character

# Dense bf16 TFLOP/s of one GPU from NVIDIA's datasheets (the "with sparsity" figures halved),
# written here apart from framework/components/utilization.py so that the check compares the
# framework's table with a second source. First substring of torch.cuda.get_device_name wins.
DATASHEET_BF16_TFLOPS = (
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.5),
    ("H100", 989.4),  # SXM5, named "NVIDIA H100 80GB HBM3"
    ("H200 NVL", 835.0),
    ("H200", 989.4),  # SXM
)


@dataclass(frozen=True)
class GPTWork:
    """One GPT workload, identical for `train` and the plain loop."""

    layers: int
    heads: int
    width: int
    block_size: int
    stride: int  # training windows start every `stride` tokens
    batch_size: int
    warmup: int  # steps before the clock starts (a compile happens in the first)
    steps: int  # timed steps
    log_every: int
    precision: str = "bf16"  # bf16 | fp32
    compile: bool = False
    peak_tflops: float | None = None  # trainer.peak_tflops (on a CPU: MFU against this)
    # trainer.eval_batches of `train`'s final validation (the plain loop has none); None: all
    eval_batches: int | None = None

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.block_size

    def with_variant(self, variant: str) -> GPTWork:
        """`bf16`, `fp32`, `bf16+compile`, ...: the precision and whether to compile."""
        precision, *flags = variant.split("+")
        return GPTWork(**{**asdict(self), "precision": precision, "compile": "compile" in flags})

    def overrides(self) -> list[str]:
        """The same work as `train` overrides, on one rank."""
        overrides = [
            "experiment=char_gpt",
            f"model.layers={self.layers}",
            f"model.heads={self.heads}",
            f"model.width={self.width}",
            f"data.block_size={self.block_size}",
            f"data.stride={self.stride}",
            f"data.batch_size={self.batch_size}",
            f"precision={self.precision}",
            f"trainer.compile={self.compile}",
            f"trainer.max_steps={self.total_steps}",
            "trainer.max_epochs=null",
            f"trainer.log_every={self.log_every}",
            "trainer.eval_every=0",
            "trainer.progress_bar=false",
            "task.sample_tokens=0",
            "checkpoint.every=0",
            "checkpoint.final=false",
            "launcher.nproc_per_node=1",
        ]
        if self.peak_tflops is not None:
            overrides.append(f"trainer.peak_tflops={self.peak_tflops}")
        if self.eval_batches is not None:
            overrides.append(f"trainer.eval_batches={self.eval_batches}")
        return overrides


def build_model(work: GPTWork) -> torch.nn.Module:
    from framework.components.models import GPT

    return GPT(
        vocab_size=VOCAB_SIZE,
        block_size=work.block_size,
        layers=work.layers,
        heads=work.heads,
        width=work.width,
        dropout=0.0,
        activation="gelu",
    )


# --- FLOPs and MFU by hand -----------------------------------------------------------------
def counted_flops(work: GPTWork) -> int:
    """One optimizer step's FLOPs (forward + backward of one batch), counted by
    torch.utils.flop_counter on the meta device, as the framework counts them."""
    with torch.device("meta"):
        model = build_model(work)
        tokens = torch.zeros(work.batch_size, work.block_size, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    return int(counter.get_total_flops())


def analytic_flops(work: GPTWork) -> int:
    """nanoGPT's estimate (model.estimate_mfu): 6N per token for the weights (N without the
    position embeddings; the tied embedding counts once, as the output head) plus
    12 * layers * block_size * width per token for attention."""
    with torch.device("meta"):
        model = build_model(work)
    weights = sum(p.numel() for p in model.parameters()) - model.positions.weight.numel()
    per_token = 6 * weights + 12 * work.layers * work.block_size * work.width
    return per_token * work.tokens_per_step


def datasheet_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of this GPU by DATASHEET_BF16_TFLOPS, or None."""
    for pattern, peak in DATASHEET_BF16_TFLOPS:
        if pattern.lower() in device_name.lower():
            return peak
    return None


def mfu(flops_per_step: float, steps_per_s: float, peak_tflops: float) -> float:
    return flops_per_step * steps_per_s / (peak_tflops * 1e12)


# --- memory --------------------------------------------------------------------------------
def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: the CUDA allocator's counter, or on a CPU the process's peak resident
    memory (VmHWM), which Linux resets on writing 5 to /proc/self/clear_refs."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mib(device: torch.device) -> float:
    from framework.components.utilization import peak_memory_mib as framework_peak

    return framework_peak(device)  # what `train` logs as memory/peak_mib_max


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the loop ------------------------------------------------------------------------------
def cosine_with_warmup(total_steps: int, warmup_steps: int = LR_WARMUP):
    """The preset's schedule (scheduler=cosine, warmup_steps=50, min_lr_ratio=0)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def batches_forever(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        yield from loader


def train_plain(work: GPTWork, device: torch.device) -> dict[str, Any]:
    """The plain loop on `work`: its steady tokens/s, peak memory and last loss."""
    from framework.components.data import text
    from framework.config.registry import option_values

    torch.manual_seed(0)
    reset_peak_memory(device)
    values = option_values("data", "text", block_size=work.block_size, stride=work.stride)
    data = text(**values).train
    loader = DataLoader(
        data,
        batch_size=work.batch_size,
        shuffle=True,
        drop_last=True,
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(0),
    )
    model = build_model(work).to(device)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0}],
        lr=LR,
        betas=BETAS,
        fused=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(work.total_steps))
    forward = torch.compile(model) if work.compile else model
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if work.precision == "bf16"
        else contextlib.nullcontext()
    )
    batches = batches_forever(loader)
    started, last_loss = time.perf_counter(), math.nan
    for step in range(1, work.total_steps + 1):
        inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
        with autocast:
            logits = forward(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % work.log_every == 0:
            last_loss = loss.item()  # nanoGPT's log line: one read of the device
        if step == work.warmup:
            synchronize(device)
            started = time.perf_counter()
    synchronize(device)
    seconds = time.perf_counter() - started
    return {
        "tokens_per_s": work.steps * work.tokens_per_step / seconds,
        "steps_per_s": work.steps / seconds,
        "seconds": seconds,
        "peak_memory_mib": peak_memory_mib(device),
        "last_loss": last_loss,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
