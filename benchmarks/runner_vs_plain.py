"""Our runner against a hand-written plain PyTorch DDP loop on the same work, in one run.

2 gloo ranks on CPU (one thread each), the small CNN on CIFAR-shaped synthetic data, batch 64
per rank, SGD. The plain loop is what a user would write: DistributedSampler, DDP, forward,
backward, step; no logging. Ours is `framework.train.run` with logging every 50 steps. Both
report steady-state samples/s over the same steps (the first `--warmup` left out); they run
alternately (plain, ours, plain, ours) and the best of each is compared.

    uv run python benchmarks/runner_vs_plain.py [--steps 150] [--rounds 2]

Target (issue 2): ours >= 0.98x plain.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from framework.data import synthetic  # noqa: E402
from framework.models import SmallCNN  # noqa: E402


def plain_worker(rank: int, port: int, args, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(0)
    splits = synthetic(train_size=args.batch_size * 2 * (args.steps + 1), val_size=8)
    sampler = torch.utils.data.DistributedSampler(splits.train, num_replicas=2, rank=rank, seed=0)
    loader = torch.utils.data.DataLoader(splits.train, batch_size=args.batch_size,
                                         sampler=sampler, drop_last=True)  # fmt: skip
    model = torch.nn.parallel.DistributedDataParallel(SmallCNN(in_channels=3, num_classes=10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step, (inputs, targets) in enumerate(loader):
        if step == args.warmup:
            started = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step + 1 == args.steps:
            break
    loss.item()  # wait for the last step
    if rank == 0:
        measured = args.steps - args.warmup
        results["plain"] = measured * 2 * args.batch_size / (time.perf_counter() - started)
    dist.destroy_process_group()


def ours(args, out: Path) -> float:
    from hydra import compose, initialize_config_dir

    from framework.launch import launch
    from framework.train import CONF_DIR

    overrides = [
        "model=cnn", "data=synthetic", f"data.batch_size={args.batch_size}",
        f"data.train_size={args.batch_size * 2 * (args.steps + 1)}", "data.val_size=8",
        "optimizer=sgd", "optimizer.lr=0.05", "optimizer.weight_decay=0", "scheduler=constant",
        f"trainer.max_steps={args.steps}", "trainer.log_every=50", "trainer.max_epochs=null",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    out.mkdir(parents=True)
    launch(cfg, out)
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # Log windows after warm-up (steps 51-100 and 101-150 by default): the plain loop's span.
    steady = [
        e["samples_per_s"] for e in events if "samples_per_s" in e and e["step"] > args.warmup
    ]
    return sum(steady) / len(steady)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="runner-bench-"))
    best = {"plain": 0.0, "ours": 0.0}
    for round_index in range(args.rounds):
        results = mp.Manager().dict()
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        mp.start_processes(plain_worker, args=(store.port, args, results), nprocs=2,
                           start_method="spawn")  # fmt: skip
        ours_samples = ours(args, root / f"round{round_index}")
        print(f"round {round_index + 1}: plain {results['plain']:7.0f} samples/s   "
              f"ours {ours_samples:7.0f} samples/s", flush=True)  # fmt: skip
        best["plain"] = max(best["plain"], results["plain"])
        best["ours"] = max(best["ours"], ours_samples)
    print(f"\nbest of {args.rounds}: plain {best['plain']:.0f}, ours {best['ours']:.0f} samples/s"
          f" -> ours / plain = {best['ours'] / best['plain']:.3f}x (target >= 0.98x)")  # fmt: skip


if __name__ == "__main__":
    main()
