"""Communication per DDP hook: bytes per step against the analytic value, and step time over a
1 Gbit/s link and over loopback. 2 ranks of `train`, ResNet-18 on CIFAR-shaped synthetic data,
batch 16 per rank, one CPU thread per rank.

    sudo uv run python -m benchmarks comm [--rounds 2]

- "1gbit": two network namespaces joined by a veth pair shaped to 1 Gbit/s (tc tbf); each rank
  sits in its own namespace. "loopback": both ranks on 127.0.0.1.
- Bytes per step, three ways: analytic (from the parameter shapes: fp32 = 4 bytes per element,
  fp16/bf16 = 2, PowerSGD rank r = 4 r (n + m) per compressed n x m matrix plus 4 per element of
  the rest), what the hook counted (`comm/bytes_per_step` in metrics.jsonl), and what left the
  rank's veth (/proc/net/dev): the difference between a run of N and a run of 2N steps, per
  step. For 2 ranks a ring allreduce sends each rank's payload once, plus TCP/IP headers.
- Step time: global batch / steady samples/s, median over rounds; hooks run in mirrored order.

Targets (issue 3): over 1 Gbit/s PowerSGD <= 0.80x allreduce, fp16/bf16 <= 0.90x; on loopback
no hook slower than 1.05x allreduce.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from dataclasses import replace
from typing import Any

from benchmarks.common import (
    Trial,
    TrialContext,
    Work,
    build_model,
    interleave,
    median,
    pyplot,
    run_ours,
    run_pool,
    save_plot,
    table,
    write_result,
)

HOOKS = {
    "allreduce": ["comm=allreduce"],
    "fp16": ["comm=fp16"],
    "bf16": ["comm=bf16"],
    "powersgd r1": ["comm=powersgd", "comm.rank=1", "comm.start_iter=2"],
    "powersgd r2": ["comm=powersgd", "comm.rank=2", "comm.start_iter=2"],
}
WORK = Work(model="resnet18", batch_size=16, warmup=3, steps=5)
NAMESPACES = ("fwbench0", "fwbench1")
ADDRESSES = ("10.231.0.1", "10.231.0.2")
VETH = ("fwveth0", "fwveth1")
TARGETS_1GBIT = {"fp16": 0.90, "bf16": 0.90, "powersgd r1": 0.80, "powersgd r2": 0.80}
TARGET_LOOPBACK = 1.05


# --- the shaped link ---------------------------------------------------------------------------
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
        sh(
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            veth,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "256kb",
            "latency",
            "100ms",
        )


def delete_link() -> None:
    for ns in NAMESPACES:
        subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL, check=False)


def tx_bytes(interface: str) -> int:
    """Bytes sent by `interface` in this thread's network namespace."""
    with open("/proc/self/net/dev") as handle:
        for line in handle:
            name, _, counters = line.partition(":")
            if name.strip() == interface:
                return int(counters.split()[8])
    raise LookupError(interface)


# --- one trial: a `train` run with one hook, its bytes counted ---------------------------------
def hook_trial(trial: Trial, ctx: TrialContext) -> dict[str, Any] | None:
    interface = trial.extra["interfaces"][ctx.rank]
    os.environ["GLOO_SOCKET_IFNAME"] = interface  # read when the trial's process group starts
    sent_before = tx_bytes(interface)
    result = run_ours(trial, ctx, HOOKS[trial.extra["hook"]])
    sent = tx_bytes(interface) - sent_before
    if ctx.rank != 0:
        ctx.store.set(f"sent/{ctx.rank}", str(sent))
        return None
    sent_by_rank = [sent] + [int(ctx.store.get(f"sent/{r}")) for r in range(1, ctx.world_size)]
    last = result["events"][-1]
    return {
        "samples_per_s": result["samples_per_s"],
        "sent_bytes": sent_by_rank,
        "counted_bytes_per_step": last["comm/bytes_per_step"],
        "steps": last["step"],
    }


# --- analytic bytes ------------------------------------------------------------------------------
def analytic_bytes(hook: str) -> int:
    """What one rank hands to allreduce per step, from the parameter shapes alone."""
    shapes = [p.shape for p in build_model(WORK).parameters() if p.requires_grad]
    elements = sum(shape.numel() for shape in shapes)
    if hook == "allreduce":
        return 4 * elements
    if hook in ("fp16", "bf16"):
        return 2 * elements
    rank = int(hook.rsplit("r", 1)[1])
    total = 0
    for shape in shapes:
        n = shape[0]
        m = shape.numel() // n
        r = min(n, m, rank)
        # torch's PowerSGD rule (min_compression_rate 2): compress when (n + m) r 2 < n m.
        total += 4 * r * (n + m) if (n + m) * r * 2 < n * m else 4 * shape.numel()
    return total


def run_network(network: str, rounds: int) -> dict[str, list[dict]]:
    interfaces = VETH if network == "1gbit" else ("lo", "lo")
    schedule = []
    for round_index, hook in interleave(list(HOOKS), rounds, mirror=True):
        # Over the link, odd rounds run twice the steps: the difference in bytes sent is
        # what a step sends, free of start-up and evaluation traffic.
        longer = network == "1gbit" and round_index % 2 == 1
        work = replace(WORK, steps=2 * WORK.steps) if longer else WORK
        schedule.append(
            Trial(
                "ours",
                work,
                round=round_index,
                label=f"{network}/{hook}",
                extra={"hook": hook, "interfaces": interfaces},
            )
        )
    results = run_pool(
        schedule,
        {"ours": hook_trial},
        on_result=_print_trial,
        namespaces=NAMESPACES if network == "1gbit" else None,
    )
    by_hook: dict[str, list[dict]] = {hook: [] for hook in HOOKS}
    for trial, result in zip(schedule, results, strict=True):
        by_hook[trial.extra["hook"]].append(result)
    return by_hook


