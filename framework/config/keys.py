"""Every key of the config is one that a schema or a callable takes, of the type and within the
bounds declared beside it. The one walker of the declarations (docs/architecture.md, "Where a
rule goes"):

- the framework's own sections (trainer, checkpoint, dist, eval, the launcher) and each group's
  base keys (data.batch_size, optimizer.lr): the fields of config/schemas.py, typed (OmegaConf
  refuses a wrong type as it composes) and bounded (`Annotated[int, Ge(1)]`);
- an option's own keys: the parameters of its callable (`_target_`), read from source without
  importing it (core/signatures.py), typed and bounded by their annotations alike, a shipped
  component's and yours;
- what a `_target_` may name: core/allowlist.py.

Bounds are annotated_types' Ge, Gt, Le, Lt, Interval, MinLen and MaxLen, on a value, or on each
item of a list or value of a mapping (`list[Annotated[int, Ge(1)]]`). A misspelt keyword
(`+model.hiden=3`, `data.val_fracton=0.3`) gets a did-you-mean, where the callable would fail in
every rank or, taking **kwargs, train silently with the default; a parameter without a default
that nothing gives and a null where the annotation takes none are refused too. An unknown key is
let through only where the callable takes **kwargs and the key is near none it names
(torchvision's `resnet18(**kwargs)` takes `num_classes`).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import re
import typing
from collections.abc import Iterator, Mapping
from typing import Any

import annotated_types
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.config import schemas as s
from framework.config.registry import (
    GROUP_BASES,
    LAUNCHERS,
    read_option,
    shipped_options,
    shipped_targets,
)
from framework.core.allowlist import check_targets, trusted_prefixes
from framework.core.exits import ConfigError
from framework.core.signatures import Signature, signature_of

HYDRA_KEYS = frozenset({"_target_", "_partial_", "_convert_", "_recursive_", "_args_"})
# The keywords the framework gives each group's callable when it calls it (framework/rank/
# build.py, components/optim.py, components/loggers.py): an option need not set them.
GIVEN_AT_CALL: dict[str, frozenset[str]] = {
    "data": frozenset({"collate_fn"}),
    "optimizer": frozenset({"params", "lr"}),
    "scheduler": frozenset({"optimizer", "total_steps"}),
    "precision": frozenset({"device"}),
    "comm": frozenset({"env"}),
    "logger": frozenset({"run", "config", "resume_id", "resume_step"}),
}
# The framework's own sections: every key is a field of their schema (`+trainer.max_step=...`
# would otherwise be accepted and never read). The root's are closed by OmegaConf itself.
CLOSED_SECTIONS = {
    "trainer": s.TrainerConfig,
    "trainer.early_stopping": s.EarlyStoppingConfig,
    "checkpoint": s.CheckpointConfig,
    "dist": s.DistConfig,
    "dist.ddp": s.DDPConfig,
    "eval": s.EvalConfig,
}
BUILT_GROUPS = ("task", "model", "data", "optimizer", "scheduler")
BOUNDS = ("Ge", "Gt", "Le", "Lt", "Interval", "MinLen", "MaxLen")


def check_keys(cfg: DictConfig, bounds: bool = True) -> None:
    """Raise ConfigError for the first key that nothing takes, a value not of its key's type
    or (`bounds`) outside its bounds, a value nothing gives, or a `_target_` that may not be
    named. Reads the callables' source; imports nothing. A value that cannot be resolved
    before the job (`${hydra:job.num}`) is left to the job, which checks it again. What a
    command only shows (--cfg job) is shown with a value out of bounds as it is."""
    try:
        trusted_prefixes(cfg)  # first: an allowed_targets that does not resolve says so
        _check_builders_named(cfg)
        _check_nothing_missing(cfg)
        for path, node, schema, closed in _sections(cfg):
            _check_section(path, node, schema, closed, bounds)
        check_targets(cfg, shipped_targets())
        for path, node, base in _options(cfg):
            _check_option(path, node, base, bounds)
    except OmegaConfBaseException as error:  # a value that is not of its key's type
        raise ConfigError(f"{error.full_key}: {str(error).splitlines()[0]}") from None


def check_call_settings(path: str, node: DictConfig, target: str) -> None:
    """Raise ConfigError for a key of `node` that `target` does not take, or a value not of
    its type or outside its bounds, as its signature declares them (hydra.sweeper's pruner
    settings: framework/core/pruners.py)."""
    signature = signature_of(target)
    if signature is None:
        return
    for key in node:
        _check_parameter(path, str(key), node, signature, frozenset(), frozenset(), bounds=True)


# --- what is missing ------------------------------------------------------------------------
def _check_builders_named(cfg: DictConfig) -> None:
    """A user's option written without its schema's defaults has no `_target_` at all; its
    other keys' interpolations would fail first, naming a key the user never wrote."""
    for group in BUILT_GROUPS:
        node = cfg.get(group)
        if isinstance(node, DictConfig) and "_target_" not in node:
            raise ConfigError(_unnamed_builder(f"{group}._target_"))


