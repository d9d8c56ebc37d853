"""Sharded checkpoints (checkpoint.format=sharded): every rank writes its own part of the
model, optimizer and EMA with torch.distributed.checkpoint (DCP), and any number of ranks reads
them back, each taking the slices its own shards need.

<run dir>/checkpoints/step_00000120.dcp/
    .metadata           DCP's index: every tensor's global shape and where its chunks lie
    __<rank>_0.distcp   the tensors rank <rank> wrote (its shards; replicated tensors once)
    state.pt            what is not a shard: rank 0's small states and every rank's own, as in
                        a step_*.pt checkpoint (read with weights_only=True)
step_00000120.json      size and sha256 of every file above, written once the folder is whole

Only tensors go through DCP: the structure around them (optimizer param groups, None entries)
is kept in state.pt as a skeleton with a mark where each tensor was. DCP's own readers unpickle
its index with plain `pickle` and its non-tensor items with `weights_only=False`; this module
reads the index with an unpickler that builds only DCP's index classes and refuses non-tensor
items, so a crafted checkpoint folder is refused, never executed.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from framework.core.exits import CheckpointError, first_line
from framework.core.versions import PATH_PICKLED_AS

SUFFIX = ".dcp"
STATE_FILE = "state.pt"  # inside the folder, beside DCP's files
TENSOR_MARK = "\x00dcp-tensor"  # where a skeleton had a tensor (a string no state holds)

# What DCP's index may contain: its metadata classes, torch.Size, dtypes and layouts.
_INDEX_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup among torch's layouts by name
    ("collections", "OrderedDict"),
    *PATH_PICKLED_AS,
}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _INDEX_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


class SafeReader(FileSystemReader):
    """DCP's file reader whose index is read by the restricted unpickler above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as file:
                metadata = _IndexUnpickler(file).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, OSError) as error:
            raise CheckpointError(
                f"checkpoint {self.path} has an unreadable or unsafe index {path.name} "
                f"({str(error)[:160]}); nothing in it was executed"
            ) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"checkpoint {self.path}: {path.name} is not a DCP index")
        return metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, refusing the pickled (non-tensor) items this module never writes."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise CheckpointError(
            f"checkpoint item {read_item.dest_index.fqn} is a pickled object, not a tensor: "
            "refused (a sharded checkpoint of this framework holds only tensors)"
        )


# --- a state as tensors + skeleton ---------------------------------------------------------
def _rebuilt(node: Any, path: str, leaf: Callable[[Any, str], Any]) -> Any:
    """`node` with every leaf (anything but a dict, list or tuple) replaced by leaf(it, its
    path); a tensor is a leaf."""
    if isinstance(node, Mapping):
        return {key: _rebuilt(value, f"{path}/{key}", leaf) for key, value in node.items()}
    if isinstance(node, list | tuple):
        return type(node)(_rebuilt(value, f"{path}/{i}", leaf) for i, value in enumerate(node))
    return leaf(node, path)


def _is_mark(node: Any) -> bool:
    return isinstance(node, str) and node == TENSOR_MARK


