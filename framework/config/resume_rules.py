"""Which settings a resumed run may change and which an evaluation must match, derived from the
schemas' field metadata (framework/config/schemas.py: `setting(..., resumable=True)`, ...), so
the lists cannot drift from the schema: a new field is part of the experiment unless its schema
says otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from framework.config import schemas as s
from framework.config.registry import GROUP_BASES
from framework.core.allowlist import matches_prefix


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