def _unnamed_builder(key: str) -> str:
    group = key.rsplit(".", 1)[0]
    return (
        f"{key} is not set: the {group} option must name what builds it (`_target_: "
        f"my_package.module.name` in its YAML file; see docs/tasks.md)"
    )


def _check_nothing_missing(cfg: DictConfig) -> None:
    """A mandatory value (??? in a schema) that no option or override set."""
    # Hydra's own node holds values that exist only inside a job (hydra.job.num): not walked.
    # Read unresolved: a value set only in the job (${hydra:job.num}) is not missing.
    plain = OmegaConf.to_container(cfg, resolve=False)
    missing = sorted(
        path for path in _missing(plain) if not path.startswith("hydra.") and "." in path
    )
    if missing and missing[0].endswith("_target_"):
        raise ConfigError(_unnamed_builder(missing[0]))
    if missing:
        raise ConfigError(f"{missing[0]} is not set: give it a value ({missing[0]}=...)")


def _missing(node: Any, path: str = "") -> Iterator[str]:
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from _missing(value, f"{path}.{key}" if path else str(key))
    elif node == "???":
        yield path


# --- the framework's sections and each group's base keys ------------------------------------
def _sections(cfg: DictConfig) -> Iterator[tuple[str, DictConfig, type, bool]]:
    """(path, node, its schema, closed: every key must be a field) of each typed section."""
    yield "", cfg, s.Config, False  # (its keys: OmegaConf's)
    for path, schema in CLOSED_SECTIONS.items():
        yield path, OmegaConf.select(cfg, path), schema, True
    if (launcher := LAUNCHERS.get(str(cfg.launcher.get("name")))) is not None:
        yield "launcher", cfg.launcher, launcher, True  # its keys: its start method's schema
    for path, node, base in _options(cfg):
        yield path, node, base, False  # (an option's other keys are its callable's)


def _check_section(path: str, node: DictConfig, schema: type, closed: bool, bounds: bool) -> None:
    hints = typing.get_type_hints(schema, include_extras=True)
    known = [field.name for field in dataclasses.fields(schema)]
    for key in node.keys() if node is not None else ():
        full = f"{path}.{key!s}" if path else str(key)
        if key not in known:
            if closed:
                raise ConfigError(f"{full} is not a setting: {_near(path, str(key), known)}")
            continue
        if bounds and (declared := _hint_bounds(hints[key])) is not None:
            _check_bounds(full, node, str(key), declared)