def split(state: Any, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """(skeleton, {key: tensor}): the skeleton is `state` with each tensor replaced by
    TENSOR_MARK; keys are the path to it under `prefix` ("model/fc.weight")."""
    tensors: dict[str, torch.Tensor] = {}

    def take(node: Any, path: str) -> Any:
        if not isinstance(node, torch.Tensor):
            return node
        tensors[path] = node
        return TENSOR_MARK

    return _rebuilt(state, prefix, take), tensors


def marked(skeleton: Any, prefix: str) -> list[str]:
    """The keys of the tensors a skeleton had."""
    keys: list[str] = []
    _rebuilt(skeleton, prefix, lambda node, path: _is_mark(node) and keys.append(path))
    return keys


def join(skeleton: Any, tensors: Mapping[str, torch.Tensor], prefix: str) -> Any:
    """The inverse of split: the skeleton with each mark replaced by its tensor."""
    return _rebuilt(skeleton, prefix, lambda node, path: tensors[path] if _is_mark(node) else node)


# --- writing -------------------------------------------------------------------------------
def write_shards(
    folder: Path,
    tensors: dict[str, torch.Tensor],
    in_background: bool,
    group: dist.ProcessGroup | None,
) -> Future | None:
    """Collective: every rank writes its tensors (its shards) into `folder`. In the background
    (checkpoint.async_save) the tensors are copied to host memory first and the returned future
    completes once every rank's file and the index are durable."""
    writer = FileSystemWriter(folder, sync_files=True)
    # Without a process group DCP saves alone: every supported torch infers it (and warns);
    # `no_dist=` would say it twice, and torch 2.6's save and 2.8's async_save take no such keyword.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is", UserWarning)
        if in_background:
            return dcp.async_save(tensors, storage_writer=writer, process_group=group)
        dcp.save(tensors, storage_writer=writer, process_group=group)
    return None


# --- reading -------------------------------------------------------------------------------
def index(folder: Path) -> Metadata:
    return SafeReader(folder).read_metadata()


def check_index(folder: Path) -> None:
    """Every chunk the index names lies within a file of the folder (a missing or truncated
    shard is found before any rank loads)."""
    for item in index(folder).storage_data.values():
        path = folder / item.relative_path
        if not path.is_file() or path.stat().st_size < item.offset + item.length:
            raise CheckpointError(
                f"checkpoint {folder} is incomplete: {item.relative_path} is missing or truncated"
            )


def shapes(folder: Path, prefix: str) -> dict[str, torch.Size]:
    """The global shape of every tensor saved under `prefix`, by its key below it."""
    start = f"{prefix}/"
    return {
        key[len(start) :]: entry.size
        for key, entry in index(folder).state_dict_metadata.items()
        if key.startswith(start) and isinstance(entry, TensorStorageMetadata)
    }


class ShardedState:
    """One entry (model, optimizer, ema) of a sharded checkpoint, as read back: the skeleton,
    and where its tensors lie. load() fills a rank's own tensors (its shards, or whole tensors
    on one rank) in place from whichever ranks wrote them."""

    def __init__(self, folder: Path, prefix: str, skeleton: Any) -> None:
        self.folder, self.prefix, self.skeleton = folder, prefix, skeleton

    @property
    def shapes(self) -> dict[str, torch.Size]:
        return shapes(self.folder, self.prefix)

    def load(self, template: Any) -> Any:
        """Collective when ranks are: `template` is this rank's own state of the same
        structure (its tensors are overwritten); returns the saved state built on them."""
        _, wanted = split(template, self.prefix)
        saved = set(marked(self.skeleton, self.prefix))
        if wanted.keys() != saved:
            differing = sorted(wanted.keys() ^ saved)
            raise CheckpointError(
                f"checkpoint {self.folder} does not fit this run ({', '.join(differing[:4])} "
                "on one side only): it was saved for another model or optimizer; resume with "
                "the settings it was trained with"
            )
        _read_into(wanted, self.folder)
        return join(self.skeleton, wanted, self.prefix)

    def whole(self) -> Any:
        """On one process, without a process group: every tensor whole, allocated from the
        index (export)."""
        entries = index(self.folder).state_dict_metadata
        tensors = {}
        for key in marked(self.skeleton, self.prefix):
            entry = entries.get(key)
            if not isinstance(entry, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint {self.folder} has no tensor {key}")
            tensors[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        _read_into(tensors, self.folder)
        return join(self.skeleton, tensors, self.prefix)


def _read_into(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """DCP's load into `tensors`, in place: collective where a process group is, alone where
    none is (DCP infers it, in every supported torch, and warns that it does)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is", UserWarning)
        try:
            dcp.load(tensors, storage_reader=SafeReader(folder), planner=TensorsOnlyPlanner())
        except CheckpointException as error:  # each rank's failure, with its traceback
            failed, _ = next(iter(error.failures.values()))
            if isinstance(failed, CheckpointError):
                raise failed from None
            raise CheckpointError(
                f"checkpoint {folder} could not be read ({first_line(failed)}): it is damaged; "
                "resume from "
                "an earlier one with checkpoint.resume=<its folder>"
            ) from None
