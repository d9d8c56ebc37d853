"""The speed options, each measured on `train` and on the plain loop doing the same thing:
precision, `trainer.channels_last`, `trainer.compile` (torch.compile) and `data.num_workers`
(+ persistent_workers). Ratios: ours / plain per option (target >= 0.98) and each option's
speed-up over fp32 for ours.

    uv run python -m benchmarks speed [--rounds 2]          # CPU: 2 gloo ranks, small CNN
    uv run python -m benchmarks speed --device cuda         # one GPU: ResNet-18 and ResNet-50

On CPU every option is tried alone. On a GPU the ladder is the one users climb: fp32, bf16,
amp (fp16 + GradScaler), bf16 + channels_last, bf16 + channels_last + compile.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

import torch

from benchmarks.common import (
    Trial,
    Work,
    interleave,
    median,
    run_ours,
    run_pool,
    table,
    write_result,
)
from benchmarks.plain import plain_loop

CPU_WORK = Work(model="cnn", batch_size=64, warmup=10, steps=30)
CPU_LADDER = {
    "fp32": {},
    "channels_last": {"channels_last": True},
    "num_workers=1": {"num_workers": 1},
    "bf16": {"precision": "bf16"},
    "compile": {"compile": True},
}
GPU_WORKS = {
    "resnet18": Work(model="resnet18", batch_size=256, warmup=15, steps=40, device="cuda"),
    "resnet50": Work(
        model="resnet50", batch_size=64, warmup=15, steps=30, image_size=224, device="cuda"
    ),
}
GPU_LADDER = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "amp": {"precision": "amp"},
    "bf16+channels_last": {"precision": "bf16", "channels_last": True},
    "bf16+channels_last+compile": {"precision": "bf16", "channels_last": True, "compile": True},
}
TARGET = 0.98


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks speed", description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--options", help="a comma list of the ladder's rungs (default: all)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    gpu = args.device == "cuda"
    works = GPU_WORKS if gpu else {"cnn": CPU_WORK}
    ladder = GPU_LADDER if gpu else CPU_LADDER
    if args.options:
        ladder = {option: ladder[option] for option in ["fp32", *args.options.split(",")]}
    world_size = 1 if gpu else 2
    schedule = [
        Trial(
            contender,
            replace(work, **ladder[option]),
            world_size=world_size,
            round=round_index,
            label=f"{model}/{option}/{contender}",
            extra={"model": model, "option": option},
        )
        for model, work in works.items()
        for round_index, option in interleave(list(ladder), args.rounds, mirror=True)
        for contender in (("plain", "ours") if round_index % 2 == 0 else ("ours", "plain"))
    ]
    results = run_pool(
        schedule, {"plain": plain_loop, "ours": run_ours}, nprocs=world_size, on_result=_print_trial
    )
    rates = {m: {o: {c: [] for c in ("plain", "ours")} for o in ladder} for m in works}
    for trial, result in zip(schedule, results, strict=True):
        rates[trial.extra["model"]][trial.extra["option"]][trial.contender].append(
            result["samples_per_s"]
        )
    rows = []
    for model in works:
        base = median(rates[model]["fp32"]["ours"])
        for option in ladder:
            ours, plain = rates[model][option]["ours"], rates[model][option]["plain"]
            ratio = median([o / p for o, p in zip(ours, plain, strict=True)])
            rows.append(
                [
                    model,
                    option,
                    f"{median(plain):.0f}",
                    f"{median(ours):.0f}",
                    f"**{ratio:.3f}x**",
                    f"{median(ours) / base:.2f}x",
                ]
            )
    headers = [
        "model",
        "option",
        "plain samples/s",
        "ours samples/s",
        "ours / plain",
        "ours vs fp32",
    ]
    where = f"{world_size} rank(s) on {'one GPU' if gpu else 'CPU (gloo, 1 thread each)'}"
    print(f"\n{where}, median of {args.rounds} rounds (target ours / plain >= {TARGET}):")
    print(table(headers, rows))
    record = {
        "device": args.device,
        "rounds": args.rounds,
        "works": works,
        "ladder": ladder,
        "samples_per_s": rates,
        "table": {"headers": headers, "rows": rows},
    }
    # The whole ladder is benchmarks/results/speed-<device>.json; a subset gets its own file.
    write_result(f"speed-{args.device}{'-partial' if args.options else ''}", record)
    return record


def _print_trial(trial: Trial, result: dict[str, Any]) -> None:
    print(
        f"round {trial.round + 1}  {trial.name:36s} {result['samples_per_s']:8.0f} samples/s",
        flush=True,
    )
