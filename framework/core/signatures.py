"""A callable's keyword parameters and their annotations, read from its module's source without
importing it.

An option's keys are typed by the signature of its `_target_` (config/keys.py), and a config
mistake must be refused before the training stack is imported: importing `torch.optim` to read
SGD's signature costs seconds, parsing the few files that lead to it costs milliseconds. So the
module is found the way the import system would find it (`importlib.machinery.PathFinder`, which
executes nothing) and its source parsed with `ast`, following `from x import name` re-exports,
plain assignments and a class's bases to the definition. What cannot be read that way (a C
extension, a name made at import time, a decorator that replaces a signature) is None: unknown,
and then not checked. Parsed files are cached by path, modification time and size, so a file
that changes is read again (docs/architecture.md says why source and not a cache on disk).
"""

from __future__ import annotations

import ast
import copy
import difflib
import functools
import importlib.machinery
import os
import pkgutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FOLLOW_AT_MOST = 12  # re-exports, aliases and bases followed to a definition


@dataclass(frozen=True)
class Parameter:
    name: str
    annotation: ast.expr | None  # as written; from __future__ annotations changes nothing here
    required: bool  # no default
    default: ast.expr | None = None  # the default as written, where there is one


@dataclass(frozen=True)
class Signature:
    target: str
    parameters: dict[str, Parameter]  # those a keyword can give (not *args, not positional-only)
    takes_kwargs: bool  # **kwargs: any other keyword is accepted too


@dataclass(frozen=True)
class Definition:
    """Where a dotted name is defined: its module, its file, and the def or class node."""

    module: str
    path: Path
    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    owner: str = ""  # the class a method is defined in

    @property
    def qualified_name(self) -> str:
        """`module.Name`, or `module.Class.method`: what the object's __qualname__ says."""
        qualname = f"{self.owner}.{self.node.name}" if self.owner else self.node.name
        return f"{self.module}.{qualname}"


def signature_of(target: str) -> Signature | None:
    """The keyword parameters of the callable `target` names ("pkg.module.Name"), or None when
    its source does not say them."""
    found = definition_of(target)
    if found is None:
        return None
    return _signature(target, found, FOLLOW_AT_MOST)


def definition_of(target: str) -> Definition | None:
    """Where `target` ("pkg.module.Name", or "pkg.module.Class.method") is defined, from source;
    None when it is not a function or class found that way."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module
        module = ".".join(parts[:cut])
        if source_file(module) is None:
            continue
        found = _lookup(module, parts[cut], FOLLOW_AT_MOST)
        for attribute in parts[cut + 1 :]:
            found = _member(found, attribute)
        return found
    return None


def source_file(module: str) -> Path | None:
    """The .py file of `module` (a package's __init__.py), found without importing anything."""
    return _source_file(module, tuple(sys.path), os.getcwd())


@functools.lru_cache(maxsize=4096)
def _source_file(module: str, search: tuple[str, ...], cwd: str) -> Path | None:
    locations: list[str] | None = [entry or cwd for entry in search]
    spec = None
    names = module.split(".")
    for depth in range(1, len(names) + 1):
        if locations is None:  # a plain module has no submodules
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(names[:depth]), locations)
        if spec is None:
            return None
        locations = list(spec.submodule_search_locations or []) or None
    origin = spec.origin if spec is not None else None
    if origin is None or not origin.endswith(".py"):
        return None  # a namespace package, or compiled code
    return Path(origin)


def is_package(module: str) -> bool:
    path = source_file(module)
    return path is not None and path.name == "__init__.py"


