"""`framework-export <checkpoint> <output>`: any checkpoint of this framework (a step_*.pt
file or a sharded step_*.dcp folder, from any number of ranks) as the bare model's state_dict,
for inference, in the form the output's name asks for:

    model.pt            one torch.save file:
                        model.load_state_dict(torch.load("model.pt", weights_only=True))
    model.safetensors   safetensors, which other frameworks read (safetensors.torch.load_file);
                        a model larger than --max-shard-size is split the way Hugging Face
                        splits one: model-00001-of-00003.safetensors, ... and
                        model.safetensors.index.json naming each tensor's file.

One process, no process group: a sharded checkpoint's tensors are read whole from every
rank's files. Into safetensors they stream, one output file's tensors at a time: at most
--max-shard-size of tensors (or the one tensor larger than it) is held at once, never the whole
model. (A step_*.pt file is one torch.load: rank 0 wrote it whole, and it is read whole.)
`--ema` exports the EMA's weights (trainer.ema_decay). An output that exists is refused, never
overwritten.

    --format hf_gpt2 out/   a model=gpt checkpoint as Hugging Face's GPT-2 folder: config.json and
                            model.safetensors in GPT2LMHeadModel's names and layouts
                            (transformers' from_pretrained loads it; storage/key_maps.py)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from framework.core.exits import CheckpointError, ExitCode
from framework.storage.checkpoint import read
from framework.storage.files import atomic_write, fsync_dir
from framework.storage.key_maps import HuggingFaceGPT2
from framework.storage.sharded import ShardedState

SAFETENSORS = ".safetensors"
DEFAULT_MAX_SHARD = "2GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20}
_UNITS["GIB"] = 2**30


def weights_in(path: Path, ema: bool = False) -> Mapping[str, Any] | ShardedState:
    """The checkpoint's model (or EMA) weights as it holds them: a state_dict (a step_*.pt
    file), or where a sharded checkpoint's tensors lie (nothing read yet)."""
    payload = read(path)
    weights = payload.get("ema" if ema else "model")
    if weights is None:
        raise CheckpointError(
            f"checkpoint {path} holds no EMA weights (it was trained without "
            "trainer.ema_decay): export without --ema"
        )
    return weights


