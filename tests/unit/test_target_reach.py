"""Every callable a config may name, scanned for a path to code that runs, imports, unpickles,
downloads or writes what its arguments say (framework/core/allowlist.py's families).

The scan follows calls it can resolve statically: names in a function's module (functions,
classes, modules' attributes) and methods of the class itself, through torch, torchvision and
framework code, to a fixed depth. A call on an object it cannot type (`obj.read()`) is not
followed: the scan is a tripwire for the obvious paths, not a proof; the deny list holds what it
found, and a target it flags must be refused or listed below with why a config cannot use it.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import marshal
import os
import pickle
import runpy
import shutil
import subprocess
import tarfile
import textwrap
import types
import urllib.request
import zipfile
from collections.abc import Iterator
from functools import cache

import pytest
import torch
import torch.hub
import torch.utils.cpp_extension

from framework.config.registry import shipped_targets
from framework.core.allowlist import TARGET_FAMILIES, target_problem

pytestmark = pytest.mark.slow

# What runs, imports, unpickles, downloads or extracts what its arguments name, or writes
# chosen bytes to a chosen path.
SINKS: dict[object, str] = {
    builtins.exec: "exec",
    builtins.eval: "eval",
    builtins.compile: "compile",
    builtins.__import__: "__import__",
    importlib.import_module: "importlib.import_module",
    pickle.load: "pickle.load",
    pickle.loads: "pickle.loads",
    pickle.Unpickler: "pickle.Unpickler",
    marshal.loads: "marshal.loads",
    torch.load: "torch.load",
    torch.save: "torch.save",
    torch.jit.load: "torch.jit.load",
    torch.hub.load: "torch.hub.load",
    torch.hub.load_state_dict_from_url: "torch.hub.load_state_dict_from_url",
    torch.hub.download_url_to_file: "torch.hub.download_url_to_file",
    torch.utils.cpp_extension.load: "cpp_extension.load",
    torch.utils.cpp_extension.load_inline: "cpp_extension.load_inline",
    torch.ops.load_library: "torch.ops.load_library",
    subprocess.Popen: "subprocess.Popen",
    subprocess.run: "subprocess.run",
    subprocess.call: "subprocess.call",
    subprocess.check_call: "subprocess.check_call",
    subprocess.check_output: "subprocess.check_output",
    os.system: "os.system",
    os.popen: "os.popen",
    **{getattr(os, name): f"os.{name}" for name in dir(os) if name.startswith(("exec", "spawn"))},
    runpy.run_path: "runpy.run_path",
    runpy.run_module: "runpy.run_module",
    shutil.unpack_archive: "shutil.unpack_archive",
    tarfile.open: "tarfile.open",
    zipfile.ZipFile: "zipfile.ZipFile",
    urllib.request.urlretrieve: "urllib.request.urlretrieve",
    urllib.request.urlopen: "urllib.request.urlopen",
}
WRITE_MODES = set("wax+")
# Special methods a run calls on what a config built (construction, calls, datasets); the
# others (copying, pickling, operators on containers) run on objects, not on config values.
PROTOCOL_METHODS = {"__init__", "__new__", "__call__", "__post_init__", "__getitem__", "__iter__"}
PROTOCOL_METHODS |= {"__next__", "__len__"}
FOLLOWED = ("torch", "torchvision", "framework")
_ABSENT = object()
DEPTH = 8

# Calls on a path the scan found that no config value reaches, and why.
REVIEWED_CALLS: dict[tuple[str, str], str] = {
    ("torch._utils._type", "torch._utils._import_dotted_name"): (
        "a storage's .type(name) imports the tensor type torch's own code names: a module's "
        "_apply converts with torch's dtypes, and a config cannot call a method"
    ),
    ("torch.nn.modules.module.Module.compile", "torch.compile"): (
        "a config cannot call a method; the run compiles the model itself (trainer.compile)"
    ),
    ("framework.storage.checkpoint.load_weights_only", "torch.serialization.load"): (
        "init.path's file is read with weights_only=True: tensors and plain values only, a "
        "pickle naming any other class is refused unrun (tests/integration/"
        "test_initial_weights.py: a pickle that would create a file creates none)"
    ),
    (
        "torch.distributed.checkpoint.filesystem.FileSystemReader.read_data",
        "torch.serialization.load",
    ): (
        "init.path's step_<N>.dcp/: DCP reads each tensor with weights_only=True, and "
        "framework.storage.sharded's TensorsOnlyPlanner refuses every pickled (byte) item"
    ),
    ("torch.distributed.checkpoint.filesystem.FileSystemReader.read_metadata", "_pickle.load"): (
        "the scan reaches the base class's method; framework.storage.sharded.SafeReader, the "
        "only reader built, overrides it with an unpickler of DCP's index classes alone"
    ),
    (
        "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner.load_bytes",
        "torch.serialization.load",
    ): (
        "the scan reaches the base class's method; framework.storage.sharded's "
        "TensorsOnlyPlanner, the only planner built, overrides it to refuse every byte item"
    ),
}


def allowed_callables() -> Iterator[str]:
    """Every dotted name a config may name: each family's public names, and every public
    callable defined in framework.components."""
    for family in TARGET_FAMILIES:
        module = importlib.import_module(family)
        for name in sorted(dir(module)):
            target = f"{family}.{name}"
            if callable(getattr(module, name, None)) and target_problem(target) is None:
                yield target
    yield from sorted(shipped_targets())


def _functions_of(obj: object) -> list[types.FunctionType]:
    """The Python functions a call of `obj` may run: a function itself, or every method a class
    and its bases within the followed packages define (constructor and all it may call)."""
    if isinstance(obj, types.FunctionType):
        return [obj]
    if isinstance(obj, types.MethodType) and isinstance(obj.__func__, types.FunctionType):
        return [obj.__func__]
    if not isinstance(obj, type):
        return []
    functions = []
    for klass in obj.__mro__:
        if not klass.__module__.startswith(FOLLOWED):
            continue
        for name, member in vars(klass).items():
            if name.startswith("__") and name not in PROTOCOL_METHODS:
                continue
            member = getattr(member, "__func__", member)  # staticmethod, classmethod
            if isinstance(member, property):
                member = member.fget
            if isinstance(member, types.FunctionType):
                functions.append(member)
    return functions


@cache
def _call_nodes(function: types.FunctionType) -> tuple[ast.Call, ...]:
    """The calls in `function`'s source, read once: a function (nn.Module's methods above all)
    is reached from many targets, through many classes and at many depths."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return ()
    return tuple(node for node in ast.walk(tree) if isinstance(node, ast.Call))