def parsed(path: Path) -> ast.Module | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return _parsed(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=512)
def _parsed(path: str, mtime_ns: int, size: int) -> ast.Module | None:
    try:
        return ast.parse(Path(path).read_bytes(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


def _lookup(module: str, name: str, budget: int) -> Definition | None:
    """`name` as module `module` defines or re-exports it."""
    path = source_file(module)
    tree = parsed(path) if path is not None else None
    if path is None or tree is None or budget <= 0:
        return None
    found: Definition | None = None
    for node in _top_level(tree.body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                found = Definition(module, path, node)  # the last binding wins, as at runtime
        elif isinstance(node, ast.ImportFrom):
            source = _imported_module(module, node)
            for alias in node.names:
                if alias.name == "*" and source is not None:
                    found = _lookup(source, name, budget - 1) or found
                elif (alias.asname or alias.name) == name and source is not None:
                    found = _lookup(source, alias.name, budget - 1)
        elif isinstance(node, ast.Assign) and _assigns(node, name):
            found = _followed(module, node.value, budget - 1)
    return found


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """A module's statements, with those of its top-level if/try blocks (the branch taken is
    not known without running it: the later definition wins, as most such blocks intend)."""
    statements: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            statements += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            statements += _top_level(node.body)
        else:
            statements.append(node)
    return statements


def _imported_module(module: str, node: ast.ImportFrom) -> str | None:
    if node.level == 0:
        return node.module
    package = module if is_package(module) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _assigns(node: ast.Assign, name: str) -> bool:
    return any(isinstance(target, ast.Name) and target.id == name for target in node.targets)


def _followed(module: str, value: ast.expr, budget: int) -> Definition | None:
    """What `name = value` binds, where value is a name or a dotted name."""
    dotted = _dotted(value)
    if dotted is None:
        return None
    head, _, rest = dotted.partition(".")
    found = _lookup(module, head, budget)
    if found is None and rest:
        return definition_of(dotted)
    for attribute in rest.split(".") if rest else ():
        found = _member(found, attribute)
    return found


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _member(found: Definition | None, name: str) -> Definition | None:
    if found is None or not isinstance(found.node, ast.ClassDef):
        return None
    for node in found.node.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and (
            node.name == name
        ):
            return Definition(found.module, found.path, node, owner=found.node.name)
    return None


def _signature(target: str, found: Definition, budget: int) -> Signature | None:
    node = found.node
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return _from_arguments(target, node.args, _aliases(found))
    if _is_dataclass(node):
        return _dataclass_signature(target, found, budget)
    init = _member(found, "__init__")
    if init is not None:
        args = init.node.args  # type: ignore[union-attr]
        signature = _from_arguments(target, args, _aliases(found))
        return _without_self(signature)
    for base in node.bases:  # no __init__ of its own: the first base's that has one
        dotted = _dotted(base)
        if dotted is None or budget <= 0:
            return None
        parent = _followed(found.module, base, budget - 1)
        if parent is None:
            return None
        if isinstance(parent.node, ast.ClassDef):
            return _signature(target, parent, budget - 1)
    return Signature(target, {}, takes_kwargs=False)  # object.__init__


def _is_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        name = _dotted(decorator.func if isinstance(decorator, ast.Call) else decorator)
        if name is not None and name.rpartition(".")[2] == "dataclass":
            return True
    return False


def _dataclass_signature(target: str, found: Definition, budget: int) -> Signature:
    node = found.node
    assert isinstance(node, ast.ClassDef)
    parameters = {}
    for base in node.bases:
        parent = _followed(found.module, base, budget - 1)
        if parent is not None and isinstance(parent.node, ast.ClassDef):
            inherited = _signature(target, parent, budget - 1)
            if inherited is not None:
                parameters.update(inherited.parameters)
    aliases = _aliases(found)
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            name = statement.target.id
            annotation = _unaliased(statement.annotation, aliases)
            parameters[name] = Parameter(
                name, annotation, statement.value is None, _field_default(statement.value)
            )
    return Signature(target, parameters, takes_kwargs=False)


def _field_default(value: ast.expr | None) -> ast.expr | None:
    """A dataclass field's default: `= 3`, or `= field(default=3)` (a factory is no literal)."""
    if isinstance(value, ast.Call) and _dotted(value.func) in ("field", "dataclasses.field"):
        given = {keyword.arg: keyword.value for keyword in value.keywords}
        return given.get("default")
    return value


def _from_arguments(target: str, args: ast.arguments, aliases: dict[str, ast.expr]) -> Signature:
    """Decorators are taken to keep the signature (functools.wraps does; torchvision's
    @register_model() and @handle_legacy_interface(...) do)."""
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    named = [
        (arg, default)
        for arg, default in zip(positional, defaults, strict=True)
        if arg not in args.posonlyargs
    ]
    named += list(zip(args.kwonlyargs, args.kw_defaults, strict=True))
    parameters = {
        arg.arg: Parameter(arg.arg, _unaliased(arg.annotation, aliases), default is None, default)
        for arg, default in named
    }
    return Signature(target, parameters, takes_kwargs=args.kwarg is not None)


Named = ast.expr | tuple[str, str]  # an alias's value, or the (module, name) it is imported from


def _aliases(found: Definition) -> dict[str, ast.expr]:
    """Its module's type aliases: its own, and those imported from its package or ours."""
    packages = {found.module.partition(".")[0], __name__.partition(".")[0]}  # (not torch: huge)
    named = {name: _alias(value, packages) for name, value in _top_level_names(found.path)}
    return {name: alias for name, alias in named.items() if alias is not None}


def _alias(value: Named, packages: set[str], budget: int = 4) -> ast.expr | None:
    if isinstance(value, ast.expr):
        return value
    module, name = value  # imported: followed through re-exports
    source = source_file(module) if module.partition(".")[0] in packages and budget else None
    there = dict(_top_level_names(source)) if source else {}
    return _alias(there[name], packages, budget - 1) if name in there else None


def _top_level_names(path: Path) -> Iterator[tuple[str, Named]]:
    """Each alias assigned, (name, value); each name imported, (name, (module, name there))."""
    tree = parsed(path)
    for node in _top_level(tree.body if tree is not None else []):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript | ast.BinOp):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    yield target.id, node.value
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for imported in node.names:
                yield imported.asname or imported.name, (node.module, imported.name)


def _unaliased(annotation: ast.expr | None, aliases: dict[str, ast.expr]) -> ast.expr | None:
    """The annotation with the module's aliases written out, where it names one."""
    if annotation is None or not aliases:
        return annotation

    class Expand(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.expr:
            return aliases.get(node.id, node)

    return Expand().visit(copy.deepcopy(annotation))


def _without_self(signature: Signature) -> Signature:
    names = list(signature.parameters)
    parameters = {name: signature.parameters[name] for name in names[1:]}
    return Signature(signature.target, parameters, signature.takes_kwargs)


def class_literal(target: str, attribute: str) -> object | None:
    """The value a class assigns to `attribute` in its body (or a base's), when the source writes
    it as a literal and no method assigns `self.<attribute>`; None otherwise."""
    found = definition_of(target)
    budget = FOLLOW_AT_MOST
    while found is not None and isinstance(found.node, ast.ClassDef) and budget > 0:
        if _assigned_on_instances(found.node, attribute):
            return None
        for statement in found.node.body:
            value = _assigned_value(statement, attribute)
            if value is not None:
                try:
                    return ast.literal_eval(value)
                except ValueError:
                    return None
        bases = found.node.bases
        found = _followed(found.module, bases[0], budget - 1) if bases else None
        budget -= 1
    return None


def _assigned_value(statement: ast.stmt, name: str) -> ast.expr | None:
    if isinstance(statement, ast.Assign) and _assigns(statement, name):
        return statement.value
    if (
        isinstance(statement, ast.AnnAssign)
        and isinstance(statement.target, ast.Name)
        and statement.target.id == name
    ):
        return statement.value
    return None


def _assigned_on_instances(node: ast.ClassDef, name: str) -> bool:
    """Whether a method assigns `self.<name>` (the value then depends on the instance)."""
    return any(
        isinstance(target, ast.Attribute)
        and target.attr == name
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
        for statement in ast.walk(node)
        if isinstance(statement, ast.Assign | ast.AnnAssign | ast.AugAssign)
        for target in (
            statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        )
    )


def suggestion(target: str) -> str | None:
    """The existing dotted name nearest to `target` when `target` names nothing (a typo in a
    package, a module or a name: `myprj.nets.MLP`, `myproj.netz.MLP`, `myproj.nets.MLPP`),
    found from source and the import path without importing anything; None when `target`
    exists or nothing is near it."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):  # the longest prefix that is a module
        module = ".".join(parts[:cut])
        if source_file(module) is None and not _is_namespace(module):
            continue
        if cut == len(parts) or definition_of(target) is not None:
            return None
        near = _nearest(parts[cut], _members(module))
        return ".".join([module, near, *parts[cut + 1 :]]) if near else None
    near = _nearest(parts[0], _top_level_modules())
    return ".".join([near, *parts[1:]]) if near else None


def module_suggestion(target: str) -> str | None:
    """For a `target` that names a module, not a callable (`torch.optim.adam`): the callable
    meant, a name its parent binds in another case (`torch.optim.Adam`), else the one public
    class or function the module defines; None where `target` is no module or nothing fits."""
    path = source_file(target)
    if path is None:
        return None
    parent, _, name = target.rpartition(".")
    same = _in_another_case(name, _members(parent) - {name}) if parent else None
    if same is not None:
        return f"{parent}.{same}"
    tree = parsed(path)
    defined = [
        node.name
        for node in (tree.body if tree is not None else [])
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_")
    ]
    return f"{target}.{defined[0]}" if len(defined) == 1 else None


def _nearest(name: str, candidates: set[str]) -> str | None:
    """The candidate `name` was meant to be: the same name in another case first (`Adamw` is
    AdamW, not Adam; `Amp` is AMP, which no spelling distance finds), else the closest."""
    same = _in_another_case(name, candidates)
    if same is not None:
        return same
    close = difflib.get_close_matches(name, sorted(candidates), n=1)
    return close[0] if close else None


def _in_another_case(name: str, candidates: set[str]) -> str | None:
    same = sorted(candidate for candidate in candidates if candidate.lower() == name.lower())
    return same[0] if same else None


def _members(module: str, budget: int = 3) -> set[str]:
    """The public names a module's source binds (through `from x import *` too), and its
    submodules if it is a package."""
    names: set[str] = set()
    path = source_file(module)
    tree = parsed(path) if path is not None else None
    for node in _top_level(tree.body if tree is not None else []):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom) and node.names[0].name == "*" and budget > 0:
            source = _imported_module(module, node)
            names.update(_members(source, budget - 1) if source else ())
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for location in _package_locations(module):
        names.update(info.name for info in pkgutil.iter_modules([location]))
    return {name for name in names if not name.startswith("_") and name != "*"}


def _package_locations(module: str) -> list[str]:
    spec = _spec(module)
    return list(spec.submodule_search_locations or []) if spec is not None else []


def _is_namespace(module: str) -> bool:
    spec = _spec(module)
    return spec is not None and spec.origin is None and bool(spec.submodule_search_locations)


def _spec(module: str) -> importlib.machinery.ModuleSpec | None:
    locations: list[str] | None = [entry or os.getcwd() for entry in sys.path]
    spec = None
    for depth, _ in enumerate(module.split("."), start=1):
        if locations is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(
            ".".join(module.split(".")[:depth]), locations
        )
        if spec is None:
            return None
        locations = list(spec.submodule_search_locations or []) or None
    return spec


def _top_level_modules() -> set[str]:
    """Every module and package on the import path (names only: nothing is imported)."""
    paths = [entry or os.getcwd() for entry in sys.path]
    return {info.name for info in pkgutil.iter_modules(paths)} | set(sys.builtin_module_names)
