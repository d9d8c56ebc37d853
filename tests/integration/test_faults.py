"""Faults as users meet them: real signals, a killed rank under torchrun, a hung rank, a NaN,
Ctrl-C. Each is a real multi-process job started from the command line."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from framework.core.exits import ExitCode
from tests.conftest import (
    DIST_ENV_VARS,
    FAULTS,
    REPO,
    make_cfg,
    read_metrics,
    run_cli,
    train_losses,
    train_many,
)
from tests.faults import FAULT_ENV, GATE_ENV, assert_same_weights, final_weights

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
STOPPED, INTERRUPTED = ExitCode.STOPPED, ExitCode.INTERRUPTED


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that mention `text` (a test's unique tmp path) or work
    in it: a rank forked from a fork server has the server's command line, and the launcher's
    working dir. Not this process: an in-process `train` (the cli fixture) works in the test's
    tmp path too, and a pytest-xdist worker's command line does not say pytest."""
    return list(_mentioning(text).values())


def _mentioning(text: str) -> dict[int, str]:
    """pid: command line (and working dir) of each process processes_mentioning finds."""
    found = {}
    for process in Path("/proc").glob("[0-9]*"):
        if process.name == str(os.getpid()):
            continue
        try:
            line = (process / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(process / "cwd")
        except OSError:
            continue
        if (text in line or cwd.startswith(text)) and "pytest" not in line:
            found[int(process.name)] = f"{line} (in {cwd})"
    return found


def torchrun_script(*args: str, cwd: Path, fault: str | None, timeout: float = 240):
    """launchers/torchrun.sh as a user runs it (its `python` is this environment's)."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["PYTHONPATH"] = str(REPO)
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.run(
        ["bash", str(REPO / "launchers" / "torchrun.sh"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_torchrun_restarts_after_a_rank_is_sigkilled_and_ends_with_the_uninterrupted_weights(
    tmp_path, fault_references
):
    result = torchrun_script(*FAULTS, cwd=tmp_path, fault="kill:1:11")
    assert result.returncode == 0, result.stderr[-4000:]
    # One run dir, named by the rendezvous id: the restarted rank 0 came back to it.
    [run_dir] = [p.parent for p in tmp_path.glob("outputs/torchrun/*/config.yaml")]
    assert "resumed from" in result.stderr and "step_00000008.pt" in result.stderr
    assert_same_weights(final_weights(run_dir), final_weights(fault_references["allreduce"]))
    assert not processes_mentioning(str(tmp_path))


def test_launcher_torchrun_restarts_a_sigkilled_rank_forked_with_the_agents_variables(
    cli, tmp_path, fault_references
):
    """launcher=torchrun forks the agent's workers from the fork server: the restarted round
    must see the agent's TORCHELASTIC_RESTART_COUNT (the fault fires only in round 0)."""
    run_dir = tmp_path / "run"
    overrides = ("launcher=torchrun", "launcher.max_restarts=1", f"hydra.run.dir={run_dir}")
    result = cli(*FAULTS, *overrides, cwd=tmp_path, env={FAULT_ENV: "kill:1:11"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resumed from" in result.stderr and "step_00000008.pt" in result.stderr
    assert_same_weights(final_weights(run_dir), final_weights(fault_references["allreduce"]))


def test_sigterm_to_the_launcher_stops_every_rank_at_one_step_and_the_same_command_resumes(
    cli, tmp_path, fault_references
):
    """...into the same metrics.jsonl and the same W&B run."""
    args = (*FAULTS, f"hydra.run.dir={tmp_path / 'run'}", "logger=wandb")
    temp = Path(tempfile.mkdtemp(prefix="faults-"))  # (short: it holds the fork server's socket)
    env = {"WANDB_MODE": "offline", FAULT_ENV: "parent-SIGTERM:0:9", "TMPDIR": str(temp)}
    stopped = run_cli(*args, cwd=tmp_path, env=env)
    # W&B's folders, made in the run dir as rank 0 imports it, none in the temp folder
    # (torchinductor_<user>: torch's cache, kept)
    left_in_temp = [p.name for p in temp.iterdir() if "wandb" in p.name]
    shutil.rmtree(temp)
    assert not left_in_temp and not list((tmp_path / "run").glob(".wandb-temp-*"))
    assert stopped.returncode == STOPPED, stopped.stderr[-3000:]
    assert "stopped on SIGTERM at step 10" in stopped.stderr  # learned a step later
    assert f"hydra.run.dir={tmp_path / 'run'}" in stopped.stderr  # how to continue
    assert "Traceback" not in stopped.stderr
    run_dir = tmp_path / "run"
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == 10

    # The signal went to the first command's own process; the second may run in this one.
    resumed = cli(*args, cwd=tmp_path, env={"WANDB_MODE": "offline", FAULT_ENV: None})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(final_weights(run_dir), final_weights(fault_references["allreduce"]))
    assert [e["step"] for e in read_metrics(run_dir) if "train/loss" in e] == list(range(1, 31))
    # Two offline segments of one W&B run: `wandb sync` uploads both into the same run.
    segments = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(segments) == 2
    assert len({segment.name.rsplit("-", 1)[1] for segment in segments}) == 1


# A char GPT on data=text_stream (tests/conf/experiment/stream_faults.yaml), reading `texts/`
# under its working dir: 8 training files of 200 bytes, 99 windows of 16 tokens, 12 steps of
# 2 x 4 per epoch; 20 steps stop mid-epoch 0 and cross into epoch 1.
STREAM_FAULTS = (*FAULTS[:1], "experiment=stream_faults", "data.files=texts/*.txt")
TEXT = "the quick brown fox jumps over a lazy dog while streams resume exactly "


def stream_corpus(folder: Path) -> None:
    (folder / "texts").mkdir()
    for index in range(9):
        (folder / "texts" / f"part{index}.txt").write_text((TEXT * 4)[index * 7 :][:200])


@pytest.fixture(scope="module")
def stream_reference(tmp_path_factory) -> Path:
    """The streamed run uninterrupted, 2 ranks, no DataLoader workers."""
    root = tmp_path_factory.mktemp("stream_reference")
    stream_corpus(root)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        train_many([(make_cfg(*STREAM_FAULTS), root / "run")])
    return root / "run"


def assert_the_uninterrupted_run(run_dir: Path, reference: Path) -> None:
    """Each step's loss once, equal to the uninterrupted run's (the same processes on the same
    CPU: bit for bit), and its final weights."""
    assert [e["step"] for e in read_metrics(run_dir) if "train/loss" in e] == list(range(1, 21))
    assert train_losses(run_dir) == train_losses(reference)
    assert_same_weights(final_weights(run_dir), final_weights(reference))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_streamed_run_stopped_by_sigterm_mid_epoch_resumes_with_its_very_next_windows(
    cli, tmp_path, stream_reference, workers
):
    """The resumed run reads the stream from the stopped one's position: the same losses at
    every step as the uninterrupted run, with or without DataLoader workers (which had read
    ahead when the signal came)."""
    stream_corpus(tmp_path)
    args = (*STREAM_FAULTS, f"data.num_workers={workers}", f"hydra.run.dir={tmp_path / 'run'}")
    # To rank 0 itself, not the launcher: this process runs it (the ranks agree on the stop).
    stopped = cli(*args, cwd=tmp_path, env={FAULT_ENV: "SIGTERM:0:6"})
    assert stopped.returncode == STOPPED, stopped.stderr[-3000:]
    assert "stopped on SIGTERM at step 7" in stopped.stderr
    run_dir = tmp_path / "run"
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["step"] == 7 and saved["trainer"]["samples_in_epoch"] == 7 * 8  # mid-epoch
    resumed = cli(*args, cwd=tmp_path, env={FAULT_ENV: None})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "at step 7" in resumed.stderr
    assert_the_uninterrupted_run(run_dir, stream_reference)


def test_a_streamed_run_whose_rank_is_sigkilled_restarts_under_torchrun_from_its_position(
    cli, tmp_path, stream_reference
):
    """Rank 1 killed at step 11 (mid-epoch 0), its 2 DataLoader workers with it: torchrun
    (launcher=torchrun: its agent here, its workers forked; launchers/torchrun.sh restarts alike,
    above) restarts both ranks, which go on from the step 8 checkpoint's stream position and end
    as the uninterrupted run (without workers: the SIGTERM test's resume, from the same rule)."""
    stream_corpus(tmp_path)
    run_dir = tmp_path / "run"
    result = cli(
        *STREAM_FAULTS,
        "data.num_workers=2",
        "launcher=torchrun",
        "launcher.max_restarts=1",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        env={FAULT_ENV: "kill:1:11"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resumed from" in result.stderr and "step_00000008.pt" in result.stderr
    assert_the_uninterrupted_run(run_dir, stream_reference)
    assert not processes_mentioning(str(tmp_path))


def test_a_signal_to_torchrun_reaches_the_ranks_which_save_and_leave_no_process_behind(tmp_path):
    run_dir = tmp_path / "run"
    result = torchrun_script(
        *FAULTS,
        f"hydra.run.dir={run_dir}",
        "checkpoint.every=0",
        cwd=tmp_path,
        fault="parent-SIGUSR1:0:9",
    )
    assert result.returncode != 0
    assert "stopped on SIGUSR1 at step" in result.stderr, result.stderr[-3000:]
    step = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"]
    assert 10 <= step < 30
    assert_no_process_left_within(1, tmp_path)


def test_a_hung_rank_ends_the_job_within_the_timeout_with_one_message_and_no_process_left(
    cli,
    tmp_path,
):
    started = time.monotonic()
    result = cli(
        *FAULTS,
        f"hydra.run.dir={tmp_path / 'run'}",
        "dist.timeout_s=5",
        cwd=tmp_path,
        env={FAULT_ENV: "hang:1:3"},
    )
    seconds = time.monotonic() - started
    assert result.returncode == 1
    messages = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(messages) == 2, result.stderr[-3000:]  # the cause, then the launcher's summary
    assert "rank 0 waited dist.timeout_s=5 s in a collective" in messages[0]
    assert messages[1] == "error: rank 0 timed out in a collective (see above)"
    assert "Traceback" not in result.stderr
    # Start-up (~10 s here) + the 5 s timeout + the launcher's grace for the hung rank.
    assert seconds < 40, seconds
    assert not processes_mentioning(str(tmp_path))


def test_a_nan_on_one_rank_stops_every_rank_at_that_step_without_saving_it(cli, tmp_path):
    run_dir = tmp_path / "run"
    result = cli(*FAULTS, f"hydra.run.dir={run_dir}", cwd=tmp_path, env={FAULT_ENV: "nan:1:6"})
    assert result.returncode == 1
    assert "non-finite loss on rank(s) 1 at step 6 (epoch 1): stopped without saving" in (
        result.stderr
    ), result.stderr[-3000:]
    assert "step_00000004.pt" in result.stderr  # where to go back to
    assert "Traceback" not in result.stderr
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.pt"))
    assert saved == ["step_00000004.pt"]
    assert max(e["step"] for e in read_metrics(run_dir)) == 5


# Then runs the rest of its command line: a terminal's foreground job has SIGINT at its default,
# where a suite started in the background inherits it ignored (and Python keeps it so).
WITH_DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def _train_in_a_session_of_its_own(fault: str, run_dir: Path, cwd: Path) -> tuple[int, str]:
    """`train` of the fault experiment with FRAMEWORK_TEST_FAULT=fault, as a terminal's job: in a
    process group of its own (a group-* fault signals it like a terminal), SIGINT at its
    default. Exit code and stderr."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS}
    env[FAULT_ENV] = fault
    cli = ["-m", "framework.cli", *FAULTS, f"hydra.run.dir={run_dir}"]
    process = subprocess.Popen(
        [sys.executable, "-c", WITH_DEFAULT_SIGINT, *cli],
        cwd=cwd,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _, stderr = process.communicate(timeout=120)
    return process.returncode, stderr


def test_ctrl_c_stops_cleanly_with_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    # Like a terminal: the launcher and every rank get it.
    returncode, stderr = _train_in_a_session_of_its_own("group-SIGINT:0:7", run_dir, tmp_path)
    assert returncode == INTERRUPTED, stderr[-3000:]
    assert "stopped on SIGINT at step 8" in stderr
    assert "Traceback" not in stderr and "destroy_process_group" not in stderr
    assert json.loads((run_dir / "checkpoints" / "step_00000008.json").read_text())["step"] == 8


def test_ctrl_c_while_train_starts_leaves_no_traceback_no_run_dir_and_no_process(tmp_path):
    """A terminal's Ctrl-C (the whole process group) as the run's parts are tried, before any
    rank starts (FRAMEWORK_TEST_FAULT step 0: as the model is built): nothing was trained, so
    the run dir this start made goes, and the command ends as Python ends on Ctrl-C (by SIGINT:
    130 in a shell, and a shell loop stops)."""
    run_dir = tmp_path / "outputs" / "run"
    returncode, stderr = _train_in_a_session_of_its_own("group-SIGINT:0:0", run_dir, tmp_path)
    assert returncode == -signal.SIGINT, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert not (tmp_path / "outputs").exists()
    assert_no_process_left_within(5, tmp_path)


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def test_a_finished_run_continues_only_with_a_larger_budget_and_refuses_other_settings(
    cli, tmp_path
):
    run_dir = tmp_path / "run"
    one_rank = (*FAULTS, f"hydra.run.dir={run_dir}", "launcher.nproc_per_node=1")
    assert cli(*one_rank, "trainer.max_steps=8", cwd=tmp_path).returncode == 0
    before = snapshot(run_dir)

    again = cli(*one_rank, "trainer.max_steps=8", cwd=tmp_path)
    assert again.returncode == 0 and "is complete at step 8" in again.stderr
    changed = cli(*one_rank, "trainer.max_steps=8", "data.batch_size=16", cwd=tmp_path)
    assert changed.returncode == 2
    assert "data.batch_size: 32 in the checkpoint, 16 now" in changed.stderr, changed.stderr
    assert "Traceback" not in changed.stderr
    after = snapshot(run_dir)  # only train.log records the two attempts (.lock: who held it)
    assert {k: v for k, v in after.items() if k not in ("train.log", ".lock")} == {
        k: v for k, v in before.items() if k not in ("train.log", ".lock")
    }

    longer = cli(*one_rank, "trainer.max_steps=12", cwd=tmp_path)
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "resumed from" in longer.stderr and "at step 8" in longer.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 12


def test_an_explicit_checkpoint_that_is_broken_or_from_another_model_is_one_clear_error(
    cli, tmp_path
):
    source = tmp_path / "source"
    one_rank = (*FAULTS, "launcher.nproc_per_node=1", "trainer.max_steps=4")
    assert cli(*one_rank, f"hydra.run.dir={source}", cwd=tmp_path).returncode == 0
    good = source / "checkpoints" / "step_00000004.pt"
    broken = tmp_path / "broken.pt"
    broken.write_bytes(good.read_bytes()[:1000])

    result = cli(
        *one_rank, f"checkpoint.resume={broken}", f"hydra.run.dir={tmp_path / 'a'}", cwd=tmp_path
    )
    assert result.returncode == 2
    assert f"error: checkpoint {broken} is unreadable: its archive is truncated or corrupted" in (
        result.stderr
    )
    assert not (tmp_path / "a").exists()

    result = cli(
        *one_rank,
        f"checkpoint.resume={good}",
        "model.hidden_sizes=[16]",
        f"hydra.run.dir={tmp_path / 'b'}",
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "holds a different model (shape (checkpoint vs model): net.1.bias (32,) vs (16,)" in (
        result.stderr
    ), result.stderr[-2000:]
    assert "Traceback" not in result.stderr


# Long enough to train for minutes unsupervised if the ranks did not notice their launcher's death.
ENDLESS = ("trainer.max_steps=200000", "checkpoint.every=0", "trainer.log_every=100")
# DataLoader workers that a kill may find busy in an item (tests/faults.py: GatedItems).
BUSY_WORKERS = ("data._target_=tests.faults.gated_synthetic", "data.num_workers=2")


def assert_no_process_left_within(seconds: float, tmp_path: Path) -> None:
    deadline = time.monotonic() + seconds
    while (left := processes_mentioning(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in _mentioning(str(tmp_path)) if left else ():  # clean up before failing
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after the launcher died: {left}"


@pytest.mark.parametrize("launcher", ["local", "torchrun"])
def test_ranks_stop_and_save_when_train_is_sigkilled(tmp_path, launcher):
    """The OOM killer or a closed terminal ends `train` with SIGKILL: its ranks notice within
    seconds, stop as on SIGTERM (saving), and leave (framework/launch/launcher_watch.py), their
    DataLoader workers with them."""
    run_dir = tmp_path / "run"
    # (short: the fork server's socket lives in it, and a socket's path has at most 107 bytes)
    temp = Path(tempfile.mkdtemp(prefix="faults-"))
    try:
        result = run_cli(
            *FAULTS,
            *ENDLESS,
            *BUSY_WORKERS,
            f"launcher={launcher}",
            f"hydra.run.dir={run_dir}",
            cwd=tmp_path,
            env={FAULT_ENV: "parent-SIGKILL:0:5", "TMPDIR": str(temp)},
            timeout=120,  # the ranks hold its output pipes: it returns once they are gone
        )
    finally:
        assert_no_process_left_within(20, tmp_path)
        left_in_temp = [p.name for p in temp.iterdir() if "elastic" in p.name]
        shutil.rmtree(temp)
    assert result.returncode == -9
    assert not left_in_temp  # (the agent's logs)
    assert "the launcher (pid" in result.stderr and "is gone" in result.stderr
    step = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"]
    assert 5 <= step < 200000


def test_ranks_of_an_external_torchrun_leave_when_its_agent_is_sigkilled(tmp_path):
    run_dir = tmp_path / "run"
    try:
        result = torchrun_script(
            *FAULTS,
            *ENDLESS,
            f"hydra.run.dir={run_dir}",
            cwd=tmp_path,
            fault="parent-SIGKILL:0:5",
            timeout=120,
        )
    finally:
        assert_no_process_left_within(20, tmp_path)
    assert result.returncode == -9
    assert "the launcher (pid" in result.stderr
    assert (run_dir / "checkpoints" / "last.pt").exists()


def test_no_dataloader_worker_outlives_a_rank_killed_while_its_workers_are_busy(cli, tmp_path):
    """SIGKILL, as the memory killer sends it, to a rank whose workers are busy inside an item
    (a slow file): they leave with it within seconds (they would hold its memory, and the
    resource tracker, for a minute). The launcher runs in this process: it is not what is killed
    (`train` killed with its ranks' workers: test_ranks_stop_and_save_when_train_is_sigkilled)."""
    try:
        result = cli(
            *FAULTS,
            *ENDLESS,
            *BUSY_WORKERS,
            f"hydra.run.dir={tmp_path / 'run'}",
            cwd=tmp_path,
            env={FAULT_ENV: "busy-SIGKILL:1:5", GATE_ENV: str(tmp_path / "gate")},
        )
    finally:
        assert_no_process_left_within(3, tmp_path)
    assert result.returncode != 0
