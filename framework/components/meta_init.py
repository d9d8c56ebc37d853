"""A model built on the meta device, then given exactly the values a whole build would give it,
one tensor at a time, each rank keeping only its shards.

`build_on_meta` runs the model's constructor under `torch.device("meta")` and records every
tensor operation it makes (a Recipe): allocations, initialisers (`normal_`, `uniform_`, ...),
copies and arithmetic, in order. Nothing is allocated and no random number is drawn. Once the
meta module is sharded and `to_empty` gave it room for its own shards, `materialize` replays
the recipe on the host with the real generator: every operation runs on the whole tensor it ran
on in a whole build (so it draws the same random numbers in the same order and computes the same
values, bit for bit), and as soon as a parameter or buffer has its final value, each module takes
its own shard of it and the whole tensor is dropped. A tensor whose contents nothing reads again
before they are overwritten (a Linear's default init, replaced by the model's own) is dropped
once written: at any moment the host holds about one tensor of the model, never the model.

Tensors are tracked by storage: a view is replayed as the same slice of the same storage, so
aliasing (an embedding's padding row, a tied weight) behaves as in the whole build.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

log = logging.getLogger("framework")

META = torch.device("meta")
# In-place operations that overwrite every element of `self` without reading it: what `self`
# held before is dead, unless an earlier view reads it.
OVERWRITES = {
    torch.ops.aten.normal_.default,
    torch.ops.aten.uniform_.default,
    torch.ops.aten.fill_.Scalar,
    torch.ops.aten.fill_.Tensor,
    torch.ops.aten.zero_.default,
    torch.ops.aten.copy_.default,
    torch.ops.aten.bernoulli_.float,
    torch.ops.aten.exponential_.default,
    torch.ops.aten.random_.default,
    getattr(torch.ops.aten.random_, "from"),
    torch.ops.aten.random_.to,
    torch.ops.aten.cauchy_.default,
    torch.ops.aten.log_normal_.default,
    torch.ops.aten.geometric_.default,
}


class MetaUnsupported(Exception):
    """The model cannot be built on the meta device: `module` names the innermost module whose
    constructor failed, `reason` the error."""

    def __init__(self, module: str, reason: str) -> None:
        super().__init__(f"{module}: {reason}")
        self.module, self.reason = module, reason


@dataclass(frozen=True)
class Ref:
    """A tensor as a slice of a recorded storage."""

    storage: int  # index into Recipe.storages
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    def covers(self, nbytes: int) -> bool:
        """Every byte of its storage is one of its elements."""
        numel = 1
        for extent in self.size:
            numel *= extent
        dense = torch.empty_strided(self.size, self.stride, device=META).is_contiguous()
        return self.offset == 0 and dense and numel * self.dtype.itemsize == nbytes


@dataclass
class Op:
    func: Any  # an aten OpOverload
    args: Any  # tensors as Ref (meta) or as they were (constants on the host)
    kwargs: Any
    outputs: list[Ref | None]  # Ref of each output tensor that got a new storage
    skip: bool  # a view: nothing to run, its uses are slices of the storage


@dataclass
class Recipe:
    """How to give a meta-built module the values a whole build gives it."""

    ops: list[Op] = field(default_factory=list)
    storage_bytes: list[int] = field(default_factory=list)  # by storage index
    state: dict[str, Ref] = field(default_factory=dict)  # parameters and buffers, by name

    def largest_tensor_bytes(self) -> int:
        return max(self.storage_bytes, default=0)


# Functions that make a tensor from Python data: on the meta device the data would be lost.
FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
IS_META = torch.Tensor.is_meta  # its getter reaches a mode as IS_META.__get__


class _AsOnTheHost(TorchFunctionMode):
    """The constructor runs as it would on the host: `torch.tensor(data)` is made there, then
    moved to the meta device by an operation the recorder sees (the host tensor is a constant of
    the recipe), and `tensor.is_meta` is False (torch.nn.init skips meta tensors)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if (
            getattr(func, "__self__", None) is IS_META
        ):  # torch.nn.init skips meta tensors: trunc_normal_, orthogonal_, ...
            return False
        if func not in FROM_DATA:
            return func(*args, **kwargs)
        device = torch.device(kwargs.pop("device", None) or torch.get_default_device())
        if device.type != "meta":
            return func(*args, device=device, **kwargs)
        return func(*args, device="cpu", **kwargs).to(META)


