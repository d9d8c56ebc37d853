"""Scaling on CPU: samples/s of `train` at 1 rank and at 2 ranks with one thread per rank, the
scaling efficiency (2-rank samples/s / (2 x 1-rank samples/s)), and the plain DDP loop doing
the same for reference. Also 1 rank using both cores (2 threads): what DDP's second process
buys over torch's own intra-op threads on the same machine.

    uv run python -m benchmarks scaling [--rounds 3] [--models cnn,resnet18]

The per-rank batch is fixed (weak scaling), so 2 ranks do twice the work per step.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.common import (
    Trial,
    TrialContext,
    interleave,
    median,
    run_ours,
    run_pool,
    table,
    write_result,
)
from benchmarks.overhead import WORKS as OVERHEAD_WORKS
from benchmarks.plain import plain_loop

WORKS = {name: OVERHEAD_WORKS[name] for name in ("cnn", "resnet18")}
SETUPS = {  # label: (contender, ranks, threads per rank)
    "plain 1x1": ("plain", 1, 1),
    "ours 1x1": ("ours", 1, 1),
    "ours 2x1": ("ours", 2, 1),
    "plain 2x1": ("plain", 2, 1),
    "ours 1x2": ("ours", 1, 2),
}


def with_threads(trial: Trial, ctx: TrialContext) -> dict[str, Any] | None:
    contender, _, threads = SETUPS[trial.extra["setup"]]
    torch.set_num_threads(threads)
    try:
        return (run_ours if contender == "ours" else plain_loop)(trial, ctx)
    finally:
        torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks scaling", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="cnn,resnet18")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    schedule = [
        Trial(
            "setup",
            WORKS[model],
            world_size=SETUPS[setup][1],
            round=round_index,
            label=f"{model}/{setup}",
            extra={"setup": setup, "model": model},
        )
        for model in models
        for round_index, setup in interleave(list(SETUPS), args.rounds)
    ]
    results = run_pool(schedule, {"setup": with_threads}, on_result=_print_trial)
    rates = {m: {s: [0.0] * args.rounds for s in SETUPS} for m in models}
    for trial, result in zip(schedule, results, strict=True):
        rates[trial.extra["model"]][trial.extra["setup"]][trial.round] = result["samples_per_s"]
    rows = []
    for model in models:
        r = {setup: median(values) for setup, values in rates[model].items()}
        rows.append(
            [
                model,
                f"{r['ours 1x1']:.0f}",
                f"{r['ours 2x1']:.0f}",
                f"**{r['ours 2x1'] / (2 * r['ours 1x1']):.0%}**",
                f"{r['plain 2x1'] / (2 * r['plain 1x1']):.0%}",
                f"{r['ours 1x2']:.0f}",
                f"{r['ours 2x1'] / r['ours 1x2']:.2f}x",
            ]
        )
    headers = [
        "model",
        "1 rank samples/s",
        "2 ranks samples/s",
        "efficiency",
        "plain loop's efficiency",
        "1 rank x 2 threads",
        "2 ranks vs 1 rank x 2 threads",
    ]
    print(f"\nmedian of {args.rounds} interleaved rounds, one thread per rank:")
    print(table(headers, rows))
    record = {
        "rounds": args.rounds,
        "samples_per_s": rates,
        "works": {m: WORKS[m] for m in models},
        "table": {"headers": headers, "rows": rows},
    }
    default = (args.models, args.rounds) == (",".join(WORKS), 3)
    write_result("scaling" if default else "scaling-partial", record)
    return record


def _print_trial(trial: Trial, result: dict[str, Any]) -> None:
    print(
        f"round {trial.round + 1}  {trial.name:20s} {result['samples_per_s']:8.0f} samples/s",
        flush=True,
    )
