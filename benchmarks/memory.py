"""Memory per rank under strategy=ddp and strategy=fsdp, at 1, 2 and 4 ranks, on the GPT preset
(experiment=char_gpt's model and batch), with fsdp's step time against ddp's on the same shape.

    uv run python -m benchmarks memory [--rounds 2] [--ranks 1,2,4] [--steps 12] [--model K=V ...]
                                       [--strategies ddp,fsdp]

--model overrides the preset's model (e.g. --model model.width=384 model.layers=4): a larger
model whose state stands out of the process's own resident memory. --strategies picks the
contenders; a `+ac` suffix adds strategy.activation_checkpointing=true (`--strategies
ddp,ddp+ac`: what recomputing each block in backward costs a step). The last column is each
contender's median step time against the first's (each round's ratios are printed too).

Per rank, exact from the local shards (DTensor.to_local() under fsdp) after the first optimizer
step: parameter, gradient and optimizer-state bytes. Also per rank: the peak resident memory
(VmHWM, reset at each trial's start) and how far it rose during the trial, and the run's own
logged `memory/peak_mib_max`. The step time is the steady one (after warm-up) of `train`
itself, both strategies interleaved in the same pool of rank processes; 4 ranks on 2 cores
share them (oversubscribed), so read that row's times as relative only.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import (
    Trial,
    TrialContext,
    Work,
    interleave,
    median,
    run_pool,
    run_train,
    table,
    write_result,
)
from framework.components.strategy import local
from framework.components.utilization import MIB, peak_memory_mib
from framework.rank.loop import Runner

STRATEGIES = ("ddp", "fsdp")
CHECKPOINTED = "+ac"  # a contender's suffix: strategy.activation_checkpointing=true
CPU = torch.device("cpu")


def overrides(
    strategy: str, world_size: int, warmup: int, steps: int, model: Sequence[str] = ()
) -> list[str]:
    """experiment=char_gpt as it ships (2 blocks of width 128, 4 heads, batch 16 x 64 tokens per
    rank, AdamW), for warm-up + measured steps: no evaluation on the way, no checkpoint."""
    checkpointed = strategy.endswith(CHECKPOINTED)
    return [
        "experiment=char_gpt",
        f"strategy={strategy.removesuffix(CHECKPOINTED)}",
        *(["strategy.activation_checkpointing=true"] if checkpointed else []),
        f"launcher.nproc_per_node={world_size}",
        "data.val_fraction=0.01",  # the final evaluation is not what is measured
        "task.sample_tokens=0",
        f"trainer.max_steps={warmup + steps}",
        "trainer.max_epochs=null",
        f"trainer.log_every={warmup}",
        "trainer.eval_every=0",
        "trainer.progress_bar=false",
        "checkpoint.every=0",
        "checkpoint.final=false",
        *model,
    ]


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state, from its local shards."""

    def size(tensor: torch.Tensor) -> int:
        shard = local(tensor)
        return shard.numel() * shard.element_size()

    parameters = list(module.parameters())
    return {
        "params": sum(size(p) for p in parameters),
        "grads": sum(size(p.grad) for p in parameters if p.grad is not None),
        "optimizer": sum(
            size(value)
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ),
    }


def reset_peak_rss() -> None:
    """VmHWM back to the current RSS: the pool's processes run trial after trial."""
    Path("/proc/self/clear_refs").write_text("5")