class _Recorder(TorchDispatchMode):
    """Every aten operation on meta tensors, with tensors turned into Refs."""

    def __init__(self) -> None:
        super().__init__()
        self.recipe = Recipe()
        self.storage_index: dict[int, int] = {}  # a meta storage's _cdata -> its index
        self.alive: list[torch.Tensor] = []  # recorded tensors stay alive: _cdata stays unique

    def ref(self, tensor: torch.Tensor) -> Ref:
        key = tensor.untyped_storage()._cdata
        if key not in self.storage_index:
            raise ValueError(
                "a tensor made from Python data (torch.tensor(...)) has no values on the meta "
                "device"
            )
        return Ref(
            self.storage_index[key],
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.storage_offset(),
            tensor.dtype,
        )

    def as_recorded(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device == META:
            return self.ref(value)
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        recorded_args = tree_map(self.as_recorded, args)
        recorded_kwargs = tree_map(self.as_recorded, kwargs)
        out = func(*args, **kwargs)
        outputs: list[Ref | None] = []
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device != META:
                continue
            storage = tensor.untyped_storage()
            if storage._cdata not in self.storage_index:
                self.storage_index[storage._cdata] = len(self.recipe.storage_bytes)
                self.recipe.storage_bytes.append(storage.nbytes())
                outputs.append(self.ref(tensor))
            else:
                outputs.append(None)
            self.alive.append(tensor)
        # A view makes no storage: its uses are slices of its input's.
        skip = _is_view(func) and not any(ref is not None for ref in outputs)
        self.recipe.ops.append(Op(func, recorded_args, recorded_kwargs, outputs, skip))
        return out


def _is_view(func: Any) -> bool:
    """Its outputs alias its inputs and it writes nothing (view, select, t, detach, ...)."""
    schema = func._schema
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    aliased = bool(schema.returns) and all(r.alias_info is not None for r in schema.returns)
    return aliased and not writes


def build_on_meta(build: Callable[[], nn.Module]) -> tuple[nn.Module, Recipe]:
    """`build()` on the meta device, and the recipe of its values. MetaUnsupported if its
    constructor cannot run there (it reads a value, or makes tensors on another device)."""
    recorder = _Recorder()
    try:
        with torch.device(META), recorder, _AsOnTheHost():
            module = build()
    except Exception as error:  # any constructor's failure is reported (re-raised), never hidden
        raise MetaUnsupported(_failing_module(), _line(error)) from error
    for name, tensor in _state(module):
        if tensor.device != META:
            raise MetaUnsupported(
                type(module).__name__, f"{name} is made on {tensor.device}, not on the meta device"
            )
        recorder.recipe.state[name] = recorder.ref(tensor)
    return module, recorder.recipe


def _state(module: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def _failing_module() -> str:
    """The innermost module whose constructor was running when the error was raised."""
    found = "the model"
    for frame, _ in traceback.walk_tb(sys.exc_info()[2]):
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "__init__" and isinstance(owner, nn.Module):
            kind = type(owner)
            found = f"{kind.__module__}.{kind.__qualname__}"
    return found


def _line(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:200]


# --- replay ------------------------------------------------------------------------------------
@dataclass
class _Plan:
    """When each storage may be dropped, and when each state tensor has its final value."""

    free_after: dict[int, list[int]]  # op index -> storages whose contents are dead after it
    final_after: dict[int, list[str]]  # op index -> state names whose values are final after it


def _touches(op: Op, storage_bytes: list[int]) -> list[tuple[int, str]]:
    """(storage, kind) for each storage the op touches: "new" (it made it), "overwrite" (wrote
    every byte, read none), "use" (read, or wrote part of it)."""
    if op.skip:
        return []
    touched: list[tuple[int, str]] = []
    arguments = op.func._schema.arguments
    written = {
        argument.name
        for argument in arguments
        if argument.alias_info is not None and argument.alias_info.is_write
    }
    named = {argument.name: value for argument, value in zip(arguments, op.args, strict=False)}
    named.update(op.kwargs)
    for name, value in named.items():
        for ref in tree_flatten(value)[0]:
            if not isinstance(ref, Ref):
                continue
            overwrite = (
                op.func in OVERWRITES
                and name == "self"
                and name in written
                and ref.covers(storage_bytes[ref.storage])
            )
            touched.append((ref.storage, "overwrite" if overwrite else "use"))
    touched += [(ref.storage, "new") for ref in op.outputs if ref is not None]
    return touched


def _plan(recipe: Recipe) -> _Plan:
    final: dict[int, list[str]] = {}
    for name, ref in recipe.state.items():
        final.setdefault(ref.storage, []).append(name)
    last_touch: dict[int, int] = {}
    free_after: dict[int, list[int]] = {}
    for index, op in enumerate(recipe.ops):
        for storage, kind in _touches(op, recipe.storage_bytes):
            previous = last_touch.get(storage)
            if kind in ("overwrite", "new") and previous is not None and previous != index:
                free_after.setdefault(previous, []).append(storage)  # nothing reads it again
            last_touch[storage] = index
    final_after: dict[int, list[str]] = {}
    for storage, index in last_touch.items():
        if storage in final:
            final_after.setdefault(index, []).extend(final[storage])
        free_after.setdefault(index, []).append(storage)
    for storage, names in final.items():
        if storage not in last_touch:  # made by an op that only views (never the case in aten)
            raise MetaUnsupported("(replay)", f"{names[0]} has no recorded value")
    return _Plan(free_after, final_after)


class _Replay:
    """The recipe's operations on real tensors, storage by storage."""

    def __init__(self, recipe: Recipe, device: torch.device) -> None:
        self.recipe, self.device = recipe, device
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.peak_bytes = self.held_bytes = 0

    def tensor(self, ref: Ref) -> torch.Tensor:
        storage = self.storages.get(ref.storage)
        if storage is None:  # dropped as dead, now written again: fresh room
            storage = self._keep(
                ref.storage, torch.UntypedStorage(self.recipe.storage_bytes[ref.storage])
            )
        return torch.empty(0, dtype=ref.dtype, device=self.device).set_(
            storage, ref.offset, ref.size, ref.stride
        )

    def _keep(self, index: int, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        self.storages[index] = storage
        self.held_bytes += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return storage

    def drop(self, index: int) -> None:
        storage = self.storages.pop(index, None)
        if storage is not None:
            self.held_bytes -= storage.nbytes()

    def real(self, value: Any) -> Any:
        if isinstance(value, Ref):
            return self.tensor(value)
        if isinstance(value, torch.device) and value.type == "meta":
            return self.device
        return value

    def run(self, op: Op) -> None:
        out = op.func(*tree_map(self.real, op.args), **tree_map(self.real, op.kwargs))
        results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for ref, result in zip(op.outputs, results, strict=False):
            if ref is None:
                continue
            if (tuple(result.shape), tuple(result.stride()), result.storage_offset()) != (
                ref.size,
                ref.stride,
                ref.offset,
            ):
                raise MetaUnsupported(
                    str(op.func), "its result is laid out differently on the host than on meta"
                )
            self._keep(ref.storage, result.untyped_storage())


@torch.no_grad()
def materialize(recipe: Recipe, modules: list[nn.Module]) -> int:
    """Give each module (built by build_on_meta, sharded or not, then `to_empty`) the values of
    a whole build, computed on the host with the global generator, as a whole build would.
    Returns the most bytes the replay held at once."""
    plan = _plan(recipe)
    replay = _Replay(recipe, torch.device("cpu"))
    targets = [dict(_state(module)) for module in modules]
    for index, op in enumerate(recipe.ops):
        if op.skip:
            continue
        replay.run(op)
        for name in plan.final_after.get(index, ()):
            whole = replay.tensor(recipe.state[name])
            for target in targets:
                _fill(target[name], whole)
            del whole  # the storage is the replay's to drop: no name may keep it alive
        for storage in plan.free_after.get(index, ()):
            replay.drop(storage)
    return replay.peak_bytes


def _fill(tensor: torch.Tensor, whole: torch.Tensor) -> None:
    """`tensor` (this rank's shard of a DTensor, or a whole tensor) takes its part of `whole`."""
    if not isinstance(tensor, DTensor):
        tensor.copy_(whole)
        return
    part = whole
    mesh = tensor.device_mesh
    for dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard):
            pieces = torch.chunk(part, mesh.size(dim), dim=placement.dim)
            coordinate = mesh.get_local_rank(dim)
            part = (
                pieces[coordinate] if coordinate < len(pieces) else part.narrow(placement.dim, 0, 0)
            )
    own = tensor.to_local()
    if own.shape != part.shape:
        raise MetaUnsupported(
            "(sharding)", f"a shard of {tuple(own.shape)} is not the chunk {tuple(part.shape)}"
        )
    own.copy_(part)
