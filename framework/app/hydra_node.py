"""What a config may put in Hydra's own node: a short positive list, checked on every
composition before Hydra uses it.

Hydra configures its logging, instantiates its callbacks, launcher and sweeper, sets variables
and writes its records from its node before any code of ours runs in the job, so a door into
that node is a door to code or to files outside the run dir. Rather than follow each door (a
value, an interpolation, a sweep parameter, a deletion, a group option of its own), every key
stays what the framework ships for the chosen options (app/shipped_node.py composes that node
from the shipped files alone), except the keys below; their values are judged as Hydra will
use them, every interpolation resolved, and whatever the node names to call must be one of
the callables Hydra and this framework ship (or your own, through allowed_targets).
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from enum import Enum
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import Container, DictConfig, OmegaConf, open_dict

from framework.app.shipped_node import plain_node, shipped_node
from framework.core.allowlist import iter_leaves, matches_prefix, target_problem, trusted_prefixes
from framework.core.exits import ConfigError, first_line

# --- the keys a config may set --------------------------------------------------------------
# Whole keys: the run and sweep dirs, the mode, the config folders (file:// only: pkg:// would
# import the package it names), the redacted record's folder.
PLAIN_SETTINGS = (
    "hydra.run.dir",
    "hydra.sweep.dir",
    "hydra.sweep.subdir",
    "hydra.mode",
    "hydra.searchpath",
    "hydra.callbacks.run_dir.output_subdir",
)
# The sweepers' numbers and names (basic, optuna). Optuna's `storage` would write a database
# wherever it says, and `custom_search_space` names a function: neither is here.
SWEEPER_SETTINGS = (
    "max_batch_size",
    "direction",
    "n_trials",
    "n_jobs",
    "study_name",
    "max_failure_rate",
)
SWEEPER_PARAMS = "hydra.sweeper.params"
SAMPLER = "hydra.sweeper.sampler"
# Variables a job may be given: none of them makes a process load code or move files
# (LD_PRELOAD, PYTHONPATH, TORCH_HOME, WANDB_DIR and MLFLOW_TRACKING_URI all would).
ENV_SET = "hydra.job.env_set"
SAFE_ENV = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "NCCL_DEBUG",
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_DISABLE",
        "NCCL_P2P_DISABLE",
        "GLOO_SOCKET_IFNAME",
        "TORCH_DISTRIBUTED_DEBUG",
        "TOKENIZERS_PARALLELISM",
    }
)
# sbatch options beyond the launcher group's keys: none names a file, a folder, a variable or a
# command (--output, --chdir, --export and `setup` lines would).
SBATCH_OPTIONS = "hydra.launcher.additional_parameters"
SAFE_SBATCH = frozenset(
    {"mail-type", "mail_type", "mail-user", "mail_user", "exclusive", "reservation", "nice"}
)
# Settable keys that hold a mapping of names to values: the names allowed in each.
NAMED_VALUES = {ENV_SET: SAFE_ENV, SBATCH_OPTIONS: SAFE_SBATCH}
CALLBACKS = "hydra.callbacks"
RUN_DIR_CALLBACK = "hydra.callbacks.run_dir"
SETTINGS_SUMMARY = (
    "hydra.run.dir, hydra.sweep.dir/subdir, hydra.mode, hydra.searchpath, hydra.sweeper.params "
    "and the sweeper's numbers, hydra.job.env_set of a few variables (CUDA_VISIBLE_DEVICES, "
    "OMP_NUM_THREADS, ...), hydra.callbacks.run_dir.output_subdir and callbacks of your own"
)
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Keys Hydra itself writes over whatever a file said, while it composes or starts a job.
HYDRA_WRITES = (
    "hydra.overrides",
    "hydra.runtime",
    "hydra.job.override_dirname",
    "hydra.job.config_name",
)

# --- what the node may call -----------------------------------------------------------------
# By exact name: the launchers and sweepers that Hydra, its plugins and we ship, the optuna
# sweeper's samplers, our run-dir callback, Hydra's job-return logger and the logging classes of
# a console setup. Your own callbacks: a module of yours in allowed_targets (config files only).
NODE_TARGETS = frozenset(
    {
        "hydra._internal.core_plugins.basic_launcher.BasicLauncher",
        "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
        "hydra_plugins.framework_launchers.framework_launchers.SweepLauncher",
        "hydra_plugins.framework_launchers.framework_launchers.SubmititSlurmLauncher",
        "hydra_plugins.framework_launchers.framework_launchers.SubmititLocalLauncher",
        "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper",
        *(
            f"optuna.samplers.{name}"
            for name in (
                "GridSampler",
                "TPESampler",
                "RandomSampler",
                "CmaEsSampler",
                "NSGAIISampler",
                "MOTPESampler",
                "QMCSampler",
            )
        ),
        "framework.app.run_dir_callback.RunDirCallback",
        "hydra.experimental.callbacks.LogJobReturnCallback",
        "logging.StreamHandler",
        "logging.FileHandler",
        "logging.Formatter",
    }
)
# Keys whose value names something to call: instantiate's `_target_`, the factories of
# logging.config.dictConfig (`()` for any factory, `class` for handlers and formatters), which
# Hydra applies to hydra.job_logging / hydra.hydra_logging, and the optuna sweeper's function.
CALLABLE_KEYS = ("_target_", "()", "class", "custom_search_space")
# Subtrees of Hydra's node that Hydra instantiates or hands to logging.config.
CODE_NODES = (
    "hydra.callbacks",
    "hydra.launcher",
    "hydra.sweeper",
    "hydra.job_logging",
    "hydra.hydra_logging",
)
# dictConfig imports any `ext://` name it is given; a console handler needs only these.
LOGGING_STREAMS = ("ext://sys.stdout", "ext://sys.stderr")
# A log file (a FileHandler's `filename`) lies in the run dir, or a config could append log
# lines (holding config values) to any file, a shell's rc file included.
LOG_FILE_PREFIX = "${hydra.runtime.output_dir}/"
NODE_FIX = (
    "Hydra's node may name the launchers, sweepers, callbacks and logging classes that Hydra "
    "and this framework ship, or your own modules listed in allowed_targets in a config file"
)
_ABSENT = object()


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent + ".")


def _child(path: str, parent: str) -> str | None:
    """The one key of `path` right under `parent` (`a.b.c` under `a.b`: `c`), else None."""
    if not path.startswith(parent + "."):
        return None
    rest = path[len(parent) + 1 :]
    return None if "." in rest else rest


def settable(path: str) -> bool:
    """Whether a config file, an experiment, a sweep parameter or an override may set the key
    of Hydra's node at `path` (dotted, from `hydra`)."""
    if path in PLAIN_SETTINGS or _under(path, SWEEPER_PARAMS) or _under(path, "hydra.searchpath"):
        return True
    if _child(path, "hydra.sweeper") in SWEEPER_SETTINGS:
        return True
    if (name := _child(path, SAMPLER)) is not None:
        return name != "_target_"
    if path in NAMED_VALUES:
        return True
    if _child(path, ENV_SET) in SAFE_ENV or _child(path, SBATCH_OPTIONS) in SAFE_SBATCH:
        return True
    return _under(path, CALLBACKS) and path != CALLBACKS and not _under(path, RUN_DIR_CALLBACK)


