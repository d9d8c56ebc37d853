"""Which settings a resumed run may change and which an evaluation must match, derived from the
schemas' field metadata (framework/config/schemas.py: `setting(..., resumable=True)`, ...), so
the lists cannot drift from the schema: a new field is part of the experiment unless its schema
says otherwise.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from omegaconf import MISSING

from framework.config import schemas as s
from framework.config.registry import GROUP_BASES, read_option, shipped_options
from framework.core.allowlist import matches_prefix
from framework.core.signatures import signature_of


def _flagged(schema: type, flag: str, prefix: str) -> Iterator[str]:
    """Dotted keys of the fields of `schema` (nested schemas too) whose metadata sets `flag`."""
    for item in dataclasses.fields(schema):
        key = f"{prefix}{item.name}"
        if item.metadata.get(flag):
            yield key
        elif dataclasses.is_dataclass(item.default_factory):
            yield from _flagged(item.default_factory, flag, f"{key}.")


def _flagged_in_groups(flag: str, groups: Iterable[str]) -> Iterator[str]:
    for group in groups:
        if group in GROUP_BASES:
            yield from _flagged(GROUP_BASES[group], flag, f"{group}.")


# Where a data option finds its files, whichever option: a data set moved to another folder (or
# fetched again) is the same data, for a resume and for an evaluation alike.
DATA_LOCATION_KEYS = ("data.root", "data.download")


@functools.cache
def resumable_keys() -> tuple[str, ...]:
    """Keys (and whole sections) a resumed run may change: they do not alter what the next step
    computes (how long, how often, where to, with which logger or launcher)."""
    keys = {
        *_flagged(s.Config, s.RESUMABLE, ""),
        *_flagged_in_groups(s.RESUMABLE, GROUP_BASES),
        *DATA_LOCATION_KEYS,
    }
    return tuple(sorted(keys))


@functools.cache
def eval_compared_groups() -> tuple[str, ...]:
    """The groups mode=eval compares with the training run's: which examples and weights."""
    return tuple(sorted(_flagged(s.Config, s.EVAL_MUST_MATCH, "")))


@functools.cache
def eval_may_differ_keys() -> tuple[str, ...]:
    """Keys of those groups that only say how examples are batched or found."""
    keys = {*_flagged_in_groups(s.EVAL_MAY_DIFFER, eval_compared_groups()), *DATA_LOCATION_KEYS}
    return tuple(sorted(keys))


def must_match_in_eval(key: str) -> bool:
    """Whether an evaluation of a checkpoint must use the training run's value of `key`."""
    return matches_prefix(key, eval_compared_groups()) and not matches_prefix(
        key, eval_may_differ_keys()
    )


def training_settings(config: Mapping[str, Any]) -> dict[str, str]:
    """The resolved, secret-redacted config (redaction.redacted_container) as flat `key: value`
    strings, without the settings a resume may change. Stored, with its hash, in every
    checkpoint."""
    resumable = resumable_keys()
    flat: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
            return
        key = prefix[:-1]
        if not matches_prefix(key, resumable):
            flat[key] = json.dumps(node)

    walk(config, "")
    return flat


def changed_settings(saved: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """The keys whose value differs between a checkpoint's settings and this run's (both as
    `training_settings` writes them). A key only one side has is no change when its value
    there is the value it takes unset (`default_value`): a key added to one's own task with a
    default that keeps the behaviour leaves every earlier checkpoint usable."""
    both = {**saved, **now}
    changed = []
    for key in sorted(saved.keys() | now.keys()):
        if saved.get(key) == now.get(key):
            continue
        if (key in saved) != (key in now) and both[key] == default_value(key, both):
            continue
        changed.append(key)
    return changed


def default_value(key: str, settings: Mapping[str, str]) -> str | None:
    """What `key` is when no config sets it, as JSON: the framework's default in the schemas,
    else the default in the signature of the `_target_` it is an argument of, else the value
    every shipped option of that `_target_` gives it. None where none is known."""
    found = _schema_default(key)
    if found is not None:
        return found
    owner, _, name = key.rpartition(".")
    target = settings.get(f"{owner}._target_")
    if not owner or target is None:
        return None
    try:
        target = json.loads(target)
    except ValueError:
        return None
    return _signature_default(target, name) or _shipped_value(owner, target, name)


def _schema_default(key: str) -> str | None:
    schema: Any = s.Config
    *path, name = key.split(".")
    for part in path:
        fields = {item.name: item for item in dataclasses.fields(schema)} if schema else {}
        if schema is s.Config and part in GROUP_BASES:
            schema = GROUP_BASES[part]
        elif part in fields and dataclasses.is_dataclass(fields[part].default_factory):
            schema = fields[part].default_factory
        else:
            return None
    item = next((item for item in dataclasses.fields(schema) if item.name == name), None)
    if item is None or dataclasses.is_dataclass(item.default_factory):
        return None
    if item.default is not dataclasses.MISSING:
        value = item.default
    elif item.default_factory is not dataclasses.MISSING:
        value = item.default_factory()
    else:
        return None
    return None if value is MISSING or value == MISSING else json.dumps(value)


def _signature_default(target: str, name: str) -> str | None:
    signature = signature_of(target)
    parameter = signature.parameters.get(name) if signature is not None else None
    if parameter is None or parameter.default is None:
        return None
    try:
        return json.dumps(ast.literal_eval(parameter.default))
    except (ValueError, TypeError, SyntaxError):  # not a literal (a name, a call)
        return None


def _shipped_value(group: str, target: str, name: str) -> str | None:
    values = set()
    for path in shipped_options(group).values():
        option = read_option(path)
        if option.get("_target_") == target and name in option:
            values.add(json.dumps(option[name]))
    return values.pop() if len(values) == 1 else None
