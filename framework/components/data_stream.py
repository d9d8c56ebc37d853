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

A file's text is its bytes, except a .jsonl file's (one field of each line's object) and a
.parquet file's (one string column): those are read through once when the stream is made, to
count their text and keep a sparse index (JsonLinesText, ParquetText), and a window of them is
read by decoding the one chunk or row group that holds it.
"""

from __future__ import annotations

import bisect
import copy
import glob
import hashlib
import json
import os
import random
import sysconfig
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from framework.components.data import Size, Splits, TokenWindows, decode_ascii
from framework.core.data_dirs import outside_data_dirs
from framework.core.exits import ConfigError

QUESTION_MARK = 63  # bytes outside ASCII become '?', so the vocabulary is 128 as data=text's
OPEN_FILES = 16  # file descriptors a worker keeps open: windows come in near-stream order
CHUNK_BYTES = 1 << 20  # a .jsonl file's index: the first line at or after every MiB
DECODED_CHUNKS = 4  # decoded .jsonl chunks or .parquet row groups a worker keeps
PARQUET_INSTALL = "uv add pyarrow (in a clone of the framework: uv sync --group parquet)"


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
    text_field: str,
) -> Splits:
    """Text files streamed one byte per token: `files` a glob (null: the standard library's
    source). The `val_files` files first in a stable hashed order are the validation split,
    held in memory; the others are streamed for training. A .jsonl file's text is each line's
    `text_field`, a .parquet file's the column of that name."""
    corpus = standard_library_sources() if files is None else matched_files(files)
    if len(corpus) <= val_files:
        raise ValueError(
            f"data.files matches {len(corpus)} files, and data.val_files={val_files} of them "
            "are for validation: give more files or a smaller data.val_files"
        )
    held_out = stable_order(corpus)[:val_files]
    val_tokens = torch.cat([ascii_tokens(file_text(path, text_field).whole()) for path in held_out])
    training = sorted(set(corpus) - set(held_out))
    return Splits(
        train=TextStream(training, block_size, stride, shuffle_buffer, text_field),
        val=TokenWindows(val_tokens, block_size, block_size),
        decode=decode_ascii,
    )


# --- a file's text: its bytes, a .jsonl file's field, a .parquet file's column ---------------
class FileText:
    """A file's text, read by byte offset (os.pread): its bytes as they are (.txt, .py, any
    suffix but .jsonl and .parquet). Its size is the file's, by os.stat."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = os.stat(path).st_size  # nothing read yet

    def open(self) -> Any:
        return os.open(self.path, os.O_RDONLY)

    def close(self, handle: Any) -> None:
        os.close(handle)

    def read(self, handle: Any, offset: int, length: int) -> bytes:
        piece = os.pread(handle, length, offset)
        if len(piece) < length:  # os.stat counted more bytes than the file now holds
            raise ValueError(f"{self.path} shrank while the run read it (data.files)")
        return piece

    def whole(self) -> bytes:
        return self.path.read_bytes()


class ChunkedText(FileText):
    """A file whose text is decoded chunk by chunk: `starts[c]` is chunk c's first byte of
    text, `starts[-1]` the file's text size. A window's bytes come from the chunks it spans,
    decoded by the worker that reads it (WindowReader keeps the last few)."""

    starts: np.ndarray

    def read(self, handle: Any, offset: int, length: int) -> bytes:
        raise NotImplementedError  # WindowReader reads a chunked text by its chunks

    def chunk_of(self, offset: int) -> int:
        """The chunk that holds text byte `offset` (chunks with no text are passed over)."""
        return int(np.searchsorted(self.starts, offset, side="right")) - 1

    def decode(self, handle: Any, chunk: int) -> bytes:
        raise NotImplementedError

    def checked(self, chunk: int, text: bytes) -> bytes:
        if len(text) != self.starts[chunk + 1] - self.starts[chunk]:
            raise ValueError(f"{self.path} changed while the run read it (data.files)")
        return text

    def whole(self) -> bytes:
        handle = self.open()
        try:
            return b"".join(self.decode(handle, c) for c in range(len(self.starts) - 1))
        finally:
            self.close(handle)


class JsonLinesText(ChunkedText):
    """A .jsonl file: one JSON object per line (blank lines skipped), its text the string in
    `field` of each, one after another with nothing between them. Made by reading the file
    through once: every line checked, and the first line at or after each MiB of the file
    indexed (its byte and the text before it), so a window decodes about a MiB of lines."""

    def __init__(self, path: Path, field: str) -> None:
        self.path, self.field = path, field
        lines, bytes_at, text_at = [], [], []
        position = text = mark = 0
        with open(path, "rb") as file:
            for number, line in enumerate(file, 1):
                if position >= mark:
                    lines.append(number)
                    bytes_at.append(position)
                    text_at.append(text)
                    mark = position + CHUNK_BYTES
                text += len(self.line_text(line, number))
                position += len(line)
        self.first_lines = np.array(lines, dtype=np.int64)
        self.bytes_at = np.array([*bytes_at, position], dtype=np.int64)
        self.starts = np.array([*text_at, text], dtype=np.int64)
        self.size = text

    def line_text(self, line: bytes, number: int) -> bytes:
        """Line `number`'s text (UTF-8); a line that is not an object with a string in
        `field` is a mistake of data.files or data.text_field, one line naming both."""
        if not line.strip():
            return b""
        where = f"data.files: {self.path} line {number}"
        try:
            record = json.loads(line)
        except ValueError as error:  # json's own error, or bytes that are not UTF-8
            raise ConfigError(
                f"{where} is not JSON ({json_problem(error)}): a .jsonl file holds one object "
                f"per line, its text in the field data.text_field={self.field}"
            ) from None
        if not isinstance(record, dict) or self.field not in record:
            raise ConfigError(
                f"{where} has no field {self.field!r} (data.text_field={self.field}): give "
                "the field that holds each line's text"
            )
        value = record[self.field]
        if not isinstance(value, str):
            raise ConfigError(
                f"{where}: its field {self.field!r} (data.text_field={self.field}) is "
                f"{json.dumps(value)[:40]}, not a string: give the field that holds the text"
            )
        return value.encode("utf-8", "surrogatepass")

    def decode(self, handle: Any, chunk: int) -> bytes:
        start, end = self.bytes_at[chunk], self.bytes_at[chunk + 1]
        raw = os.pread(handle, int(end - start), int(start))
        number = int(self.first_lines[chunk])
        lines = raw.split(b"\n")  # as the file's lines were counted: a raw \r is no line's end
        texts = [self.line_text(line, number + i) for i, line in enumerate(lines)]
        return self.checked(chunk, b"".join(texts))


def json_problem(error: ValueError) -> str:
    """What json.loads found wrong, with the column (the line is said already)."""
    if not isinstance(error, json.JSONDecodeError):
        return "not UTF-8"
    at = "" if error.msg.endswith(" at") else " at"
    return f"{error.msg}{at} column {error.pos + 1}"


def parquet_module(path: Path) -> Any:
    """pyarrow.parquet, or one line naming how to install it (an optional dependency)."""
    try:
        import pyarrow.parquet
    except ImportError:
        raise ConfigError(
            f"data.files matches {path}, and reading a .parquet file needs pyarrow, which is "
            f"not installed: {PARQUET_INSTALL}"
        ) from None
    return pyarrow.parquet


class ParquetText(ChunkedText):
    """A .parquet file: its text the strings of the column `field`, row after row, with
    nothing between them; a chunk is a row group. Made by reading the column through once,
    one row group at a time: its type checked (strings, no nulls) and each group's text
    counted."""

    def __init__(self, path: Path, field: str) -> None:
        self.path, self.field = path, field
        parquet = parquet_module(path)
        import pyarrow as pa
        import pyarrow.compute as pc

        where = f"data.files: {path}"
        try:
            file = parquet.ParquetFile(path)
        except (pa.ArrowException, OSError) as error:
            raise ConfigError(f"{where} is not a Parquet file ({error})") from None
        schema = file.schema_arrow
        if field not in schema.names:
            raise ConfigError(
                f"{where} has no column {field!r} (data.text_field={field}): its columns are "
                f"{', '.join(schema.names)}"
            )
        kind = schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ConfigError(
                f"{where}: its column {field!r} (data.text_field={field}) holds {kind}, not "
                "strings: give the column that holds the text"
            )
        sizes = []
        for group in range(file.num_row_groups):
            column = file.read_row_group(group, columns=[field]).column(0)
            if column.null_count:
                raise ConfigError(
                    f"{where}: its column {field!r} (data.text_field={field}) holds "
                    f"{column.null_count} nulls in row group {group}: every row needs a text"
                )
            sizes.append(pc.sum(pc.binary_length(column)).as_py() or 0)
        self.starts = np.array([0, *accumulate(sizes)], dtype=np.int64)
        self.size = int(self.starts[-1])

    def open(self) -> Any:
        return parquet_module(self.path).ParquetFile(self.path)

    def close(self, handle: Any) -> None:
        handle.close()

    def decode(self, handle: Any, chunk: int) -> bytes:
        column = handle.read_row_group(chunk, columns=[self.field]).column(0).combine_chunks()
        return self.checked(chunk, arrow_string_bytes(column))


def arrow_string_bytes(array: Any) -> bytes:
    """The UTF-8 bytes of an Arrow string array's values, one after another: the slice of its
    data buffer between its first and last offsets."""
    import pyarrow as pa

    if len(array) == 0:
        return b""
    _, offsets, data = array.buffers()
    width = np.int64 if pa.types.is_large_string(array.type) else np.int32
    bounds = np.frombuffer(offsets, dtype=width)[array.offset : array.offset + len(array) + 1]
    start, end = int(bounds[0]), int(bounds[-1])
    return b"" if end == start else bytes(memoryview(data)[start:end])


def file_text(path: Path, text_field: str) -> FileText:
    """The text of one file of data.files, by its suffix."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return JsonLinesText(path, text_field)
    if suffix == ".parquet":
        return ParquetText(path, text_field)
    return FileText(path)


class TextStream(IterableDataset):
    """Training windows streamed from files; `for_rank` makes one rank's shard of it, whose
    set_epoch(epoch, start) the training loop calls as it calls a sampler's."""

    def __init__(
        self,
        files: Sequence[Path],
        block_size: int,
        stride: int,
        shuffle_buffer: int,
        text_field: str = "text",
    ) -> None:
        self.files = tuple(files)
        self.texts = tuple(file_text(Path(path), text_field) for path in self.files)
        self.sizes = tuple(text.size for text in self.texts)
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

    def identity(self) -> dict[str, Any]:
        """The files and their text sizes: what a position in the stream counts windows of."""
        return {"files": [str(path) for path in self.files], "sizes": list(self.sizes)}

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
        """Windows in an epoch: the files' text sizes decide (os.stat's, but for .jsonl and
        .parquet files)."""
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
        self.texts = [stream.texts[index] for index in order]
        sizes = [stream.sizes[index] for index in order]
        self.starts = [0, *accumulate(sizes)]  # each file's first byte in the concatenation
        self.block_size, self.stride = stream.block_size, stream.stride
        self.open: dict[int, Any] = {}  # file index -> open handle, oldest first
        self.decoded: OrderedDict[tuple[int, int], bytes] = OrderedDict()  # (file, chunk)

    def __enter__(self) -> WindowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        for index, handle in self.open.items():
            self.texts[index].close(handle)
        self.open.clear()
        self.decoded.clear()

    def handle(self, index: int) -> Any:
        if index not in self.open:
            if len(self.open) >= OPEN_FILES:
                oldest = next(iter(self.open))
                self.texts[oldest].close(self.open.pop(oldest))
            self.open[index] = self.texts[index].open()
        return self.open[index]

    def chunk(self, index: int, chunk: int) -> bytes:
        """Chunk `chunk` of file `index`'s text, decoded (the last few are kept)."""
        key = (index, chunk)
        if key in self.decoded:
            self.decoded.move_to_end(key)
        else:
            text = self.texts[index]
            assert isinstance(text, ChunkedText)
            self.decoded[key] = text.decode(self.handle(index), chunk)
            if len(self.decoded) > DECODED_CHUNKS:
                self.decoded.popitem(last=False)
        return self.decoded[key]

    def read(self, index: int, offset: int, length: int) -> bytes:
        """`length` bytes of file `index`'s text from `offset`."""
        text = self.texts[index]
        if not isinstance(text, ChunkedText):
            return text.read(self.handle(index), offset, length)
        pieces = []
        while length > 0:
            chunk = text.chunk_of(offset)
            start = offset - int(text.starts[chunk])
            piece = self.chunk(index, chunk)[start : start + length]
            pieces.append(piece)
            offset, length = offset + len(piece), length - len(piece)
        return b"".join(pieces)

    def tokens(self, number: int) -> torch.Tensor:
        offset, wanted = number * self.stride, self.block_size + 1
        index = bisect.bisect_right(self.starts, offset) - 1
        pieces = []
        while wanted > 0:
            length = min(wanted, self.starts[index + 1] - offset)
            pieces.append(self.read(index, offset - self.starts[index], length))
            wanted, offset, index = wanted - length, offset + length, index + 1
        return ascii_tokens(b"".join(pieces))