def _near(path: str, key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f"did you mean {path}.{close[0]}?" if close else f"the keys are {', '.join(known)}"


# --- an option's own keys, by its callable's signature --------------------------------------
def _options(cfg: DictConfig) -> Iterator[tuple[str, DictConfig, type]]:
    for group, base in GROUP_BASES.items():
        node = cfg.get(group)
        if group == "logger":  # any number of them, each under its name
            for name, logger in (node or {}).items():
                if isinstance(logger, DictConfig) and "_target_" in logger:
                    yield f"logger.{name}", logger, base
        elif isinstance(node, DictConfig) and "_target_" in node:
            yield group, node, base


def _check_option(path: str, node: DictConfig, base: type, bounds: bool) -> None:
    declared = HYDRA_KEYS | {field.name for field in dataclasses.fields(base)}
    extra = [str(key) for key in node if str(key) not in declared]
    if not extra:  # every key is the framework's: nothing to read (a parameter it lacks is
        return  # the constructor's to name, in one line: the trial, rank/preflight.py)
    signature = signature_of(str(node._target_))
    if signature is None:  # not readable from source: instantiate reports what it finds
        return
    given = GIVEN_AT_CALL.get(path.split(".")[0], frozenset()) - declared
    for key in extra:
        if key in given:  # the framework's value would win over the option's
            raise ConfigError(
                f"{path}.{key} is given by the framework when it builds the {path}, "
                "over any value set here: remove it"
            )
        _check_parameter(path, key, node, signature, declared, given, bounds)
    for key in declared & set(signature.parameters):  # a framework key the callable takes
        _check_parameter(path, key, node, signature, declared, given, bounds)
    _check_required(path, node, signature, given)


def _check_required(
    path: str, node: DictConfig, signature: Signature, given: frozenset[str]
) -> None:
    """Every parameter without a default is in the option or given by the framework (positional
    `_args_` may give any of them)."""
    if "_args_" in node:
        return
    for name, parameter in signature.parameters.items():
        if parameter.required and name not in node and name not in given:
            raise ConfigError(
                f"{path}.{name} is not set and {signature.target} has no default for it: "
                f"give it a value (+{path}.{name}=...)"
            )


def options_taking(group: str, key: str) -> list[str]:
    """The shipped options of `group` whose callable takes `key` (init.path: init=file)."""
    if group not in GROUP_BASES:
        return []
    found = []
    for name, path in shipped_options(group).items():
        target = read_option(path).get("_target_")
        signature = signature_of(str(target)) if target else None
        if signature is not None and key in signature.parameters:
            found.append(name)
    return found


def _check_parameter(
    path: str,
    key: str,
    node: DictConfig,
    signature: Signature,
    declared: frozenset[str],
    given: frozenset[str],
    bounds: bool,
) -> None:
    parameter = signature.parameters.get(key)
    if parameter is None:
        settable = set(signature.parameters) - given
        known = (settable | declared) - HYDRA_KEYS
        close = difflib.get_close_matches(key, sorted(known), n=1)
        if signature.takes_kwargs and not close:
            return
        hint = (
            f"did you mean {path}.{close[0]}?"
            if close
            else f"it takes {', '.join(sorted(settable)) or 'no keyword'}"
        )
        if not close and (others := options_taking(path, key)):
            hint += f"; {' or '.join(f'{path}={name}' for name in others)} takes it"
        raise ConfigError(f"{path}.{key} is not a setting of {signature.target}: {hint}")
    annotation = parameter.annotation
    if annotation is None:
        return
    try:
        value = node[key]
    except OmegaConfBaseException:  # a resolver's value, set only in the job (${hydra:...})
        return
    if value is None and not _may_be_null(annotation, parameter.default):
        _refuse_null(path, key, node, annotation, signature.target)
    check_type(f"{path}.{key}", value, annotation, signature.target)
    if bounds and (declared_bounds := _source_bounds(annotation)) is not None:
        _check_bounds(f"{path}.{key}", node, key, declared_bounds)


def _may_be_null(annotation: ast.expr, default: ast.expr | None) -> bool:
    """None is the parameter's own default, or its annotation takes it (or says nothing
    checkable)."""
    default_is_none = isinstance(default, ast.Constant) and default.value is None
    return default_is_none or _accepts(annotation, None) is not False


def _refuse_null(path: str, key: str, node: DictConfig, annotation: ast.expr, target: str) -> None:
    written = _written(annotation)
    if OmegaConf.is_interpolation(node, key):  # a setting of another group that is not set
        raw = OmegaConf.to_container(node, resolve=False)
        source = str(raw[key]) if isinstance(raw, dict) else "an interpolation"
        other = re.fullmatch(r"\$\{(\w+)\.([\w.]+)\}", source)
        if other is None:  # a resolver's (${hydra:job.num}): it may be set only when the job runs
            return
        fix = f"pick a {other[1]} option that sets {other[1]}.{other[2]}"
        raise ConfigError(
            f"{path}.{key} is null (from {source}) but {target} takes {key}: {written}: "
            f"{fix}, or give {path}.{key} a value"
        )
    raise ConfigError(
        f"{path}.{key}=null is not of type {written}: {target} takes {key}: {written}"
    )


def check_type(key: str, value: Any, annotation: ast.expr, target: str) -> None:
    """Raise ConfigError when `value` is not of the annotated type (as far as an annotation
    written with builtins, typing's Optional/Union/Literal/Annotated and containers says; any
    other annotation accepts anything). None is left to the callable: it may be its own
    default."""
    if value is None or _accepts(annotation, value) is not False:
        return
    name, written = key.split(".")[-1], _written(annotation)
    choices = _choices(annotation)
    expected = f"one of {', '.join(map(repr, choices))}" if choices else f"of type {written}"
    raise ConfigError(f"{key}={_shown(value)} is not {expected}: {target} takes {name}: {written}")


def _written(annotation: ast.expr) -> str:
    """The annotation's type as its source writes it, without its bounds (they are said apart)."""

    class WithoutBounds(ast.NodeTransformer):
        def visit_Subscript(self, node: ast.Subscript) -> ast.expr:
            if _name(node.value) == "Annotated" and isinstance(node.slice, ast.Tuple):
                return typing.cast(ast.expr, self.visit(node.slice.elts[0]))
            return typing.cast(ast.expr, self.generic_visit(node))

    return ast.unparse(WithoutBounds().visit(copy.deepcopy(annotation)))


def _choices(annotation: ast.expr) -> list[Any]:
    """The values a Literal annotation allows (inside an Optional or `| None` too)."""
    return [
        node.value
        for literal in ast.walk(annotation)
        if isinstance(literal, ast.Subscript) and _name(literal.value) == "Literal"
        for node in ast.walk(literal.slice)
        if isinstance(node, ast.Constant)
    ]


def _shown(value: Any) -> str:
    if isinstance(value, DictConfig | ListConfig):
        return str(OmegaConf.to_container(value))
    return repr(value)


# What a value of each builtin annotation may be (bool is an int to Python, and not one here).
# str: any scalar, since `name=123` on the command line arrives as an int that a str takes.
SCALARS: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str, int, float),
    "complex": (int, float, complex),
}
SEQUENCES = {"list", "List", "tuple", "Tuple", "Sequence", "Iterable", "Collection", "set"}
MAPPINGS = {"dict", "Dict", "Mapping", "MutableMapping"}
UNIONS = {"Union", "Optional"}


