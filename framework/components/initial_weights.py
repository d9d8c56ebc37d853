"""init=<option>: the weights a run starts from (docs/weights.md). init=none: the model's own
initialisation. init=file: a file's or folder's tensors (framework/storage/weights_file.py), their
names mapped to the model's (init.format's key map, then init.rename's rules), the model keys
init.skip names left as built, every other key filled by a tensor of its shape and dtype: each
mismatch named in one line, exit 2, before any rank trains (the trial meets it first)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from framework.core.exits import ConfigError
from framework.storage.key_maps import KEY_MAPS, KeyMap
from framework.storage.weights_file import TensorInfo, WeightsSource, open_weights

log = logging.getLogger("framework")
SHOWN = 3  # mismatches named per kind; the rest are counted


class AsBuilt:
    """init=none: the weights the model's constructor made (trainer.seed decides them)."""

    def plan(self, module: nn.Module) -> None:
        return None


@dataclass(frozen=True)
class LoadPlan:
    """Which file tensor fills which model key, checked against the model."""

    source: WeightsSource
    key_map: KeyMap
    names: dict[str, str]  # model key -> file name
    skipped: list[str] = field(default_factory=list)  # model keys left as built

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every planned tensor, read from the file and given the model's layout."""
        read = self.source.read(self.names.values())
        return {
            key: self.key_map.tensor_in_model(name, read[name]) for key, name in self.names.items()
        }

    @torch.no_grad()
    def load_into_shards(self, module: nn.Module) -> int:
        """Into a model sharded by FSDP2 (each parameter a DTensor of Shard(0) over a 1-D
        mesh): each rank reads only its own rows of each tensor (a safetensors file reads only
        those bytes) and copies them into its shard; whole tensors where a parameter is not
        sharded. Returns the most bytes of the file's tensors held at once: one tensor's part."""
        # Tied weights under each of their names: a file may hold either.
        targets = {
            **dict(module.named_buffers(remove_duplicate=False)),
            **dict(module.named_parameters(remove_duplicate=False)),
        }
        most = 0
        for key, name in self.names.items():
            local, rows = _own_rows(targets[key])
            if rows is None:
                part = self.key_map.tensor_in_model(name, self.source.read([name])[name])
            else:
                dim = self.key_map.rows_in_file(name)
                part = self.source.read_part(name, dim, *rows)
                part = self.key_map.tensor_in_model(name, part)
            local.copy_(part)
            most = max(most, part.nbytes)
            del part  # before the next tensor is read
        return most


class FromFile:
    """init=file: the model's weights from `path` (docs/weights.md)."""

    def __init__(
        self,
        path: str,
        format: Literal["auto", "hf_gpt2"],
        rename: dict[str, str],
        skip: list[str],
        strict: bool,
    ) -> None:
        self.path = Path(path).expanduser()
        self.key_map = KEY_MAPS[format]
        self.rules = [_rule(pattern, replacement) for pattern, replacement in rename.items()]
        self.skip = list(skip)
        self.strict = strict

    def plan(self, module: nn.Module) -> LoadPlan:
        """The file's tensors matched to `module`'s keys; ConfigError naming what does not fit."""
        source = open_weights(self.path)
        self.key_map.check_model(self.path, module)
        entries, expected = source.entries(), _model_entries(module)
        skipped = self._skipped(expected)
        names, unexpected, duplicated = self._matched(entries, expected, skipped)
        required = set(expected) - set(skipped) - _aliases(module)
        missing = sorted(required - names.keys())
        misfits = _misfits(names, entries, expected, self.key_map)
        self._refuse(missing, unexpected, duplicated, misfits)
        if required and not names:  # (init.strict=false: what fits is nothing)
            file_names = ", ".join((unexpected or list(entries))[:3])  # (as renamed)
            model_keys = ", ".join(sorted(required)[:3])
            raise ConfigError(
                f"init.path={self.path} fills no key of the model: its names are like "
                f"{file_names}, the model's like {model_keys}: map them with init.rename"
            )
        return LoadPlan(source, self.key_map, names, skipped)

    def _skipped(self, expected: Mapping[str, TensorInfo]) -> list[str]:
        unused = [p for p in self.skip if not any(fnmatch(key, p) for key in expected)]
        if unused:
            raise ConfigError(
                f"init.skip: {', '.join(unused)} matches no key of the model (its keys are "
                f"named like {', '.join(list(expected)[:4])})"
            )
        return [key for key in expected if any(fnmatch(key, p) for p in self.skip)]

    def _matched(
        self,
        entries: Mapping[str, TensorInfo],
        expected: Mapping[str, TensorInfo],
        skipped: list[str],
    ) -> tuple[dict[str, str], list[str], list[str]]:
        """(model key -> file name, file names that fill no model key, model keys two file
        names fill). A file name mapped to a skipped key is left out: the key stays as built."""
        names: dict[str, str] = {}
        unexpected, duplicated = [], []
        for name in entries:
            key = self.key_map.name_in_model(name)
            if key is None:  # a name the key map knows carries no weight (a cached mask)
                continue
            key = self._renamed(key)
            if key in skipped:
                continue
            if key not in expected:
                unexpected.append(key if key == name else f"{name} (as {key})")
            elif key in names:
                duplicated.append(f"{key} (from {names[key]} and {name})")
            else:
                names[key] = name
        return names, unexpected, duplicated

    def _renamed(self, name: str) -> str:
        for rule in self.rules:
            name = rule(name)
        return name

    def _refuse(
        self, missing: list[str], unexpected: list[str], duplicated: list[str], misfits: list[str]
    ) -> None:
        kinds = [("shape or dtype (file vs model)", misfits), ("filled twice", duplicated)]
        if self.strict:
            kinds = [
                ("missing from the file", missing),
                ("in the file, not in the model", unexpected),
                *kinds,
            ]
        problems = [_listed(label, items) for label, items in kinds if items]
        if problems:
            raise ConfigError(
                f"init.path={self.path} does not fit the model ({'; '.join(problems)}): map "
                "its names with init.rename, leave model keys as built with init.skip"
                f"{', or load what fits with init.strict=false' if missing or unexpected else ''}"
            )


