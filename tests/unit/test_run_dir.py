"""The run dir's lifecycle: which dirs a run may use (a user's folder never), the lock of a run
in progress, trimming metrics.jsonl after a restart, the resume hint, what a refused start
removes (only what it made), and the throwaway dirs of torchrun ranks."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import tempfile
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from framework.config.validation import validate
from framework.core.exits import ConfigError
from framework.storage.files import is_throwaway, throwaway_dir
from framework.storage.run_dir import RunDir
from tests.conftest import make_cfg

RUN_FIX = "Choose a new hydra.run.dir (or leave it unset for a fresh timestamped dir)"


@functools.cache
def composed(*overrides: str) -> DictConfig:
    return make_cfg(*overrides)  # only read here


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def tree(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def test_the_run_dirs_files_have_their_documented_names(tmp_path):
    run = RunDir(tmp_path)
    assert [
        p.relative_to(tmp_path).as_posix()
        for p in (run.record, run.config, run.metrics, run.summary, run.log, run.curves, run.lock)
    ] == [
        ".hydra",
        "config.yaml",
        "metrics.jsonl",
        "summary.json",
        "train.log",
        "curves.png",
        ".lock",
    ]
    assert run.checkpoints == tmp_path / "checkpoints"


# --- accept or refuse --------------------------------------------------------------------------
def test_a_new_or_empty_dir_or_one_whose_run_never_logged_is_accepted(tmp_path):
    RunDir(tmp_path / "new").check_reusable(composed(), sweep_job=False)
    RunDir(tmp_path).check_reusable(composed(), sweep_job=False)
    # A run that was refused or killed before its first log event: its lock marks it as ours.
    (tmp_path / ".lock").write_text("pid 1 on host, since 2025-01-01T12:00:00\n")
    (tmp_path / ".hydra").mkdir()
    (tmp_path / "train.log").write_text("started\n")
    RunDir(tmp_path).check_reusable(composed(), sweep_job=False)


@pytest.mark.parametrize("sweep_job", [False, True])
def test_a_users_folder_is_refused_untouched_naming_its_files(tmp_path, sweep_job):
    for name in ("notes.txt", "data.csv", "config.yaml", "train.log"):
        (tmp_path / name).write_text("mine\n")
    (tmp_path / ".hydra").mkdir()
    (tmp_path / "checkpoints").mkdir()  # no step_*.pt in it: not a run's
    before = files(tmp_path)
    with pytest.raises(ConfigError) as refusal:
        RunDir(tmp_path).check_reusable(composed(), sweep_job=sweep_job)
    where, fix = (
        (str(tmp_path), "Choose a new hydra.sweep.dir")
        if sweep_job
        else (f"hydra.run.dir={tmp_path}", RUN_FIX)
    )
    assert str(refusal.value) == (
        f"{where} holds files that are not a run's (.hydra, checkpoints, config.yaml, data.csv "
        f"and 2 more); it is left untouched. {fix}"
    )
    assert files(tmp_path) == before


@pytest.mark.parametrize("held", ["metrics.jsonl", "summary.json"])
def test_a_dir_holding_a_run_without_checkpoints_is_refused_and_left_untouched(tmp_path, held):
    (tmp_path / held).write_text("{}\n")
    (tmp_path / "config.yaml").write_text("seed: 1\n")
    before = files(tmp_path)
    with pytest.raises(ConfigError) as refusal:
        RunDir(tmp_path).check_reusable(composed(), sweep_job=False)
    assert str(refusal.value) == (
        f"hydra.run.dir={tmp_path} already holds a run with no checkpoint to continue from (or "
        f"checkpoint.resume=never); it is left untouched. {RUN_FIX}"
    )
    assert files(tmp_path) == before


def test_a_sweep_job_dir_holding_a_run_is_refused_naming_the_sweep_dir(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError) as refusal:
        RunDir(tmp_path).check_reusable(composed(), sweep_job=True)
    assert str(refusal.value) == (
        f"{tmp_path} already holds a run with no checkpoint to continue from (or "
        "checkpoint.resume=never); it is left untouched. Choose a new hydra.sweep.dir"
    )


def test_a_dir_with_a_checkpoint_is_reused_to_resume_unless_resume_is_never(tmp_path):
    run = RunDir(tmp_path)
    run.metrics.write_text('{"step": 10}\n')
    run.checkpoints.mkdir()
    (run.checkpoints / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ConfigError, match="no checkpoint to continue from"):
        run.check_reusable(composed(), sweep_job=False)
    (run.checkpoints / "step_00000010.pt").write_bytes(b"")
    run.check_reusable(composed(), sweep_job=False)
    with pytest.raises(ConfigError, match="no checkpoint to continue from"):
        run.check_reusable(composed("checkpoint.resume=never"), sweep_job=False)


RESTARTS = {
    "torchrun": {"TORCHELASTIC_RUN_ID": "job-1", "TORCHELASTIC_RESTART_COUNT": "{count}"},
    "slurm": {"SUBMITIT_EXECUTOR": "slurm", "SLURM_RESTART_COUNT": "{count}"},
}


@pytest.mark.parametrize("launcher", RESTARTS)
def test_a_restarted_job_reuses_its_dir_before_its_first_checkpoint(
    tmp_path, monkeypatch, launcher
):
    run = RunDir(tmp_path)
    run.metrics.write_text('{"step": 3}\n')
    for count, accepted in (("0", False), ("1", True)):
        for name, value in RESTARTS[launcher].items():
            monkeypatch.setenv(name, value.format(count=count))
        assert run.continues(composed()) is accepted
        assert run.continues(composed("checkpoint.resume=never")) is False
    run.check_reusable(composed(), sweep_job=False)
    with pytest.raises(ConfigError, match="checkpoint.resume=never"):
        run.check_reusable(composed("checkpoint.resume=never"), sweep_job=False)


# --- a run's life ------------------------------------------------------------------------------
def test_save_config_writes_the_record_as_yaml(tmp_path):
    record = {"optimizer": {"lr": 0.1, "betas": [0.9, 0.999]}, "data": {"api_token": "***"}}
    RunDir(tmp_path).save_config(record)
    assert OmegaConf.to_container(OmegaConf.load(tmp_path / "config.yaml")) == record


EVENTS = [
    '{"step": 1, "train/loss": 0.5}\n',
    '{"step": 2, "train/loss": 0.4}\n',
    '{"event": "resumed"}\n',  # no step: kept
    '{"step": 3, "val/loss": 0.3}\n',
    '{"step": 4, "train/loss": 0.2}\n',
    '{"step": 5, "train/lo',  # cut short by a kill
]


def test_trim_metrics_drops_events_after_the_step_and_a_line_cut_short(tmp_path):
    run = RunDir(tmp_path)
    run.metrics.write_text("".join(EVENTS))
    assert run.trim_metrics(3) == 2
    assert run.metrics.read_text() == "".join(EVENTS[:4])
    assert run.trim_metrics(0) == 3  # a restart before the first checkpoint
    assert run.metrics.read_text() == EVENTS[2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp file left


def test_trim_metrics_leaves_a_file_with_nothing_to_drop_as_it_is(tmp_path):
    run = RunDir(tmp_path)
    assert run.trim_metrics(5) == 0 and not run.metrics.exists()
    run.metrics.write_text("".join(EVENTS[:4]))
    inode = run.metrics.stat().st_ino
    assert run.trim_metrics(3) == 0
    assert run.metrics.stat().st_ino == inode  # not rewritten
    assert run.metrics.read_text() == "".join(EVENTS[:4])


def test_read_summary(tmp_path):
    run = RunDir(tmp_path)
    run.summary.write_text(json.dumps({"val/accuracy": 0.75, "steps": 30}))
    assert run.read_summary() == {"val/accuracy": 0.75, "steps": 30}


def write_hydra_mode(run: RunDir, mode: str) -> None:
    run.record.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"hydra": {"mode": mode}}), run.record / "hydra.yaml")


def test_the_resume_hint_names_the_run_dir_or_the_sweep_dir_or_slurms_requeue(tmp_path):
    single = RunDir(tmp_path / "outputs" / "12-00-00")
    assert single.resume_hint(composed()) == (
        f"To continue, run the same command with hydra.run.dir={single.path}"
    )
    write_hydra_mode(single, "RUN")
    assert single.resume_hint(composed()) == (
        f"To continue, run the same command with hydra.run.dir={single.path}"
    )
    sweep_dir = tmp_path / "multirun" / "12-00-00"
    job = RunDir(sweep_dir / "3")
    write_hydra_mode(job, "MULTIRUN")
    assert job.resume_hint(composed()) == (
        f"To continue, run the same command with hydra.sweep.dir={sweep_dir}"
    )
    assert job.resume_hint(composed("launcher=slurm")) == (
        "SLURM requeues the job if it was preempted or timed out; it then resumes here"
    )


# --- a run in progress -------------------------------------------------------------------------
def test_a_second_run_in_a_dir_in_use_is_refused_naming_the_holder(tmp_path):
    run = RunDir(tmp_path)
    with run.held():
        holder = run.lock.read_text().strip()
        assert holder.startswith(f"pid {os.getpid()} on {socket.gethostname()}, since ")
        with pytest.raises(ConfigError) as refusal, RunDir(tmp_path).held():
            pass
        assert str(refusal.value) == (
            f"hydra.run.dir={tmp_path} is in use by another run ({holder}); nothing was changed. "
            "Wait for it to end, or choose another hydra.run.dir"
        )
        assert run.lock.read_text().strip() == holder  # the refused attempt wrote nothing
    with RunDir(tmp_path).held():  # released when the run ends
        assert run.lock.read_text().strip() != ""
    assert not run.is_foreign()  # a dir holding only a lock is a run dir


# --- after a refused start -------------------------------------------------------------------
def start_in(path: Path) -> RunDir:
    """What the app does with a run dir before its config is refused: note which folders Hydra
    makes, make them, note whether the dir began empty, write Hydra's record and train.log."""
    run = RunDir(path)
    run.note_missing_folders()
    path.mkdir(parents=True, exist_ok=True)
    run.note_start()
    run.record.mkdir(exist_ok=True)
    (run.record / "config.yaml").write_text("seed: 1\n")
    run.log.write_text("refused\n")
    return run