def _accepts(annotation: ast.expr, value: Any) -> bool | None:
    """True or False where the annotation says; None where it says nothing we can check."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:  # a string annotation: the same, quoted
            return _accepts(ast.parse(annotation.value, mode="eval").body, value)
        except SyntaxError:
            return None
    if isinstance(annotation, ast.Constant) and annotation.value is None:
        return value is None
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _any_of([annotation.left, annotation.right], value)
    name = _name(annotation.value if isinstance(annotation, ast.Subscript) else annotation)
    if isinstance(annotation, ast.Subscript):
        return _accepts_subscript(name, annotation.slice, value)
    if name in SCALARS:
        return isinstance(value, SCALARS[name]) and (name == "bool") == isinstance(value, bool)
    if name in SEQUENCES:
        return isinstance(value, ListConfig | list | tuple)
    if name in MAPPINGS:
        return isinstance(value, DictConfig | dict)
    return None


def _accepts_subscript(name: str | None, inner: ast.expr, value: Any) -> bool | None:
    items = inner.elts if isinstance(inner, ast.Tuple) else [inner]
    if name == "Annotated":  # the type, then its bounds
        return _accepts(items[0], value)
    if name in UNIONS:
        return value is None if name == "Optional" and value is None else _any_of(items, value)
    if name == "Literal":
        choices = [item.value for item in items if isinstance(item, ast.Constant)]
        return value in choices and type(value) in {type(choice) for choice in choices}
    if name in SEQUENCES:
        if not isinstance(value, ListConfig | list | tuple):
            return False
        variadic = isinstance(items[-1], ast.Constant) and items[-1].value is Ellipsis
        if name in ("tuple", "Tuple") and len(items) > 1 and not variadic:  # one per position
            return len(value) == len(items) and all(
                _accepts(element, item) is not False
                for element, item in zip(items, value, strict=True)
            )
        return all(_accepts(items[0], item) is not False for item in value)
    if name in MAPPINGS:
        return isinstance(value, DictConfig | dict)
    return None


def _any_of(options: list[ast.expr], value: Any) -> bool | None:
    verdicts = [_accepts(option, value) for option in options]
    if any(verdict is None or verdict for verdict in verdicts):
        return None if not any(verdicts) else True
    return False


def _name(node: ast.expr) -> str | None:
    """`int`, `typing.Optional` -> `Optional`, `t.List` -> `List`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


# --- bounds ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Bounds:
    """What a value must satisfy (`own`), and each item of it, a list's or a mapping's
    values (`items`)."""

    own: tuple[Any, ...] = ()
    items: Bounds | None = None


