"""Checkpoint files: atomic writes, verified reads, refusals that name the file."""

from __future__ import annotations

import io
import os
import resource
import signal
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.multiprocessing import ProcessExitedException

from framework.core.exits import CheckpointError, SaveFailed
from framework.core.launch_context import DistEnv
from framework.storage import checkpoint
from framework.storage.checkpoint import Checkpointer, check_model_keys, newest_valid, read, write
from framework.storage.files import step_files
from framework.storage.sharded import join, marked, split
from tests.conftest import start_ranks


def payload(step: int, **extra) -> dict:
    return {
        "format": checkpoint.FORMAT,
        "step": step,
        "model": {"w": torch.full((3,), step)},
        **extra,
    }


def test_write_keeps_the_newest_k_and_points_last_at_the_newest(tmp_path):
    for step in (5, 10, 15, 20):
        write(tmp_path, step, payload(step), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "last.pt",
        "step_00000015.json",
        "step_00000015.pt",
        "step_00000020.json",
        "step_00000020.pt",
    ]
    assert os.readlink(tmp_path / "last.pt") == "step_00000020.pt"
    # A single process loads the bare model for inference, weights only.
    loaded = torch.load(tmp_path / "last.pt", weights_only=True)
    assert torch.equal(loaded["model"]["w"], torch.full((3,), 20))


def break_file(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # one flipped byte in the middle: the zip may still read, the checksum does not match
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :])


@pytest.mark.parametrize("how", ["empty", "truncated", "corrupted"])
def test_a_broken_newest_checkpoint_falls_back_to_the_previous_with_a_warning(
    tmp_path, how, caplog
):
    write(tmp_path, 4, payload(4), keep=3)
    write(tmp_path, 8, payload(8), keep=3)
    break_file(tmp_path / "step_00000008.pt", how)
    with pytest.raises(CheckpointError, match=r"step_00000008\.pt is (corrupted|unreadable)"):
        read(tmp_path / "step_00000008.pt")
    path, loaded = newest_valid(tmp_path)
    assert path.name == "step_00000004.pt" and loaded["step"] == 4
    assert "step_00000008.pt" in caplog.text and "falling back" in caplog.text


@pytest.mark.parametrize("sidecar", ["", "{not json", '{"format": 1}', "[1, 2]"])
def test_a_damaged_sidecar_is_skipped_like_a_damaged_checkpoint(tmp_path, sidecar, caplog):
    write(tmp_path, 4, payload(4), keep=3)
    write(tmp_path, 8, payload(8), keep=3)
    (tmp_path / "step_00000008.json").write_text(sidecar)
    with pytest.raises(CheckpointError, match=r"sidecar .*step_00000008\.json is damaged"):
        read(tmp_path / "step_00000008.pt")
    path, loaded = newest_valid(tmp_path)
    assert path.name == "step_00000004.pt" and loaded["step"] == 4
    assert "falling back" in caplog.text