def _own_rows(target: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """This rank's part of `target` and the rows of the whole tensor it holds (FSDP2's Shard(0):
    chunks of ceil(rows / ranks) in rank order); None where it holds the whole tensor."""
    if not isinstance(target, DTensor):
        return target, None
    local = target.to_local()
    placements = target.placements
    if target.dim() == 0 or len(placements) != 1 or placements[0] != Shard(0):
        raise ConfigError(
            f"init: {type(target).__name__} placed as {placements} is not FSDP2's row sharding; "
            "load it under strategy=ddp and save a checkpoint to resume instead"
        )
    rows, ranks = target.shape[0], target.device_mesh.size()
    chunk = -(-rows // ranks)
    start = min(target.device_mesh.get_local_rank() * chunk, rows)
    stop = min(start + chunk, rows)
    return local, (start, stop)


def _rule(pattern: str, replacement: str) -> Callable[[str], str]:
    """A prefix rule ("encoder.": "trunk."), or a regular expression where the pattern starts
    with ^ ("^h\\.(\\d+)\\.": "blocks.\\1."), applied to the whole name once."""
    if not pattern.startswith("^"):
        return lambda name: replacement + name[len(pattern) :] if name.startswith(pattern) else name
    try:
        compiled = re.compile(pattern)
    except re.error as error:
        raise ConfigError(f"init.rename: {pattern} is no regular expression ({error})") from None
    return lambda name: compiled.sub(replacement, name, count=1)


def _model_entries(module: nn.Module) -> dict[str, TensorInfo]:
    """Every key of the model's state_dict (whole shapes, also where the model is sharded or on
    the meta device)."""
    return {
        key: TensorInfo(tuple(value.shape), value.dtype)
        for key, value in module.state_dict().items()
    }


def _aliases(module: nn.Module) -> set[str]:
    """State keys that name a tensor another key already names (tied weights: GPT's head and
    token embedding): filled with it, never required of a file."""
    owned = {name for name, _ in module.named_parameters()}
    owned |= {name for name, _ in module.named_buffers()}
    return set(module.state_dict()) - owned


def _misfits(
    names: Mapping[str, str],
    entries: Mapping[str, TensorInfo],
    expected: Mapping[str, TensorInfo],
    key_map: KeyMap,
) -> list[str]:
    found = []
    for key, name in names.items():
        shape = key_map.shape_in_model(name, entries[name].shape)
        have, want = entries[name], expected[key]
        if shape != want.shape:
            found.append(f"{key} {list(shape)} vs {list(want.shape)}")
        elif have.dtype != want.dtype:
            found.append(f"{key} {_short(have.dtype)} vs {_short(want.dtype)}")
    return found


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _listed(label: str, items: list[str]) -> str:
    more = f", and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return f"{len(items)} {label}: {', '.join(items[:SHOWN])}{more}"