@cache
def _calls(function: types.FunctionType, owner: type | None) -> tuple[tuple[ast.Call, object], ...]:
    """Each call in `function` and what it resolves to for `owner` (None: not followed)."""
    return tuple((call, _callee(call, function, owner)) for call in _call_nodes(function))


def _lookup(function: types.FunctionType, name: str) -> object | None:
    """`name` as `function` sees it: its module's globals, then the builtins."""
    found = function.__globals__.get(name, _ABSENT)
    return vars(builtins).get(name) if found is _ABSENT else found


def _callee(call: ast.Call, function: types.FunctionType, owner: type | None) -> object | None:
    node = call.func
    if isinstance(node, ast.Name):
        return _lookup(function, node.id)
    if not isinstance(node, ast.Attribute):
        return None
    base = node.value
    if isinstance(base, ast.Name) and base.id in ("self", "cls") and owner is not None:
        return getattr(owner, node.attr, None)
    if isinstance(base, ast.Name):
        outer = _lookup(function, base.id)
        if isinstance(outer, types.ModuleType | type):
            return getattr(outer, node.attr, None)
    if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
        outer = _lookup(function, base.value.id)
        if isinstance(outer, types.ModuleType):
            inner = getattr(outer, base.attr, None)
            if isinstance(inner, types.ModuleType | type):
                return getattr(inner, node.attr, None)
    return None


def _writes_a_file(call: ast.Call, callee: object) -> bool:
    if callee is not builtins.open:
        return False
    mode = call.args[1] if len(call.args) > 1 else None
    mode = next((k.value for k in call.keywords if k.arg == "mode"), mode)
    if mode is None:
        return False
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return bool(WRITE_MODES & set(mode.value))
    return True  # a mode chosen at run time


def _all_constant(call: ast.Call) -> bool:
    """`importlib.import_module("torch._dynamo")`: what it runs is fixed in the source."""
    values = [*call.args, *(keyword.value for keyword in call.keywords)]
    return all(isinstance(value, ast.Constant) for value in values)


def _sink(obj: object) -> str | None:
    try:
        return SINKS.get(obj)
    except TypeError:  # unhashable
        return None


@cache
def path_to_sink(obj: object, depth: int = DEPTH) -> tuple[str, ...] | None:
    """The chain of calls from `obj` to a sink, or None when the scan finds none."""
    if depth == 0:
        return None
    owner = obj if isinstance(obj, type) else None
    for function in _functions_of(obj):
        where = f"{function.__module__}.{function.__qualname__}"
        for call, callee in _calls(function, owner):
            if callee is None or (where, _name(callee)) in REVIEWED_CALLS:
                continue
            sink = _sink(callee) or ("open(..., 'w')" if _writes_a_file(call, callee) else None)
            if sink and not _all_constant(call):
                return (where, sink)
            module = getattr(callee, "__module__", None) or ""
            if callee is obj or not module.startswith(FOLLOWED):
                continue
            if isinstance(callee, types.FunctionType | type | types.MethodType):
                deeper = path_to_sink(callee, depth - 1)
                if deeper:
                    return (where, *deeper)
    return None


def _name(obj: object) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"


def _locate(target: str) -> object:
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)


def reachable_sinks() -> dict[str, tuple[str, ...]]:
    found = {}
    for target in allowed_callables():
        chain = path_to_sink(_locate(target))
        if chain:
            found[target] = chain
    return found


def test_no_allowed_target_reaches_code_loading_or_writing():
    found = reachable_sinks()
    report = "".join(f"{name}: {' -> '.join(chain)}\n" for name, chain in sorted(found.items()))
    assert not found, "allowed targets that reach a sink:\n" + report


@pytest.mark.parametrize(
    ("target", "sink"),
    [
        ("torchvision.datasets.CIFAR10", "pickle.load"),
        ("torchvision.datasets.MNIST", "torch.load"),
        ("torchvision.datasets.Caltech101", "urllib.request.urlopen"),
        ("torchvision.models.ResNet18_Weights", "torch.hub.load_state_dict_from_url"),
        ("framework.components.loggers.JsonlSink", "open(..., 'w')"),
    ],
)
def test_the_scan_sees_the_paths_the_allowlist_closes(target, sink):
    """The scan is not blind: what the families leave out would reach a sink."""
    chain = path_to_sink(_locate(target))
    assert chain is not None and chain[-1] == sink, chain
    assert target_problem(target, shipped=shipped_targets()) is not None
