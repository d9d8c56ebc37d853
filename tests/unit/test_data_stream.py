"""data=text_stream: the streamed split's windows, sharded over ranks and DataLoader workers,
each read once per epoch, in the same order for any num_workers, resumed at a global position."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from framework.components import data_stream
from framework.components.data import train_loader
from framework.components.data_stream import TextStream, WindowReader, file_text, text_stream
from framework.core.data_dirs import outside_data_dirs
from framework.core.exits import ConfigError
from framework.core.launch_context import DistEnv

BLOCK, BATCH = 8, 3  # tokens per window; windows per rank's batch


class WindowNumbers(TextStream):
    """The stream's own sharding, with each window's number as its sample (its id: it starts
    at token number * stride of the epoch's concatenation)."""

    def window(self, reader: WindowReader, number: int) -> int:
        return number


def corpus(folder: Path, files: int = 9) -> list[Path]:
    rng = random.Random(0)
    paths = []
    for index in range(files):
        path = folder / f"part{index}.txt"
        path.write_bytes(bytes(rng.randrange(32, 127) for _ in range(rng.randrange(40, 200))))
        paths.append(path)
    return paths


def rank_batches(
    stream: TextStream, rank: int, world_size: int, workers: int, epoch: int = 0, start: int = 0
) -> list[list[int]]:
    """What rank `rank`'s training loader yields in an epoch, from global position `start`."""
    data = {"batch_size": BATCH, "shuffle": True, "num_workers": workers, "drop_last": True}
    data |= {"pin_memory": False, "persistent_workers": False}
    env = DistEnv(rank=rank, world_size=world_size, local_world_size=world_size)
    loader, position = train_loader(stream, data, env, seed=7, device=torch.device("cpu"))
    position.set_epoch(epoch, start=start)
    batches = [batch.tolist() for batch in loader]
    assert len(batches) == len(loader)
    return batches


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_window_is_read_once_per_epoch_in_the_same_order_for_any_workers(
    tmp_path, world_size
):
    stream = WindowNumbers(corpus(tmp_path), BLOCK, BLOCK, shuffle_buffer=16)
    reference = stream.for_rank(0, 1, 1, seed=7, shuffle=True)
    global_batch = BATCH * world_size
    for epoch in (0, 1):
        reference.set_epoch(epoch)
        order = list(reference.global_order())
        assert sorted(order) == list(range(stream.windows()))
        used = len(order) // global_batch * global_batch
        by_workers = {
            workers: [
                rank_batches(stream, r, world_size, workers, epoch) for r in range(world_size)
            ]
            for workers in (0, 2)
        }
        assert by_workers[0] == by_workers[2]  # same batches, same order, same ranks
        ranks = by_workers[0]
        steps = used // global_batch
        assert all(len(batches) == steps for batches in ranks)
        seen = [n for step in range(steps) for batches in ranks for n in batches[step]]
        assert sorted(seen) == sorted(order[:used])  # each window of the epoch exactly once
        for step in range(steps):  # step s reads global batch s, whatever the world size
            at_step = {n for batches in ranks for n in batches[step]}
            assert at_step == set(order[step * global_batch : (step + 1) * global_batch])
    reference.set_epoch(0)
    first = list(reference.global_order())
    reference.set_epoch(1)
    assert list(reference.global_order()) != first  # shuffled again each epoch


@pytest.mark.parametrize(("world_size", "workers"), [(1, 0), (2, 2), (3, 0), (3, 2)])
def test_a_resumed_epoch_reads_exactly_the_rest(tmp_path, world_size, workers):
    """Two global batches consumed (on any world size): the rest of each rank's shard."""
    stream = WindowNumbers(corpus(tmp_path), BLOCK, BLOCK, shuffle_buffer=16)
    consumed = 2 * BATCH * world_size
    for rank in range(world_size):
        whole = rank_batches(stream, rank, world_size, workers, epoch=1)
        resumed = rank_batches(stream, rank, world_size, workers, epoch=1, start=consumed)
        assert resumed == whole[2:]


def assert_windows_of(stream: TextStream, text: bytes) -> None:
    """The stream (block 4, stride 4, unshuffled) yields `text`'s windows in order, bytes >= 128
    read as '?'."""
    expected = torch.tensor([b if b < 128 else 63 for b in text])
    windows = list(stream)
    assert len(windows) == len(stream) == (len(text) - 5) // 4 + 1
    for number, (inputs, targets) in enumerate(windows):
        assert torch.equal(inputs, expected[number * 4 : number * 4 + 4])
        assert torch.equal(targets, expected[number * 4 + 1 : number * 4 + 5])


def test_a_window_is_the_bytes_of_the_files_it_spans_one_token_per_byte(tmp_path, monkeypatch):
    """Unshuffled, the files in sorted order, their bytes one after another; bytes >= 128
    become '?' (63)."""
    monkeypatch.setenv("FRAMEWORK_DATA_DIRS", str(tmp_path))
    (tmp_path / "a.txt").write_bytes(b"abcdef")
    (tmp_path / "b.txt").write_bytes("gh\u00e9ijklmnopqrstuvwxyz".encode())
    (tmp_path / "c.txt").write_bytes(b"0123456789")
    splits = text_stream(str(tmp_path / "*.txt"), 4, 4, 1, shuffle_buffer=2, text_field="text")
    stream = splits.train.for_rank(0, 1, 1, seed=0, shuffle=False)
    kept = sorted(path.name for path in stream.files)
    text = b"".join((tmp_path / name).read_bytes() for name in kept)
    assert_windows_of(stream, text)


def test_a_window_of_jsonl_and_parquet_files_is_their_texts_bytes_in_order(tmp_path, monkeypatch):
    """A .jsonl file's text is one field of each line (blank lines skipped), a .parquet file's
    one string column, the texts one after another as UTF-8, one token per byte. Indexed every
    64 bytes here and written in row groups of 6 rows, so windows span chunks, row groups and
    files, and a reader decodes chunks again after it dropped them."""
    monkeypatch.setattr(data_stream, "CHUNK_BYTES", 64)
    monkeypatch.setattr(data_stream, "DECODED_CHUNKS", 2)
    texts = [f"text {i} caf\u00e9; " * (i % 3 + 1) for i in range(40)]
    lines = [json.dumps({"id": i, "body": text}) for i, text in enumerate(texts[:20])]
    (tmp_path / "a.jsonl").write_text("\n".join([*lines[:5], "", *lines[5:]]) + "\n")
    table = pa.table({"body": texts[20:], "id": list(range(20, 40))})
    pq.write_table(table, tmp_path / "b.parquet", row_group_size=6)
    files = [tmp_path / "a.jsonl", tmp_path / "b.parquet"]
    stream = TextStream(files, 4, 4, 2, text_field="body").for_rank(0, 1, 1, seed=0, shuffle=False)
    jsonl, parquet = stream.texts
    assert len(jsonl.starts) > 10 and len(parquet.starts) == 5  # chunks; 4 row groups
    assert jsonl.whole() == "".join(texts[:20]).encode()
    assert parquet.whole() == "".join(texts[20:]).encode()
    text = "".join(texts).encode()
    assert_windows_of(stream, text)


def test_a_parquet_file_without_pyarrow_is_one_line_naming_the_install(tmp_path, monkeypatch):
    pq.write_table(pa.table({"text": ["some text"]}), tmp_path / "b.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if not installed
    with pytest.raises(
        ConfigError, match=r"b.parquet, and reading .* needs pyarrow.*uv add pyarrow"
    ):
        file_text(tmp_path / "b.parquet", "text")


@pytest.mark.parametrize("files", [".ssh/*", ".ssh/id_rsa", "*/.aws/credentials", "texts/.*"])
def test_hidden_files_under_the_working_directory_are_no_data(tmp_path, files):
    """`train` run in a home directory: its .ssh, .aws, .env are under the working directory."""
    for secret in (".ssh/id_rsa", "me/.aws/credentials", "texts/.env"):
        (tmp_path / secret).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / secret).write_text("not for the run dir")
    problem = outside_data_dirs(files, tmp_path, {})
    assert problem is not None and problem.startswith("names a hidden file or folder")
    assert outside_data_dirs("texts/*", tmp_path, {}) is None
    hidden_corpus = {"FRAMEWORK_DATA_DIRS": str(tmp_path / ".ssh")}  # named by the environment
    assert outside_data_dirs(str(tmp_path / ".ssh" / "*"), tmp_path / "me", hidden_corpus) is None


def test_a_link_out_of_the_data_dirs_is_refused_when_the_files_are_matched(tmp_path, monkeypatch):
    """The glob lies in an allowed folder, one match is a link to a file outside it."""
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "key").write_text("not for the run dir")
    texts = tmp_path / "texts"
    texts.mkdir()
    for index in range(3):
        (texts / f"{index}.txt").write_text("some text " * 10)
    (texts / "3.txt").symlink_to(tmp_path / "secret" / "key")
    monkeypatch.setenv("FRAMEWORK_DATA_DIRS", str(texts))
    with pytest.raises(
        ValueError, match=r"3.txt \(a link to .*secret/key\) lies outside the working directory"
    ):
        text_stream(str(texts / "*.txt"), 4, 4, 1, shuffle_buffer=2, text_field="text")


