"""Text files streamed from disk (data=text_stream): data larger than memory, read in windows,
resumed exactly mid-epoch on any number of ranks and DataLoader workers (docs/data.md).

The epoch's global order of windows depends on the seed, the epoch and the files alone, never on
the world size: the files' order is shuffled per epoch, their concatenation cut into windows of
block_size + 1 tokens every `stride` tokens, and the window numbers passed through a shuffle
buffer. The buffer shuffles numbers, not text, so the order is known without reading a byte;
each window's bytes are then read (os.pread) by the one rank and the one worker that keep it.
Rank r of W keeps global positions r, r + W, ... below the last whole global batch, starting
after the `start` windows a resumed run had consumed (ResumableSampler's rule for map-style
data), and worker k of K keeps that rank's batches k, k + K, ..., which the DataLoader's
round-robin hands out in order: the same batches for any num_workers.
"""

from __future__ import annotations

import bisect
import copy
import glob
import hashlib
import os
import random
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from framework.components.data import Size, Splits, TokenWindows, decode_ascii
from framework.core.data_dirs import outside_data_dirs

QUESTION_MARK = 63  # bytes outside ASCII become '?', so the vocabulary is 128 as data=text's
OPEN_FILES = 16  # file descriptors a worker keeps open: windows come in near-stream order


def ascii_tokens(raw: bytes) -> torch.Tensor:
    """One token per byte; bytes >= 128 (UTF-8's multi-byte characters) become '?'."""
    values = np.frombuffer(raw, dtype=np.uint8)
    return torch.from_numpy(np.where(values < 128, values, QUESTION_MARK).astype(np.int64))