def test_when_no_checkpoint_reads_back_resume_is_refused_not_restarted_from_step_0(tmp_path):
    write(tmp_path, 4, payload(4), keep=3)
    write(tmp_path, 8, payload(8), keep=3)
    break_file(tmp_path / "step_00000004.pt", "truncated")
    (tmp_path / "step_00000008.json").write_text("{")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(CheckpointError, match=r"none of the 2 checkpoints in .* reads back"):
        newest_valid(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    assert newest_valid(tmp_path / "nothing-here") is None  # no checkpoint: a fresh start


def test_a_checkpoint_copied_without_its_checksum_file_still_loads_and_is_still_checked(tmp_path):
    write(tmp_path, 3, payload(3), keep=1)
    copy = tmp_path / "copy.pt"
    copy.write_bytes((tmp_path / "step_00000003.pt").read_bytes())
    assert read(copy)["step"] == 3
    break_file(copy, "truncated")
    with pytest.raises(CheckpointError, match="copy.pt is unreadable"):
        read(copy)


class _Exploit:
    """Unpickling this runs a shell command (what a malicious "checkpoint" does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "checkpoints" / "step_00000099.pt"
    evil.parent.mkdir()
    torch.save({"format": checkpoint.FORMAT, "step": 99, "x": _Exploit(marker)}, evil)
    with pytest.raises(CheckpointError, match=r"was refused: it holds pickled objects or code"):
        read(evil)
    assert not marker.exists()
    write(evil.parent, 50, payload(50), keep=5)
    path, _ = newest_valid(evil.parent)  # resume=auto skips it for the previous good one
    assert path.name == "step_00000050.pt" and not marker.exists()


def test_the_exploit_file_really_executes_under_a_plain_unpickler(tmp_path):
    """Guards the test above against a harmless "malicious" file."""
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"x": _Exploit(marker)}, evil)
    torch.load(evil, weights_only=False)
    assert marker.exists()


def test_a_file_that_is_not_ours_is_refused(tmp_path):
    torch.save({"state_dict": {}}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a checkpoint written by this framework"):
        read(tmp_path / "other.pt")


def test_a_different_model_gets_one_error_listing_every_mismatched_key(tmp_path):
    saved = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).state_dict()
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Linear(16, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2)
    )
    with pytest.raises(CheckpointError) as error:
        check_model_keys(tmp_path / "x.pt", saved, model)
    message = str(error.value)
    assert "missing from the checkpoint: 3.bias, 3.weight" in message
    assert "0.weight (8, 4) vs (16, 4)" in message and "1.weight (2, 8) vs (2, 16)" in message


def _write_a_big_checkpoint(rank: int, run_dir: Path, started: Path) -> None:
    w = torch.zeros(100_000_000)  # 400 MB: the kill lands inside torch.save
    big = {"format": checkpoint.FORMAT, "step": 2, "model": {"w": w}}
    started.write_text("writing")
    checkpoint.write(run_dir, 2, big, keep=3)


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint_valid(tmp_path):
    run_dir, started = tmp_path / "run", tmp_path / "started"
    write(run_dir, 1, payload(1), keep=3)
    # (a process of its own, forked from the fork server that has imported torch)
    saver = start_ranks(_write_a_big_checkpoint, (run_dir, started), nprocs=1, join=False)
    process = saver.processes[0]
    while not started.exists():
        assert process.is_alive(), "the saving process ended before it wrote"
        time.sleep(0.01)
    time.sleep(0.3)  # inside torch.save of 400 MB
    os.kill(process.pid, signal.SIGKILL)
    with pytest.raises(ProcessExitedException, match="terminated with signal SIGKILL"):
        saver.join()  # (ended by the kill, not by finishing)
    assert not (run_dir / "step_00000002.pt").exists()
    assert any(p.name.startswith(".step_00000002.pt.tmp") for p in run_dir.iterdir())
    path, loaded = newest_valid(run_dir)
    assert path.name == "step_00000001.pt" and loaded["step"] == 1
    assert os.readlink(run_dir / "last.pt") == "step_00000001.pt"


FILE_SIZE_LIMIT = 200_000  # bytes: a full disk, as a process sees it


def _save_past_a_size_limit(rank: int, run_dir: Path, said: Path) -> None:
    """In a process of its own: a file-size limit holds for the whole process."""
    cfg = OmegaConf.create({"every": 1, "keep": 3, "best": 0})
    saver = Checkpointer(cfg, run_dir, DistEnv(), {})
    saver.write_file(1, lambda: {"model": {"w": torch.zeros(10)}}, {})
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
    try:
        saver.write_file(2, lambda: {"model": {"w": torch.zeros(1_000_000)}}, {})
    except SaveFailed as error:
        said.write_text(str(error))


def test_a_save_past_a_file_size_limit_says_so_and_keeps_the_previous_checkpoint(tmp_path):
    run_dir, said = tmp_path / "run", tmp_path / "said.txt"
    start_ranks(_save_past_a_size_limit, (run_dir, said), nprocs=1)
    message = said.read_text() if said.exists() else "(no SaveFailed)"
    assert message.startswith("the checkpoint of step 2 could not be written to"), message
    assert "File too large" in message and "step_00000001.pt is intact" in message
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "last.pt",
        "step_00000001.json",
        "step_00000001.pt",
    ]
    assert read(run_dir / "last.pt")["step"] == 1


def test_a_sharded_checkpoints_skeleton_keeps_everything_around_the_tensors():
    """Only tensors go through DCP; param groups, tuples and None entries come back as saved."""

    state = {
        "state": {"fc.weight": {"exp_avg": torch.ones(2), "step": torch.tensor(3.0), "m": None}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["fc.weight"]}],
    }
    skeleton, tensors = split(state, "optimizer")
    assert sorted(tensors) == [
        "optimizer/state/fc.weight/exp_avg",
        "optimizer/state/fc.weight/step",
    ]
    assert marked(skeleton, "optimizer") == list(tensors)
    assert skeleton["param_groups"] == state["param_groups"]
    rebuilt = join(through_torch_save(skeleton), tensors, "optimizer")
    assert rebuilt["param_groups"][0]["betas"] == (0.9, 0.99)
    assert rebuilt["state"]["fc.weight"]["m"] is None
    assert rebuilt["state"]["fc.weight"]["exp_avg"] is tensors["optimizer/state/fc.weight/exp_avg"]


def through_torch_save(value):
    """As state.pt stores a skeleton: saved, then read with weights_only=True."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _sharded_save_past_a_size_limit(
    rank: int, run_dir: Path, said: Path, in_background: bool
) -> None:
    cfg = OmegaConf.create({"every": 1, "keep": 3, "best": 0, "async_save": in_background})
    saver = Checkpointer(cfg, run_dir, DistEnv(), {}, sharded=True)
    saver.write_sharded(1, {"model": {"w": torch.zeros(10)}}, dict, {})
    saver.finish_pending()
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
    try:
        saver.write_sharded(2, {"model": {"w": torch.zeros(1_000_000)}}, dict, {})
        saver.finish_pending()  # where a background save's failure is raised
    except SaveFailed as error:
        said.write_text(str(error))


