"""A run resumed from its dir takes the overrides it was started with from its record (a sweep's
job too), and a refused resume leaves the run as it was, naming the command that works."""

from __future__ import annotations

import json

import pytest

from framework.core.exits import ExitCode

pytestmark = pytest.mark.slow

STARTED_WITH = (
    "data=synthetic",
    "data.train_size=64",
    "data.val_size=17",
    "data.in_channels=1",
    "data.image_size=8",
    "model.width=8",
    "launcher.nproc_per_node=1",
    "trainer.max_epochs=null",
)


def run_files(run_dir):
    """Every file of the run, but the lock (each start writes who holds it)."""
    return {
        path: path.read_bytes()
        for path in run_dir.rglob("*")
        if path.is_file() and path.name != ".lock"
    }


def test_a_resume_takes_the_runs_overrides_and_a_refused_one_writes_nothing(cli, tmp_path):
    run_dir = tmp_path / "run"
    first = cli(*STARTED_WITH, "trainer.max_steps=2", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    files = run_files(run_dir)

    # A change that alters training is refused: nothing in the run changes, and the message
    # names the command that resumes.
    refused = cli(
        f"hydra.run.dir={run_dir}", "trainer.max_steps=4", "optimizer.lr=0.5", cwd=tmp_path
    )
    assert refused.returncode == ExitCode.CONFIG_REJECTED, refused.stderr[-3000:]
    assert "optimizer.lr: 0.1 in the checkpoint, 0.5 now" in refused.stderr
    assert f"`train hydra.run.dir={run_dir}` takes them from the run's record" in refused.stderr
    assert run_files(run_dir) == files  # train.log included

    # Only the run dir and what may change: the run's own data and model settings are taken.
    resumed = cli(f"hydra.run.dir={run_dir}", "trainer.max_steps=4", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming with the run's own overrides from" in resumed.stderr
    assert "model.width=8" in resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    log = (run_dir / "train.log").read_text()
    assert log.startswith(files[run_dir / "train.log"].decode())  # appended, as one run's log
    assert "resumed from" in log


def test_a_runs_record_chooses_no_logger_and_its_experiment_is_checked_as_typed(cli, tmp_path):
    """A run dir may be someone else's copy: the loggers (and where they send) come from the
    command typed, and an experiment its record names meets the same checks as a typed one."""
    run_dir = tmp_path / "run"
    first = cli(*STARTED_WITH, "trainer.max_steps=2", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    record = run_dir / ".hydra" / "overrides.yaml"
    started = record.read_text()

    record.write_text(started + "- logger=tensorboard\n")
    resumed = cli(f"hydra.run.dir={run_dir}", "trainer.max_steps=3", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    adopted = next(line for line in resumed.stderr.splitlines() if "resuming with" in line)
    assert "model.width=8" in adopted and "logger" not in adopted
    assert not (run_dir / "tensorboard").exists()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3

    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "planted.yaml").write_text(
        "# @package _global_\nhydra:\n  callbacks:\n    c:\n      _target_: shutil.copyfile\n"
        f"      src: {record}\n      dst: {tmp_path / 'copied'}\n"
    )
    record.write_text(started + "- experiment=planted\n")
    files = run_files(run_dir)
    refused = cli(f"hydra.run.dir={run_dir}", "trainer.max_steps=4", cwd=tmp_path)
    assert refused.returncode == ExitCode.CONFIG_REJECTED, refused.stderr[-3000:]
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .startswith("error: hydra.callbacks.c._target_=shutil.copyfile is not allowed")
    ), refused.stderr
    assert not (tmp_path / "copied").exists()
    assert run_files(run_dir) == files