def standard_library_sources() -> list[Path]:
    """The default corpus: the .py files of this Python's standard library (no site-packages,
    no __pycache__), which ships with every Python and needs no download."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        path
        for path in root.rglob("*.py")
        if "site-packages" not in path.parts and "__pycache__" not in path.parts
    )


def matched_files(pattern: str) -> list[Path]:
    """The regular files a glob matches (** reaches into folders), sorted; each one's real
    path (a link followed) must lie in the folders data.files may read."""
    paths = sorted(Path(name) for name in glob.glob(pattern, recursive=True))
    files = [path for path in paths if path.is_file()]
    for path in files:
        real = path.resolve()
        if problem := outside_data_dirs(str(real), Path.cwd(), os.environ):
            raise ValueError(f"data.files={pattern}: {path} (a link to {real}) {problem}")
    if not files:
        raise ValueError(f"data.files={pattern} matches no file: give a glob of text files")
    return files


def stable_order(files: Sequence[Path]) -> list[Path]:
    """The files in the order of a hash of their path relative to the corpus' common folder:
    the same on every machine that holds the same corpus, unlike the hash() of a str."""
    root = os.path.commonpath([str(path) for path in files]) if len(files) > 1 else ""

    def key(path: Path) -> str:
        return hashlib.sha256(os.path.relpath(path, root or path.parent).encode()).hexdigest()

    return sorted(files, key=key)


def text_stream(
    files: str | None,
    block_size: Size,
    stride: Size,
    val_files: Size,
    shuffle_buffer: Size,
) -> Splits:
    """Text files streamed one byte per token: `files` a glob (null: the standard library's
    source). The `val_files` files first in a stable hashed order are the validation split,
    held in memory; the others are streamed for training."""
    corpus = standard_library_sources() if files is None else matched_files(files)
    if len(corpus) <= val_files:
        raise ValueError(
            f"data.files matches {len(corpus)} files, and data.val_files={val_files} of them "
            "are for validation: give more files or a smaller data.val_files"
        )
    held_out = stable_order(corpus)[:val_files]
    val_tokens = torch.cat([ascii_tokens(path.read_bytes()) for path in held_out])
    training = sorted(set(corpus) - set(held_out))
    return Splits(
        train=TextStream(training, block_size, stride, shuffle_buffer),
        val=TokenWindows(val_tokens, block_size, block_size),
        decode=decode_ascii,
    )


class TextStream(IterableDataset):
    """Training windows streamed from files; `for_rank` makes one rank's shard of it, whose
    set_epoch(epoch, start) the training loop calls as it calls a sampler's."""

    def __init__(
        self, files: Sequence[Path], block_size: int, stride: int, shuffle_buffer: int
    ) -> None:
        self.files = tuple(files)
        self.sizes = tuple(os.stat(path).st_size for path in self.files)  # nothing read yet
        self.block_size, self.stride, self.shuffle_buffer = block_size, stride, shuffle_buffer
        self.rank, self.world_size, self.batch_size, self.seed, self.shuffle = 0, 1, 1, 0, False
        self.epoch = self.start = 0

    def for_rank(
        self, rank: int, world_size: int, batch_size: int, seed: int, shuffle: bool
    ) -> TextStream:
        shard = copy.copy(self)
        shard.rank, shard.world_size, shard.batch_size = rank, world_size, batch_size
        shard.seed, shard.shuffle = seed, shuffle
        return shard

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """`start`: windows of this epoch's global order consumed by all ranks together."""
        self.epoch, self.start = epoch, start

    # --- the epoch's global order: the same on any number of ranks -------------------------
    def file_order(self) -> list[int]:
        order = list(range(len(self.files)))
        if self.shuffle:
            random.Random(f"files:{self.seed}:{self.epoch}").shuffle(order)
        return order

    def windows(self) -> int:
        """Windows in an epoch: the files' sizes decide, read by os.stat alone."""
        return max(0, (sum(self.sizes) - self.block_size - 1) // self.stride + 1)

    def used(self) -> int:
        """Windows an epoch uses: whole global batches (batch_size on every rank)."""
        global_batch = self.batch_size * self.world_size
        return self.windows() // global_batch * global_batch

    def global_order(self) -> Iterator[int]:
        """The epoch's window numbers (window w starts at token w * stride of the epoch's
        concatenation), through the shuffle buffer."""
        numbers = range(self.windows())
        if not self.shuffle:
            return iter(numbers)
        return shuffled(numbers, self.shuffle_buffer, random.Random(f"{self.seed}:{self.epoch}"))

    # --- this rank's and this worker's share ----------------------------------------------
    def __len__(self) -> int:
        return len(range(self.start + self.rank, self.used(), self.world_size))

    def kept(self, worker: int, workers: int) -> Iterator[int]:
        """The window numbers this rank's worker yields, in order."""
        used = self.used()
        for position, number in enumerate(self.global_order()):
            if position >= used:
                return
            local = position - self.start - self.rank
            if local < 0 or local % self.world_size:
                continue
            if (local // self.world_size // self.batch_size) % workers == worker:
                yield number

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        with WindowReader(self) as reader:
            for number in self.kept(worker, workers):
                yield self.window(reader, number)

    def window(self, reader: WindowReader, number: int) -> Any:
        """Window `number`'s sample, read by the one rank and worker that keep it."""
        return self.sample(reader.tokens(number))

    def sample(self, tokens: torch.Tensor) -> Any:
        """A window's sample: (inputs, next tokens), as data=text's. A user's own stream
        subclasses this (a transform of its own)."""
        return tokens[:-1], tokens[1:]


def shuffled(numbers: Iterable[int], size: int, rng: random.Random) -> Iterator[int]:
    """A shuffle buffer of `size`: each incoming number takes the place of one drawn out."""
    buffer: list[int] = []
    for number in numbers:
        if len(buffer) < size:
            buffer.append(number)
            continue
        slot = rng.randrange(size)
        yield buffer[slot]
        buffer[slot] = number
    rng.shuffle(buffer)
    yield from buffer


class WindowReader:
    """Reads window w of the epoch's concatenation from the files it spans."""

    def __init__(self, stream: TextStream) -> None:
        order = stream.file_order()
        self.paths = [stream.files[index] for index in order]
        sizes = [stream.sizes[index] for index in order]
        self.starts = [0, *accumulate(sizes)]  # each file's first byte in the concatenation
        self.block_size, self.stride = stream.block_size, stream.stride
        self.open: dict[int, int] = {}  # file index -> descriptor, oldest first

    def __enter__(self) -> WindowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        for descriptor in self.open.values():
            os.close(descriptor)
        self.open.clear()

    def descriptor(self, index: int) -> int:
        if index not in self.open:
            if len(self.open) >= OPEN_FILES:
                os.close(self.open.pop(next(iter(self.open))))
            self.open[index] = os.open(self.paths[index], os.O_RDONLY)
        return self.open[index]

    def tokens(self, number: int) -> torch.Tensor:
        offset, wanted = number * self.stride, self.block_size + 1
        index = bisect.bisect_right(self.starts, offset) - 1
        pieces = []
        while wanted > 0:
            length = min(wanted, self.starts[index + 1] - offset)
            piece = os.pread(self.descriptor(index), length, offset - self.starts[index])
            if len(piece) < length:  # os.stat counted more bytes than the file now holds
                raise ValueError(f"{self.paths[index]} shrank while the run read it (data.files)")
            pieces.append(piece)
            wanted, offset, index = wanted - length, offset + length, index + 1
        return ascii_tokens(b"".join(pieces))