@pytest.mark.parametrize("in_background", [False, True], ids=["sync", "async_save"])
def test_a_sharded_save_past_a_file_size_limit_says_so_and_keeps_the_previous_one(
    tmp_path, in_background
):
    run_dir, said = tmp_path / "run", tmp_path / "said.txt"
    start_ranks(_sharded_save_past_a_size_limit, (run_dir, said, in_background), nprocs=1)
    message = said.read_text() if said.exists() else "(no SaveFailed)"
    assert message.startswith("the checkpoint of step 2 could not be written to"), message
    assert "File too large" in message and "step_00000001.dcp is intact" in message
    assert [p.name for _, p in step_files(run_dir)] == ["step_00000001.dcp"]
    assert os.readlink(run_dir / "last.pt") == "step_00000001.dcp"
    assert read(run_dir / "last.pt")["step"] == 1


def test_tied_weights_export_to_safetensors_under_each_name(tmp_path):
    """A GPT's input and output embeddings share one tensor; safetensors refuses shared memory
    in a file, so each name gets its own copy, equal to it."""
    from safetensors.torch import load_file

    from framework.storage.export import export_safetensors

    shared = torch.randn(4, 3)
    weights = {"tokens.weight": shared, "head.weight": shared, "bias": torch.zeros(3)}
    exported = export_safetensors(weights, tmp_path / "model.safetensors", 10**9)
    assert exported.files == [tmp_path / "model.safetensors"] and exported.tensors == 3
    loaded = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(loaded[name], tensor) for name, tensor in weights.items())
    # Nothing left beside it, and the mode of any new file here (the library's writer makes 0600).
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask


def test_a_split_export_counts_its_shards_not_the_index(tmp_path, capsys):
    """Three tensors of 400 bytes under --max-shard-size=500: three safetensors files and the
    index that names them. The files the export reports, and the count it prints, are the three
    shards; the index is reported apart."""
    from framework.storage.export import export, main

    weights = {name: torch.full((100,), float(i)) for i, name in enumerate(("a", "b", "c"))}
    write(tmp_path / "run", 1, {**payload(1), "model": weights}, keep=1)
    checkpoint_file = tmp_path / "run" / "last.pt"
    shards = [tmp_path / f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = tmp_path / "model.safetensors.index.json"

    exported = export(checkpoint_file, tmp_path / "model.safetensors", max_shard_bytes=500)
    assert exported.files == shards and exported.index == index
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["run", index.name, *(p.name for p in shards)]
    )

    (tmp_path / "again").mkdir()
    main(
        [
            str(checkpoint_file),
            str(tmp_path / "again" / "model.safetensors"),
            "--max-shard-size=500",
        ]
    )
    said = capsys.readouterr().out
    assert said.startswith(f"{tmp_path / 'again' / index.name}: 3 tensors, 0.0 MB in 3 files")
    assert "4 file" not in said