def wire_bytes_per_step(runs: list[dict]) -> float | None:
    """Bytes one rank sent per step: (long run - short run) / (extra steps), mean over ranks."""
    short = [r for r in runs if r["steps"] == WORK.total_steps]
    long = [r for r in runs if r["steps"] > WORK.total_steps]
    if not short or not long:
        return None
    extra_steps = long[0]["steps"] - short[0]["steps"]
    per_rank = [
        (lb - sb) / extra_steps
        for lb, sb in zip(long[0]["sent_bytes"], short[0]["sent_bytes"], strict=True)
    ]
    return sum(per_rank) / len(per_rank)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks comm", description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--networks", default="1gbit,loopback")
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of the veth link")
    args = parser.parse_args(argv)
    networks = args.networks.split(",")
    if "1gbit" in networks and os.geteuid() != 0:
        raise SystemExit(
            "the 1gbit link needs root (network namespaces and tc): use sudo, "
            "or --networks loopback"
        )
    measured: dict[str, dict[str, list[dict]]] = {}
    try:
        for network in networks:
            if network == "1gbit":
                create_link(args.rate)
            measured[network] = run_network(network, args.rounds)
            delete_link()
    finally:
        delete_link()
    global_batch = 2 * WORK.batch_size
    step_ms = {
        network: {
            hook: [1000 * global_batch / r["samples_per_s"] for r in runs]
            for hook, runs in by_hook.items()
        }
        for network, by_hook in measured.items()
    }
    rows, counted_bytes, wire_bytes = [], {}, {}
    for hook in HOOKS:
        analytic = analytic_bytes(hook)
        counted = median([r["counted_bytes_per_step"] for r in measured[networks[0]][hook]])
        wire = wire_bytes_per_step(measured["1gbit"][hook]) if "1gbit" in measured else None
        counted_bytes[hook], wire_bytes[hook] = counted, wire
        row = [
            hook,
            f"{analytic / 1e6:.3f} MB",
            f"{counted / 1e6:.3f} MB",
            f"{wire / 1e6:.3f} MB ({wire / analytic:.3f}x)" if wire else "n/a",
        ]
        for network in measured:
            ms = median(step_ms[network][hook])
            ratio = ms / median(step_ms[network]["allreduce"])
            target = TARGETS_1GBIT.get(hook) if network == "1gbit" else TARGET_LOOPBACK
            mark = "" if target is None or ratio <= target else " (misses)"
            row.append(f"{ms:.0f} ms ({ratio:.2f}x{mark})")
        rows.append(row)
    headers = [
        "hook",
        "analytic bytes/step",
        "counted by hook",
        "sent on the wire (1 Gbit/s)",
        *(f"step time {network} (vs allreduce)" for network in measured),
    ]
    print(f"\nmedians of {args.rounds} mirrored rounds:")
    print(table(headers, rows))
    record = {
        "work": WORK,
        "rounds": args.rounds,
        "step_ms": step_ms,
        "runs": measured,
        "analytic_bytes": {hook: analytic_bytes(hook) for hook in HOOKS},
        "counted_bytes": counted_bytes,
        "wire_bytes": wire_bytes,
        "table": {"headers": headers, "rows": rows},
    }
    default = (args.networks, args.rounds, args.rate) == ("1gbit,loopback", 2, "1gbit")
    name = "comm" if default else "comm-partial"
    write_result(name, record)
    plot(record, networks, name)
    return record


def plot(record: dict[str, Any], networks: list[str], name: str = "comm") -> None:
    plt = pyplot()
    hooks = list(HOOKS)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    positions = range(len(hooks))
    kinds = {
        "analytic": record["analytic_bytes"],
        "counted by hook": record["counted_bytes"],
        "on the wire": record["wire_bytes"],
    }
    bar = 0.8 / len(kinds)
    for index, (kind, values) in enumerate(kinds.items()):
        left.bar(
            [p + index * bar for p in positions],
            [(values.get(h) or 0) / 1e6 for h in hooks],
            bar,
            label=kind,
        )
    left.legend()
    left.set_yscale("log")
    left.set_xticks([p + bar for p in positions], hooks, rotation=20)
    left.set_ylabel("MB per step per rank (log)")
    left.set_title("gradient bytes per step")
    width = 0.8 / len(networks)
    for index, network in enumerate(networks):
        medians = [median(record["step_ms"][network][h]) for h in hooks]
        right.bar([p + index * width for p in positions], medians, width, label=network)
    right.set_xticks([p + width * (len(networks) - 1) / 2 for p in positions], hooks, rotation=20)
    right.set_ylabel("ms per step (median)")
    right.set_title("step time, 2 ranks, ResNet-18, batch 16/rank")
    right.legend()
    save_plot(figure, name)


def _print_trial(trial: Trial, result: dict[str, Any]) -> None:
    ms = 1000 * 2 * trial.work.batch_size / result["samples_per_s"]
    print(
        f"round {trial.round + 1}  {trial.name:24s} {ms:6.0f} ms/step  "
        f"{result['counted_bytes_per_step'] / 1e6:8.3f} MB/step counted",
        flush=True,
    )