def refusal(path: str) -> str:
    return (
        f"{path} cannot be set from a config file or the command line: Hydra's node keeps what "
        f"the framework ships, except {SETTINGS_SUMMARY}"
    )


def callable_key(path: str) -> bool:
    """`path` names something Hydra's node calls (instantiate's, logging's)."""
    return path.rsplit(".", 1)[-1] in CALLABLE_KEYS


def hydra_target_problem(target: Any, trusted: Iterable[str] = ()) -> str | None:
    """Why Hydra's node may not call `target`; None when it may."""
    if isinstance(target, str) and target in NODE_TARGETS:
        return None
    if isinstance(target, str) and matches_prefix(target, trusted):
        return target_problem(target, trusted)
    return "is not allowed here: " + NODE_FIX


# --- the check of a composed node -----------------------------------------------------------
def check_hydra_node(cfg: DictConfig, overrides: list[str]) -> None:
    """Raise ConfigError unless what cfg's Hydra node calls is allowed, Hydra's record of the
    overrides is what `overrides` make it (a config file cannot write it), and every key that
    differs from the shipped node is settable, with a value its rule allows once resolved."""
    trusted = trusted_prefixes(cfg)
    node = plain_node(cfg)
    for path, value in iter_leaves(node, "hydra"):
        if matches_prefix(path, CODE_NODES) and (problem := _leaf_problem(path, value, trusted)):
            raise ConfigError(problem)
    _check_override_record(cfg, overrides)
    reference = shipped_node(_choices(cfg))
    changed = [path for path in _changed(node, reference) if not matches_prefix(path, HYDRA_WRITES)]
    for path in changed:
        if not settable(path):
            raise ConfigError(refusal(path))
    resolving = _Resolver(cfg)
    for area in sorted({_area(path) for path in changed}):
        if problem := _area_problem(area, resolving.value(area), trusted):
            raise ConfigError(problem)


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


def _area(path: str) -> str:
    """The key whose resolved value a changed `path` is judged with: a whole callback, all of
    the sweeper's params or env_set, or the key itself."""
    for whole in (SWEEPER_PARAMS, *NAMED_VALUES):
        if _under(path, whole):
            return whole
    if path.startswith(CALLBACKS + ".") and not _under(path, RUN_DIR_CALLBACK):
        return ".".join(path.split(".")[:3])
    return path


