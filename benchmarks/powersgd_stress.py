"""PowerSGD reliability on gloo: N consecutive 2-rank ResNet-18 jobs, default 25 MB buckets
(several buckets), PowerSGD active for at least 10 steps. Counts failures.

    uv run python benchmarks/powersgd_stress.py                  # ours: 20 runs of `train`
    uv run python benchmarks/powersgd_stress.py --impl torch --runs 5
        # the same job in a plain DDP loop with torch's powerSGD_hook, for comparison

Each of our runs is a fresh `python -m framework.train` job (2 local ranks); the run passes when
it exits 0 and its metrics.jsonl shows >= 10 compressed steps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_ours(run: int, args, out: Path) -> tuple[bool, str]:
    run_dir = out / f"run{run:02d}"
    command = [
        sys.executable,
        "-m",
        "framework.train",
        "model=resnet18",
        "data=synthetic",
        f"data.batch_size={args.batch_size}",
        "data.train_size=1024",
        "data.val_size=32",
        "comm=powersgd",
        f"comm.rank={args.rank}",
        f"comm.start_iter={args.start_iter}",
        f"trainer.max_steps={args.start_iter + args.compressed_steps}",
        "trainer.log_every=1",
        f"trainer.seed={run}",
        f"hydra.run.dir={run_dir}",
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        return False, result.stderr.strip().splitlines()[-1] if result.stderr else "no output"
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    compressed = sum(1 for e in events if e.get("comm/compression", 1.0) > 1.0)
    ok = compressed >= args.compressed_steps
    return ok, f"{compressed} compressed steps, compression {events[-2]['comm/compression']:.1f}x"


def _torch_worker(rank: int, port: int, args) -> None:
    """A plain DDP loop with torch's own powerSGD_hook (the configuration that crashed)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from framework.components.models import resnet18_cifar

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    torch.manual_seed(0)
    model = DDP(resnet18_cifar(in_channels=3, num_classes=10))
    state = powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=args.rank, start_powerSGD_iter=args.start_iter
    )
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(args.start_iter + args.compressed_steps):
        inputs = torch.randn(args.batch_size, 3, 32, 32)
        loss = torch.nn.functional.cross_entropy(
            model(inputs), torch.randint(0, 10, (args.batch_size,))
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


def run_torch(run: int, args, out: Path) -> tuple[bool, str]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        mp.start_processes(_torch_worker, args=(store.port, args), nprocs=2, start_method="spawn")
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as error:
        return False, str(error).strip().splitlines()[-1][:200]
    return True, "finished"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--impl", choices=["ours", "torch"], default="ours")
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD matrix_approximation_rank")
    parser.add_argument("--start-iter", type=int, default=2)
    parser.add_argument("--compressed-steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank, 32x32 inputs")
    return parser.parse_args(argv)


def main() -> None:
    args = parse()
    out = Path(tempfile.mkdtemp(prefix="powersgd-stress-"))
    run_one = run_ours if args.impl == "ours" else run_torch
    failures = 0
    for run in range(args.runs):
        started = time.perf_counter()
        ok, detail = run_one(run, args, out)
        failures += not ok
        status = "ok  " if ok else "FAIL"
        seconds = time.perf_counter() - started
        print(f"run {run + 1:2d}/{args.runs} {status} {seconds:5.1f}s {detail}", flush=True)
    print(f"\n{args.impl}: {args.runs - failures}/{args.runs} runs passed, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