def test_a_refused_start_removes_its_dir_and_the_dated_folders_made_for_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    earlier = tmp_path / "outputs" / "2025-01-01" / "11-00-00"
    earlier.mkdir(parents=True)
    (earlier / "metrics.jsonl").write_text("{}\n")
    start_in(tmp_path / "outputs" / "2025-01-01" / "12-00-00").discard()
    start_in(tmp_path / "outputs" / "2025-01-02" / "09-00-00").discard()
    assert tree(tmp_path) == [
        "outputs",
        "outputs/2025-01-01",
        "outputs/2025-01-01/11-00-00",
        "outputs/2025-01-01/11-00-00/metrics.jsonl",
    ]


def test_a_refused_start_keeps_a_users_empty_folder_above_its_dir(tmp_path):
    mine = tmp_path / "experiments"
    mine.mkdir()
    start_in(mine / "a" / "b").discard()
    assert mine.is_dir() and list(mine.iterdir()) == []


def test_a_refused_sweep_job_keeps_the_sweep_dir_for_the_other_jobs(tmp_path):
    start_in(tmp_path / "multirun" / "12-00-00" / "0").discard(sweep_job=True)
    assert tree(tmp_path) == ["multirun", "multirun/12-00-00"]


@pytest.mark.parametrize("earlier", ["metrics.jsonl", "notes.txt"])
def test_a_refused_start_in_a_dir_that_held_files_removes_nothing(tmp_path, earlier):
    """A refused resume, or a user's folder: the dir did not begin empty."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / earlier).write_text("{}\n")
    run = start_in(tmp_path / "run")
    before = files(run.path)
    run.discard()
    assert files(run.path) == before


def test_a_refused_start_keeps_a_dir_that_got_a_checkpoint(tmp_path):
    run = start_in(tmp_path / "run")
    run.checkpoints.mkdir()
    (run.checkpoints / "step_00000010.pt").write_bytes(b"")
    run.discard()
    assert (run.checkpoints / "step_00000010.pt").exists() and run.log.exists()


def test_a_refused_start_in_the_empty_working_dir_empties_it_again(tmp_path, monkeypatch):
    here = tmp_path / "here"  # hydra.run.dir=.
    here.mkdir()
    monkeypatch.chdir(here)
    run = start_in(here)
    run.config.write_text("seed: 1\n")
    run.discard()
    assert here.is_dir() and list(here.iterdir()) == []


# --- torchrun ranks > 0 ----------------------------------------------------------------------
def test_a_throwaway_dir_is_a_new_temporary_dir_recognised_as_one_and_gone_after(tmp_path):
    handler = signal.getsignal(signal.SIGTERM)
    with throwaway_dir() as first, throwaway_dir() as second:
        assert first != second and first.is_dir() and list(first.iterdir()) == []
        assert first.parent == Path(tempfile.gettempdir())
        assert is_throwaway(first) and is_throwaway(second)
        (first / "what Hydra wrote").write_text("")
    assert not first.exists() and not second.exists()
    with pytest.raises(SystemExit), throwaway_dir() as refused:  # a refused config's exit
        raise SystemExit(2)
    assert not refused.exists()
    assert signal.getsignal(signal.SIGTERM) == handler  # this process's, as it was
    assert not is_throwaway(tmp_path / "outputs" / "12-00-00")
    assert not is_throwaway(Path("/tmp/framework-rank-dir/run"))


def test_a_second_start_in_a_dir_the_first_began_empty_keeps_the_first_runs_files(tmp_path):
    """One process, two starts in one dir (a notebook, the cli fixture): the second began in a
    dir holding the first run's metrics, so its refusal removes nothing."""
    first = start_in(tmp_path / "run")
    first.metrics.write_text('{"step": 1, "train/loss": 0.5}\n')  # logged, no checkpoint yet
    second = RunDir(tmp_path / "run")
    second.note_start()
    second.discard()
    assert second.metrics.read_text() == '{"step": 1, "train/loss": 0.5}\n'


