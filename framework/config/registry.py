"""The one place where the config is made known to Hydra: the root schema, each group's base
schema (in its ConfigStore as schema/<group>/base, which every option of the group extends, the
shipped ones as a user's own), the launchers' schemas, and the resolvers the YAML files use.
framework/train.py calls `register_configs()` before Hydra composes anything; so do tests and
benchmarks that compose a config themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from framework.config import schemas as s
from framework.config.resolvers import register_resolvers
from framework.core.config_dir import CONF_DIR, is_shipped
from framework.core.signatures import signature_of

# group -> the schema of the keys the framework reads from any of its options. Stored open: an
# option adds keys of its own, typed by its `_target_`'s signature (keys.py), while the
# framework's keys stay typed.
GROUP_BASES: dict[str, type] = {
    "task": s.TaskConfig,
    "model": s.ModelConfig,
    "init": s.InitConfig,
    "data": s.DataConfig,
    "optimizer": s.OptimizerConfig,
    "scheduler": s.SchedulerConfig,
    "precision": s.PrecisionConfig,
    "comm": s.CommConfig,
    "strategy": s.StrategyConfig,
    "logger": s.LoggerConfig,
}
# The launchers build nothing by `_target_`: every key is the framework's, typed here.
LAUNCHERS: dict[str, type] = {
    "local": s.LocalLauncherConfig,
    "torchrun": s.TorchrunLauncherConfig,
    "slurm": s.SlurmLauncherConfig,
    "slurm_local": s.SlurmLocalLauncherConfig,
}
# Building blocks a config may name besides the options' own targets.
BUILDING_BLOCKS = ("framework.components.data.PadSequences",)
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.cache
def shipped_targets() -> frozenset[str]:
    """Every framework callable a config may name: the `_target_` of each shipped option."""
    return frozenset({*_shipped_targets(), *BUILDING_BLOCKS})


def shipped_options(group: str) -> dict[str, Path]:
    """The shipped options of `group`: name -> YAML file. A file added to the group's folder,
    or edited there, is not one: its content is not what the framework shipped."""
    found = sorted((CONF_DIR / group).glob("*.yaml"))
    return {path.stem: path for path in found if is_shipped(path)}


def read_option(path: Path) -> Any:
    """A shipped option's YAML as plain values. Parsed by libyaml where PyYAML has it: the
    checks read every shipped option, and the pure-Python parser took 30-50 ms of the 1.5 s a
    refused mistake took (docs/benchmarks.md); both build the same values."""
    return yaml.load(path.read_text(), Loader=_SAFE_LOADER) or {}


def _shipped_targets() -> Iterator[str]:
    for group in GROUP_BASES:
        for path in shipped_options(group).values():
            yield from _targets(read_option(path))


def _targets(node: object) -> Iterator[str]:
    """Every `_target_` in a YAML document (a logger's sits under its name)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "_target_" and isinstance(value, str):
                yield value
            else:
                yield from _targets(value)


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore and register the resolvers (idempotent)."""
    _store_schemas(ConfigStore.instance())
    register_resolvers()


@functools.cache
def _store_schemas(store: ConfigStore) -> None:
    """Once a store: the schemas never change, and making their nodes takes 0.1 s, a third of
    a composition, which every config a process composes would pay again (tests compose
    thousands)."""
    store.store(name="base_config", node=s.Config)
    for group, base in GROUP_BASES.items():
        store.store(group=f"schema/{group}", name="base", node=open_schema(base))
    for name, schema in LAUNCHERS.items():
        store.store(group="schema/launcher", name=name, node=schema)


def open_schema(schema: type) -> DictConfig:
    """`schema`'s fields, typed, in a node that also takes keys the schema does not name."""
    node = OmegaConf.structured(schema)
    OmegaConf.set_struct(node, False)
    return node


def shipped_choice(group: str, node: DictConfig) -> str:
    """The shipped option of `group` that `node` is (its file's keys all as the node has them),
    for messages; else the callable it names."""
    for name, path in shipped_options(group).items():
        values = read_option(path)
        values.pop("defaults", None)
        if all(node.get(key) == value for key, value in values.items()):
            return name
    return str(node.get("_target_"))


def option_values(group: str, name: str, **changes: object) -> dict[str, object]:
    """The keywords conf/<group>/<name>.yaml gives its callable, `changes` on top: a shipped
    option called from Python (tests, benchmarks) as `train` calls it, without the framework's
    keys (data.batch_size) that a callable taking no **kwargs is not given. Interpolations
    (`${data.num_classes}`) are left to `changes`."""
    content = read_option(shipped_options(group)[name])
    values = {key: value for key, value in content.items() if not _is_special(key)}
    signature = signature_of(str(content["_target_"])) if "_target_" in content else None
    if signature is not None and not signature.takes_kwargs:
        values = {key: value for key, value in values.items() if key in signature.parameters}
    return {**values, **changes}


def _is_special(key: str) -> bool:
    return key == "defaults" or (key.startswith("_") and key.endswith("_"))
