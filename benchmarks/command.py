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

`--options [LIST]` measures the speed options through the command instead: for each rung of the
pooled `speed` benchmark's CPU ladder (fp32, channels_last, num_workers=1, bf16, compile; `all`,
the default, or a comma list, fp32 always included), `train` with that option (precision=bf16,
trainer.channels_last, trainer.compile, data.num_workers) and the plain torchrun loop with the
same option (--precision, --channels-last, --compile, --num-workers), all of them alternated in
one schedule. Per option: each side's samples/s (median, spread), train / plain (ratio of
medians, and the ratio in each round) and each side's speed-up over its own fp32. `--work cnn` is
the work of the pooled figures (benchmarks/results/speed-cpu.json), for a side by side.

    uv run --group bench python -m benchmarks command --options [--work cnn] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    Work,
    interleave,
    median,
    spread,
    steady_samples_per_s,
    table,
    write_result,
)
from benchmarks.overhead import WORKS as POOLED_WORKS
from benchmarks.plain import lightning_available
from benchmarks.speed import CPU_LADDER
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
PLAIN_SCRIPT = str(REPO / "benchmarks" / "plain_loop_torchrun.py")
Commands = Callable[[Path], dict[str, list[str]]]  # a scratch folder -> the commands, by name


def script_args(work: Work) -> list[str]:
    return [
        f"--steps={work.total_steps}",
        f"--warmup={work.warmup}",
        f"--batch-size={work.batch_size}",
        f"--image-size={work.image_size}",
        f"--lr={work.lr}",
    ]


def option_args(work: Work) -> list[str]:
    """The work's speed options as the plain loop's flags (Lightning's script takes none)."""
    flags = [f"--precision={work.precision}", f"--num-workers={work.num_workers}"]
    return flags + ["--channels-last"] * work.channels_last + ["--compile"] * work.compile


def train_command(work: Work, scratch: Path) -> list[str]:
    return [TRAIN, *work.overrides(2), "data.in_channels=3", f"hydra.run.dir={scratch}"]


def plain_command(work: Work) -> list[str]:
    """The plain torchrun loop on the same work, speed options included, as `train`'s."""
    return [*torchrun(), PLAIN_SCRIPT, *script_args(work), *option_args(work)]


