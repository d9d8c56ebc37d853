"""What a config may put in Hydra's own node: a short positive list, each settable key's rule,
and what the node may call. app/hydra_node.py checks every composition against it.

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

import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from framework.app.config_search_path import searchpath_problem
from framework.core.allowlist import matches_prefix, target_problem
from framework.core.path_text import path_text_problem, text_problem
from framework.core.pruners import PRUNERS, PRUNING_SWEEPER

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
# The sweepers' names and numbers, each in its range (no trials run nothing, no jobs never end).
# Optuna's `storage` writes a database anywhere, `custom_search_space` names a function: not here.
SWEEPER_SETTINGS: dict[str, tuple[float, float] | None] = {
    "max_batch_size": (1, math.inf),
    "direction": None,
    "n_trials": (1, math.inf),
    "n_jobs": (1, math.inf),
    "study_name": None,
    "max_failure_rate": (0, 1),
    "pruner": None,
}
# hydra/sweeper=optuna_prune: each pruner's settings, under its name (core/pruners.py).
PRUNER_SETTINGS = tuple(f"hydra.sweeper.{name}" for name in PRUNERS)
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
# Settable keys whose value names a folder.
FOLDERS = (
    "hydra.run.dir",
    "hydra.sweep.dir",
    "hydra.sweep.subdir",
    f"{RUN_DIR_CALLBACK}.output_subdir",
)
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
        PRUNING_SWEEPER,
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
    if any(_child(path, pruner) not in (None, "_target_") for pruner in PRUNER_SETTINGS):
        return True
    if (name := _child(path, SAMPLER)) is not None:
        return name != "_target_"
    if path in NAMED_VALUES:
        return True
    if _child(path, ENV_SET) in SAFE_ENV or _child(path, SBATCH_OPTIONS) in SAFE_SBATCH:
        return True
    return _under(path, CALLBACKS) and path != CALLBACKS and not _under(path, RUN_DIR_CALLBACK)


def refusal(*paths: str) -> str:
    """One line naming every key refused at once, so one fix is enough."""
    return (
        f"{', '.join(paths)} cannot be set from a config file or the command line: Hydra's node "
        f"keeps what the framework ships, except {SETTINGS_SUMMARY}"
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


def area(path: str) -> str:
    """The key whose resolved value a changed `path` is judged with: a whole callback, all of
    the sweeper's params or env_set, or the key itself."""
    for whole in (SWEEPER_PARAMS, *NAMED_VALUES):
        if _under(path, whole):
            return whole
    if path.startswith(CALLBACKS + ".") and not _under(path, RUN_DIR_CALLBACK):
        return ".".join(path.split(".")[:3])
    return path


def area_problem(area: str, value: Any, trusted: tuple[str, ...]) -> str | None:
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
    names = {key: str(key).lstrip("+~") for key in params}
    if refused := [
        name for name in names.values() if name.startswith("hydra.") and not settable(name)
    ]:
        return refusal(*refused)
    for key, value in params.items():
        name = names[key]
        if matches_prefix(name, ["hydra.searchpath"]):  # read as each job is composed
            return f"{SWEEPER_PARAMS}.{key}: the config folders cannot be swept: set them once"
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
        return searchpath_problem(value)
    if not _scalar(value):
        return f"{path}={value}: give a plain value here"
    low, high = SWEEPER_SETTINGS.get(_child(path, "hydra.sweeper") or "") or (-math.inf, math.inf)
    if isinstance(value, int | float) and not isinstance(value, bool) and not low <= value <= high:
        within = f"from {low:g} to {high:g}" if high < math.inf else f">= {low:g}"
        return f"{path}={value}: give a number {within}"
    if isinstance(value, str) and (problem := _text_problem(path, value)):
        return f"{path}={value!r} {problem}: give another"
    if path == "hydra.sweep.subdir":
        normal = os.path.normpath(str(value))
        if os.path.isabs(normal) or normal in (".", "..") or normal.startswith("../"):
            return f"hydra.sweep.subdir={value} must name a folder inside hydra.sweep.dir"
    if path == f"{RUN_DIR_CALLBACK}.output_subdir" and value is not None:
        name = str(value)
        if name in ("", ".", "..") or "/" in name or "\\" in name:
            return f"{path}={name} must be a folder name inside the run dir (no /, no ..)"
    return None


def _text_problem(path: str, value: str) -> str | None:
    return path_text_problem(value) if path in FOLDERS else text_problem(value)


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
