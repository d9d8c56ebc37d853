"""The check of Hydra's node, on every composition before Hydra uses it: what it calls is
allowed, and every key that differs from the node the framework ships (app/shipped_node.py) is
on the positive list (app/hydra_settings.py), with a value its rule allows once resolved. Before
a run or a sweep starts, the config folders its search path names exist and hide nothing."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from hydra._internal.sources_registry import SourcesRegistry
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.plugins.config_source import ConfigSource
from omegaconf import DictConfig, OmegaConf

from framework.app.config_search_path import PROJECT_PROVIDER, USER_PROVIDER
from framework.app.hydra_settings import (
    CODE_NODES,
    HYDRA_WRITES,
    LOG_FILE_PREFIX,
    LOGGING_STREAMS,
    area,
    area_problem,
    callable_key,
    hydra_target_problem,
    refusal,
    settable,
)
from framework.app.job_values import JobValues
from framework.app.shipped_node import plain_node, shipped_node
from framework.core.allowlist import iter_leaves, matches_prefix, trusted_prefixes
from framework.core.exits import ConfigError

_ABSENT = object()


def check_hydra_node(
    cfg: DictConfig, overrides: list[str], config_name: str | None = "config"
) -> None:
    """Raise ConfigError unless what cfg's Hydra node calls is allowed, Hydra's record of the
    overrides is what `overrides` make it (a config file cannot write it), and every key that
    differs from the shipped node is settable, with a value its rule allows once resolved. The
    message names every problem of the node, so that one fix is enough."""
    trusted = trusted_prefixes(cfg)
    node = plain_node(cfg)
    problems = [
        problem
        for path, value in iter_leaves(node, "hydra")
        if matches_prefix(path, CODE_NODES) and (problem := _leaf_problem(path, value, trusted))
    ]
    _check_override_record(cfg, overrides)
    reference = shipped_node(_choices(cfg), config_name)
    changed = [path for path in _changed(node, reference) if not matches_prefix(path, HYDRA_WRITES)]
    if refused := [path for path in changed if not settable(path)]:
        problems.append(refusal(*refused))
    judged = sorted({area(path) for path in changed if path not in refused})
    problems += _area_problems(cfg, judged, trusted)
    if problems:
        raise ConfigError("; ".join(problems))


def _area_problems(cfg: DictConfig, areas: list[str], trusted: tuple[str, ...]) -> list[str]:
    """What each area's rule refuses of its value, resolved as the job will (on a copy of the
    config, made only where an area changed)."""
    if not areas:
        return []
    resolving, problems = JobValues(cfg), []
    for judged in areas:
        try:
            if problem := area_problem(judged, resolving.value(judged), trusted):
                problems.append(problem)
        except ConfigError as unresolved:
            problems.append(str(unresolved))
    return problems


def _leaf_problem(path: str, value: Any, trusted: Iterable[str]) -> str | None:
    """What Hydra will instantiate, call or import from this leaf of its node, unresolved."""
    key = path.rsplit(".", 1)[-1]
    text = value if isinstance(value, str) else ""
    if callable_key(path) and value is not None:
        if "${" in text:
            return f"{path}={value}: an interpolation cannot name what Hydra calls"
        problem = hydra_target_problem(value, trusted)
        return f"{path}={value} {problem}" if problem else None
    if text.startswith("ext://") and text not in LOGGING_STREAMS:
        return f"{path}={value} would import a module: use {' or '.join(LOGGING_STREAMS)}"
    if key == "filename" and (not text.startswith(LOG_FILE_PREFIX) or ".." in text):
        return f"{path}={value}: a log file must lie in the run dir ({LOG_FILE_PREFIX}<name>)"
    return None


def _choices(cfg: DictConfig) -> dict[str, Any]:
    """group: option as composed; None for a group whose default is missing (`???`), which
    Hydra skips while it composes a sweep's master config and refuses in each job."""
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices, resolve=False)
    assert isinstance(choices, dict)
    for group, option in choices.items():
        if option == "???" and group.startswith("hydra/"):  # (Hydra's node would lack it)
            raise ConfigError(f"{group} is left ??? by a config file: pick one, {group}=<option>")
    return {group: None if option == "???" else option for group, option in choices.items()}


def _check_override_record(cfg: DictConfig, overrides: list[str]) -> None:
    parsed = OverridesParser.create().parse_overrides(overrides)
    expected = {
        "hydra": [o.input_line for o in parsed if o.is_hydra_override()],
        "task": [o.input_line for o in parsed if not o.is_hydra_override()],
    }
    recorded = OmegaConf.to_container(cfg.hydra.overrides, resolve=False)
    if recorded != expected:
        raise ConfigError(
            "hydra.overrides cannot be set from a config file: it is Hydra's record of the "
            "command line"
        )


def _flat(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(path, value) of every leaf; lists and empty mappings are leaves."""
    if isinstance(node, Mapping) and node:
        for key, value in node.items():
            yield from _flat(value, f"{path}.{key}")
    else:
        yield path, node


def _changed(real: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    ours, shipped = dict(_flat(real, "hydra")), dict(_flat(reference, "hydra"))
    return sorted(
        path
        for path in ours.keys() | shipped.keys()
        if ours.get(path, _ABSENT) != shipped.get(path, _ABSENT)
    )


def check_config_folders(config: DictConfig) -> None:
    """Every folder on the config search path exists: Hydra skips a missing one silently, and
    the options the user meant to add would then be 'not found' with no hint why. No option of
    the user's own folders is hidden by a shipped option of the same name, which Hydra would
    pick instead, silently."""
    sources = {}
    for source in config.hydra.runtime.config_sources:
        kind = SourcesRegistry.instance().resolve(source.schema)
        sources[source.provider] = found = kind(source.provider, f"{source.schema}://{source.path}")
        if not found.available():
            where = (
                "FRAMEWORK_CONFIG_PATH" if source.provider == USER_PROVIDER else "hydra.searchpath"
            )
            raise ConfigError(
                f"{where}: {source.schema}://{source.path} is not a folder of config files (it "
                "does not exist, or the package does not import): give file:///absolute/path "
                "or pkg://importable.package.folder"
            )
        if source.provider in (PROJECT_PROVIDER, USER_PROVIDER) and "main" in sources:
            check_not_hidden(found, sources["main"])


def check_not_hidden(user: ConfigSource, shipped: ConfigSource) -> None:
    for group in user.list("", ObjectType.GROUP):
        if not shipped.is_group(group):
            continue
        for option in set(user.list(group, ObjectType.CONFIG)) & set(
            shipped.list(group, ObjectType.CONFIG)
        ):
            name = option.removesuffix(".yaml")
            raise ConfigError(
                f"{user.full_path()}/{group}/{name}.yaml is hidden: {group}={name} picks the "
                "shipped option of that name; rename yours"
            )
