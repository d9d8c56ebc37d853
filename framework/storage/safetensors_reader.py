"""A safetensors file read with plain reads (pread), never mapped: what a process holds of it is
what it asked for. safetensors' own safe_open maps the whole file copy-on-write (a private,
writable mapping): under a per-process memory limit on data (`ulimit -d`, RLIMIT_DATA; the
scale tests' cap, tests/faults.py) that mapping is charged in full to every rank that opens the
file, before one byte is read, so a rank of a sharded model could not even read the names of
a file larger than its room (tests/integration/test_memory_cap.py).

The format (https://huggingface.co/docs/safetensors): 8 bytes, the header's length n (little
endian); n bytes of JSON, each tensor's name -> {dtype, shape, data_offsets: [begin, end]} (bytes
after the header) and an optional "__metadata__" of strings; then the tensors' bytes, row-major,
little endian. Every entry is checked against the file's size before anything is read."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# safetensors' dtype names (its format's header) -> torch's.
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
HEADER_LIMIT = 100_000_000  # safetensors' own limit on the header's length


class NotSafetensors(ValueError):
    """The file is not a safetensors file this reader can read (the message says why)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: its dtype's name (the header's), shape, and bytes' place in the
    file (absolute offsets)."""

    dtype_name: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def dtype(self) -> torch.dtype | None:
        """torch's dtype, or None for one this framework does not load (such as F8_E4M3)."""
        return DTYPES.get(self.dtype_name)


def read_header(path: Path) -> dict[str, Entry]:
    """The file's tensors by name, sorted (as safe_open's keys()); NotSafetensors when it is
    not one."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        prefix = file.read(8)
        if len(prefix) < 8:
            raise NotSafetensors("shorter than the 8 bytes of a header's length")
        length = int.from_bytes(prefix, "little")
        if not 2 <= length <= min(HEADER_LIMIT, size - 8):
            raise NotSafetensors(f"a header of {length} bytes in a file of {size}")
        header = file.read(length)
    if _nesting(header) > MAX_NESTING:
        raise NotSafetensors(f"its header nests deeper than the format's {MAX_NESTING} levels")
    try:
        table = json.loads(header.decode("utf-8"), object_pairs_hook=_without_repeats)
    except NotSafetensors:
        raise
    except (UnicodeDecodeError, ValueError):
        raise NotSafetensors("its header is not JSON") from None
    if not isinstance(table, dict):
        raise NotSafetensors("its header is not a JSON object")
    metadata = table.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise NotSafetensors("its __metadata__ is not an object of strings")
    start = 8 + length
    entries = {name: _entry(name, fields, start, size) for name, fields in table.items()}
    _check_contiguous(entries, start, size)
    return dict(sorted(entries.items()))


# The format's header: {name: {"dtype", "shape": [...], "data_offsets": [...]}} and
# "__metadata__": {str: str}. Deeper nesting is refused before json builds it (a crafted
# header could otherwise exhaust the recursion limit or the memory while being parsed).
MAX_NESTING = 3
STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _nesting(header: bytes) -> int:
    """How deep the header's arrays and objects nest, strings left out."""
    plain = np.frombuffer(STRINGS.sub(b'""', header), dtype=np.uint8)
    opens = (plain == ord("[")) | (plain == ord("{"))
    closes = (plain == ord("]")) | (plain == ord("}"))
    depth = np.cumsum(opens.astype(np.int64) - closes.astype(np.int64))
    return int(depth.max()) if len(depth) else 0


def _without_repeats(pairs: list[tuple[str, object]]) -> dict[str, object]:
    table = dict(pairs)
    if len(table) != len(pairs):
        raise NotSafetensors("its header names a tensor twice")
    return table


def _check_contiguous(entries: dict[str, Entry], start: int, size: int) -> None:
    """The tensors' bytes one after another from the header's end to the file's, as
    safetensors writes and its own reader requires: no two tensors share a byte."""
    at = start
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != at:
            raise NotSafetensors(f"its entry {name!r} does not start where the one before ends")
        at = entry.end
    if at != size:
        raise NotSafetensors("its tensors do not end at the file's end")


def _entry(name: str, fields: object, start: int, size: int) -> Entry:
    if not isinstance(fields, dict):
        raise NotSafetensors(f"its entry {name!r} is not a JSON object")
    dtype, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
    if not isinstance(dtype, str):
        raise NotSafetensors(f"its entry {name!r} has no dtype")
    if not _ints(shape):
        raise NotSafetensors(f"its entry {name!r} has no shape of non-negative integers")
    if not _ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise NotSafetensors(f"its entry {name!r} has no data_offsets [begin, end]")
    begin, end = start + offsets[0], start + offsets[1]
    if end > size:
        raise NotSafetensors(f"its entry {name!r} ends past the file's end")
    if dtype in DTYPES:
        expected = math.prod(shape) * _itemsize(DTYPES[dtype])
        if end - begin != expected:
            raise NotSafetensors(
                f"its entry {name!r} holds {end - begin} bytes, not the {expected} of its "
                "dtype and shape"
            )
    return Entry(dtype, tuple(shape), begin, end)


def _ints(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) and item >= 0 for item in value
    )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def read_tensor(path: Path, entry: Entry) -> torch.Tensor:
    """The whole tensor, read into memory of its own."""
    return read_rows(path, entry, 0, 0, entry.shape[0] if entry.shape else 1)


def read_rows(path: Path, entry: Entry, dim: int, start: int, stop: int) -> torch.Tensor:
    """Indices start:stop of dimension `dim` (0 or 1) of the tensor: only those bytes are read
    (dimension 1: a run of bytes from each row)."""
    dtype = entry.dtype
    assert dtype is not None, entry.dtype_name  # entries() refused the others first
    shape = list(entry.shape)
    if not shape:  # a scalar: its bytes whole
        out = torch.empty((), dtype=dtype)
        with open(path, "rb") as file:
            _read_into(file.fileno(), entry.begin, out)
        return out
    if not 0 <= start <= stop <= shape[dim]:
        raise IndexError(f"{start}:{stop} of dimension {dim} of shape {entry.shape}")
    itemsize = _itemsize(dtype)
    shape[dim] = stop - start
    out = torch.empty(shape, dtype=dtype)
    if out.numel() == 0:
        return out
    with open(path, "rb") as file:
        fd = file.fileno()
        if dim == 0:
            row = math.prod(entry.shape[1:]) * itemsize
            _read_into(fd, entry.begin + start * row, out)
        else:
            inner = math.prod(entry.shape[2:]) * itemsize  # bytes of one index of dimension 1
            for index in range(entry.shape[0]):
                offset = entry.begin + (index * entry.shape[1] + start) * inner
                _read_into(fd, offset, out[index])
    return out


def _read_into(fd: int, offset: int, out: torch.Tensor) -> None:
    """The bytes at `offset` into `out` (contiguous), in the host's byte order (little endian:
    no other is supported)."""
    if sys.byteorder != "little":
        raise NotSafetensors("this host is big endian; safetensors files are little endian")
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        read = os.preadv(fd, [view[done:]], offset + done)
        if read == 0:
            raise NotSafetensors("it ended before a tensor's last byte")
        done += read
