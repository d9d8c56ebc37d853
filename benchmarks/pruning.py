"""A pruning sweep against the same sweep unpruned: the default experiment (digits_cnn, 2 ranks,
330 steps), a 16-trial learning-rate sweep, log-uniform over three decades, the same trials in
both (Optuna's RandomSampler, one seed): `hydra/sweeper=optuna_prune` with ASHA against
`hydra/sweeper=optuna`. Reported: the optimizer steps each trained (the cost), each one's best
val/accuracy, and the pruned sweep's best trial run alone (pruning must not perturb a trial that
survives: its final metrics equal the lone run's).

    uv run python -m benchmarks pruning [--seed 0] [--trials 16]   # ~10 min on 2 cores

Every sweep evaluates every 22 steps (an epoch); ASHA's rungs are at 22, 66 and 198 steps
(min_resource 22, reduction_factor 3).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, table, write_result

LR = "optimizer.lr=tag(log,interval(0.001,1.0))"
COMMON = ("trainer.eval_every=22", "trainer.progress_bar=false", "hydra.sweeper.n_jobs=1")
ASHA = (
    "hydra/sweeper=optuna_prune",
    "hydra.sweeper.pruner=asha",
    "hydra.sweeper.asha.min_resource=22",
    "hydra.sweeper.asha.reduction_factor=3",
)
UNPRUNED = ("hydra/sweeper=optuna",)


def sweep(kind: tuple[str, ...], seed: int, trials: int, folder: Path) -> dict[str, Any]:
    sweep_dir = folder / "sweep"
    argv = [
        "-m",
        *kind,
        "hydra/sweeper/sampler=random",
        f"hydra.sweeper.sampler.seed={seed}",
        f"hydra.sweeper.n_trials={trials}",
        "hydra.sweeper.direction=maximize",
        LR,
        *COMMON,
        f"hydra.sweep.dir={sweep_dir}",
    ]
    wall = run_train(argv, folder)
    with (sweep_dir / "summary.csv").open() as file:
        rows = list(csv.DictReader(file))
    jobs = []
    for row in rows:  # the metrics as each job wrote them (summary.csv rounds them)
        summary = json.loads((sweep_dir / row["run_dir"] / "summary.json").read_text())
        jobs.append(
            {
                "job": int(row["job"]),
                "lr": row["optimizer.lr"],
                "status": row["status"],
                **{key: summary[key] for key in ("steps", "val/accuracy", "val/loss")},
            }
        )
    finished = [job for job in jobs if job["status"] == "completed"]
    best = max(finished, key=lambda job: job["val/accuracy"])
    return {"wall_s": wall, "jobs": jobs, "steps": sum(j["steps"] for j in jobs), "best": best}


def alone(lr: str, folder: Path) -> dict[str, Any]:
    """The trial's configuration as one run of its own."""
    run_dir = folder / "alone"
    run_train([f"optimizer.lr={lr}", *COMMON[:2], f"hydra.run.dir={run_dir}"], folder)
    return json.loads((run_dir / "summary.json").read_text())


def run_train(argv: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "framework.cli", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"train {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks pruning")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=16)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        (root / "asha").mkdir()
        (root / "none").mkdir()
        pruned = sweep(ASHA, args.seed, args.trials, root / "asha")
        unpruned = sweep(UNPRUNED, args.seed, args.trials, root / "none")
        lone = alone(pruned["best"]["lr"], root)
    same_trials = [j["lr"] for j in pruned["jobs"]] == [j["lr"] for j in unpruned["jobs"]]
    record = {
        "seed": args.seed,
        "trials": args.trials,
        "same_trials": same_trials,
        "asha": pruned,
        "unpruned": unpruned,
        "steps_ratio": pruned["steps"] / unpruned["steps"],
        "best_alone": {k: lone[k] for k in ("val/accuracy", "val/loss", "steps")},
        "best_equals_alone": all(
            lone[k] == pruned["best"][k] for k in ("val/accuracy", "val/loss", "steps")
        ),
    }
    print(
        table(
            ["sweep", "steps trained", "trials pruned", "best val/accuracy (lr)", "wall s"],
            [
                [
                    name,
                    result["steps"],
                    sum(job["status"] == "pruned" for job in result["jobs"]),
                    f"{result['best']['val/accuracy']:.4f} ({float(result['best']['lr']):.4g})",
                    f"{result['wall_s']:.0f}",
                ]
                for name, result in (("asha", pruned), ("unpruned", unpruned))
            ],
        )
    )
    print(
        f"steps: {record['steps_ratio']:.1%} of the unpruned sweep's; same trials: {same_trials}; "
        f"the best trial alone: {record['best_alone']} (equal: {record['best_equals_alone']})"
    )
    write_result("pruning", record)