def commands(
    work: Work, scratch: Path, before: tuple[str, Path] | None = None
) -> dict[str, list[str]]:
    """Every measured command, by contender name; `before`: (revision, its exported files)
    adds `train` as of that revision."""
    plain = [*torchrun(), PLAIN_SCRIPT]
    lightning = [sys.executable, str(REPO / "benchmarks" / "lightning_command.py")]
    short = Work(
        model=work.model,
        steps=SWEEP_STEPS // 2,
        warmup=SWEEP_STEPS // 2,
        image_size=work.image_size,
    )
    found = {
        "train": train_command(work, scratch),
        "plain torchrun": plain_command(work),
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


def option_commands(work: Work, scratch: Path, options: Sequence[str]) -> dict[str, list[str]]:
    """`train [option]` and `plain torchrun [option]` for each speed option (a rung of
    speed.py's CPU ladder, applied to the work as speed.py applies it), side by side."""
    found = {}
    for option in options:
        optioned = replace(work, **CPU_LADDER[option])
        found[f"train [{option}]"] = train_command(optioned, scratch)
        found[f"plain torchrun [{option}]"] = plain_command(optioned)
    return found


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
    if name == "train" or name.startswith(("train @", "train [")):  # its run dir's log
        events = [
            json.loads(line) for line in (scratch / "metrics.jsonl").read_text().split("\n") if line
        ]
        measured["samples_per_s"] = steady_samples_per_s(events, warmup)
    elif found := RATE.search(result.stdout + result.stderr):
        measured["samples_per_s"] = float(found.group(1))
    return measured


def throughput_contender(name: str) -> bool:
    return name in (*SPEED, "lightning") or name.startswith("train @")


def rates(measured: list[dict[str, Any]]) -> list[float]:
    return [run["samples_per_s"] for run in measured]


def ratio(ours: list[dict[str, Any]], plain: list[dict[str, Any]]) -> dict[str, Any]:
    """Our median samples/s over the plain loop's, and our ratio in each round (over the plain
    run of the same round: the pair saw the same state of a noisy machine)."""
    return {
        "ratio_of_medians": median(rates(ours)) / median(rates(plain)),
        "round_ratios": [o / p for o, p in zip(rates(ours), rates(plain), strict=True)],
    }


def ratios_to_plain(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each throughput contender's ratio to the plain loop."""
    return {
        name: ratio(measured, runs["plain torchrun"])
        for name, measured in runs.items()
        if name != "plain torchrun" and throughput_contender(name)
    }


def option_figures(runs: dict[str, list[dict[str, Any]]], options: Sequence[str]) -> dict:
    """Per option: `train`'s and the plain loop's samples/s, train's ratio to the plain loop
    with the same option, and each side's speed-up over its own fp32 (ratio of medians)."""
    figures = {}
    for option in options:
        ours, plain = runs[f"train [{option}]"], runs[f"plain torchrun [{option}]"]
        figures[option] = {
            "train_samples_per_s": rates(ours),
            "plain_samples_per_s": rates(plain),
            **ratio(ours, plain),
            "train_vs_fp32": ratio(ours, runs["train [fp32]"])["ratio_of_medians"],
            "plain_vs_fp32": ratio(plain, runs["plain torchrun [fp32]"])["ratio_of_medians"],
        }
    return figures


def option_table(figures: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = [
        "option",
        "train samples/s (median, spread)",
        "plain torchrun samples/s (median, spread)",
        "train / plain",
        "per round",
        "train vs its fp32",
        "plain vs its fp32",
    ]
    rows = [
        [
            option,
            spread(found["train_samples_per_s"]),
            spread(found["plain_samples_per_s"]),
            f"**{found['ratio_of_medians']:.3f}x**",
            " ".join(f"{r:.2f}" for r in found["round_ratios"]),
            f"{found['train_vs_fp32']:.2f}x",
            f"{found['plain_vs_fp32']:.2f}x",
        ]
        for option, found in figures.items()
    ]
    return headers, rows


def chosen_options(listed: str, parser: argparse.ArgumentParser) -> list[str]:
    """`all` or a comma list of CPU_LADDER's rungs, in the ladder's order; fp32 always (each
    option's speed-up is over it)."""
    names = list(CPU_LADDER) if listed == "all" else listed.split(",")
    if unknown := set(names) - set(CPU_LADDER):
        parser.error(f"--options: unknown {sorted(unknown)}; known: all, {','.join(CPU_LADDER)}")
    return [option for option in CPU_LADDER if option in names or option == "fp32"]


def folder_name(name: str) -> str:
    """A contender's name as a folder Hydra takes as is in hydra.run.dir= (no spaces, brackets
    or `=`): `train [num_workers=1]` -> train-num_workers-1."""
    return re.sub(r"\W+", "-", name).strip("-")


def run_rounds(
    names: list[str], build: Commands, root: Path, rounds: int, warmup: int
) -> dict[str, list[dict[str, Any]]]:
    """Every contender once a round, alternated (A B C, B C A, ...), each in a fresh scratch."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_index, name in interleave(names, rounds):
        scratch = root / f"{folder_name(name)}-{round_index}"
        measured = measure(name, build(scratch)[name], scratch, warmup)
        runs[name].append(measured)
        rate = measured.get("samples_per_s")
        shown = f"  {rate:.0f} samples/s" if rate else ""
        print(
            f"round {round_index + 1}  {name:32s} {measured['command_s']:.2f} s{shown}", flush=True
        )
    return runs


def contender_table(runs: dict[str, list[dict[str, Any]]]) -> tuple[list[str], list[list[str]]]:
    rows = [
        [
            name,
            spread([run["command_s"] for run in measured]) + " s",
            spread(rates(measured)) if "samples_per_s" in measured[0] else "",
        ]
        for name, measured in runs.items()
    ]
    headers = ["command", "whole command (median, spread)", "steady samples/s (median, spread)"]
    return headers, rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks command", description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--work", choices=list(WORKS), default="cnn-16x16")
    parser.add_argument("--steps", type=int, help="measured steps, after the work's warm-up")
    parser.add_argument("--image-size", type=int, help="(default: the work's)")
    parser.add_argument("--speed-only", action="store_true", help="train and the plain loop only")
    parser.add_argument("--before", metavar="REV", help="also train as of this git revision")
    parser.add_argument(
        "--options",
        nargs="?",
        const="all",
        metavar="LIST",
        help=f"the speed options instead: all (the default) or some of {','.join(CPU_LADDER)}",
    )
    args = parser.parse_args(argv)
    if args.options and (args.speed_only or args.before):
        parser.error("--options measures train and the plain loop alone: no --speed-only, --before")
    work = WORKS[args.work]
    if args.steps is not None:
        work = replace(work, steps=args.steps)
    if args.image_size is not None:
        work = replace(work, image_size=args.image_size)
    root = Path(tempfile.mkdtemp(prefix="command-bench-"))
    before = (args.before, tree_at(args.before)) if args.before else None
    if args.options:
        options = chosen_options(args.options, parser)
        build: Commands = partial(option_commands, work, options=options)
    else:
        build = partial(commands, work, before=before)
    names = list(build(root))
    if args.speed_only:
        names = [name for name in names if throughput_contender(name) and name != "lightning"]
    try:
        runs = run_rounds(names, build, root, args.rounds, work.warmup)
    finally:
        # Scratch: the rounds' run dirs and the exported revision; nothing reads them afterwards.
        for folder in (root, before[1]) if before else (root,):
            shutil.rmtree(folder, ignore_errors=True)
    headers, rows = contender_table(runs)
    print(f"\n{args.rounds} rounds, alternated:")
    print(table(headers, rows))
    record: dict[str, Any] = {"rounds": args.rounds, "work": work, "runs": runs}
    record["table"] = {"headers": headers, "rows": rows}
    if args.options:
        report_options(record, options, args.work)
        write_result(f"command-options-{args.work}", record)
    else:
        report_to_plain(record, sweep=not args.speed_only)
        write_result("command" if not args.speed_only else f"command-speed-{args.work}", record)
    return record


def report_options(record: dict[str, Any], options: list[str], work_name: str) -> None:
    """Print the options' table; record its figures."""
    record["options"] = option_figures(record["runs"], options)
    headers, rows = option_table(record["options"])
    print(f"\nthe speed options (speed.py's CPU ladder) on {work_name}, median of each side:")
    print(table(headers, rows))
    record["options_table"] = {"headers": headers, "rows": rows}


def report_to_plain(record: dict[str, Any], sweep: bool) -> None:
    """Print each contender's ratio to the plain loop and (`sweep`) the cost of each further
    sweep job; record them."""
    runs = record["runs"]
    record["to_plain"] = ratios_to_plain(runs)
    for name, found in record["to_plain"].items():
        rounds = " ".join(f"{r:.2f}" for r in found["round_ratios"])
        print(f"{name} / plain torchrun: {found['ratio_of_medians']:.3f}x (rounds {rounds})")
    if sweep:
        jobs = {n: median([r["command_s"] for r in runs[n]]) for n in runs if "sweep" in n}
        per_further_job = (jobs["train sweep, 3 jobs"] - jobs["train sweep, 1 job"]) / 2
        print(f"\ntrain: each further job of a local sweep: {per_further_job:.2f} s")
        record["per_further_sweep_job_s"] = per_further_job
