"""Every key of an option is something its callable or the framework takes, of the type its
signature says. A misspelt keyword (`+model.hiden=3`, `data.val_fracton=0.3`) is refused with a
did-you-mean before the run dir exists, instead of failing in every rank with a traceback or,
where the callable swallows `**kwargs`, training silently with the default; `data.noise=abc`
for a `noise: float` is refused like a typed key. So is a parameter without a default that
neither the option nor the framework gives (`~model.width`), and a null where the annotation
takes none (model=gpt's `vocab_size: ${data.vocab_size}` with image data).

A key is known when it is a parameter of the callable (`_target_`, read from source without
importing it: signatures.py) or a field of its group's base schema (the keys the framework
reads itself, such as data.batch_size, typed by OmegaConf). An unknown key is refused, except
where the callable takes `**kwargs` and the key is not a near-miss of a known one: torchvision's
`resnet18(**kwargs)` takes `num_classes` that its signature does not name.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import re
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from framework.config.registry import GROUP_BASES
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


def check_target_keys(cfg: DictConfig) -> None:
    """Raise ConfigError for a key of an option that nothing takes, or of a type its callable
    does not take, and for a parameter the callable needs that nothing gives. Reads the
    callables' source; imports nothing."""
    for path, node, base in _component_nodes(cfg):
        declared = HYDRA_KEYS | _fields(base)
        extra = [str(key) for key in node if str(key) not in declared]
        if not extra:  # every key is the framework's: nothing to read (a parameter it lacks is
            continue  # the constructor's to name, in one line: rank/build.py)
        signature = signature_of(str(node._target_))
        if signature is None:  # not readable from source: instantiate reports what it finds
            continue
        given = GIVEN_AT_CALL.get(path.split(".")[0], frozenset()) - declared
        for key in extra:
            if key in given:  # the framework's value would win over the option's
                raise ConfigError(
                    f"{path}.{key} is given by the framework when it builds the {path}, "
                    "over any value set here: remove it"
                )
            _check_key(path, key, node, signature, declared, given)
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


def _check_key(
    path: str,
    key: str,
    node: DictConfig,
    signature: Signature,
    declared: frozenset[str],
    given: frozenset[str],
) -> None:
    parameter = signature.parameters.get(key)
    if parameter is not None:
        annotation = parameter.annotation
        if annotation is not None:
            if node[key] is None and not _may_be_null(annotation, parameter.default):
                _refuse_null(path, key, node, annotation, signature.target)
            check_type(f"{path}.{key}", node[key], annotation, signature.target)
        return
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
    raise ConfigError(f"{path}.{key} is not a setting of {signature.target}: {hint}")


def _may_be_null(annotation: ast.expr, default: ast.expr | None) -> bool:
    """None is the parameter's own default, or its annotation takes it (or says nothing
    checkable)."""
    default_is_none = isinstance(default, ast.Constant) and default.value is None
    return default_is_none or _accepts(annotation, None) is not False


def _refuse_null(path: str, key: str, node: DictConfig, annotation: ast.expr, target: str) -> None:
    written = ast.unparse(annotation)
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


def _component_nodes(cfg: DictConfig) -> Iterator[tuple[str, DictConfig, type | None]]:
    for group, base in GROUP_BASES.items():
        node = cfg.get(group)
        if group == "logger":  # any number of them, each under its name
            for name, logger in (node or {}).items():
                if isinstance(logger, DictConfig) and "_target_" in logger:
                    yield f"logger.{name}", logger, base
        elif isinstance(node, DictConfig) and "_target_" in node:
            yield group, node, base


def check_type(key: str, value: Any, annotation: ast.expr, target: str) -> None:
    """Raise ConfigError when `value` is not of the annotated type (as far as an annotation
    written with builtins, typing's Optional/Union/Literal and containers says; any other
    annotation accepts anything). None is left to the callable: it may be its own default."""
    if value is None or _accepts(annotation, value) is not False:
        return
    name, written = key.split(".")[-1], ast.unparse(annotation)
    choices = _choices(annotation)
    expected = f"one of {', '.join(map(repr, choices))}" if choices else f"of type {written}"
    raise ConfigError(f"{key}={_shown(value)} is not {expected}: {target} takes {name}: {written}")


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


def _fields(schema: type | None) -> frozenset[str]:
    return (
        frozenset(item.name for item in dataclasses.fields(schema))
        if dataclasses.is_dataclass(schema)
        else frozenset()
    )
