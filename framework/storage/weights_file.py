"""Weights a run starts from (init=file, docs/weights.md), read only, never written: a
safetensors file; a folder in Hugging Face's layout (model.safetensors, or the shards that
model.safetensors.index.json names); a checkpoint of this framework (a step_<N>.pt file or a
step_<N>.dcp folder, checked as a resume checks it); or a torch.save'd state_dict read with
weights_only. A file that weights_only cannot read is refused, and nothing in it runs.

What a source holds (names, shapes, dtypes) is read without reading a tensor; `read` reads the
tensors asked for and no other (a safetensors file tensor by tensor), `read_part` one
range of one dimension of a tensor (a safetensors file reads only those bytes, with plain reads
and no mapping of the file: a rank of a sharded model holds its own rows and no more)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from framework.core.exits import CheckpointError
from framework.core.path_text import text_problem
from framework.storage import checkpoint
from framework.storage.export import SAFETENSORS, sharded_names
from framework.storage.safetensors_reader import (
    DTYPES,
    Entry,
    NotSafetensors,
    read_header,
    read_rows,
    read_tensor,
)
from framework.storage.sharded import ShardedState

HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as a file holds it, known without reading it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class WeightsSource(Protocol):
    """Named tensors in a file or folder."""

    path: Path

    def entries(self) -> dict[str, TensorInfo]: ...

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]: ...

    def read_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices start:stop of dimension `dim` (0 or 1) of the tensor `name`."""
        ...

    def files(self) -> list[Path]: ...


def open_weights(path: Path) -> WeightsSource:
    """The weights at `path`, by what it is; CheckpointError (one line naming it) when it holds
    none this framework reads."""
    path = Path(path).expanduser()
    if path.is_dir():
        return _open_folder(path)
    if not path.is_file():
        raise CheckpointError(f"init.path={path}: there is no such file or folder")
    if path.suffix == SAFETENSORS:
        return SafetensorsFiles(path, path.parent, {n: path.name for n in _safetensors_names(path)})
    return _open_torch_file(path)


def _open_folder(folder: Path) -> WeightsSource:
    if (folder / HF_INDEX).is_file():
        index = folder / HF_INDEX
        return SafetensorsFiles(folder, folder, _index_map(index), index)
    if (folder / HF_SINGLE).is_file():
        names = _safetensors_names(folder / HF_SINGLE)
        return SafetensorsFiles(folder, folder, dict.fromkeys(names, HF_SINGLE))
    if (folder / ".metadata").is_file():  # DCP's index: a sharded checkpoint of ours
        return _from_checkpoint(folder, checkpoint.read(folder))
    raise CheckpointError(
        f"init.path={folder} is a folder without {HF_SINGLE}, {HF_INDEX} or a sharded "
        "checkpoint's .metadata: name the weights file, or the folder that holds them"
    )


def _safetensors_names(path: Path) -> list[str]:
    return list(_header(path))


def _header(path: Path) -> dict[str, Entry]:
    try:
        return read_header(path)
    except (NotSafetensors, OSError) as error:
        raise CheckpointError(
            f"init.path: {path} is no safetensors file ({error}); nothing in it was read further"
        ) from None