class Letters(TextStream):
    """A user's own stream: its own transform (a dict of the window's tokens, upper-cased)."""

    def sample(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        upper = torch.where((tokens >= 97) & (tokens <= 122), tokens - 32, tokens)
        return {"inputs": upper[:-1], "targets": upper[1:]}


def count_batch(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Its own collate: stacked, with the batch's size."""
    return {
        "inputs": torch.stack([s["inputs"] for s in samples]),
        "size": torch.tensor(len(samples)),
    }


def test_a_users_own_stream_with_its_own_transform_and_collate_is_sharded_alike(tmp_path):
    files = corpus(tmp_path)
    own = Letters(files, BLOCK, BLOCK, shuffle_buffer=16)
    numbers = WindowNumbers(files, BLOCK, BLOCK, shuffle_buffer=16)
    data = {"batch_size": BATCH, "shuffle": True, "num_workers": 2, "drop_last": True}
    data |= {"pin_memory": False, "persistent_workers": False}
    env = DistEnv(rank=1, world_size=2, local_world_size=2)
    cpu = torch.device("cpu")
    loader, position = train_loader(own, data, env, seed=7, device=cpu, collate_fn=count_batch)
    position.set_epoch(0)
    batches = list(loader)
    expected = rank_batches(numbers, rank=1, world_size=2, workers=0)
    assert len(batches) == len(expected) > 0
    with WindowReader(numbers.for_rank(1, 2, BATCH, 7, True)) as reader:
        for batch, windows in zip(batches, expected, strict=True):
            assert int(batch["size"]) == BATCH
            tokens = torch.stack([reader.tokens(number)[:-1] for number in windows])
            lower = (tokens >= 97) & (tokens <= 122)
            assert torch.equal(batch["inputs"], torch.where(lower, tokens - 32, tokens))
