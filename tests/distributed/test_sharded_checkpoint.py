"""Sharded checkpoints (checkpoint.format=sharded, the default under strategy=fsdp): every rank
writes its own shards with torch.distributed.checkpoint, a resume on the same ranks is
bit-exact, one in the background (checkpoint.async_save) saves the same numbers, and the
folder keeps a one-file checkpoint's guarantees (atomic, checked on load, never unpickles
code). Real 2-rank gloo jobs."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from framework.storage.export import whole_weights
from tests.conftest import TINY, make_cfg, read_metrics, train_in_process, train_losses

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FSDP = (
    *TINY,
    "model=mlp",
    "strategy=fsdp",
    "scheduler=cosine",
    "optimizer=adamw",
    "launcher.nproc_per_node=2",
    "data.batch_size=8",
    "checkpoint.every=4",
    "checkpoint.keep=2",
)


def train(run_dir: Path, steps: int, *extra: str) -> dict:
    return train_in_process(make_cfg(*FSDP, f"trainer.max_steps={steps}", *extra), run_dir)


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return whole_weights(checkpoint)


@pytest.fixture(scope="module")
def trained_fsdp(tmp_path_factory) -> tuple[Path, dict]:
    """A 2-rank fsdp run of 12 steps (checkpoints of steps 8 and 12 kept), read by every test
    here that needs a plain run: its run dir and summary. A test that changes files copies it."""
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    return run_dir, train(run_dir, 12)


def test_each_rank_writes_its_shards_and_a_resume_on_the_same_ranks_is_bit_exact(
    tmp_path, trained_fsdp
):
    straight, resumed = trained_fsdp[0], tmp_path / "resumed"
    train(resumed, 12, "checkpoint.keep=3")
    for step in (8, 12):  # as if killed after step 7: the newest checkpoint is step 4's
        shutil.rmtree(resumed / "checkpoints" / f"step_{step:08d}.dcp")
    train(resumed, 12, "checkpoint.keep=3")

    folder = straight / "checkpoints" / "step_00000012.dcp"
    assert (straight / "checkpoints" / "last.pt").resolve() == folder
    assert sorted(p.name for p in folder.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "state.pt",
    ]
    sidecar = json.loads(folder.with_suffix(".json").read_text())
    assert sorted(sidecar["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]
    kept = sorted(p.name for p in (straight / "checkpoints").glob("step_*"))
    assert kept == [
        "step_00000008.dcp",
        "step_00000008.json",
        "step_00000012.dcp",
        "step_00000012.json",
    ]
    # The resumed run continued from step 4 and retrained steps 5-12 to the same numbers.
    assert "resumed from" in (resumed / "train.log").read_text()
    assert train_losses(resumed)[-8:] == train_losses(straight)[-8:]
    expected, got = weights(folder), weights(resumed / "checkpoints" / "last.pt")
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_a_background_save_holds_the_numbers_of_its_step(tmp_path, trained_fsdp):
    """async_save copies the shards and writes them while the next steps train: the saved
    step 4 equals a synchronous save's, and a resume from it reproduces the run."""
    sync_run = trained_fsdp[0]
    train(tmp_path / "async", 12, "checkpoint.async_save=true", "checkpoint.keep=5")
    for step in (4, 8, 12):
        name = f"step_{step:08d}.dcp"
        sync = weights(sync_run / "checkpoints" / name) if step > 4 else None
        in_background = weights(tmp_path / "async" / "checkpoints" / name)
        for key, tensor in (sync or {}).items():
            assert torch.equal(in_background[key], tensor), (step, key)
    assert train_losses(tmp_path / "async") == train_losses(sync_run)
    resumed = tmp_path / "from_background"
    train(
        resumed,
        12,
        f"checkpoint.resume={tmp_path / 'async' / 'checkpoints' / 'step_00000004.dcp'}",
    )
    assert train_losses(resumed) == train_losses(sync_run)[4:]


def test_a_damaged_or_partial_sharded_checkpoint_falls_back_to_the_previous_one(
    tmp_path, trained_fsdp
):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_fsdp[0], run_dir, symlinks=True)
    checkpoints = run_dir / "checkpoints"
    # A save killed mid-way leaves only a partial folder, never a step_* one.
    partial = checkpoints / ".step_00000014.dcp.partial"
    shutil.copytree(checkpoints / "step_00000012.dcp", partial)
    shard = checkpoints / "step_00000012.dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-16])  # truncated on disk
    train(run_dir, 14)
    log = (run_dir / "train.log").read_text()
    assert "step_00000012.dcp/__1_0.distcp is corrupted or truncated" in log
    assert "resumed from" in log and "at step 8" in log
    assert not partial.exists()
    assert [e["step"] for e in read_metrics(run_dir) if "train/loss" in e][-6:] == list(
        range(9, 15)
    )