def test_a_sweep_jobs_dir_holding_only_the_record_this_start_wrote_is_not_foreign(tmp_path):
    """A sweep's job: Hydra makes its dir, the callback writes the record, then the app checks
    the dir (join_sweep): the record is this start's own, not a user's file."""
    job = start_in(tmp_path / "multirun" / "12-00-00" / "0")
    job.log.unlink()
    assert sorted(p.name for p in job.path.iterdir()) == [".hydra"]
    assert not job.is_foreign()
    job.check_reusable(composed(), sweep_job=True)  # accepted
    other = tmp_path / "someone-elses"
    (other / ".hydra").mkdir(parents=True)
    assert RunDir(other).is_foreign()


# --- the run dir as a class: never through a link, never another start's --------------------
def test_a_planted_lock_link_is_refused_and_its_target_left_as_it_is(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").symlink_to(victim)
    refused = pytest.raises(ConfigError, match=r"\.lock is a link: a run never writes through one")
    with refused, RunDir(run_dir).held():
        pass
    assert victim.read_text() == "the user's file\n"
    assert RunDir(run_dir).take_at_start() is False


def test_a_planted_lock_hard_link_or_fifo_is_refused_and_its_target_left_as_it_is(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.link(victim, run_dir / ".lock")
    with (
        pytest.raises(ConfigError, match=r"\.lock is not a run's lock file"),
        RunDir(run_dir).held(),
    ):
        pass
    assert victim.read_text() == "the user's file\n"
    (run_dir / ".lock").unlink()
    os.mkfifo(run_dir / ".lock")
    with (
        pytest.raises(ConfigError, match=r"\.lock is not a run's lock file"),
        RunDir(run_dir).held(),
    ):
        pass


def test_another_tools_lock_file_makes_no_folder_a_run_dir_and_is_never_written(tmp_path):
    (tmp_path / ".lock").write_text("held by my sync tool\n")
    (tmp_path / "notes.txt").write_text("mine\n")
    with pytest.raises(ConfigError, match=r"holds files that are not a run's \(\.lock, notes"):
        RunDir(tmp_path).check_reusable(composed(), sweep_job=False)
    (tmp_path / "notes.txt").unlink()
    with pytest.raises(ConfigError, match="not a run's lock file"), RunDir(tmp_path).held():
        pass
    assert (tmp_path / ".lock").read_text() == "held by my sync tool\n"


def test_a_runs_own_lock_is_taken_again_by_the_next_start(tmp_path):
    with RunDir(tmp_path).held():
        assert "pid" in (tmp_path / ".lock").read_text()
    with RunDir(tmp_path).held():  # the file an earlier run left is no obstacle
        pass


@pytest.mark.parametrize(
    "name", ["metrics.jsonl", "train.log", "config.yaml", ".hydra", "metrics.csv", "wandb"]
)
def test_a_run_dir_holding_a_link_where_the_run_writes_is_refused(tmp_path, name):
    (tmp_path / "victim").mkdir()
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_00000001.pt").write_bytes(b"")
    (tmp_path / "run" / name).symlink_to(tmp_path / "victim")
    with pytest.raises(ConfigError, match=f"holds a link where a run writes its files \\({name}"):
        RunDir(tmp_path / "run").check_reusable(composed(), sweep_job=False)


def test_a_link_in_the_runs_record_is_refused_before_the_record_is_written(tmp_path):
    (tmp_path / "victim.yaml").write_text("mine\n")
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / ".hydra" / "overrides.yaml").symlink_to(tmp_path / "victim.yaml")
    assert RunDir(run_dir).links() == [".hydra/overrides.yaml"]
    with pytest.raises(ConfigError, match=r"holds a link where a run writes its files \(\.hydra/"):
        RunDir(run_dir).check_reusable(composed(), sweep_job=False)
    assert (tmp_path / "victim.yaml").read_text() == "mine\n"


def test_an_atomic_write_never_writes_through_a_link_planted_as_its_temporary_file(tmp_path):
    from framework.storage.files import atomic_write

    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    target = tmp_path / "run" / "summary.json"
    target.parent.mkdir()
    (target.parent / f".summary.json.tmp-{os.getpid()}").symlink_to(victim)
    atomic_write(target, lambda file: file.write(b"{}"))
    assert target.read_text() == "{}" and not target.is_symlink()
    assert victim.read_text() == "mine\n"


def hold_in_another_process(run_dir: Path):
    """Another `train`'s lock on run_dir (flock is per process here), until it is killed."""
    import subprocess
    import sys

    code = (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, b'pid other')\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(run_dir / ".lock")], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_start_refused_because_another_holds_the_dir_removes_nothing(tmp_path):
    """Two starts on one new dir at the same moment: both saw it missing, both think they made
    it; the one that lost the lock must leave the other's dir alone."""
    run_dir = tmp_path / "outputs" / "new"
    loser = RunDir(run_dir)
    loser.note_missing_folders()
    run_dir.mkdir(parents=True)
    loser.note_start()  # empty: it would count the dir as its own
    holder = hold_in_another_process(run_dir)
    try:
        (run_dir / "config.yaml").write_text("the winner's\n")
        assert loser.take_at_start() is False
        with pytest.raises(ConfigError, match="is in use by another run"), loser.held(adopt=True):
            pass
        loser.discard()
        assert (run_dir / "config.yaml").read_text() == "the winner's\n"
    finally:
        holder.kill()
        holder.wait()


