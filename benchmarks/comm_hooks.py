"""Step time of each DDP communication hook relative to plain allreduce, measured in one run.

2 ranks, torchvision ResNet-18 on CIFAR-shaped synthetic data, each rank one CPU thread, over
  - "1gbit":    two network namespaces joined by a veth pair shaped to 1 Gbit/s (tc tbf),
  - "loopback": both ranks on 127.0.0.1.
Ranks are started the way torchrun would start them (RANK/WORLD_SIZE/MASTER_ADDR), each in its
own namespace, running `python -m framework.train`. Step time = global batch / samples_per_s,
median over the steps after warm-up (and after PowerSGD's start_iter). Every hook runs twice,
in mirrored order (A B C ... C B A), and its two medians are averaged, so slow drift of the
machine does not favour the hooks that ran first; the spread between the two is printed.

    sudo uv run python benchmarks/comm_hooks.py [--steps 16] [--warmup 4] [--batch-size 16]

Targets (issue 3): over 1 Gbit/s PowerSGD <= 0.80x allreduce, fp16/bf16 <= 0.90x; on loopback
no hook slower than 1.05x allreduce.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOOKS = {
    "allreduce": ["comm=allreduce"],
    "fp16": ["comm=fp16"],
    "bf16": ["comm=bf16"],
    "powersgd-r1": ["comm=powersgd", "comm.rank=1"],
    "powersgd-r2": ["comm=powersgd", "comm.rank=2"],
}
NAMESPACES = ("fwbench0", "fwbench1")
ADDRESSES = ("10.231.0.1", "10.231.0.2")
VETH = ("fwveth0", "fwveth1")


def sh(*args: str) -> None:
    subprocess.run(args, check=True)


def create_link(rate: str) -> None:
    delete_link()
    for ns in NAMESPACES:
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, veth, address in zip(NAMESPACES, VETH, ADDRESSES, strict=True):
        sh("ip", "link", "set", veth, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", veth)
        sh("ip", "-n", ns, "link", "set", veth, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate",
           rate, "burst", "256kb", "latency", "100ms")  # fmt: skip


def delete_link() -> None:
    for ns in NAMESPACES:
        subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL, check=False)


def run_hook(network: str, hook: str, args, port: int, out: Path) -> float:
    run_dir = out / f"{network}-{hook}-{port}"
    overrides = [
        "model=resnet18", "data=synthetic", f"data.batch_size={args.batch_size}",
        f"data.train_size={args.batch_size * 2 * (args.steps + args.warmup + 2)}",
        "data.val_size=16", "data.eval_batch_size=16",
        f"trainer.max_steps={args.steps + args.warmup}",
        "trainer.log_every=1", "optimizer.lr=0.01",
        "comm.start_iter=2" if "powersgd" in hook else "trainer.seed=0",
        f"hydra.run.dir={run_dir}", *HOOKS[hook],
    ]  # fmt: skip
    processes = []
    for rank in range(2):
        env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1", "MASTER_PORT": str(port),
            "MASTER_ADDR": ADDRESSES[0] if network == "1gbit" else "127.0.0.1",
            "GLOO_SOCKET_IFNAME": VETH[rank] if network == "1gbit" else "lo",
        }  # fmt: skip
        prefix = ["ip", "netns", "exec", NAMESPACES[rank]] if network == "1gbit" else []
        command = [*prefix, sys.executable, "-m", "framework.train", *overrides]
        processes.append(subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))  # fmt: skip
    outputs = [p.communicate(timeout=1200)[0] for p in processes]
    if any(p.returncode for p in processes):
        raise RuntimeError(f"{network}/{hook} failed:\n" + "\n".join(o[-2000:] for o in outputs))
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [e for e in events if "train/loss" in e and e["step"] > args.warmup]
    global_batch = 2 * args.batch_size
    return statistics.median(global_batch / e["samples_per_s"] for e in steady)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16, help="measured steps per hook")
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--networks", default="1gbit,loopback")
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of the veth link")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces and tc)")
    out = Path(tempfile.mkdtemp(prefix="comm-bench-"))
    results: dict[str, dict[str, list[float]]] = {}
    port = 29611
    try:
        for network in args.networks.split(","):
            if network == "1gbit":
                create_link(args.rate)
            times: dict[str, list[float]] = {hook: [] for hook in HOOKS}
            for hook in [*HOOKS, *reversed(HOOKS)]:
                port += 1
                times[hook].append(run_hook(network, hook, args, port, out))
                print(f"{network:9s} {hook:12s} {times[hook][-1] * 1000:7.1f} ms/step", flush=True)
            results[network] = times
            delete_link()
    finally:
        delete_link()
    print("\nstep time relative to allreduce (each: mean of two runs; spread between them)")
    print(f"{'hook':12s}" + "".join(f"{network:>30s}" for network in results))
    for hook in HOOKS:
        row = f"{hook:12s}"
        for times in results.values():
            mean = statistics.mean(times[hook])
            spread = abs(times[hook][0] - times[hook][1]) / mean
            ratio = mean / statistics.mean(times["allreduce"])
            row += f"{mean * 1000:11.0f} ms {ratio:6.2f}x (+-{spread / 2:4.1%})"
        print(row)


if __name__ == "__main__":
    main()
