"""Start-up: seconds from the command to the end of a 1-step run (2 ranks, the default work: a
small CNN on scikit-learn's digits), against the floor, one process importing what DDP needs
(`python -c "import torch._dynamo"`), measured interleaved in the same run: each contender's
median and spread (its slowest and fastest run against the median).

    uv run python -m benchmarks startup [--repeats 5]

Contenders, alternated round by round:
- floor:              python -c "import torch._dynamo"
- train:              train trainer.max_steps=1 (launcher=local: ranks from a preloaded fork server)
- train torchrun:     train launcher=torchrun trainer.max_steps=1 (agent's workers: the same)
- external torchrun:  torchrun --nproc_per_node=2 -m framework.train trainer.max_steps=1
- plain torchrun:     torchrun --nproc_per_node=2 benchmarks/plain_torchrun.py (a hand-written
                      DDP loop on the same work, 1 step)
Target: train's whole command within 1.5x the floor. Rank 0's "start-up:" line
(framework/core/startup_clock.py) gives train's breakdown: imports, compose, start ranks, process
group, data, model, setup, first step; "exit" is the rest of the command.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, interleave, median, spread, table, write_result

TARGET_RATIO = 1.5
STARTUP_LINE = re.compile(r"start-up: ([\d.]+) s to the first step \((.*)\)")
# `uv run train` runs the console script (framework/cli.py), which starts the fork server first.
TRAIN = [str(Path(sys.executable).with_name("train")), "trainer.max_steps=1", "trainer.log_every=1"]
ONE_STEP = TRAIN[1:]
HUNG_S = 240  # a command this slow hung (plain torch 2.13 once hung at exit on rank 0): rerun


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun() -> list[str]:
    """torchrun with 2 ranks on a free port (not 29500: another job may hold it)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
    ]


def command(contender: str, run_dir: Path) -> list[str]:
    if contender == "floor":
        return [sys.executable, "-c", "import torch._dynamo"]
    if contender == "plain torchrun":
        return [*torchrun(), str(REPO / "benchmarks" / "plain_torchrun.py")]
    if contender == "external torchrun":
        return [*torchrun(), "-m", "framework.train", *ONE_STEP, f"hydra.run.dir={run_dir}"]
    extra = ["launcher=torchrun"] if contender == "train torchrun" else []
    return [*TRAIN, *extra, f"hydra.run.dir={run_dir}"]


def measure(contender: str, run_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for attempt in range(2):
        started = time.perf_counter()
        try:
            result = subprocess.run(
                command(contender, run_dir),
                cwd=REPO,
                env=env,
                text=True,
                capture_output=True,
                timeout=HUNG_S,
            )
        except subprocess.TimeoutExpired:
            print(
                f"  {contender} hung for {HUNG_S} s (attempt {attempt + 1}); run again", flush=True
            )
            continue
        seconds = time.perf_counter() - started
        break
    else:
        raise RuntimeError(f"{contender} hung twice")
    if result.returncode != 0:
        raise RuntimeError(f"{contender} failed:\n{(result.stdout + result.stderr)[-3000:]}")
    measured: dict[str, Any] = {"command_s": seconds}
    found = STARTUP_LINE.search(result.stderr)
    if found:
        phases = dict(part.rsplit(" ", 1) for part in found.group(2).split(", "))
        measured["phases"] = {name: float(value) for name, value in phases.items()}
        measured["phases"]["exit"] = seconds - float(found.group(1))
    return measured


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks startup", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    contenders = ["floor", "train", "train torchrun", "external torchrun", "plain torchrun"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    for round_index, contender in interleave(contenders, args.repeats):
        measured = measure(contender, scratch / f"{contender}-{round_index}".replace(" ", "-"))
        runs[contender].append(measured)
        print(f"round {round_index + 1}  {contender:18s} {measured['command_s']:.2f} s", flush=True)
    seconds = {
        name: median([run["command_s"] for run in measured]) for name, measured in runs.items()
    }
    floor = seconds["floor"]
    rows = [
        [
            name,
            spread([run["command_s"] for run in runs[name]]) + " s",
            f"**{seconds[name] / floor:.2f}x**"
            if name == "train"
            else f"{seconds[name] / floor:.2f}x",
        ]
        for name in contenders
    ]
    phases = [run["phases"] for run in runs["train"] if "phases" in run]
    breakdown = {name: median([p[name] for p in phases]) for name in phases[0]} if phases else {}
    print(f"\nmedian of {args.repeats} interleaved runs (target: train <= {TARGET_RATIO}x floor):")
    headers = ["command", "whole command (median, spread)", "median vs the floor"]
    print(table(headers, rows))
    print(
        "\ntrain, where the time goes (medians, s): "
        + ", ".join(f"{name} {value:.2f}" for name, value in breakdown.items())
    )
    record = {
        "target_ratio": TARGET_RATIO,
        "repeats": args.repeats,
        "runs": runs,
        "median_s": seconds,
        "breakdown_s": breakdown,
        "table": {"headers": headers, "rows": rows},
    }
    write_result("startup", record)
    return record
