"""Accuracy parity: the default experiment (small CNN on scikit-learn's digits, 2 ranks, 15
epochs) with each DDP communication hook and each precision, 3 seeds each: final validation
accuracy as mean, standard deviation and range. A hook or precision that costs accuracy shows
up as a lower mean than allreduce/fp32 beyond the seeds' spread.

    uv run python -m benchmarks accuracy [--seeds 0,1,2] [--hooks ...] [--precisions ...]
    uv run python -m benchmarks accuracy --hooks allreduce,powersgd --precisions amp  # ~5 min

`trainer.seed` sets the initial weights and the data order; the validation split is fixed.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks.common import Trial, TrialContext, Work, run_pool, run_train, table, write_result

HOOKS = {
    "allreduce": [],
    "fp16": ["comm=fp16"],
    "bf16": ["comm=bf16"],
    "powersgd": ["comm=powersgd"],
}
# amp (float16 autocast + GradScaler) is a GPU feature: float16 kernels on this CPU ran 8x
# slower than fp32 (484 against 3805 samples/s), 45 s a run, so it is opt-in here.
PRECISIONS = ("fp32", "bf16")


def accuracy_trial(trial: Trial, ctx: TrialContext) -> dict[str, Any] | None:
    extra = trial.extra
    overrides = [
        *HOOKS[extra["hook"]],
        f"precision={extra['precision']}",
        f"trainer.seed={extra['seed']}",
        "launcher.nproc_per_node=2",
        "trainer.progress_bar=false",
        "checkpoint.final=false",
    ]
    result = run_train(overrides, ctx, warmup=10)
    if ctx.rank != 0:
        return None
    return {
        "val/accuracy": result["summary"]["val/accuracy"],
        "val/loss": result["summary"]["val/loss"],
        "samples_per_s": result["samples_per_s"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks accuracy", description=__doc__)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--hooks", default=",".join(HOOKS))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    args = parser.parse_args(argv)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    hooks, precisions = args.hooks.split(","), args.precisions.split(",")
    schedule = [
        Trial(
            "train",
            Work(),
            label=f"{hook}/{precision}/seed{seed}",
            extra={"hook": hook, "precision": precision, "seed": seed},
        )
        for seed in seeds
        for hook in hooks
        for precision in precisions
    ]
    results = run_pool(schedule, {"train": accuracy_trial}, on_result=_print_trial)
    accuracy: dict[str, dict[str, list[float]]] = {h: {p: [] for p in precisions} for h in hooks}
    for trial, result in zip(schedule, results, strict=True):
        accuracy[trial.extra["hook"]][trial.extra["precision"]].append(result["val/accuracy"])
    rows = [
        [hook, *(_cell(accuracy[hook][precision]) for precision in precisions)] for hook in hooks
    ]
    headers = ["comm hook", *(f"precision={precision}" for precision in precisions)]
    print(f"\nfinal val/accuracy (%), mean +- std over seeds {seeds} [min - max]:")
    print(table(headers, rows))
    record = {"seeds": seeds, "accuracy": accuracy, "table": {"headers": headers, "rows": rows}}
    # The default grid is benchmarks/results/accuracy.json; an opt-in one gets its own file.
    suffix = "" if precisions == list(PRECISIONS) else "-" + "-".join(precisions)
    write_result(f"accuracy{suffix}", record)
    return record


def _cell(values: list[float]) -> str:
    mean = 100 * statistics.mean(values)
    std = 100 * statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.2f} +- {std:.2f} [{100 * min(values):.1f} - {100 * max(values):.1f}]"


def _print_trial(trial: Trial, result: dict[str, Any]) -> None:
    print(
        f"{trial.name:28s} val/accuracy={result['val/accuracy']:.4f} "
        f"({result['samples_per_s']:.0f} samples/s)",
        flush=True,
    )
