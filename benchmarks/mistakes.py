"""How long a config mistake takes to be refused, as a user retrying after each edit sees it: ten
typical mistakes, `train --help` and `train --cfg job`, each a whole command, beside the floor of
any Hydra app (`python -c` importing hydra and composing this config once), alternated round by
round in one run. Each mistake must be refused with exit 2 and one line, or the benchmark fails.

    uv run python -m benchmarks mistakes [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import interleave, median, spread, table, write_result
from framework.core.exits import ExitCode

TRAIN = str(Path(sys.executable).with_name("train"))
# What a researcher types wrong in a day: typos in keys, values and option names, a misspelt
# class, a value outside its choices, an impossible number.
MISTAKES = {
    "unknown key": ["data.standardise=true"],
    "misspelt key": ["model=mlp", "model.hiden_sizes=[8]"],
    "key without +": ["model.hiden=16"],
    "wrong type": ["data.batch_size=abc"],
    "unknown option": ["model=nosuch"],
    "wrong float": ["optimizer.momentum=abc"],
    "misspelt class": ["optimizer._target_=torch.optim.SDG"],
    "not a choice": ["task=autoencoder", "task.reconstruction=l1"],
    "unknown metric": ["objective=val/acuracy"],
    "impossible value": ["trainer.grad_accum=0"],
}
ANSWERS = {"--help": ["--help"], "--cfg job": ["--cfg", "job"]}
FLOOR = (
    "from hydra import compose, initialize_config_dir\n"
    "from framework.config import CONF_DIR\n"
    "from framework.config.registry import register_configs\n"
    "register_configs()\n"
    "with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):\n"
    "    compose('config')\n"
)


def commands() -> dict[str, list[str]]:
    mistakes = {name: [TRAIN, *overrides] for name, overrides in MISTAKES.items()}
    answers = {name: [TRAIN, *arguments] for name, arguments in ANSWERS.items()}
    return {"floor": [sys.executable, "-c", FLOOR], **mistakes, **answers}


def cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(name: str, argv: list[str], cwd: Path) -> tuple[float, float]:
    """Seconds the whole command took, and the CPU seconds of the command's own process (on a
    loaded machine the wall time measures the neighbours too). A mistake that is not refused in
    one line fails."""
    started, cpu = time.perf_counter(), cpu_of_children()
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)
    seconds, cpu = time.perf_counter() - started, cpu_of_children() - cpu
    if name in MISTAKES:
        lines = result.stderr.strip().splitlines()
        if result.returncode != ExitCode.CONFIG_REJECTED or len(lines) != 1:
            raise RuntimeError(
                f"{name} ({' '.join(argv[1:])}) was not refused in one line:\n"
                f"exit {result.returncode}\n{result.stderr[-2000:]}"
            )
    elif result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-2000:]}")
    if (cwd / "outputs").exists():
        raise RuntimeError(f"{name} left a run dir")
    return seconds, cpu


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks mistakes")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    runs = commands()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as scratch:
        for _, name in interleave(list(runs), args.rounds):
            wall, used = timed(name, runs[name], Path(scratch))
            seconds[name].append(wall)
            cpu[name].append(used)
    floor, floor_cpu = median(seconds["floor"]), median(cpu["floor"])
    rows = [
        [
            name,
            "import hydra + one composition" if name == "floor" else " ".join(runs[name][1:]),
            spread(seconds[name]),
            f"{median(seconds[name]) / floor:.2f}x",
            f"{median(cpu[name]):.2f}",
            f"{median(cpu[name]) / floor_cpu:.2f}x",
        ]
        for name in runs
    ]
    print(f"\n{args.rounds} rounds, alternated; each a whole command, medians (spread):")
    print(table(["what", "command", "seconds", "vs floor", "CPU s", "CPU vs floor"], rows))
    mistakes = [median(seconds[name]) for name in MISTAKES]
    record = {
        "rounds": args.rounds,
        "load_average": os.getloadavg(),
        "seconds": seconds,
        "cpu_seconds": cpu,
        "floor_s": floor,
        "floor_cpu_s": floor_cpu,
        "mistake_cpu_vs_floor": median([median(cpu[name]) for name in MISTAKES]) / floor_cpu,
        "mistake_median_s": median(mistakes),
        "mistake_worst_s": max(mistakes),
        "mistake_vs_floor": median(mistakes) / floor,
    }
    print(
        f"\na mistake refused in {record['mistake_median_s']:.2f} s (median of the ten; worst "
        f"{record['mistake_worst_s']:.2f} s): {record['mistake_vs_floor']:.2f}x the floor "
        f"({floor:.2f} s); in CPU time {record['mistake_cpu_vs_floor']:.2f}x "
        f"(load average {os.getloadavg()[0]:.1f})"
    )
    write_result("mistakes", record)
    return record
