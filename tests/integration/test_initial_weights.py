"""init=file as users run it: a run starts from a file's weights (safetensors, Hugging Face's
sharded folder, our checkpoints, a torch.save'd state_dict), a file that does not fit is one
line before any rank trains, a pickle that would run code is refused unrun, and the run records
the file it started from (docs/weights.md)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from framework.core.exits import ExitCode
from framework.storage.export import export
from tests.conftest import make_cfg, train_in_process

pytestmark = pytest.mark.slow
TINY = ("launcher.nproc_per_node=1", "trainer.max_steps=2", "model.width=4")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished tiny run's last checkpoint."""
    root = tmp_path_factory.mktemp("trained")
    train_in_process(make_cfg(*TINY), root / "run")
    return root / "run" / "checkpoints" / "last.pt"


def weights_file(kind: str, checkpoint: Path, folder: Path) -> Path:
    """The checkpoint's weights in the form `kind` names."""
    if kind == "safetensors":
        export(checkpoint, folder / "model.safetensors")
        return folder / "model.safetensors"
    if kind == "sharded folder":  # Hugging Face's layout: shards and their index
        export(checkpoint, folder / "model.safetensors", max_shard_bytes=200)
        assert (folder / "model.safetensors.index.json").is_file()
        return folder
    if kind == "state_dict":
        export(checkpoint, folder / "model.pt")
        return folder / "model.pt"
    return checkpoint  # our own step_<N>.pt


def eval_summary(result, where: Path) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    [summary] = where.glob("eval/*/summary.json")
    return json.loads(summary.read_text())


@pytest.mark.parametrize("kind", ["safetensors", "sharded folder", "state_dict", "checkpoint"])
def test_mode_eval_of_a_files_weights_gives_the_checkpoints_own_numbers(
    cli, tmp_path, trained, kind
):
    path = weights_file(kind, trained, tmp_path)
    result = cli(*TINY, "mode=eval", "init=file", f"init.path={path}", cwd=tmp_path)
    from_file = eval_summary(result, tmp_path / "outputs")
    result = cli(*TINY, "mode=eval", f"checkpoint.resume={trained}", cwd=tmp_path)
    from_checkpoint = eval_summary(result, trained.parent.parent)
    for summary in trained.parent.parent.glob("eval/*/summary.json"):  # (for the next case)
        summary.unlink()
    assert from_file["val/loss"] == from_checkpoint["val/loss"]
    assert from_file["val/accuracy"] == from_checkpoint["val/accuracy"]
    assert from_file["checkpoint"] == str(path.resolve())


