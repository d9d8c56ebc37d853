"""What a config may set in Hydra's own node: a short positive list.

Hydra configures its logging, instantiates its callbacks, launcher and sweeper, sets variables
and writes its records from its node before any callback of ours runs, so a door into that node
is a door to code or to files outside the run dir. Rather than follow each door (a value, an
interpolation, a sweep parameter, a mode), every key of the node stays what the framework ships
for the chosen options (app/hydra_node_check.py compares the node composed from the user's
files with the one composed from the shipped files alone), except the keys below. Their values
are checked as Hydra will use them, every interpolation resolved.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

# Whole keys: the run and sweep dirs, the mode, the config folders (file:// only: pkg:// would
# import the package it names), the redacted record's folder.
PLAIN_SETTINGS = (
    "hydra.run.dir",
    "hydra.sweep.dir",
    "hydra.sweep.subdir",
    "hydra.mode",
    "hydra.searchpath",
    "hydra.callbacks.validate.output_subdir",
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
SEARCHPATH = "hydra.searchpath"
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
CALLBACKS = "hydra.callbacks"
VALIDATE = "hydra.callbacks.validate"
SETTINGS_SUMMARY = (
    "hydra.run.dir, hydra.sweep.dir/subdir, hydra.mode, hydra.searchpath, hydra.sweeper.params "
    "and the sweeper's numbers, hydra.job.env_set of a few variables (CUDA_VISIBLE_DEVICES, "
    "OMP_NUM_THREADS, ...), hydra.callbacks.validate.output_subdir and callbacks of your own"
)
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


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
    if path in PLAIN_SETTINGS or _under(path, SWEEPER_PARAMS) or _under(path, SEARCHPATH):
        return True
    if _child(path, "hydra.sweeper") in SWEEPER_SETTINGS:
        return True
    if (name := _child(path, SAMPLER)) is not None:
        return name != "_target_"
    if path in (ENV_SET, SBATCH_OPTIONS):
        return True
    if _child(path, ENV_SET) in SAFE_ENV or _child(path, SBATCH_OPTIONS) in SAFE_SBATCH:
        return True
    return _under(path, CALLBACKS) and path != CALLBACKS and not _under(path, VALIDATE)


def refusal(path: str) -> str:
    return (
        f"{path} cannot be set from a config file or the command line: Hydra's node keeps what "
        f"the framework ships, except {SETTINGS_SUMMARY}"
    )


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def value_problem(path: str, value: Any) -> str | None:
    """Why the resolved `value` of the settable key `path` is refused, or None."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if problem := value_problem(f"{path}.{key}", item):
                return problem
        return None
    if path == "hydra.searchpath":
        return _searchpath_problem(value)
    if not _scalar(value):
        return f"{path}={value}: give a plain value here"
    if isinstance(value, str) and CONTROL.search(value):
        return f"{path}={value!r}: a line break or control character is not allowed here"
    if path == "hydra.sweep.subdir":
        return _subdir_problem(str(value))
    if path == "hydra.callbacks.validate.output_subdir" and value is not None:
        return _folder_name_problem(path, str(value))
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


def _subdir_problem(subdir: str) -> str | None:
    normal = os.path.normpath(subdir)
    if os.path.isabs(subdir) or normal == ".." or normal.startswith("../") or normal == ".":
        return f"hydra.sweep.subdir={subdir} must name a folder inside hydra.sweep.dir"
    return None


def _folder_name_problem(path: str, name: str) -> str | None:
    if name in ("", ".", "..") or "/" in name or "\\" in name:
        return f"{path}={name} must be a folder name inside the run dir (no /, no ..)"
    return None


def callback_problem(path: str, node: Any) -> str | None:
    """A callback of your own (its `_target_` is judged by core/allowlist.py): its arguments
    are plain values, so nothing inside it is instantiated in turn."""
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
