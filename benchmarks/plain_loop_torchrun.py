"""The plain peer of the `command` benchmark: the DDP loop a user writes for torchrun, with
nothing but torch. The same work as `train`'s small CNN on synthetic 32x32 images (the
architecture of framework.components.models.SmallCNN, width 32), SGD, batch per rank, one
thread per rank. Rank 0 prints `samples_per_s=<steady rate after warm-up>`.

    torchrun --nproc_per_node=2 benchmarks/plain_loop_torchrun.py --steps 160
        [--precision bf16] [--channels-last] [--compile] [--num-workers 1]

The speed options, each done as benchmarks/plain.py's pooled plain loop does it (and as `train`'s
precision=bf16, trainer.channels_last, trainer.compile, data.num_workers do): bf16 autocast
around the forward pass and the loss; the model and every input batch in channels-last memory
format; torch.compile of the DDP-wrapped model; DataLoader workers, kept alive across epochs
(persistent_workers). Without them, the fp32 loop on the main process.
"""

import argparse
import contextlib
import os
import sys
import time

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class SmallCNN(nn.Module):
    """framework.components.models.SmallCNN's layers, written with nothing but torch. A class of
    the script's own, as users write models: under torch.compile, a bare nn.Sequential at the top
    ran eager (dynamo traced no graph of it: TORCH_LOGS=graph_code printed none, 2026-11-25), so
    `--compile` compared `train`'s compiled model with an uncompiled one."""

    def __init__(self, in_channels: int = 3, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def work_parser() -> argparse.ArgumentParser:
    """The work, as benchmarks/command.py passes it (to this script and to Lightning's)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    return parser


def work_arguments() -> argparse.Namespace:
    return work_parser().parse_args()


def arguments() -> argparse.Namespace:
    """The work and the speed options: this script's alone (Lightning's script takes the work
    only, and refuses an option it would otherwise ignore)."""
    parser = work_parser()
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--num-workers", type=int, default=0)
    return parser.parse_args()


def random_images(args: argparse.Namespace, world: int) -> TensorDataset:
    """Enough random 3-channel images and labels for every step of every rank."""
    torch.manual_seed(0)
    samples = args.steps * args.batch_size * world
    images = torch.randn(samples, 3, args.image_size, args.image_size)
    return TensorDataset(images, torch.randint(0, 10, (samples,)))


def autocast(precision: str) -> contextlib.AbstractContextManager:
    """bf16: the forward pass and the loss under CPU autocast to bfloat16 (no loss scaling)."""
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def main() -> None:
    args = arguments()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    data = random_images(args, world)
    loader = DataLoader(
        data,
        batch_size=args.batch_size,
        sampler=DistributedSampler(data),
        drop_last=True,
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
    )
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = DistributedDataParallel(
        SmallCNN().to(memory_format=memory_format),
        bucket_cap_mb=25.0,
        gradient_as_bucket_view=True,
    )
    if args.compile:
        model = torch.compile(model)  # the DDP wrapper, as train and plain.py compile it
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    started = None
    for step, (inputs, targets) in enumerate(loader, start=1):
        inputs = inputs.to(
            memory_format=memory_format
        )  # no copy without --channels-last (contiguous already)
        optimizer.zero_grad(set_to_none=True)
        with autocast(args.precision):
            loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        if step == args.warmup:
            loss.item()  # the warm-up's work done before the clock starts
            started = time.perf_counter()
    loss.item()
    seconds = time.perf_counter() - started
    if dist.get_rank() == 0:
        rate = (args.steps - args.warmup) * args.batch_size * world / seconds
        print(f"samples_per_s={rate:.1f}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # see plain_torchrun.py: torch 2.13 can deadlock freeing a DDP model at exit


if __name__ == "__main__":
    main()
