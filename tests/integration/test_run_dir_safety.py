"""Nothing of a user's is lost: a refused start removes only what it made, a user's folder is
never written into, and two runs never share a run dir (framework/storage/run_dir.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from framework.storage.run_dir import RunDir
from tests.conftest import exit_code_of_train, start_ranks

ONE_RANK = ("launcher.nproc_per_node=1", "trainer.max_steps=2", "checkpoint.every=1")
# Refused by the rank, after Hydra made the run dir and the record was written.
# A model whose output is no reconstruction: only the rank that builds it can tell.
REFUSED_BY_THE_RANK = ("task=autoencoder",)


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
    assert result.returncode == 2 and "must have its inputs' shape" in result.stderr
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
    # What the command adopted from the run's record, then the one error line: not the rank's
    # start-up lines, printed only once the checkpoint has been taken.
    adopted, error = other.stderr.splitlines()
    assert adopted.startswith("resuming with the run's own overrides from ")
    assert error.startswith("error: ") and "optimizer state does not fit this run" in error
    assert not (tmp_path / "second").exists()  # so the corrected command is not blocked
    fixed = cli(
        *ONE_RANK,
        "trainer.max_steps=4",
        resume,
        f"hydra.run.dir={tmp_path / 'second'}",
        cwd=tmp_path,
    )
    assert fixed.returncode == 0, fixed.stderr[-2000:]


# --- the run dir as a class: where it really is, who holds it, what a logger may name ---------
@pytest.mark.slow
def test_a_run_dir_that_climbs_into_a_users_folder_is_judged_where_it_really_is(cli, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: notes\n")
    before = files_of(mine)
    result = cli(*ONE_RANK, f"hydra.run.dir={tmp_path}/new/../mine", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"hydra.run.dir={mine} holds files that are not a run's (config.yaml)" in result.stderr
    assert files_of(mine) == before and not (tmp_path / "new").exists()


@pytest.mark.slow
def test_a_folder_name_too_long_is_one_line_and_leaves_no_dir(cli, tmp_path):
    result = cli(*ONE_RANK, f"hydra.run.dir={tmp_path}/runs/{'x' * 300}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "is longer than the 255 bytes allowed" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", ".lock", "train.log"])
def test_a_loggers_file_may_not_replace_the_runs_own(cli, tmp_path, name):
    result = cli(*ONE_RANK, "logger=csv", f"logger.csv.filename={name}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"logger.csv.filename={name} is a file the run writes itself" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_sweep_dir_holding_a_users_files_or_another_sweep_is_refused(cli, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "summary.csv").write_text("my,table\n")
    result = cli("-m", *ONE_RANK, "optimizer.lr=0.1,0.05", f"hydra.sweep.dir={mine}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"hydra.sweep.dir={mine} holds files that are not a sweep's" in result.stderr
    assert sorted(p.name for p in mine.iterdir()) == ["summary.csv"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "multirun.yaml").write_text("hydra:\n  overrides:\n    task: [optimizer.lr=0.2]\n")
    (other / "summary.csv").write_text("job,status\n0,completed\n")
    before = files_of(other)
    result = cli("-m", *ONE_RANK, "optimizer.lr=0.1,0.05", f"hydra.sweep.dir={other}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "holds another sweep (optimizer.lr=0.2)" in result.stderr
    assert files_of(other) == before


def _train_as_a_user(rank: int, argv: list[str], cwd: Path, said: Path) -> None:
    """`train argv` in cwd, as the console script runs it, in a process of its own: its
    stderr into said/<rank>.err, its exit code into said/<rank>.code."""
    os.chdir(cwd)
    with open(said / f"{rank}.err", "w") as err:
        os.dup2(err.fileno(), 2)
    sys.argv = ["train", *argv]
    try:
        code = exit_code_of_train()
    finally:
        sys.stderr.flush()
    (said / f"{rank}.code").write_text(str(code))


@pytest.mark.slow
def test_two_runs_started_at_once_on_one_new_dir(tmp_path):
    """One runs; the other is told the dir is in use, in one line, and nothing of the first is
    removed (it used to vanish, and the first to crash). Both are forked at once from the
    tests' fork server, which has imported the training stack."""
    run_dir, said = tmp_path / "new" / "run", tmp_path / "said"
    said.mkdir()
    argv = [*ONE_RANK, f"hydra.run.dir={run_dir}"]
    start_ranks(_train_as_a_user, (argv, tmp_path, said), nprocs=2)
    ended = sorted(
        (int((said / f"{rank}.code").read_text()), (said / f"{rank}.err").read_text())
        for rank in range(2)
    )
    (first, first_err), (second, second_err) = ended
    assert first == 0, first_err[-3000:]
    assert second == 2, second_err[-3000:]
    assert "is in use by another run" in second_err and "Traceback" not in second_err
    assert (run_dir / "summary.json").exists() and (run_dir / "config.yaml").exists()


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_is_continued_by_the_same_command(cli, tmp_path):
    run_dir = tmp_path / "run"
    command = (*ONE_RANK, "checkpoint.every=0")
    (run_dir / ".hydra").mkdir(parents=True)  # what a kill leaves: the record, some metrics
    # Hydra's record of the command: its task overrides (hydra.* keys are recorded apart)
    (run_dir / ".hydra" / "overrides.yaml").write_text(
        "".join(f"- {override}\n" for override in command)
    )
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.3}\n')
    (run_dir / ".lock").write_text("pid 1 on a killed host\n")
    result = cli(*command, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dropped; they are re-run" in result.stderr
    assert (run_dir / "summary.json").exists()


@pytest.mark.slow
def test_a_model_too_large_for_memory_is_one_line_and_leaves_no_run_dir(cli, tmp_path):
    # 10**13 channels: a first layer of 3.6e14 bytes, more than any machine's address space
    result = cli(*ONE_RANK, "model.width=10000000000000", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: model: framework.components.models.SmallCNN is too large for the cpu memory of "
        "this machine: it asked for 360000.0 GB at once; make it smaller (its largest setting "
        "is model.width=10000000000000), or shard it over the ranks with strategy=fsdp (built on "
        "the meta device, no rank holds it whole)"
    ]
    assert list(tmp_path.iterdir()) == []