@pytest.mark.parametrize(
    ("output", "option", "said"),
    [
        ("model.pt", "--max-shard-size=2GB", "splits safetensors files: name the output"),
        ("model.safetensors", "--max-shard-size=lots", "--max-shard-size=lots is no size"),
    ],
)
def test_export_refuses_a_shard_size_it_cannot_use(tmp_path, capsys, output, option, said):
    from framework.storage.export import main

    with pytest.raises(SystemExit) as refused:
        main([str(tmp_path / "missing.pt"), str(tmp_path / output), option])
    assert refused.value.code == 2 and said in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_new_top_k_checkpoint_is_logged_as_the_best_only_when_it_is(tmp_path, caplog):
    """checkpoint.best=2, higher is better: 0.5 then 0.9 are each the best so far; 0.7 is kept
    as the second; best.pt stays on 0.9's step."""
    caplog.set_level("INFO", logger="framework")
    lines = []
    for step, score in ((10, 0.5), (20, 0.9), (30, 0.7)):
        caplog.clear()
        checkpoint.write_best(tmp_path, step, payload(step), score, maximize=True, keep=2)
        lines.append(caplog.records[-1].getMessage())
    assert lines[0].startswith("best checkpoint: step 10 (0.5), the best so far")
    assert lines[1].startswith("best checkpoint: step 20 (0.9), the best so far")
    assert lines[2].startswith(
        "checkpoint among the 2 best: step 30 (0.7) is number 2; the best is still step 20"
    )
    assert "best checkpoint" not in lines[2]
    assert (tmp_path / "best.pt").resolve().name == "step_00000020.pt"


def _archive_cut_short(path: Path) -> bytes:
    torch.save({"format": checkpoint.FORMAT, "x": torch.ones(64)}, path)
    return path.read_bytes()[:300]


NOT_CHECKPOINTS = {
    "empty": (lambda path: b"", "the file is empty"),
    "zeroed": (lambda path: bytes(2048), "it holds only zero bytes"),
    "random": (lambda path: bytes(range(1, 256)) * 8, "neither a torch archive nor a pickle"),
    "text": (
        lambda path: b"hello, not a checkpoint\n" * 20,
        "neither a torch archive nor a pickle",
    ),
    "bare pickle": (
        lambda path: __import__("pickle").dumps({"step": 1}, protocol=4),
        "it is a bare pickle, not a checkpoint",
    ),
    "cut archive": (_archive_cut_short, "its archive is truncated or corrupted"),
}


@pytest.mark.parametrize("kind", NOT_CHECKPOINTS)
def test_a_file_named_like_a_checkpoint_that_is_none_says_what_it_is_in_our_words(tmp_path, kind):
    """Not "pickled objects or code" (a random file is neither), nor torch's text about its
    legacy formats cut mid-word."""
    make, reason = NOT_CHECKPOINTS[kind]
    path = tmp_path / "step_00000001.pt"
    path.write_bytes(make(path))
    with pytest.raises(CheckpointError) as refused:
        read(path)
    said = str(refused.value)
    assert said == f"checkpoint {path} is unreadable: {said.split(': ', 1)[1]}"
    assert reason in said and said.endswith("nothing in it was executed")
    assert "pickled objects" not in said and "weights_only" not in said


def test_a_long_cause_is_cut_at_a_word():
    from framework.core.exits import first_line

    said = first_line(RuntimeError("Cannot use weights_only with files saved in the legacy"), 30)
    assert said == "Cannot use weights_only with ..."
    assert first_line(RuntimeError("short"), 30) == "short"