def test_a_run_stopped_before_its_first_checkpoint_is_continued_by_the_same_command(tmp_path):
    run = RunDir(tmp_path)
    run.metrics.write_text('{"step": 3}\n')
    run.record.mkdir()
    (run.record / "overrides.yaml").write_text("- trainer.max_steps=9\n")
    run.check_reusable(composed(), sweep_job=False, overrides=["trainer.max_steps=9"])
    with pytest.raises(ConfigError, match="already holds a run with no checkpoint"):
        run.check_reusable(composed(), sweep_job=False, overrides=["trainer.max_steps=8"])
    run.summary.write_text("{}\n")  # a finished run is never started over
    with pytest.raises(ConfigError, match="already holds a run with no checkpoint"):
        run.check_reusable(composed(), sweep_job=False, overrides=["trainer.max_steps=9"])


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("made/" + "x" * 300 + "/run", "File name too long"),
        ("a_file/made/run", "Not a directory"),
        ("/proc/nope/run", "No such file or directory"),
    ],
)
def test_a_folder_the_file_system_refuses_is_named_and_leaves_nothing(tmp_path, where, expected):
    from framework.storage.run_dir import make_folder

    (tmp_path / "a_file").write_text("mine\n")
    problem = make_folder(tmp_path / where)
    assert problem is not None and expected in problem
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a_file"]
    assert make_folder(tmp_path / "fine" / "run") is None
    assert (tmp_path / "fine" / "run").is_dir()


