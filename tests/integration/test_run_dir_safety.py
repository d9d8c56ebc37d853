"""Nothing of a user's is lost: a refused start removes only what it made, a user's folder is
never written into, and two runs never share a run dir (framework/storage/run_dir.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework.storage.run_dir import RunDir

ONE_RANK = ("launcher.nproc_per_node=1", "trainer.max_steps=2", "checkpoint.every=1")
# Refused by the rank, after Hydra made the run dir and the record was written.
REFUSED_BY_THE_RANK = ("data=synthetic", "data.train_size=16", "data.val_size=4")


def files_of(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_users_folder_is_refused_and_left_byte_for_byte(cli, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: notes\n")
    (mine / "train.log").write_text("my log\n")
    (mine / ".hydra").mkdir()
    (mine / ".hydra" / "config.yaml").write_text("another app's record\n")
    before = files_of(mine)
    result = cli(*ONE_RANK, f"hydra.run.dir={mine}", cwd=tmp_path)
    assert result.returncode == 2
    assert "holds files that are not a run's (.hydra, config.yaml, train.log)" in result.stderr
    assert files_of(mine) == before and sorted(p.name for p in mine.iterdir()) == [
        ".hydra",
        "config.yaml",
        "train.log",
    ]


@pytest.mark.slow
def test_a_refused_start_removes_its_own_dir_but_not_the_users_empty_folder_above_it(cli, tmp_path):
    parent = tmp_path / "experiments"  # the user's, empty
    parent.mkdir()
    result = cli(*ONE_RANK, *REFUSED_BY_THE_RANK, f"hydra.run.dir={parent}/a/b", cwd=tmp_path)
    assert result.returncode == 2 and "smaller than one global batch" in result.stderr
    assert parent.is_dir() and list(parent.iterdir()) == []  # a/ and a/b/ were Hydra's


@pytest.mark.slow
def test_a_refused_start_in_the_default_dir_leaves_no_dated_folders(cli, tmp_path):
    result = cli(*ONE_RANK, *REFUSED_BY_THE_RANK, cwd=tmp_path)
    assert result.returncode == 2
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_a_second_run_in_a_run_dir_in_use_is_refused_naming_the_holder(cli, tmp_path):
    run_dir = tmp_path / "run"
    first = cli(*ONE_RANK, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    (run_dir / "checkpoints" / "step_00000002.pt").unlink()  # so the second would resume step 1
    before = files_of(run_dir)
    with RunDir(run_dir).held():  # the first run, still going (a lock of its own: flock)
        holder = (run_dir / ".lock").read_text().strip()
        second = cli(*ONE_RANK, "trainer.max_steps=3", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert second.returncode == 2
    assert f"hydra.run.dir={run_dir} is in use by another run ({holder})" in second.stderr
    assert holder.startswith("pid ")
    after = files_of(run_dir)
    after.pop(run_dir / ".lock"), before.pop(run_dir / ".lock")
    assert after == before  # nothing was trimmed, written or removed
    third = cli(*ONE_RANK, "trainer.max_steps=3", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert third.returncode == 0, third.stderr[-2000:]  # released: it resumes
    assert "resum" in third.stderr


@pytest.mark.slow
def test_when_every_checkpoint_is_unreadable_a_resume_is_refused_and_nothing_changes(cli, tmp_path):
    run_dir = tmp_path / "run"
    first = cli(*ONE_RANK, f"hydra.run.dir={run_dir}", "checkpoint.final=false", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    for checkpoint in (run_dir / "checkpoints").glob("step_*.pt"):
        checkpoint.write_bytes(checkpoint.read_bytes()[:100])  # truncated by a full disk
    before = files_of(run_dir)
    before.pop(run_dir / "train.log"), before.pop(run_dir / ".lock")
    again = cli(*ONE_RANK, "trainer.max_steps=4", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert again.returncode == 2
    assert "none of the 2 checkpoints" in again.stderr and "nothing was changed" in again.stderr
    after = files_of(run_dir)
    after.pop(run_dir / "train.log"), after.pop(run_dir / ".lock")  # (this attempt's own lines)
    assert after == before  # the metrics of steps 1-2 are still there: no restart from step 0


@pytest.mark.slow
def test_a_resume_with_another_optimizer_is_one_line_and_leaves_nothing_in_the_way(cli, tmp_path):
    first = cli(*ONE_RANK, f"hydra.run.dir={tmp_path / 'first'}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    resume = f"checkpoint.resume={tmp_path / 'first' / 'checkpoints' / 'last.pt'}"
    other = cli(
        *ONE_RANK,
        "trainer.max_steps=4",
        resume,
        "optimizer=adamw",
        f"hydra.run.dir={tmp_path / 'second'}",
        cwd=tmp_path,
    )
    assert other.returncode == 2
    assert "the checkpoint's optimizer state does not fit this run" in other.stderr
    assert "Traceback" not in other.stderr
    assert not (tmp_path / "second").exists()  # so the corrected command is not blocked
    fixed = cli(
        *ONE_RANK,
        "trainer.max_steps=4",
        resume,
        f"hydra.run.dir={tmp_path / 'second'}",
        cwd=tmp_path,
    )
    assert fixed.returncode == 0, fixed.stderr[-2000:]