def _area_problem(area: str, value: Any, trusted: tuple[str, ...]) -> str | None:
    if area == SWEEPER_PARAMS:
        return _params_problem(value)
    if area in NAMED_VALUES:
        return _named_values_problem(area, value)
    if area.startswith(CALLBACKS + ".") and area != f"{RUN_DIR_CALLBACK}.output_subdir":
        if problem := _callback_problem(area, value):
            return problem
        target = value.get("_target_")
        found = hydra_target_problem(target, trusted)
        return f"{area}._target_={target} {found}" if found else None
    return _value_problem(area, value)


def _params_problem(params: Any) -> str | None:
    """The sweeper applies each parameter to every job as `key=value`: plain values, and a
    key of Hydra's node only where an override may set it."""
    if params is None:
        return None
    if not isinstance(params, Mapping):
        return f"{SWEEPER_PARAMS}={params}: give a mapping of keys to plain values"
    for key, value in params.items():
        name = str(key).lstrip("+~")
        if name.startswith("hydra.") and not settable(name):
            return refusal(name)
        if problem := _value_problem(f"{SWEEPER_PARAMS}.{key}", value):
            return problem
        if isinstance(value, Mapping):
            return f"{SWEEPER_PARAMS}.{key}: give a plain value"
    return None


def _named_values_problem(area: str, value: Any) -> str | None:
    if not isinstance(value, Mapping):
        return f"{area}={value}: give a mapping of names to plain values"
    for name in value:
        if name not in NAMED_VALUES[area]:
            return refusal(f"{area}.{name}")
    return _value_problem(area, value)


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _value_problem(path: str, value: Any) -> str | None:
    """Why the resolved `value` of the settable key `path` is refused, or None."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if problem := _value_problem(f"{path}.{key}", item):
                return problem
        return None
    if path == "hydra.searchpath":
        return _searchpath_problem(value)
    if not _scalar(value):
        return f"{path}={value}: give a plain value here"
    if isinstance(value, str) and CONTROL.search(value):
        return f"{path}={value!r}: a line break or control character is not allowed here"
    if path == "hydra.sweep.subdir":
        normal = os.path.normpath(str(value))
        if os.path.isabs(normal) or normal in (".", "..") or normal.startswith("../"):
            return f"hydra.sweep.subdir={value} must name a folder inside hydra.sweep.dir"
    if path == f"{RUN_DIR_CALLBACK}.output_subdir" and value is not None:
        name = str(value)
        if name in ("", ".", "..") or "/" in name or "\\" in name:
            return f"{path}={name} must be a folder name inside the run dir (no /, no ..)"
    return None


def _searchpath_problem(value: Any) -> str | None:
    entries = value if isinstance(value, list | tuple) else [value]
    for entry in entries:
        if not isinstance(entry, str) or not entry.startswith("file://"):
            return (
                f"hydra.searchpath entry {entry!r} is refused: give file:///absolute/path "
                "(pkg:// would import the package it names; FRAMEWORK_CONFIG_PATH may)"
            )
    return None


def _callback_problem(path: str, node: Any) -> str | None:
    """A callback of your own (its `_target_` is judged by the allowlist): its arguments are
    plain values, so nothing inside it is instantiated in turn."""
    if not isinstance(node, Mapping):
        return f"{path}={node}: a callback is a mapping with a _target_"
    for key, value in node.items():
        if key == "_target_":
            continue
        if str(key).startswith("_") or not _plain_tree(value):
            return f"{path}.{key}: a callback's arguments must be plain values"
    return None


def _plain_tree(value: Any) -> bool:
    if isinstance(value, Mapping):
        return all(not str(k).startswith("_") and _plain_tree(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(_plain_tree(item) for item in value)
    return _scalar(value)


class _Resolver:
    """Values of the node as Hydra resolves them in a job (its number and id set), read on a
    copy: resolving must not change the config Hydra is about to use."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = copy.deepcopy(cfg)
        with open_dict(self.cfg.hydra.job):
            for key, value in (("num", 0), ("id", "0")):
                if OmegaConf.is_missing(self.cfg.hydra.job, key):
                    self.cfg.hydra.job[key] = value

    def value(self, path: str) -> Any:
        hydra_config = HydraConfig.instance()
        before = hydra_config.cfg
        try:
            hydra_config.set_config(self.cfg)  # for ${hydra:...}
            node = OmegaConf.select(self.cfg, path, throw_on_resolution_failure=True)
            if isinstance(node, Container):
                return OmegaConf.to_container(node, resolve=True, enum_to_str=True)
            return node.name if isinstance(node, Enum) else node
        except Exception as error:  # noqa: BLE001 (any resolver's failure: refused, named)
            raise ConfigError(
                f"{path} cannot be resolved before the run ({first_line(error)}): give it a "
                "plain value"
            ) from None
        finally:
            hydra_config.cfg = before
