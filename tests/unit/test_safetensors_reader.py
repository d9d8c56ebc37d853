"""framework/storage/safetensors_reader.py: a safetensors file read with plain reads, only the
bytes asked for, never mapped. What it reads equals safetensors' own reading of the same file
(every dtype the framework loads, rows of dimension 0 and 1); a file that is no safetensors
file, or whose header points outside it, is refused before a byte of a tensor is read."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from framework.core.exits import CheckpointError
from framework.storage.safetensors_reader import NotSafetensors, read_header, read_rows, read_tensor
from framework.storage.weights_file import open_weights


def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "weight": torch.randn(7, 5, 3, generator=generator),
        "half": torch.randn(4, 9, generator=generator).bfloat16(),
        "scale": torch.tensor(3.5),
        "mask": torch.rand(6, generator=generator) > 0.5,
        "empty": torch.zeros(0, 4),
        "ids": torch.randint(-9, 9, (5, 6), generator=generator),
    }


def test_whole_tensors_and_rows_of_either_dimension_are_safetensors_own(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(tensors(), path, metadata={"format": "pt"})
    header = read_header(path)
    assert list(header) == sorted(tensors())  # as safe_open's keys()
    with safe_open(str(path), framework="pt") as opened:
        for name in header:
            whole = opened.get_tensor(name)
            assert torch.equal(read_tensor(path, header[name]), whole), name
            assert read_tensor(path, header[name]).dtype == whole.dtype
            if whole.dim() >= 1:
                for start, stop in ((0, whole.shape[0]), (1, 3), (2, 2)):
                    if stop <= whole.shape[0]:
                        part = read_rows(path, header[name], 0, start, stop)
                        assert torch.equal(part, opened.get_slice(name)[start:stop]), name
            if whole.dim() >= 2:
                for start, stop in ((0, whole.shape[1]), (1, 3)):
                    part = read_rows(path, header[name], 1, start, stop)
                    assert torch.equal(part, whole[:, start:stop]), name
                    assert part.is_contiguous()


def test_reading_maps_nothing_of_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"weight": torch.ones(64, 64)}, path)
    header = read_header(path)
    read_rows(path, header["weight"], 0, 0, 16)
    with open("/proc/self/maps") as maps:
        assert str(path) not in maps.read()
    with safe_open(str(path), framework="pt"), open("/proc/self/maps") as maps:
        assert str(path) in maps.read()  # what safetensors' own reader does (the control)


def header_file(path, header: object, data: bytes = b"") -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"PK\x03\x04 a zip, not safetensors", "a header of"),
        (b"\x02\x00", "shorter than the 8 bytes"),
        ({"weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, "ends past"),
        ({"weight": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "8 bytes, not the 12"),
        ({"weight": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 0]}}, "no shape"),
        ({"weight": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, "no data_offsets"),
        ({"weight": [1, 2]}, "is not a JSON object"),
        ([1, 2], "is not a JSON object"),
    ],
)
def test_a_file_that_is_no_safetensors_file_is_refused_in_one_line(tmp_path, content, said):
    path = tmp_path / "model.safetensors"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        header_file(path, content, bytes(8))
    with pytest.raises(NotSafetensors, match=said):
        read_header(path)
    with pytest.raises(CheckpointError, match="is no safetensors file") as refused:
        open_weights(path)
    assert "\n" not in str(refused.value)


F32_2 = {"dtype": "F32", "shape": [2]}  # 8 bytes


@pytest.mark.parametrize(
    ("header", "data", "said"),
    [
        # Refused by safetensors' own reader too; read here, they would alias or skip bytes.
        (
            b'{"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "x": {"dtype": "F32", '
            b'"shape": [2], "data_offsets": [8, 16]}}',
            bytes(16),
            "names a tensor twice",
        ),
        (
            json.dumps(
                {"x": {**F32_2, "data_offsets": [0, 8]}, "y": {**F32_2, "data_offsets": [4, 12]}}
            ).encode(),
            bytes(12),
            "does not start where the one before ends",
        ),
        (
            json.dumps({"x": {**F32_2, "data_offsets": [4, 12]}}).encode(),
            bytes(12),
            "does not start where",
        ),
        (
            json.dumps({"x": {**F32_2, "data_offsets": [0, 8]}}).encode(),
            bytes(12),
            "do not end at the file's end",
        ),
        (
            json.dumps({"__metadata__": {"format": ["pt"]}}).encode(),
            b"",
            "__metadata__ is not an object of strings",
        ),
        # Nesting json would build (and recurse into) before anything is checked.
        (
            b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            b"",
            "nests deeper than the format's 3",
        ),
    ],
    ids=["a name twice", "overlapping", "a gap", "bytes left over", "metadata", "deep nesting"],
)
def test_a_header_safetensors_itself_refuses_is_refused(tmp_path, header, data, said):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    with pytest.raises(NotSafetensors, match=said):
        read_header(path)


def test_a_dtype_the_framework_does_not_load_is_named_when_its_tensors_are_listed(tmp_path):
    path = tmp_path / "model.safetensors"
    header_file(path, {"weight": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, b"ab")
    source = open_weights(path)  # its names are readable
    with pytest.raises(CheckpointError, match="holds a tensor of dtype F8_E4M3"):
        source.entries()
