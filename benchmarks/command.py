"""Through the command users run: `train` (launcher=local: the fork server, the run dir), a
hand-written torchrun loop and Lightning, each started as a whole command, alternated round by
round (A B C, B C A, ...). The pooled `overhead` benchmark calls the per-rank entry point in
long-lived processes instead; this one pays everything a user pays.

    uv run --group bench python -m benchmarks command [--rounds 4] [--steps 60]

Measured, as the median and the spread (min-max, as +- % of the median) of each side:
- throughput: steady samples/s after warm-up, small CNN on 16x16 images (`--image-size`), 2
  gloo ranks, one thread each, batch 64 per rank (benchmarks/plain_loop_torchrun.py,
  lightning_command.py);
- the whole command of that short job, from start to exit;
- each further job of a local sweep: `train -m optimizer.lr=a,b,c` against a 1-job sweep, per
  job, next to the peers' whole command for one more job (they start one command per job);
- the time to refuse a config mistake: an unknown key for `train`, an unknown option for the
  plain script under torchrun and for the Lightning script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    Work,
    interleave,
    median,
    steady_samples_per_s,
    table,
    write_result,
)
from benchmarks.plain import lightning_available
from benchmarks.startup import HUNG_S, torchrun

TRAIN = str(Path(sys.executable).with_name("train"))
RATE = re.compile(r"samples_per_s=([\d.]+)")
SWEEP_STEPS = 20


def script_args(work: Work) -> list[str]:
    return [
        f"--steps={work.total_steps}",
        f"--warmup={work.warmup}",
        f"--batch-size={work.batch_size}",
        f"--image-size={work.image_size}",
        f"--lr={work.lr}",
    ]


def commands(work: Work, scratch: Path) -> dict[str, list[str]]:
    """Every measured command, by contender name."""
    plain = [*torchrun(), str(REPO / "benchmarks" / "plain_loop_torchrun.py")]
    lightning = [sys.executable, str(REPO / "benchmarks" / "lightning_command.py")]
    short = Work(
        model=work.model,
        steps=SWEEP_STEPS // 2,
        warmup=SWEEP_STEPS // 2,
        image_size=work.image_size,
    )
    found = {
        "train": [TRAIN, *work.overrides(2), "data.in_channels=3", f"hydra.run.dir={scratch}"],
        "plain torchrun": [*plain, *script_args(work)],
        "lightning": [*lightning, *script_args(work)],
        "train sweep, 1 job": [TRAIN, "-m", *_sweep(short, scratch, "0.05")],
        "train sweep, 3 jobs": [TRAIN, "-m", *_sweep(short, scratch, "0.05,0.04,0.03")],
        "plain torchrun, 1 job": [*plain, *script_args(short)],
        "lightning, 1 job": [*lightning, *script_args(short)],
        "train mistake": [TRAIN, "+trainer.max_stepz=1", f"hydra.run.dir={scratch}"],
        "plain torchrun mistake": [*plain, "--stepz=1"],
        "lightning mistake": [*lightning, "--stepz=1"],
    }
    return found if lightning_available() else {k: v for k, v in found.items() if "lightn" not in k}


def _sweep(work: Work, scratch: Path, rates: str) -> list[str]:
    return [
        *work.overrides(2),
        "data.in_channels=3",
        f"optimizer.lr={rates}",
        f"hydra.sweep.dir={scratch}",
    ]


def run_whole(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The command in a session of its own: a peer that hangs is ended with every process it
    started (Lightning's second rank is its own child, not ours)."""
    with subprocess.Popen(
        argv,
        cwd=cwd,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=HUNG_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise RuntimeError(f"hung for {HUNG_S} s: {' '.join(argv)}") from None
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def measure(name: str, argv: list[str], scratch: Path, warmup: int) -> dict[str, Any]:
    started = time.perf_counter()
    result = run_whole(argv, scratch.parent)
    measured: dict[str, Any] = {"command_s": time.perf_counter() - started}
    if "mistake" in name:
        if result.returncode == 0:
            raise RuntimeError(f"{name} was not refused")
        return measured
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{(result.stdout + result.stderr)[-3000:]}")
    if name == "train":
        events = [
            json.loads(line) for line in (scratch / "metrics.jsonl").read_text().split("\n") if line
        ]
        measured["samples_per_s"] = steady_samples_per_s(events, warmup)
    elif found := RATE.search(result.stdout + result.stderr):
        measured["samples_per_s"] = float(found.group(1))
    return measured


def spread(values: list[float]) -> str:
    middle = median(values)
    return f"{middle:.4g} (+{max(values) / middle - 1:.1%} / -{1 - min(values) / middle:.1%})"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks command", description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60, help="measured steps, after 20")
    parser.add_argument("--image-size", type=int, default=16)
    args = parser.parse_args(argv)
    work = Work(model="cnn", steps=args.steps, warmup=20, batch_size=64, image_size=args.image_size)
    root = Path(tempfile.mkdtemp(prefix="command-bench-"))
    names = list(commands(work, root))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_index, name in interleave(names, args.rounds):
        scratch = root / f"{name}-{round_index}".replace(" ", "-").replace(",", "")
        measured = measure(name, commands(work, scratch)[name], scratch, work.warmup)
        runs[name].append(measured)
        rate = measured.get("samples_per_s")
        shown = f"  {rate:.0f} samples/s" if rate else ""
        print(
            f"round {round_index + 1}  {name:24s} {measured['command_s']:.2f} s{shown}", flush=True
        )
    rows = [
        [
            name,
            spread([run["command_s"] for run in measured]) + " s",
            spread([run["samples_per_s"] for run in measured])
            if "samples_per_s" in measured[0]
            else "",
        ]
        for name, measured in runs.items()
    ]
    sweep = {n: median([r["command_s"] for r in runs[n]]) for n in names if "sweep" in n}
    per_further_job = (sweep["train sweep, 3 jobs"] - sweep["train sweep, 1 job"]) / 2
    headers = ["command", "whole command (median, spread)", "steady samples/s (median, spread)"]
    print(f"\n{args.rounds} rounds, alternated:")
    print(table(headers, rows))
    print(f"\ntrain: each further job of a local sweep: {per_further_job:.2f} s")
    record = {
        "rounds": args.rounds,
        "work": work,
        "runs": runs,
        "per_further_sweep_job_s": per_further_job,
        "table": {"headers": headers, "rows": rows},
    }
    write_result("command", record)
    return record