def _index_map(index: Path) -> dict[str, str]:
    """weight_map: tensor name -> its file, each a plain name in the index's folder (a name
    that would lead elsewhere is refused: an index chooses no file outside its folder)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"init.path: {index} has no weight_map of tensor names to files (Hugging Face's "
            "index): write it again, or name one .safetensors file"
        ) from None
    for name, file in weight_map.items():
        if (
            not isinstance(file, str)
            or "/" in file
            or file in ("", ".", "..")
            or text_problem(file)
        ):
            raise CheckpointError(
                f"init.path: {index} names a file that is not a plain name in its folder: "
                "an index names only files beside it"
            )
        if not isinstance(name, str) or text_problem(name):
            raise CheckpointError(f"init.path: {index} holds a tensor name that is not text")
    return weight_map


class SafetensorsFiles:
    """One safetensors file, or the shards an index names; each file's header read once, its
    tensors read with plain reads, only the bytes asked for (safetensors_reader.py: a rank holds
    what it read, and nothing of the file is mapped). `path`: as given (the file, or the
    folder)."""

    def __init__(
        self, path: Path, folder: Path, weight_map: Mapping[str, str], index: Path | None = None
    ) -> None:
        self.path, self.folder, self.index = path, folder, index
        self.weight_map = dict(weight_map)
        self.headers: dict[Path, dict[str, Entry]] = {}

    def files(self) -> list[Path]:
        shards = sorted({self.folder / name for name in self.weight_map.values()})
        return [*([self.index] if self.index else []), *shards]

    def entries(self) -> dict[str, TensorInfo]:
        found: dict[str, TensorInfo] = {}
        for file, names in self._by_file(self.weight_map).items():
            for name in names:
                entry = self._entry(file, name)
                found[name] = TensorInfo(entry.shape, _dtype(entry, file))
        return {name: found[name] for name in self.weight_map}

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        wanted = {name: self.weight_map[name] for name in names}
        for file, group in self._by_file(wanted).items():
            for name in group:
                tensors[name] = read_tensor(file, self._entry(file, name))
        return tensors

    def read_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        [(file, _)] = self._by_file({name: self.weight_map[name]}).items()
        return read_rows(file, self._entry(file, name), dim, start, stop)

    def _entry(self, file: Path, name: str) -> Entry:
        if file not in self.headers:
            self.headers[file] = _header(file)
        entry = self.headers[file].get(name)
        if entry is None:
            raise CheckpointError(
                f"init.path: {self.path} names {name} in {file.name}, which does not hold it: "
                "the index and its files disagree"
            )
        return entry

    def _by_file(self, weight_map: Mapping[str, str]) -> dict[Path, list[str]]:
        groups: dict[Path, list[str]] = {}
        for name, file in weight_map.items():
            path = self.folder / file
            if not path.is_file():
                raise CheckpointError(
                    f"init.path: {self.index} names {file}, which is not in {self.folder}"
                )
            groups.setdefault(path, []).append(name)
        return groups


def _dtype(entry: Entry, file: Path) -> torch.dtype:
    if entry.dtype is None:
        raise CheckpointError(
            f"init.path: {file} holds a tensor of dtype {entry.dtype_name}, which this framework "
            f"does not load (it loads {', '.join(DTYPES)})"
        )
    return entry.dtype


def _open_torch_file(path: Path) -> WeightsSource:
    """A framework checkpoint (checked against its sidecar), else a plain state_dict of
    tensors; read with weights_only, so a pickle that would run code is refused unrun."""
    payload = checkpoint.load_weights_only(path)
    if isinstance(payload, dict) and payload.get("format") == checkpoint.FORMAT:
        return _from_checkpoint(path, checkpoint.read(path))
    if isinstance(payload, dict) and all(
        isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in payload.items()
    ):
        return TensorsInMemory(path, payload)
    raise CheckpointError(
        f"init.path: {path} holds no state_dict of named tensors (nor a checkpoint of this "
        "framework): save model.state_dict(), or export it with framework-export"
    )


def _from_checkpoint(path: Path, payload: dict[str, Any]) -> WeightsSource:
    """A checkpoint's model weights (the EMA's are the checkpoint's other entry)."""
    weights = payload["model"]
    if isinstance(weights, ShardedState):
        return ShardedWeights(path, weights)
    return TensorsInMemory(path, dict(weights))


class TensorsInMemory:
    """A torch.save file, read whole by torch.load (it cannot read one tensor alone)."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        self.path, self.tensors = path, tensors

    def files(self) -> list[Path]:
        return [self.path]

    def entries(self) -> dict[str, TensorInfo]:
        return {
            name: TensorInfo(tuple(tensor.shape), tensor.dtype)
            for name, tensor in self.tensors.items()
        }

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {name: self.tensors[name] for name in names}

    def read_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.tensors[name].narrow(dim, start, stop - start)


class ShardedWeights:
    """A step_<N>.dcp folder's model weights: only the tensors asked for are read (collective
    where a process group is: every rank asks for the same)."""

    def __init__(self, path: Path, state: ShardedState) -> None:
        self.path, self.state = path, state
        self.keys = sharded_names(state)  # state_dict name -> its key in the checkpoint

    def files(self) -> list[Path]:
        return sorted(file for file in self.path.resolve().iterdir() if file.is_file())

    def entries(self) -> dict[str, TensorInfo]:
        found = self.state.entries()
        return {
            name: TensorInfo(tuple(found[key].size), found[key].properties.dtype)
            for name, key in self.keys.items()
        }

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        wanted = {name: self.keys[name] for name in names}
        read_back = self.state.read(list(wanted.values()))
        return {name: read_back[key] for name, key in wanted.items()}

    def read_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """(DCP reads whole tensors here: a rank holds one at a time, then keeps its rows.)"""
        return self.read([name])[name].narrow(dim, start, stop - start).clone()


def file_record(source: WeightsSource) -> dict[str, Any]:
    """What a run records of the weights it started from: the path and each file's sha256."""
    files = source.files()
    root = source.path if source.path.is_dir() else source.path.parent
    return {
        "path": str(source.path.resolve()),
        "sha256": {_relative(file, root): _sha256(file) for file in files},
    }


def _relative(file: Path, root: Path) -> str:
    try:
        return str(file.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(file.resolve())


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()
