"""Start-up: seconds from the command to the first optimizer step, `train` against the plain
loop a user would write (benchmarks/plain_torchrun.py), both under torchrun with 2 ranks on the
default work (small CNN on scikit-learn's digits).

    uv run python -m benchmarks startup [--repeats 5]

The clock starts when the command is started and stops when rank 0 prints `step=1` (ours logs
every step here, the plain script prints after its first step). Runs alternate plain / ours.
Target: ours at most 1 s more than plain (the median of the paired differences).
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

from benchmarks.common import REPO, interleave, median, table, write_result

TARGET_EXTRA_S = 1.0
FIRST_STEP = re.compile(r"\bstep=1\b")


def torchrun() -> list[str]:
    """torchrun with 2 ranks on a free port (not 29500: another job may hold it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            f"--master_port={port}"]  # fmt: skip


def command(contender: str, run_dir: Path) -> list[str]:
    if contender == "plain":
        return [*torchrun(), str(REPO / "benchmarks" / "plain_torchrun.py")]
    return [*torchrun(), "-m", "framework.train", "trainer.max_steps=1", "trainer.log_every=1",
            f"hydra.run.dir={run_dir}"]  # fmt: skip


def time_to_first_step(contender: str, run_dir: Path) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    process = subprocess.Popen(command(contender, run_dir), cwd=REPO, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    first_step, output = None, []
    for line in process.stdout:
        output.append(line)
        if first_step is None and FIRST_STEP.search(line):
            first_step = time.perf_counter() - started
    if process.wait() != 0 or first_step is None:
        raise RuntimeError(f"{contender} failed:\n{''.join(output[-30:])}")
    return {"first_step_s": first_step, "exit_s": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks startup", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    times: dict[str, list[dict[str, float]]] = {"plain": [], "ours": []}
    for round_index, contender in interleave(["plain", "ours"], args.repeats):
        measured = time_to_first_step(contender, scratch / f"{contender}-{round_index}")
        times[contender].append(measured)
        print(f"round {round_index + 1}  {contender:6s} first step after "
              f"{measured['first_step_s']:.2f} s, exit after {measured['exit_s']:.2f} s",
              flush=True)  # fmt: skip
    first = {name: [t["first_step_s"] for t in runs] for name, runs in times.items()}
    extra = [o - p for o, p in zip(first["ours"], first["plain"], strict=True)]
    rows = [
        ["plain loop (torchrun)", f"{median(first['plain']):.2f} s", "", ""],
        ["train (torchrun)", f"{median(first['ours']):.2f} s", f"**{median(extra):+.2f} s**",
         f"<= +{TARGET_EXTRA_S:.0f} s"],
    ]  # fmt: skip
    headers = ["command", "to first optimizer step", "ours - plain", "target"]
    print(f"\nmedian of {args.repeats} alternating runs:")
    print(table(headers, rows))
    record = {"target_extra_s": TARGET_EXTRA_S, "repeats": args.repeats, "runs": times,
              "extra_s": extra, "table": {"headers": headers, "rows": rows}}  # fmt: skip
    write_result("startup", record)
    return record