def test_a_run_from_a_file_records_it_and_resumes_without_it(cli, tmp_path, trained):
    path = weights_file("safetensors", trained, tmp_path)
    run = tmp_path / "run"
    args = (*TINY, f"hydra.run.dir={run}", "trainer.log_every=1")
    result = cli(*args, "init=file", f"init.path={path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((run / "init.json").read_text())
    assert record["path"] == str(path.resolve())
    assert record["sha256"] == {"model.safetensors": hashlib.sha256(path.read_bytes()).hexdigest()}
    # It started from the file's weights: its first loss is the trained run's loss there, not
    # a fresh model's.
    fresh = cli(
        *args[:-1], f"hydra.run.dir={tmp_path / 'fresh'}", "trainer.log_every=1", cwd=tmp_path
    )
    assert fresh.returncode == 0
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["train/loss"]
    first_fresh = json.loads((tmp_path / "fresh" / "metrics.jsonl").read_text().splitlines()[0])[
        "train/loss"
    ]
    assert first != first_fresh
    # A resume takes the weights from its checkpoint: the file is read by no check and no rank
    # (the same command goes on after it is gone, as a requeued job does), nor named again.
    path.unlink()
    same = (*TINY[:1], "model.width=4", f"hydra.run.dir={run}", "init=file", f"init.path={path}")
    resumed = cli(*same, "trainer.max_steps=4", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"init: {path} not read: the checkpoint resumed holds the weights" in resumed.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    resumed = cli(
        *args[:1], "trainer.max_steps=6", "model.width=4", f"hydra.run.dir={run}", cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
    assert json.loads((run / "init.json").read_text()) == record
    # In a new dir the file must be there, said before anything starts.
    result = cli(*args[:1], "init=file", f"init.path={path}", cwd=tmp_path)
    assert result.returncode == ExitCode.CONFIG_REJECTED
    assert result.stderr.strip().splitlines() == [
        f"error: init.path={path} does not exist: give a .safetensors file, a folder of them "
        "(Hugging Face's layout), or a checkpoint (<run dir>/checkpoints/last.pt)"
    ]
    assert not (tmp_path / "outputs").exists()


def test_a_file_that_does_not_fit_is_one_line_naming_each_mismatch_before_training(
    cli, tmp_path, trained
):
    path = weights_file("safetensors", trained, tmp_path)
    cases = {
        # other names: every model key missing, every file tensor unexpected
        ("init.rename={features.:trunk.}",): [
            "6 missing from the file: features.0.bias, features.0.weight, features.2.bias, "
            "and 3 more",
            "6 in the file, not in the model: features.0.bias (as trunk.0.bias)",
        ],
        # loading what fits, where nothing does: refused, not the model as built
        ("init.rename={features.:trunk.,head.:top.}", "init.strict=false"): [
            "fills no key of the model: its names are like features.0.bias (as trunk.0.bias)",
            "the model's like features.0.bias",
        ],
        # another width: shapes named, file vs model
        ("model.width=8",): ["features.0.weight [4, 1, 3, 3] vs [8, 1, 3, 3]", "and 4 more"],
        ("init.skip=[nothing.*]",): ["init.skip: nothing.* matches no key of the model"],
    }
    not_a_fix = {("model.width=8",): "init.strict=false"}  # (a misfit is refused either way)
    for extra, expected in cases.items():
        result = cli(*TINY, "init=file", f"init.path={path}", *extra, cwd=tmp_path)
        assert result.returncode == ExitCode.CONFIG_REJECTED, result.stderr[-2000:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        for part in expected:
            assert part in lines[0], lines[0]
        assert not_a_fix.get(extra, "\0") not in lines[0], lines[0]
        assert not (tmp_path / "outputs").exists()


def test_a_new_head_is_left_as_built_and_the_trunk_comes_from_the_file(cli, tmp_path, trained):
    path = weights_file("safetensors", trained, tmp_path)
    result = cli(
        *TINY,
        "init=file",
        f"init.path={path}",
        "init.skip=[head.*]",
        "trainer.max_steps=1",
        "checkpoint.every=1",
        f"hydra.run.dir={tmp_path / 'run'}",
        "optimizer.lr=1e-30",  # one step that changes no weight measurably
        "optimizer.weight_decay=0",
        "optimizer.momentum=0",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    after = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["model"]
    before = torch.load(trained, weights_only=True)["model"]
    assert torch.equal(after["features.0.weight"], before["features.0.weight"])
    assert not torch.equal(after["head.weight"], before["head.weight"])


class WouldWriteAFile:
    """A pickle that, unpickled, opens (creates) a file: what a malicious .bin does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


# One rank is tried in the launcher's process, several in a process forked for the trial.
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_pickle_that_would_run_code_is_refused_in_one_line_and_nothing_in_it_runs(
    cli, tmp_path, ranks
):
    marker, evil = tmp_path / "ran", tmp_path / "pytorch_model.bin"
    torch.save({"features.0.weight": WouldWriteAFile(marker)}, evil)
    torch.load(evil, weights_only=False)  # armed: a plain unpickling runs it
    assert marker.exists()
    marker.unlink()
    tiny = (f"launcher.nproc_per_node={ranks}", *TINY[1:])
    result = cli(*tiny, "init=file", f"init.path={evil}", cwd=tmp_path)
    assert result.returncode == ExitCode.CONFIG_REJECTED, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(evil) in lines[0] and "nothing in it was executed" in lines[0]
    assert not marker.exists()
    assert not (tmp_path / "outputs").exists()


def test_a_sharded_checkpoint_folder_gives_its_own_numbers(cli, tmp_path):
    run = tmp_path / "run"
    train_in_process(make_cfg(*TINY, "checkpoint.format=sharded"), run)
    [folder] = (run / "checkpoints").glob("step_*.dcp")
    result = cli(*TINY, "mode=eval", "init=file", f"init.path={folder}", cwd=tmp_path)
    from_file = eval_summary(result, tmp_path / "outputs")
    result = cli(*TINY, "mode=eval", f"checkpoint.resume={folder}", cwd=tmp_path)
    from_checkpoint = eval_summary(result, run)
    assert from_file["val/loss"] == from_checkpoint["val/loss"]
    assert from_file["val/accuracy"] == from_checkpoint["val/accuracy"]