def runs_own_names() -> list[str]:
    """Every name the run writes in its dir: RunDir's files and the loggers' and the ranks'
    folders (RUN_DIR_NAMES), and a temporary file of an atomic write."""
    from framework.config.validation import RUN_DIR_NAMES

    run = RunDir(Path("run"))
    files = [
        getattr(run, name).name
        for name in dir(RunDir)
        if isinstance(getattr(RunDir, name), property) and name != "path"
    ]
    assert {".lock", ".hydra", "metrics.jsonl", "summary.json"} <= set(files)
    return sorted({*files, *RUN_DIR_NAMES, ".metrics.jsonl.tmp-1"})


def logger_file_options() -> list[tuple[str, str]]:
    """(logger, key) of every shipped logger's setting that names a file or folder."""
    from framework.config import CONF_DIR

    found = []
    for option in sorted((CONF_DIR / "logger").glob("*.yaml")):
        node = OmegaConf.load(option).get(option.stem) or {}
        found += [
            (option.stem, str(key))
            for key in node
            if any(part in str(key) for part in ("file", "path", "dir"))
        ]
    assert ("csv", "filename") in found
    return found


@pytest.mark.parametrize(("logger", "key"), logger_file_options())
def test_no_loggers_file_may_take_a_name_the_run_writes_itself(logger, key):
    for name in runs_own_names():
        with pytest.raises(ConfigError) as refused:
            validate(make_cfg(f"logger={logger}", f"logger.{logger}.{key}={name}"))
        assert f"logger.{logger}.{key}={name} is a file the run writes itself" in str(refused.value)
    validate(make_cfg(f"logger={logger}", f"logger.{logger}.{key}=my_{logger}_log"))


def test_an_allocation_that_fails_while_the_model_is_built_is_a_config_mistake():
    import torch

    from framework.rank.build import refused_if_too_large

    model = OmegaConf.create({"_target_": "my.Model", "width": 10**15, "depth": 2, "bias": True})
    with pytest.raises(ConfigError) as refused, refused_if_too_large(model, torch.device("cpu")):
        torch.empty(10**15)  # 4e15 bytes: no allocator gives it
    assert str(refused.value) == (
        "model: my.Model is too large for the cpu memory of this machine: it asked for "
        "4000000.0 GB at once; make it smaller (its largest setting is model.width="
        "1000000000000000), or shard it over the ranks with strategy=fsdp (built on the meta "
        "device, no rank holds it whole)"
    )
    with (
        pytest.raises(ValueError, match="not memory"),
        refused_if_too_large(model, torch.device("cpu")),
    ):
        raise ValueError("not memory")
