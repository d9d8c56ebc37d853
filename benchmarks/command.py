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

`--speed-only` measures only the throughput of `train` against the plain torchrun loop, on this
benchmark's work or on one of the `overhead` benchmark's (`--work cnn-8x8`, `--work cnn`): the
pooled figures' work, through the command. `--before REV` adds `train` as of git revision REV
(its files exported to a temporary folder and imported ahead of this checkout's), alternated with
the rest: a change's before and after in one run.
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
from dataclasses import replace
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
from benchmarks.overhead import WORKS as POOLED_WORKS
from benchmarks.plain import lightning_available
from benchmarks.startup import HUNG_S, torchrun

TRAIN = str(Path(sys.executable).with_name("train"))
TRAIN_SCRIPT = "from framework.cli import main; main()"  # what the `train` console script runs
RATE = re.compile(r"samples_per_s=([\d.]+)")
SWEEP_STEPS = 20
# This benchmark's own work (--steps sets its measured steps), then the pooled benchmark's
# small-CNN works, which the plain torchrun loop can run too.
WORKS = {
    "cnn-16x16": Work(model="cnn", steps=60, warmup=20, batch_size=64, image_size=16),
    "cnn-8x8": POOLED_WORKS["cnn-8x8"],
    "cnn": POOLED_WORKS["cnn"],
}
SPEED = ("train", "plain torchrun")


def script_args(work: Work) -> list[str]:
    return [
        f"--steps={work.total_steps}",
        f"--warmup={work.warmup}",
        f"--batch-size={work.batch_size}",
        f"--image-size={work.image_size}",
        f"--lr={work.lr}",
    ]


def commands(
    work: Work, scratch: Path, before: tuple[str, Path] | None = None
) -> dict[str, list[str]]:
    """Every measured command, by contender name; `before`: (revision, its exported files)
    adds `train` as of that revision."""
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
    if before is not None:
        revision, files = before
        # The console script's import, from the exported files (ahead of this checkout's on
        # the path); the fork server and the ranks take that path over.
        earlier = ["env", f"PYTHONPATH={files}", sys.executable, "-c", TRAIN_SCRIPT]
        found[f"train @{revision}"] = [*earlier, *found["train"][1:]]
    return found if lightning_available() else {k: v for k, v in found.items() if "lightn" not in k}


def _sweep(work: Work, scratch: Path, rates: str) -> list[str]:
    return [
        *work.overrides(2),
        "data.in_channels=3",
        f"optimizer.lr={rates}",
        f"hydra.sweep.dir={scratch}",
    ]


def tree_at(revision: str) -> Path:
    """This repository's files at a git revision, exported to a new temporary folder."""
    folder = Path(tempfile.mkdtemp(prefix="train-at-"))
    archive = subprocess.run(
        ["git", "archive", revision], cwd=REPO, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


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
    if name == "train" or name.startswith("train @"):
        events = [
            json.loads(line) for line in (scratch / "metrics.jsonl").read_text().split("\n") if line
        ]
        measured["samples_per_s"] = steady_samples_per_s(events, warmup)
    elif found := RATE.search(result.stdout + result.stderr):
        measured["samples_per_s"] = float(found.group(1))
    return measured


def throughput_contender(name: str) -> bool:
    return name in (*SPEED, "lightning") or name.startswith("train @")


def ratios_to_plain(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each throughput contender's median samples/s over the plain loop's, and its ratio in each
    round (the plain run of the same round)."""
    plain = [run["samples_per_s"] for run in runs["plain torchrun"]]
    found = {}
    for name, measured in runs.items():
        if name == "plain torchrun" or not throughput_contender(name):
            continue
        rates = [run["samples_per_s"] for run in measured]
        found[name] = {
            "ratio_of_medians": median(rates) / median(plain),
            "round_ratios": [ours / theirs for ours, theirs in zip(rates, plain, strict=True)],
        }
    return found


def spread(values: list[float]) -> str:
    middle = median(values)
    return f"{middle:.4g} (+{max(values) / middle - 1:.1%} / -{1 - min(values) / middle:.1%})"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks command", description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--work", choices=list(WORKS), default="cnn-16x16")
    parser.add_argument("--steps", type=int, help="measured steps, after the work's warm-up")
    parser.add_argument("--image-size", type=int, help="(default: the work's)")
    parser.add_argument("--speed-only", action="store_true", help="train and the plain loop only")
    parser.add_argument("--before", metavar="REV", help="also train as of this git revision")
    args = parser.parse_args(argv)
    work = WORKS[args.work]
    if args.steps is not None:
        work = replace(work, steps=args.steps)
    if args.image_size is not None:
        work = replace(work, image_size=args.image_size)
    before = (args.before, tree_at(args.before)) if args.before else None
    root = Path(tempfile.mkdtemp(prefix="command-bench-"))
    names = list(commands(work, root, before))
    if args.speed_only:
        names = [name for name in names if throughput_contender(name) and name != "lightning"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_index, name in interleave(names, args.rounds):
        scratch = root / f"{name}-{round_index}".replace(" ", "-").replace(",", "")
        measured = measure(name, commands(work, scratch, before)[name], scratch, work.warmup)
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
    headers = ["command", "whole command (median, spread)", "steady samples/s (median, spread)"]
    print(f"\n{args.rounds} rounds, alternated:")
    print(table(headers, rows))
    record: dict[str, Any] = {"rounds": args.rounds, "work": work, "runs": runs}
    record["to_plain"] = ratios_to_plain(runs)
    for name, ratio in record["to_plain"].items():
        rounds = " ".join(f"{r:.2f}" for r in ratio["round_ratios"])
        print(f"{name} / plain torchrun: {ratio['ratio_of_medians']:.3f}x (rounds {rounds})")
    if not args.speed_only:
        sweep = {n: median([r["command_s"] for r in runs[n]]) for n in names if "sweep" in n}
        per_further_job = (sweep["train sweep, 3 jobs"] - sweep["train sweep, 1 job"]) / 2
        print(f"\ntrain: each further job of a local sweep: {per_further_job:.2f} s")
        record["per_further_sweep_job_s"] = per_further_job
    record["table"] = {"headers": headers, "rows": rows}
    write_result("command" if not args.speed_only else f"command-speed-{args.work}", record)
    return record
