"""A Hydra multirun (`train -m ...`): what each job ended with, and the sweep's summary table.

The sweep launchers (framework/app/summarized_sweep.py) hand every finished job to
`SweepSummary.add`; it rewrites `summary.csv` and `summary.md` in the sweep dir, one row per
job: its number, status, overrides and final metrics, or why it failed.
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra.core.utils import JobReturn, JobStatus

from framework.core.secrets import scrub
from framework.rank.plots import plot_sweep, try_plot
from framework.storage.run_dir import RunDir

log = logging.getLogger(__name__)

RUN_COLUMNS = ("steps", "samples_per_s", "wall_s")  # after the objective and the val/* metrics


@dataclass
class JobRow:
    num: int
    status: str  # completed | pruned (a pruning sweep's pruner stopped it) | failed
    overrides: dict[str, str]
    run_dir: str
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    @classmethod
    def from_return(cls, num: int, ret: JobReturn) -> JobRow:
        overrides = {  # scrubbed: a swept value may be a secret (core/secrets.py)
            key: scrub(value) for key, value in _app_overrides(list(ret.overrides or [])).items()
        }
        completed = ret.status == JobStatus.COMPLETED
        # Hydra's working_dir is the cwd (hydra.job.chdir=false); the job's dir is the output dir.
        run_dir = Path(ret.hydra_cfg.hydra.runtime.output_dir if ret.hydra_cfg else ret.working_dir)
        summary_file = RunDir(run_dir).summary
        found = completed and summary_file.exists()
        metrics = json.loads(summary_file.read_text()) if found else {}
        return cls(
            num=num,
            status=_status(metrics) if completed else "failed",
            overrides=overrides,
            run_dir=str(run_dir),
            metrics=metrics,
            error="" if completed else scrub(str(ret._return_value)),
        )


class SweepSummary:
    """The rows of one sweep, kept across the launcher's batches (optuna launches several)."""

    def __init__(self, sweep_dir: Path, objective: str | None) -> None:
        self.sweep_dir, self.configured_objective = sweep_dir, objective
        # The same sweep run again (to resume it): the jobs that completed before keep their
        # rows until they report again, and a failure now never replaces a completed row.
        self.rows: dict[int, JobRow] = earlier_rows(sweep_dir)

    @property
    def objective(self) -> str:
        """The configured objective, or (null: the task's main metric) what the jobs report."""
        reported = [
            row.metrics["objective"] for row in self.rows.values() if "objective" in row.metrics
        ]
        return self.configured_objective or (reported[0] if reported else "objective")

    def best(self) -> JobRow | None:
        """The completed job with the best objective, by its direction (a pruned one's is
        from before its end: not a contender)."""
        scored = [
            row
            for row in self.rows.values()
            if self.objective in row.metrics and row.status == "completed"
        ]
        if not scored:
            return None
        sign = -1 if scored[0].metrics.get("objective_direction") == "min" else 1
        return max(scored, key=lambda row: sign * row.metrics[self.objective])

    def add(self, first_num: int, returns: list[JobReturn]) -> None:
        for offset, ret in enumerate(returns):
            row = JobRow.from_return(first_num + offset, ret)
            earlier = self.rows.get(row.num)
            if row.status == "failed" and earlier is not None and earlier.status != "failed":
                log.warning("sweep job %d: %s (its completed run is kept)", row.num, row.error)
                continue
            self.rows[row.num] = row
        self.write()
        failed = sum(row.status == "failed" for row in self.rows.values())
        pruned = sum(row.status == "pruned" for row in self.rows.values())
        best = self.best()
        leader = f"; best {self.objective}: job {best.num}" if best else ""
        log.info(
            "sweep summary (%d jobs, %d failed%s%s): %s",
            len(self.rows),
            failed,
            f", {pruned} pruned" if pruned else "",
            leader,
            self.sweep_dir / "summary.md",
        )

    def table(self) -> tuple[list[str], list[list[str]]]:
        keys = sorted({key for row in self.rows.values() for key in row.overrides})
        reported = sorted(
            {key for row in self.rows.values() for key in row.metrics if key.startswith("val/")}
        )
        metrics = [self.objective, *(m for m in (*reported, *RUN_COLUMNS) if m != self.objective)]
        header = ["job", "status", *keys, *metrics, "run_dir", "error"]
        body = []
        for num in sorted(self.rows):
            row = self.rows[num]
            body.append(
                [
                    str(num),
                    row.status,
                    *(row.overrides.get(key, "") for key in keys),
                    *(_format(row.metrics.get(metric)) for metric in metrics),
                    _relative(row.run_dir, self.sweep_dir),
                    row.error,
                ]
            )
        return header, body

    def write(self) -> None:
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        header, body = self.table()
        with (self.sweep_dir / "summary.csv").open("w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(header)
            writer.writerows(body)
        lines = [_markdown_row(header), _markdown_row(["---"] * len(header))]
        lines += [_markdown_row(cells) for cells in body]
        (self.sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")
        try_plot(plot_sweep, self.sweep_dir, self.labelled_runs(), self.objective)

    def labelled_runs(self) -> list[tuple[str, Path, float]]:
        """Each job that ended well: a label (its number, the overrides that vary, "pruned"
        where a pruner stopped it), its dir and its final objective."""
        rows = [self.rows[num] for num in sorted(self.rows)]
        varying = [
            key
            for key in sorted({k for row in rows for k in row.overrides})
            if len({row.overrides.get(key) for row in rows}) > 1
        ]
        return [
            (
                " ".join(
                    [
                        f"#{row.num}",
                        *(f"{k}={row.overrides.get(k, '')}" for k in varying),
                        *(["pruned"] if row.status == "pruned" else []),
                    ]
                ),
                Path(row.run_dir),
                row.metrics.get(self.objective, float("nan")),
            )
            for row in rows
            if row.status != "failed"
        ]


def earlier_rows(sweep_dir: Path) -> dict[int, JobRow]:
    """The completed jobs a sweep dir already holds: <num>/summary.json and the job's record
    of its overrides."""
    rows = {}
    for job_dir in sweep_dir.iterdir() if sweep_dir.is_dir() else ():
        run = RunDir(job_dir)
        record = run.record / "overrides.yaml"
        if not job_dir.name.isdigit() or not run.summary.is_file() or not record.is_file():
            continue
        try:
            overrides = [str(item) for item in yaml.safe_load(record.read_text()) or []]
            metrics = json.loads(run.summary.read_text())
        except (OSError, ValueError, TypeError, yaml.YAMLError):  # a job killed mid-write
            continue
        row = JobRow(
            num=int(job_dir.name),
            status=_status(metrics),
            overrides=_app_overrides(overrides),
            run_dir=str(job_dir),
            metrics=metrics,
        )
        rows[row.num] = row
    return rows


def _status(metrics: dict[str, Any]) -> str:
    """A job that ended well: completed, or pruned (its summary says so)."""
    return "pruned" if metrics.get("pruned") else "completed"


def _app_overrides(items: list[str]) -> dict[str, str]:
    pairs = dict(item.split("=", 1) for item in items if "=" in item)
    return {key: value for key, value in pairs.items() if not key.lstrip("+~").startswith("hydra.")}


def _format(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _relative(path: str, root: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(root.resolve()))
    except ValueError:
        return path


def _markdown_row(cells: list[str]) -> str:
    escaped = (cell.replace("|", "\\|").replace("\n", " ") for cell in cells)
    return "| " + " | ".join(escaped) + " |"
