"""Every key of a component's node is something its callable or the framework takes. A misspelt
keyword (`+model.hiden=3`, `+data.batch_sise=8`) is refused with a did-you-mean before the run
dir exists, instead of failing in every rank with a traceback or, where the callable swallows
`**kwargs`, training silently with the default.

A key is known when it is a parameter of the callable (`_target_`), a field of the node's
schema, or a field of its group's base schema (the keys the framework reads itself, such as
data.batch_size). An unknown key is refused, except where the callable takes `**kwargs` and the
key is not a near-miss of a known one: torchvision's `resnet18(**kwargs)` takes `num_classes`
that its signature does not name.

A key the schema does not declare but the callable names takes its type from the callable's
annotation where that is int, float or bool: a user's own loader, model or task is then the
schema of its own keys (`noise: float = 0.1`), and `data.noise=abc` is refused like a typed key.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Iterator

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from framework.config import schemas as s
from framework.core.exits import ConfigError

HYDRA_KEYS = frozenset({"_target_", "_partial_", "_convert_", "_recursive_", "_args_"})
# The schema every option of a group extends: the keys the framework reads from any option.
GROUP_BASES: dict[str, type] = {
    "task": s.TaskConfig,
    "model": s.ModelConfig,
    "data": s.DataConfig,
    "optimizer": s.OptimizerConfig,
    "scheduler": s.SchedulerConfig,
    "precision": s.PrecisionConfig,
    "comm": s.CommConfig,
}


def check_target_keys(cfg: DictConfig) -> None:
    """Raise ConfigError for a key of a component's node that nothing takes. Call after the
    allowlist check: it imports each `_target_`."""
    for path, node, base in _component_nodes(cfg):
        declared = HYDRA_KEYS | _fields(OmegaConf.get_type(node)) | _fields(base)
        extra = [str(key) for key in node if str(key) not in declared]
        if not extra:  # every key is in a schema: nothing to import
            continue
        parameters = _parameters(node._target_)
        if parameters is None:  # not introspectable: instantiate reports what it finds
            continue
        named, open_ended = parameters
        known = (set(named) | declared) - HYDRA_KEYS
        for key in extra:
            if key in named:
                _check_type(f"{path}.{key}", node[key], named[key], node._target_)
            if key in known:
                continue
            close = difflib.get_close_matches(key, sorted(known), n=1)
            if open_ended and not close:
                continue
            hint = (
                f"did you mean {path}.{close[0]}?"
                if close
                else (f"it takes {', '.join(sorted(named)) or 'no keyword'}")
            )
            raise ConfigError(f"{path}.{key} is not a setting of {node._target_}: {hint}")


def _component_nodes(cfg: DictConfig) -> Iterator[tuple[str, DictConfig, type | None]]:
    for group, base in GROUP_BASES.items():
        node = cfg.get(group)
        if isinstance(node, DictConfig) and "_target_" in node:
            yield group, node, base
    for name, node in (cfg.get("logger") or {}).items():
        if isinstance(node, DictConfig) and "_target_" in node:
            yield f"logger.{name}", node, s.LoggerConfig


# The annotations a value is checked against, and what each accepts (bool is an int to Python).
# Not str: `name=123` on the command line arrives as an int that a str parameter may well take.
SIMPLE_TYPES: dict[object, tuple[type, ...]] = {int: (int,), float: (int, float), bool: (bool,)}


def _check_type(key: str, value: object, annotation: object, target: str) -> None:
    accepted = SIMPLE_TYPES.get(annotation)
    if accepted is None or value is None:  # (None: the callable's own default decides)
        return
    if isinstance(value, bool) and bool not in accepted or not isinstance(value, accepted):
        name = annotation.__name__  # type: ignore[attr-defined]
        raise ConfigError(
            f"{key}={value!r} is not of type {name}: {target} takes {key.split('.')[-1]}: {name}"
        )


def _parameters(target: str) -> tuple[dict[str, object], bool] | None:
    """({keyword parameter `target` names: its annotation}, whether it also takes **kwargs)."""
    try:
        callable_ = get_object(target)
        try:
            signature = inspect.signature(callable_, eval_str=True)
        except (NameError, AttributeError, SyntaxError, TypeError):  # annotations that need imports
            signature = inspect.signature(callable_)
    except Exception:  # not importable, or a builtin without a signature
        return None
    named = {
        name: parameter.annotation
        for name, parameter in signature.parameters.items()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    }
    open_ended = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    return named, open_ended


def _fields(schema: type | None) -> set[str]:
    return (
        {item.name for item in dataclasses.fields(schema)}
        if dataclasses.is_dataclass(schema)
        else set()
    )