class _RunsCode:
    def __reduce__(self):
        return (exec, ("open('PWNED', 'w').write('x')",))


def test_a_crafted_index_is_refused_and_never_executed(cli, tmp_path, trained_fsdp):
    name = "step_00000008.dcp"
    folder = tmp_path / "run" / "checkpoints" / name
    # The folder alone, without its sidecar (.json): no checksum refuses it first, so the index
    # itself must be refused.
    shutil.copytree(trained_fsdp[0] / "checkpoints" / name, folder)
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    (tmp_path / "attack").mkdir()
    result = cli(
        *FSDP, "trainer.max_steps=12", f"checkpoint.resume={folder}", cwd=tmp_path / "attack"
    )
    assert result.returncode == 2
    assert "unreadable or unsafe index .metadata" in result.stderr
    assert "builtins.exec is not part of a checkpoint index" in result.stderr
    assert not list(tmp_path.rglob("PWNED"))


def test_eval_and_export_read_a_sharded_checkpoint_on_any_number_of_ranks(
    tmp_path, trained_fsdp, capsys
):
    from framework.storage.export import main

    run_dir, trained = trained_fsdp
    checkpoint = run_dir / "checkpoints" / "last.pt"
    for ranks in (1, 3):
        summary = train_in_process(
            make_cfg(
                *FSDP,
                "mode=eval",
                f"checkpoint.resume={checkpoint}",
                f"launcher.nproc_per_node={ranks}",
            ),
            run_dir / "eval" / str(ranks),
        )
        assert summary["world_size"] == ranks
        assert summary["val/accuracy"] == trained["val/accuracy"]
        assert summary["val/loss"] == pytest.approx(trained["val/loss"], rel=1e-6)

    # framework-export's main() in this process: a new interpreter would add only its imports.
    exported = tmp_path / "model.pt"
    main([str(checkpoint), str(exported)])
    assert f"from {checkpoint}" in capsys.readouterr().out
    state = torch.load(exported, weights_only=True)
    instantiate(make_cfg(*FSDP).model).load_state_dict(state)  # strict: every key and shape
    for name, tensor in weights(checkpoint).items():
        assert torch.equal(state[name], tensor)
    with pytest.raises(SystemExit) as again:
        main([str(checkpoint), str(exported)])
    assert again.value.code == 2 and "already exists" in capsys.readouterr().err


def test_a_sharded_checkpoint_exports_to_safetensors_one_file_of_tensors_at_a_time(
    tmp_path, trained_fsdp, capsys
):
    """framework-export into safetensors files of at most 100 kB of tensors (the MLP's 128 kB
    matrix alone in one): every tensor bit for bit, Hugging Face's index, and never more than
    one file's tensors held at once (the exporter's weak references count what is alive)."""
    from safetensors.torch import load_file

    from framework.storage.export import export, main

    checkpoint = trained_fsdp[0] / "checkpoints" / "last.pt"
    assert checkpoint.resolve().suffix == ".dcp"
    expected = weights(checkpoint)
    exported = export(checkpoint, tmp_path / "model.safetensors", max_shard_bytes=100_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    loaded = {name: load_file(tmp_path / name) for name in files}
    got = {key: tensor for part in loaded.values() for key, tensor in part.items()}
    assert got.keys() == expected.keys() and len(got) == exported.tensors
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
        assert index["weight_map"][name] in [f for f, part in loaded.items() if name in part]
    per_file = [sum(t.nbytes for t in part.values()) for part in loaded.values()]
    assert index["metadata"]["total_size"] == sum(per_file) == exported.total_bytes
    largest = max(t.nbytes for t in expected.values())
    assert all(size <= 100_000 or size == largest for size in per_file)
    assert exported.peak_bytes == max(per_file) < exported.total_bytes

    # One file when it fits (the default limit: 2 GB); the command says what it wrote and held.
    (tmp_path / "one").mkdir()
    main([str(checkpoint), str(tmp_path / "one" / "model.safetensors")])
    assert "6 tensors, 0.2 MB in 1 file; at most 0.2 MB of tensors held" in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "one").iterdir()] == ["model.safetensors"]
    whole = load_file(tmp_path / "one" / "model.safetensors")
    assert all(torch.equal(whole[name], tensor) for name, tensor in expected.items())
    with pytest.raises(SystemExit) as refused:  # nothing is overwritten
        main([str(checkpoint), str(tmp_path / "model.safetensors"), "--max-shard-size=100kB"])
    assert refused.value.code == 2 and "already exists" in capsys.readouterr().err
