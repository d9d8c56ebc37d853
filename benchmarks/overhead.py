"""Loop overhead: steady-state samples/s of `train` against a plain DDP loop on the same work,
with PyTorch Lightning as the peer. 2 gloo ranks on CPU, one thread each, data in memory.

    uv run --group bench python -m benchmarks overhead [--rounds 3] [--models cnn,resnet18]

Target: ours / plain >= 0.98. Each round runs every contender once, the order rotated by one
each round (A B C, B C A, C A B: every contender once in every position over 3 rounds); a ratio
is taken within a round, and the table shows the median over rounds.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.common import (
    Trial,
    Work,
    interleave,
    median,
    pyplot,
    run_ours,
    run_pool,
    save_plot,
    spread,
    table,
    write_result,
)
from benchmarks.plain import lightning_available, lightning_fit, plain_loop

WORKS = {
    # The default experiment's shape (8x8 images, batch 32): steps of a few ms, where any
    # per-step cost of the loop shows.
    "cnn-8x8": Work(model="cnn", batch_size=32, image_size=8, warmup=20, steps=200),
    "cnn": Work(model="cnn", batch_size=64, warmup=10, steps=30),
    "resnet18": Work(model="resnet18", batch_size=16, warmup=3, steps=9),
}
CONTENDERS = {"plain": plain_loop, "ours": run_ours, "lightning": lightning_fit}
TARGET = 0.98


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks overhead", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default=",".join(WORKS))
    args = parser.parse_args(argv)
    names = ["plain", "ours"] + (["lightning"] if lightning_available() else [])
    if "lightning" not in names:
        print("lightning is not installed: `uv run --group bench ...` adds it; measuring without")
    schedule = [
        Trial(contender, WORKS[model], round=round_index, label=f"{model}/{contender}")
        for model in args.models.split(",")
        for round_index, contender in interleave(names, args.rounds)
    ]
    results = run_pool(schedule, CONTENDERS, on_result=_print_trial)
    rows, record = [], {"target": TARGET, "rounds": args.rounds, "models": {}}
    for model in args.models.split(","):
        rates = {name: [0.0] * args.rounds for name in names}
        for trial, result in zip(schedule, results, strict=True):
            if trial.work is WORKS[model]:
                rates[trial.contender][trial.round] = result["samples_per_s"]
        ratios = {name: [r / p for r, p in zip(rates[name], rates["plain"], strict=True)]
                  for name in names}  # fmt: skip
        record["models"][model] = {"work": WORKS[model], "samples_per_s": rates,
                                   "ratio_to_plain": ratios}  # fmt: skip
        row = [model, f"{median(rates['plain']):.0f}", f"{median(rates['ours']):.0f}",
               f"**{median(ratios['ours']):.3f}x**", f"{spread(ratios['ours']):.1%}"]  # fmt: skip
        if "lightning" in names:
            row += [f"{median(rates['lightning']):.0f}", f"{median(ratios['lightning']):.3f}x"]
        rows.append(row)
    headers = ["model", "plain samples/s", "ours samples/s", "ours / plain", "spread"]
    if "lightning" in names:
        headers += ["Lightning samples/s", "Lightning / plain"]
    print(f"\nmedian of {args.rounds} interleaved rounds (target ours / plain >= {TARGET}):")
    print(table(headers, rows))
    record["table"] = {"headers": headers, "rows": rows}
    # The default run backs the README; any other selection gets its own files.
    name = "overhead" if (args.models, args.rounds) == (",".join(WORKS), 3) else "overhead-partial"
    write_result(name, record)
    plot(record, names, name)
    return record


def plot(record: dict[str, Any], names: list[str], name: str = "overhead") -> None:
    """Each contender's samples/s relative to the plain loop, per model, with the target."""
    plt = pyplot()
    models = list(record["models"])
    figure, axes = plt.subplots(figsize=(6.5, 3.6))
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        ratios = [median(record["models"][m]["ratio_to_plain"][name]) for m in models]
        bars = axes.bar([p + index * width for p in range(len(models))], ratios, width,
                        label={"ours": "train (ours)", "plain": "plain DDP loop",
                               "lightning": "PyTorch Lightning"}[name])  # fmt: skip
        axes.bar_label(bars, fmt="%.2f", fontsize=8)
    axes.axhline(TARGET, color="black", linestyle="--", linewidth=0.8, label=f"target {TARGET}")
    axes.set_xticks([p + width * (len(names) - 1) / 2 for p in range(len(models))], models)
    axes.set_ylabel("samples/s relative to plain")
    axes.set_ylim(0, 1.35)
    axes.set_title("loop overhead: 2 gloo ranks on CPU (median of rounds)")
    axes.legend(loc="lower right", fontsize=8)
    save_plot(figure, name)


def _print_trial(trial: Trial, result: dict[str, Any]) -> None:
    print(f"round {trial.round + 1}  {trial.name:20s} {result['samples_per_s']:8.0f} samples/s",
          flush=True)  # fmt: skip
