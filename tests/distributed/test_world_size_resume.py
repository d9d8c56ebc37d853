"""Resume on another number of ranks: 2 -> 1 -> 3 ranks continue the run that stayed on 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from framework.storage.export import whole_weights
from framework.storage.run_dir import RunDir
from tests.conftest import TINY, make_cfg, read_metrics, train_in_process, train_losses

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# One global batch of 12 on every leg (2 x 6, 1 x 12, 3 x 4): each step then sees the same 12
# samples of the epoch's global order, so the legs reproduce the uninterrupted run's losses.
# No dropout or augmentation: per-rank RNG streams, which cannot carry over, draw nothing.
BASE = (*TINY, "model=mlp", "scheduler=constant", "checkpoint.every=6", "optimizer.fused=false")
LEGS = [(2, 6, 6), (1, 12, 12), (3, 4, 18)]  # (ranks, per-rank batch, last step)
# A tiny char GPT on data=text_stream: 12 text files of about 600 bytes, 16-token windows.
STREAM = (
    "task=language_model",
    "model=gpt",
    "data=text_stream",
    "data.block_size=16",
    "data.stride=16",
    "data.val_files=2",
    "data.shuffle_buffer=32",
    "model.layers=1",
    "model.heads=2",
    "model.width=16",
    "task.sample_tokens=0",
    "trainer.log_every=1",
    "scheduler=constant",
    "checkpoint.every=6",
    "optimizer.fused=false",
)


def leg(
    ranks: int,
    batch: int,
    steps: int,
    strategy: str,
    fmt: str,
    run_dir: Path,
    *extra: str,
    base: tuple[str, ...] = BASE,
) -> dict:
    cfg = make_cfg(
        *base,
        f"strategy={strategy}",
        fmt,
        f"launcher.nproc_per_node={ranks}",
        f"data.batch_size={batch}",
        f"trainer.max_steps={steps}",
        *extra,
    )
    return train_in_process(cfg, run_dir)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """A one-file checkpoint's or a sharded one's (strategy=fsdp's default), whole."""
    return whole_weights(run_dir / "checkpoints" / "last.pt")


@pytest.mark.parametrize(
    ("strategy", "checkpoints"),
    [("ddp", "file"), ("ddp", "sharded"), ("fsdp", "file"), ("fsdp", "sharded")],
)
def test_two_then_one_then_three_ranks_continue_the_two_rank_run(tmp_path, strategy, checkpoints):
    """One file gathered to rank 0, or each rank's shards read back resharded by DCP."""
    strategy_and_format = (strategy, f"checkpoint.format={checkpoints}")
    leg(2, 6, 18, *strategy_and_format, tmp_path / "straight")
    losses, previous = [], None
    for index, (ranks, batch, steps) in enumerate(LEGS):
        run_dir = tmp_path / f"leg{index}"
        resume = () if previous is None else (f"checkpoint.resume={previous}",)
        summary = leg(ranks, batch, steps, *strategy_and_format, run_dir, *resume)
        assert summary["steps"] == steps and summary["world_size"] == ranks
        events = [e for e in read_metrics(run_dir) if "train/loss" in e]
        assert [e["step"] for e in events] == list(range(steps - 5, steps + 1))
        if previous is not None:  # the change is announced: RNG streams cannot carry over
            announced = f"written by {LEGS[index - 1][0]} ranks, on {ranks}: the model and optim"
            assert announced in RunDir(run_dir).log.read_text()
        losses += train_losses(run_dir)
        previous = run_dir / "checkpoints" / "last.pt"
    # Model and optimizer (momentum) resharded, the data continued from the global position.
    torch.testing.assert_close(losses, train_losses(tmp_path / "straight"), rtol=1e-5, atol=1e-6)
    expected, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "leg2")
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_a_streamed_char_gpt_goes_on_from_its_stream_position_on_two_then_one_then_three_ranks(
    tmp_path, monkeypatch
):
    """data=text_stream: each leg reads the windows the uninterrupted run read at those steps,
    the one-rank leg through 2 DataLoader workers: the same losses, the same weights."""
    texts = tmp_path / "texts"
    texts.mkdir()
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "streams",
        "resume",
        "exactly",
    ]
    for index in range(12):
        line = " ".join(words[(index + step) % len(words)] for step in range(100))
        (texts / f"part{index:02d}.txt").write_text(line[:600])
    monkeypatch.setenv("FRAMEWORK_DATA_DIRS", str(texts))
    stream = (*STREAM, f"data.files={texts}/*.txt")
    common = ("ddp", "checkpoint.format=file")
    leg(2, 6, 18, *common, tmp_path / "straight", base=stream)
    losses, previous = [], None
    for index, (ranks, batch, steps) in enumerate(LEGS):
        run_dir = tmp_path / f"leg{index}"
        resume = () if previous is None else (f"checkpoint.resume={previous}",)
        workers = ("data.num_workers=2",) if ranks == 1 else ()
        summary = leg(ranks, batch, steps, *common, run_dir, *resume, *workers, base=stream)
        assert summary["steps"] == steps and summary["world_size"] == ranks
        losses += train_losses(run_dir)
        previous = run_dir / "checkpoints" / "last.pt"
    straight = train_losses(tmp_path / "straight")
    assert len(losses) == len(straight) == 18
    torch.testing.assert_close(losses, straight, rtol=1e-5, atol=1e-6)
    expected, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "leg2")
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_the_epoch_counts_samples_seen_whatever_the_world_size(tmp_path):
    """2 ranks x 8 per rank for 4 steps (64 of the 256 samples), then 1 rank x 8 for 4 more (32):
    the epoch goes on from 0.25 to 0.375, where steps / steps per epoch would say 0.25 again."""
    first = leg(2, 8, 4, "ddp", "checkpoint.format=file", tmp_path / "two", "trainer.log_every=4")
    assert first["epochs"] == 0.25
    resume = f"checkpoint.resume={tmp_path / 'two' / 'checkpoints' / 'last.pt'}"
    second = leg(
        1, 8, 8, "ddp", "checkpoint.format=file", tmp_path / "one", resume, "trainer.log_every=2"
    )
    epochs = [e["epoch"] for e in read_metrics(tmp_path / "one") if "train/loss" in e]
    assert epochs == [0.3125, 0.375]
    assert second["epochs"] == 0.375
