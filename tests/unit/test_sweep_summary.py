"""A sweep dir's summary.csv / summary.md (framework/app/sweep_summary.py): a sweep run again in
its dir keeps the rows of the jobs it completed before; a refused job never replaces one."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from framework.app.sweep_summary import SweepSummary


def finished_job(sweep_dir: Path, num: int, lr: str, accuracy: float) -> None:
    job = sweep_dir / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(f"- optimizer.lr={lr}\n")
    summary = {"objective": "val/accuracy", "val/accuracy": accuracy, "steps": 10}
    (job / "summary.json").write_text(json.dumps(summary))


def returned(sweep_dir: Path, num: int, lr: str, error: str) -> JobReturn:
    ret = JobReturn()
    ret.overrides = [f"optimizer.lr={lr}"]
    ret.hydra_cfg = OmegaConf.create(
        {"hydra": {"runtime": {"output_dir": str(sweep_dir / str(num))}}}
    )
    ret.status = JobStatus.FAILED
    ret._return_value = error
    return ret


def rows(sweep_dir: Path) -> list[dict[str, str]]:
    with (sweep_dir / "summary.csv").open() as file:
        return list(csv.DictReader(file))


def test_a_sweep_run_again_keeps_its_completed_rows_over_refused_jobs(tmp_path):
    finished_job(tmp_path, 0, "0.1", 0.95)
    finished_job(tmp_path, 1, "0.05", 0.93)
    summary = SweepSummary(tmp_path, None)
    summary.add(0, [returned(tmp_path, 0, "0.1", "already holds a run with no checkpoint")])
    found = rows(tmp_path)
    assert [(row["job"], row["status"], row["val/accuracy"]) for row in found] == [
        ("0", "completed", "0.95"),
        ("1", "completed", "0.93"),
    ]
    summary.add(2, [returned(tmp_path, 2, "0.01", "diverged")])  # a new job's failure shows
    assert [row["status"] for row in rows(tmp_path)] == ["completed", "completed", "failed"]


def test_a_job_whose_summary_was_cut_short_has_no_earlier_row(tmp_path):
    finished_job(tmp_path, 0, "0.1", 0.95)
    finished_job(tmp_path, 1, "0.05", 0.93)
    (tmp_path / "1" / "summary.json").write_text('{"val/acc')  # killed mid-write
    assert list(SweepSummary(tmp_path, None).rows) == [0]


def test_a_sweep_dir_is_reused_only_by_the_same_sweep(tmp_path):
    import pytest

    from framework.app.run_dir_callback import check_sweep_dir
    from framework.core.exits import ConfigError

    check_sweep_dir(tmp_path / "new", ["optimizer.lr=0.1,0.05"])
    (tmp_path / "multirun.yaml").write_text("hydra:\n  overrides:\n    task: [optimizer.lr=0.2]\n")
    check_sweep_dir(tmp_path, ["optimizer.lr=0.2"])  # the same sweep, run again to resume it
    with pytest.raises(ConfigError, match=r"holds another sweep \(optimizer.lr=0.2\)"):
        check_sweep_dir(tmp_path, ["optimizer.lr=0.1,0.05"])
    (tmp_path / "multirun.yaml").write_text("hydra: [unclosed\n")
    with pytest.raises(ConfigError, match="holds files that are not a sweep's"):
        check_sweep_dir(tmp_path, ["optimizer.lr=0.2"])


def test_a_pruned_job_is_marked_pruned_and_is_no_contender_for_best(tmp_path):
    finished_job(tmp_path, 0, "0.1", 0.90)
    finished_job(tmp_path, 1, "0.5", 0.95)  # better so far, but stopped by the pruner
    pruned = json.loads((tmp_path / "1" / "summary.json").read_text())
    (tmp_path / "1" / "summary.json").write_text(json.dumps({**pruned, "pruned": True}))
    summary = SweepSummary(tmp_path, None)
    summary.write()
    assert [(row["job"], row["status"]) for row in rows(tmp_path)] == [
        ("0", "completed"),
        ("1", "pruned"),
    ]
    assert "| 1 | pruned |" in (tmp_path / "summary.md").read_text()
    assert summary.best().num == 0
    assert [label for label, _, _ in summary.labelled_runs()] == [
        "#0 optimizer.lr=0.1",
        "#1 optimizer.lr=0.5 pruned",
    ]