def whole_weights(path: Path, ema: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint's model (or EMA) weights, every tensor whole, on the host."""
    weights = weights_in(path, ema)
    return weights.whole() if isinstance(weights, ShardedState) else dict(weights)


@dataclass(frozen=True)
class Exported:
    """What an export wrote: the tensors, the files that hold them (the shards), the index that
    names them (for more than one safetensors file), and the most tensor bytes it held at once
    (measured: the bytes of every tensor it had read that was still alive)."""

    tensors: int
    files: list[Path]
    total_bytes: int
    peak_bytes: int
    index: Path | None = None


def export(
    checkpoint: Path, output: Path, ema: bool = False, max_shard_bytes: int | None = None
) -> Exported:
    """Write the weights to `output` (a .safetensors name: safetensors, split into files of at
    most `max_shard_bytes` of tensors; any other: one torch.save file), atomically per file."""
    output = output.expanduser()
    if not output.parent.is_dir():
        raise CheckpointError(f"{output.parent} is no folder: create it first")
    if output.suffix == SAFETENSORS:
        limit = parse_size(DEFAULT_MAX_SHARD) if max_shard_bytes is None else max_shard_bytes
        return export_safetensors(weights_in(checkpoint.expanduser(), ema), output, limit)
    if max_shard_bytes is not None:
        raise CheckpointError(
            f"--max-shard-size splits safetensors files: name the output *{SAFETENSORS} "
            f"(e.g. {output.with_suffix(SAFETENSORS).name}), or leave the option out"
        )
    _refuse_existing([output])
    weights = whole_weights(checkpoint.expanduser(), ema)
    atomic_write(output, lambda file: torch.save(weights, file))
    size = sum(t.nbytes for t in weights.values() if isinstance(t, torch.Tensor))
    return Exported(len(weights), [output], size, size)


def export_safetensors(
    weights: Mapping[str, Any] | ShardedState, output: Path, max_shard_bytes: int
) -> Exported:
    """One safetensors file per group of tensors (planned from their sizes before any is
    read), and, for more than one, the index Hugging Face's loaders read."""
    sizes = tensor_sizes(weights)
    groups = plan_shards(sizes, max_shard_bytes)
    paths = shard_paths(output, len(groups))
    index = output.with_name(output.name + ".index.json")
    _refuse_existing([*paths, index])
    held = _Held()
    if not isinstance(weights, ShardedState):
        held.add(weights)  # torch.load read it whole
    weight_map: dict[str, str] = {}
    for group, path in zip(groups, paths, strict=True):
        tensors = _read_group(weights, group)
        held.add(tensors)
        write_safetensors(path, tensors)
        weight_map.update(dict.fromkeys(group, path.name))
        del tensors  # before the next group is read
    total = sum(sizes.values())
    if len(paths) == 1:
        return Exported(len(sizes), paths, total, held.peak)
    record = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write(index, lambda file: file.write(json.dumps(record, indent=2).encode()))
    return Exported(len(sizes), paths, total, held.peak, index)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """safetensors' own writer, without a copy of the tensors in memory, into a temporary name
    beside `path`; then made durable, given the mode a new file gets here (the writer makes its
    files 0600) and renamed: `path` is whole or absent."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})  # Hugging Face's loaders ask
        with open(tmp, "rb") as file:
            os.fsync(file.fileno())
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def tensor_sizes(weights: Mapping[str, Any] | ShardedState) -> dict[str, int]:
    """Bytes of each tensor, by its name in the state_dict, in its order (from the index for a
    sharded checkpoint: nothing is read)."""
    if isinstance(weights, ShardedState):
        names = sharded_names(weights)
        entries = weights.entries()
        return {
            name: entries[key].size.numel() * entries[key].properties.dtype.itemsize
            for name, key in names.items()
        }
    for name, value in weights.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"the weights hold {name}, which is no tensor ({type(value).__name__}): "
                f"safetensors holds only tensors; export to a .pt file instead"
            )
    return {name: tensor.nbytes for name, tensor in weights.items()}


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """The names in order, cut into groups of at most max_shard_bytes (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes.items():
        if groups[-1] and filled + size > max_shard_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += size
    return groups


def shard_paths(output: Path, count: int) -> list[Path]:
    """`output` itself for one file; Hugging Face's names beside it for several."""
    if count == 1:
        return [output]
    stem = output.name.removesuffix(SAFETENSORS)
    return [
        output.with_name(f"{stem}-{i:05d}-of-{count:05d}{SAFETENSORS}") for i in range(1, count + 1)
    ]


def sharded_names(weights: ShardedState) -> dict[str, str]:
    """{state_dict name: its key in the checkpoint} of a sharded model's flat state_dict."""
    skeleton = weights.skeleton
    keys = set(weights.entries())
    names = (
        {name: f"{weights.prefix}/{name}" for name in skeleton}
        if isinstance(skeleton, dict)
        else {}
    )
    if set(names.values()) != keys:
        raise CheckpointError(
            f"checkpoint {weights.folder}: its {weights.prefix} weights are no flat state_dict "
            "of tensors; safetensors holds only such: export to a .pt file instead"
        )
    return names


def _read_group(
    weights: Mapping[str, Any] | ShardedState, group: list[str]
) -> dict[str, torch.Tensor]:
    """The group's tensors, whole, contiguous and sharing no memory (safetensors refuses tied
    weights that share it: each name gets its own copy)."""
    if isinstance(weights, ShardedState):
        prefix = weights.prefix
        read_back = weights.read([f"{prefix}/{name}" for name in group])
        return {name: read_back[f"{prefix}/{name}"] for name in group}
    tensors, seen = {}, set()
    for name in group:
        tensor = weights[name].contiguous()
        storage = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return tensors


class _Held:
    """The most bytes of tensors alive at once among those the export read (weak references:
    a tensor kept by mistake past its group would count)."""

    def __init__(self) -> None:
        self._alive: dict[int, weakref.ref[torch.Tensor]] = {}
        self.peak = 0

    def add(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._alive = {key: ref for key, ref in self._alive.items() if ref() is not None}
        self._alive.update({id(t): weakref.ref(t) for t in tensors.values()})
        self.peak = max(self.peak, sum(_nbytes(ref()) for ref in self._alive.values()))


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.nbytes


def _refuse_existing(paths: list[Path]) -> None:
    for path in paths:
        if path.exists() or path.is_symlink():
            raise CheckpointError(
                f"{path} already exists: give a new file (nothing is overwritten)"
            )


def parse_size(text: str) -> int:
    """'2GB' (10^9), '500MB', '64KiB' (2^10), or bytes, as bytes."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if found is None or float(found[1]) <= 0:
        raise CheckpointError(
            f"--max-shard-size={text} is no size: give bytes or a number with KB, MB, GB "
            "(or KiB, MiB, GiB), e.g. 2GB"
        )
    return int(float(found[1]) * _UNITS[(found[2] or "").upper()])


def summary(exported: Exported) -> str:
    count = len(exported.files)
    files = f"{count} file" if count == 1 else f"{count} files"
    if exported.index is not None:
        files += f" named by {exported.index.name}"
    return (
        f"{exported.tensors} tensors, {exported.total_bytes / 1e6:.1f} MB in {files}; "
        f"at most {exported.peak_bytes / 1e6:.1f} MB of tensors held at once"
    )


GPT = "framework.components.models.GPT"


def export_hf_gpt2(checkpoint: Path, folder: Path, ema: bool = False) -> Exported:
    """A model=gpt checkpoint as Hugging Face's GPT-2 folder (config.json, model.safetensors):
    the names and layouts GPT2LMHeadModel saves, its sizes from the checkpoint's own config."""
    checkpoint = checkpoint.expanduser()
    settings = {key: json.loads(value) for key, value in read(checkpoint)["config"].items()}
    if settings.get("model._target_") != GPT:
        raise CheckpointError(
            f"--format hf_gpt2 writes a model={GPT}'s weights as GPT-2's; {checkpoint} holds a "
            f"{settings.get('model._target_')}: export it without --format"
        )
    if folder.exists():
        raise CheckpointError(f"{folder} exists: name a new folder (nothing is overwritten)")
    weights = whole_weights(checkpoint, ema)
    key_map = HuggingFaceGPT2()
    tensors = {}
    for key, tensor in weights.items():
        name = key_map.name_in_file(key)
        if name is not None:
            tensors[name] = key_map.tensor_in_file(name, tensor)
    folder.mkdir(parents=False)
    write_safetensors(folder / "model.safetensors", tensors)
    config = gpt2_config(settings, weights)
    atomic_write(folder / "config.json", lambda file: file.write(json.dumps(config).encode()))
    size = sum(t.nbytes for t in tensors.values())
    return Exported(len(tensors), [folder / "model.safetensors"], size, size)


def gpt2_config(settings: Mapping[str, Any], weights: Mapping[str, torch.Tensor]) -> dict:
    """GPT2Config's keys for the shipped GPT's settings (dropout as trained; no cross-attention,
    tied embeddings, layer norm eps 1e-5: nn.LayerNorm's)."""
    vocab_size, width = weights["tokens.weight"].shape
    activation = settings.get("model.activation", "gelu")
    dropout = settings.get("model.dropout", 0.0)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": weights["positions.weight"].shape[0],
        "n_embd": width,
        "n_layer": settings["model.layers"],
        "n_head": settings["model.heads"],
        "n_inner": None,
        "activation_function": "gelu_new" if activation == "gelu_tanh" else "gelu",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": dropout,
        "embd_pdrop": dropout,
        "attn_pdrop": dropout,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="framework-export",
        description="Turn a checkpoint (a file or a sharded folder) into the bare model's "
        "state_dict: one torch.load-able file, or safetensors (an output named *.safetensors).",
    )
    parser.add_argument("checkpoint", type=Path, help="<run dir>/checkpoints/last.pt, or a step")
    parser.add_argument(
        "output",
        type=Path,
        help="the file to write (must not exist): model.pt or model.safetensors",
    )
    parser.add_argument("--ema", action="store_true", help="the EMA's weights instead")
    parser.add_argument(
        "--format",
        choices=["state_dict", "hf_gpt2"],
        default="state_dict",
        help="hf_gpt2: a model=gpt checkpoint as Hugging Face's GPT-2 folder (the output: a new "
        "folder)",
    )
    parser.add_argument(
        "--max-shard-size",
        help=f"safetensors: tensors per file at most (default {DEFAULT_MAX_SHARD}; also what "
        "is held in memory at once)",
    )
    args = parser.parse_args(argv)
    try:
        limit = None if args.max_shard_size is None else parse_size(args.max_shard_size)
        if args.format == "hf_gpt2":
            exported = export_hf_gpt2(args.checkpoint, args.output, args.ema)
        else:
            exported = export(args.checkpoint, args.output, args.ema, limit)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(ExitCode.CONFIG_REJECTED) from None
    # The file a loader opens: the index of a split export, else the one file.
    print(f"{exported.index or exported.files[0]}: {summary(exported)}, from {args.checkpoint}")


if __name__ == "__main__":
    main()