def _hint_bounds(hint: Any) -> Bounds | None:
    """The bounds a schema field's type declares (typing's objects)."""
    if typing.get_origin(hint) is typing.Annotated:
        inner = _hint_bounds(hint.__origin__)
        own = tuple(m for m in hint.__metadata__ if type(m).__name__ in BOUNDS)
        return Bounds(own, inner.items if inner else None) if own or inner else None
    arguments = typing.get_args(hint)
    if typing.get_origin(hint) in (list, tuple, dict) and arguments:
        items = _hint_bounds(arguments[-1])
        return Bounds(items=items) if items else None
    return next((b for a in arguments if (b := _hint_bounds(a)) is not None), None)  # a union


def _source_bounds(annotation: ast.expr) -> Bounds | None:
    """The bounds a callable's annotation declares, read from its source."""
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _source_bounds(annotation.left) or _source_bounds(annotation.right)
    if not isinstance(annotation, ast.Subscript):
        return None
    name = _name(annotation.value)
    inner = annotation.slice
    items = inner.elts if isinstance(inner, ast.Tuple) else [inner]
    if name == "Annotated":
        own = tuple(bound for item in items[1:] if (bound := _bound_of(item)) is not None)
        below = _source_bounds(items[0])
        return Bounds(own, below.items if below else None) if own or below else None
    if name in SEQUENCES or name in MAPPINGS:
        below = _source_bounds(items[-1])
        return Bounds(items=below) if below else None
    if name in UNIONS:
        return next((found for item in items if (found := _source_bounds(item))), None)
    return None


def _bound_of(node: ast.expr) -> Any:
    """`Ge(1)` or `annotated_types.Interval(gt=0, lt=1)` as written: the bound, else None."""
    if not isinstance(node, ast.Call) or _name(node.func) not in BOUNDS:
        return None
    try:
        args = [ast.literal_eval(arg) for arg in node.args]
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except ValueError:  # not a literal: not checked
        return None
    return getattr(annotated_types, str(_name(node.func)))(*args, **kwargs)


def _check_bounds(key: str, node: DictConfig, name: str, bounds: Bounds) -> None:
    try:
        value = node[name]
    except OmegaConfBaseException:  # set only in the job (${hydra:...}): checked there
        return
    if (problem := _bounds_problem(value, bounds)) is not None:
        raise ConfigError(f"{key}={_plain(value)} {problem}")


def _bounds_problem(value: Any, bounds: Bounds) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    for bound in bounds.own:
        if not _within(value, bound):
            return f"must be {_said(bound)}"
    if bounds.items is not None and isinstance(value, ListConfig | DictConfig | list | dict):
        items = value.values() if isinstance(value, Mapping | DictConfig) else value
        for item in items:
            if (problem := _bounds_problem(item, bounds.items)) is not None:
                return f"{problem} (each item)"
    return None


def _within(value: Any, bound: Any) -> bool:
    if isinstance(bound, annotated_types.MinLen | annotated_types.MaxLen):
        size = len(value) if hasattr(value, "__len__") else None
        if size is None:
            return True
        return (
            size >= bound.min_length
            if isinstance(bound, annotated_types.MinLen)
            else (size <= bound.max_length)
        )
    if not isinstance(value, int | float):
        return True  # (its type is the type check's)
    return all(
        limit is None or compare(value, limit)
        for limit, compare in (
            (getattr(bound, "ge", None), lambda v, x: v >= x),
            (getattr(bound, "gt", None), lambda v, x: v > x),
            (getattr(bound, "le", None), lambda v, x: v <= x),
            (getattr(bound, "lt", None), lambda v, x: v < x),
        )
    )


def _said(bound: Any) -> str:
    if isinstance(bound, annotated_types.MinLen):
        return f"at least {bound.min_length} long"
    if isinstance(bound, annotated_types.MaxLen):
        return f"at most {bound.max_length} long"
    ge, gt = getattr(bound, "ge", None), getattr(bound, "gt", None)
    le, lt = getattr(bound, "le", None), getattr(bound, "lt", None)
    low, high = (ge, gt) != (None, None), (le, lt) != (None, None)
    if low and high:
        left = f"[{ge}" if ge is not None else f"({gt}"
        right = f"{le}]" if le is not None else f"{lt})"
        return f"in {left}, {right}"
    if low:
        return f">= {ge}" if ge is not None else f"> {gt}"
    return f"<= {le}" if le is not None else f"< {lt}"


def _plain(value: Any) -> str:
    if isinstance(value, DictConfig | ListConfig):
        return str(OmegaConf.to_container(value))
    return str(value)