def measured_train(trial: Trial, ctx: TrialContext) -> dict[str, Any] | None:
    """`train` on this rank, its state bytes captured after its first optimizer step (while the
    gradients still exist), and its peak memory; rank 0 returns every rank's."""
    reset_peak_rss()
    start_mib = peak_memory_mib(CPU)
    captured: dict[str, int] = {}
    original = Runner.update

    def update_and_measure(runner: Runner, step: int, totals: torch.Tensor) -> Any:
        """The update, measured just before it zeroes the gradients."""
        optimizer = runner.optimizer
        zero_grad = optimizer.zero_grad

        def measure_then_zero(set_to_none: bool = True) -> None:
            if not captured:
                captured.update(state_bytes(runner.model.module, optimizer))
            zero_grad(set_to_none=set_to_none)

        optimizer.zero_grad = measure_then_zero
        try:
            return original(runner, step, totals)
        finally:
            del optimizer.zero_grad  # the class's again

    Runner.update = update_and_measure
    try:
        strategy, warmup = trial.extra["strategy"], trial.work.warmup
        result = run_train(
            overrides(strategy, ctx.world_size, warmup, trial.work.steps, trial.extra["model"]),
            ctx,
            warmup,
        )
    finally:
        Runner.update = original
    mine = {**captured, "peak_mib": peak_memory_mib(CPU), "start_mib": start_mib}
    ctx.store.set(f"rank/{ctx.rank}", json.dumps(mine))
    if ctx.rank != 0:
        return None
    ranks = [json.loads(ctx.store.get(f"rank/{rank}")) for rank in range(ctx.world_size)]
    events = result["events"]
    return {
        "samples_per_s": result["samples_per_s"],
        "global_batch_size": result["summary"]["global_batch_size"],
        "flops_per_step": result["summary"].get("flops_per_step"),
        "logged_peak_mib_max": events[-1]["memory/peak_mib_max"],
        "ranks": ranks,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks memory", description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="measured steps, after warm-up")
    parser.add_argument("--model", nargs="*", default=[], help="overrides of the preset's model")
    parser.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="contenders, the first the reference (a +ac suffix: activation checkpointing)",
    )
    args = parser.parse_args(argv)
    strategies = args.strategies.split(",")
    rank_counts = [int(n) for n in args.ranks.split(",")]
    work = Work(steps=args.steps, warmup=args.warmup)  # only its step counts are used
    # First, one untimed trial on every process of the pool: one-time costs (the text's first
    # load, the first FLOP count) then land in no measured trial's RSS rise.
    warm_up = Trial(
        "measured",
        Work(steps=1, warmup=1),
        world_size=max(rank_counts),
        label="pool warm-up",
        extra={"strategy": "ddp", "model": args.model},
    )
    schedule = [
        Trial(
            "measured",
            work,
            world_size=ranks,
            round=round_index,
            label=f"{ranks}x{strategy}",
            extra={"strategy": strategy, "ranks": ranks, "model": args.model},
        )
        for ranks in rank_counts
        for round_index, strategy in interleave(strategies, args.rounds)
    ]
    results = run_pool(
        [warm_up, *schedule],
        {"measured": measured_train},
        nprocs=max(rank_counts),
        on_result=_print_trial,
    )[1:]
    runs: dict[str, list[dict]] = {}
    for trial, result in zip(schedule, results, strict=True):
        runs.setdefault(trial.name, []).append(result)
    rows = []
    for ranks in rank_counts:
        step_ms = {
            strategy: [
                1000 * r["global_batch_size"] / r["samples_per_s"]
                for r in runs[f"{ranks}x{strategy}"]
            ]
            for strategy in strategies
        }
        for strategy in strategies:
            rows.append(_row(ranks, strategy, runs[f"{ranks}x{strategy}"], step_ms, strategies[0]))
            if strategy != strategies[0]:
                ratios = [
                    a / b for a, b in zip(step_ms[strategy], step_ms[strategies[0]], strict=True)
                ]
                print(
                    f"{ranks}x{strategy} / {ranks}x{strategies[0]} step time, per round: "
                    + " ".join(f"{ratio:.2f}" for ratio in ratios)
                )
    headers = [
        "ranks",
        "strategy",
        "params MiB/rank",
        "grads MiB/rank",
        "AdamW state MiB/rank",
        "state MiB/rank",
        "peak RSS MiB/rank (max)",
        "RSS rise in the run MiB/rank (max)",
        "step ms",
        f"step time / {strategies[0]}'s",
    ]
    print(f"\nmedian of {args.rounds} interleaved rounds; bytes from rank 0's local shards:")
    print(table(headers, rows))
    record = {
        "rounds": args.rounds,
        "ranks": rank_counts,
        "overrides": overrides("<strategy>", 0, args.warmup, args.steps, args.model),
        "runs": runs,
        "table": {"headers": headers, "rows": rows},
    }
    default = (args.ranks, args.rounds, args.steps, args.warmup) == ("1,2,4", 2, 12, 3) and (
        strategies == list(STRATEGIES)
    )
    name = "memory" if default else "memory-partial"
    shape = "-".join(o.split(".")[-1].replace("_size=", "").replace("=", "") for o in args.model)
    if strategies != list(STRATEGIES):
        shape = "-".join([*strategies, shape] if shape else strategies).replace("+", "")
    write_result(f"{name}-{shape}" if shape else name, record)
    return record


def _row(
    ranks: int, strategy: str, runs: list[dict], step_ms: dict[str, list[float]], reference: str
) -> list[str]:
    first = runs[0]["ranks"]

    def most(key: str) -> float:  # the largest rank's share (shards may be uneven)
        return max(rank[key] for rank in first) / MIB

    peak = median([max(rank["peak_mib"] for rank in run["ranks"]) for run in runs])
    rise = median(
        [max(rank["peak_mib"] - rank["start_mib"] for rank in run["ranks"]) for run in runs]
    )
    state = max(rank["params"] + rank["grads"] + rank["optimizer"] for rank in first) / MIB
    ratio = median(step_ms[strategy]) / median(step_ms[reference])
    return [
        str(ranks),
        strategy,
        f"{most('params'):.3f}",
        f"{most('grads'):.3f}",
        f"{most('optimizer'):.3f}",
        f"**{state:.3f}**",
        f"{peak:.0f}",
        f"{rise:.0f}",
        f"{median(step_ms[strategy]):.0f}",
        f"{ratio:.2f}x" if strategy != reference else "",
    ]


def _print_trial(trial: Trial, result: dict[str, Any]) -> None:
    ranks = result["ranks"]
    state = max(r["params"] + r["grads"] + r["optimizer"] for r in ranks) / MIB
    print(
        f"round {trial.round + 1}  {trial.name:8s} {result['samples_per_s']:8.0f} samples/s  "
        f"state {state:.3f} MiB/rank  peak RSS {max(r['peak_mib'] for r in ranks):.0f} MiB",
        flush=True,
    )
