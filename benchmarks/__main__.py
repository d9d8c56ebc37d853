"""`uv run python -m benchmarks <name> [options]`: one benchmark, its ratios printed, its JSON
written to benchmarks/results/<name>.json (and a PNG where it plots).

    overhead   loop overhead: train vs a plain DDP loop vs Lightning (small CNN, ResNet-18)
    startup    command -> first optimizer step: train vs the plain loop, under torchrun
    comm       bytes per step per DDP hook vs analytic; step time over 1 Gbit/s and loopback
    accuracy   digits, 3 seeds: final validation accuracy per comm hook and precision
    scaling    samples/s at 1 and 2 ranks on CPU, and the scaling efficiency
    speed      the speed options (precision, channels_last, compile, num_workers) vs plain
    presets    each experiment preset as users run it, its result next to a baseline
    command    train / a torchrun loop / Lightning as whole commands: speed and its spread,
               a short job, each further sweep job, the time to refuse a mistake
               (--options: the speed options, train vs the torchrun loop)
    memory     bytes and peak memory per rank, ddp vs fsdp at 1, 2 and 4 ranks (GPT preset),
               and fsdp's step time against ddp's
    mistakes   ten typical config mistakes, --help and --cfg job as whole commands, beside the
               floor of any Hydra app (import hydra, compose once)
    front_door what the command loads and how often it composes before it answers or runs: a
               refused typo, a single run, a 2-job sweep
    pruning    a 16-trial learning-rate sweep with ASHA against the same sweep unpruned:
               steps trained, the best found, the best trial run alone
    stream     data=text_stream: a rank's peak memory at 1x and 10x the data, and its
               throughput against data=text's on the same text
    all        every one of the above, in that order

    gpu        one prepared check of the CUDA path on a lent GPU, every step timed into
               $OUT/gpu-check.json (never part of `all`; --cpu: the same steps at toy size)

`python -m benchmarks <name> --help` lists a benchmark's options.
"""

from __future__ import annotations

import importlib
import sys
import time

BENCHMARKS = (
    "overhead",
    "startup",
    "comm",
    "accuracy",
    "scaling",
    "speed",
    "presets",
    "command",
    "memory",
    "mistakes",
    "front_door",
    "pruning",
    "stream",
)


# Checks, not measurements of this machine: each runs only when named.
CHECKS = ("gpu",)


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in (*BENCHMARKS, *CHECKS, "all"):
        print(__doc__)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    names = BENCHMARKS if argv[0] == "all" else (argv[0],)
    for name in names:
        started = time.perf_counter()
        print(f"=== {name} ===", flush=True)
        importlib.import_module(f"benchmarks.{name}").main(argv[1:] if len(names) == 1 else [])
        print(f"=== {name}: {time.perf_counter() - started:.0f} s ===\n", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
