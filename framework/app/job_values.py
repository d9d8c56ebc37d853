"""The config's values as a job will resolve them, before any job starts: every value of the
config resolves here or the command is refused, in one line, on every path (a run, a sweep,
--cfg job, --help, mode=eval, mode=estimate, a resume), where it would otherwise fail inside
Hydra's job or a rank, in a traceback."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from enum import Enum
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import Container, DictConfig, OmegaConf, open_dict

from framework.core.allowlist import matches_prefix
from framework.core.exits import ConfigError, first_line
from framework.core.path_text import path_text_problem, text_problem

# What a job has that a command does not yet: its number, id and output dir (`${hydra:job.num}`
# in a config resolves to these while checked).
JOB_RUNTIME = {"job.num": 0, "job.id": "0", "runtime.output_dir": "."}
# Made by Hydra once, before any job: `${hydra:...}` in it has nothing to read (Hydra's own
# traceback, "HydraConfig was not set").
BEFORE_ANY_JOB = ("hydra.sweeper",)


class JobValues:
    """Values of the config as Hydra resolves them in a job, read on a copy: resolving must not
    change the config Hydra is about to use."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = copy.deepcopy(cfg)
        for key, value in JOB_RUNTIME.items():
            section, name = key.split(".")
            node = self.cfg.hydra[section]
            with open_dict(node):
                if OmegaConf.is_missing(node, name) or name not in node:
                    node[name] = value
        # Hydra's view of the copy, made once (`set_config` copies Hydra's whole node).
        hydra_config = HydraConfig.instance()
        before = hydra_config.cfg
        hydra_config.set_config(self.cfg)
        self.hydra_view, hydra_config.cfg = hydra_config.cfg, before

    def value(self, path: str) -> Any:
        """The value at `path` (dotted), resolved where Hydra resolves it (in a job, or before
        any job); a section as plain containers."""
        hydra_config = HydraConfig.instance()
        before = hydra_config.cfg
        try:
            hydra_config.cfg = None if matches_prefix(path, BEFORE_ANY_JOB) else self.hydra_view
            node = OmegaConf.select(self.cfg, path, throw_on_resolution_failure=True)
            if isinstance(node, Container):
                return OmegaConf.to_container(node, resolve=True, enum_to_str=True)
            return node.name if isinstance(node, Enum) else node
        except Exception as error:  # noqa: BLE001 (any resolver's failure: refused, named)
            raise ConfigError(
                f"{_key_of(error, path)} cannot be resolved before the run ({first_line(error)}): "
                "give it a plain value, or set what it reads"
            ) from None
        finally:
            hydra_config.cfg = before


def _key_of(error: Exception, path: str) -> str:
    return str(getattr(error, "full_key", None) or path)


def check_resolves(cfg: DictConfig) -> None:
    """Every value of the config (of Hydra's node, the folders the job makes: app/hydra_node.py
    resolves what else of it a config changed) resolves as the job will resolve it, and every
    text among them is text a file system and a terminal take (core/path_text.py; a key named
    as a path, as a path)."""
    values = JobValues(cfg)
    for key in [*(str(key) for key in cfg if key != "hydra"), *HYDRA_FOLDERS]:
        for path, leaf in _leaves(values.value(key), key):
            if isinstance(leaf, str) and (problem := _text_problem(path, leaf)):
                raise ConfigError(f"{path} {problem}: give another value")


# The folders the job makes (whatever the command: a value that cannot be one is refused alike).
HYDRA_FOLDERS = ("hydra.run.dir", "hydra.sweep.dir")


# Keys whose value names a file, a folder or a server, by their name (data.root,
# logger.csv.filename, checkpoint.resume, logger.mlflow.tracking_uri, data.files).
PATH_KEY = re.compile(r"(dir|root|path|file|files|filename|resume|uri|url)$")


def _text_problem(path: str, text: str) -> str | None:
    if PATH_KEY.search(path.rsplit(".", 1)[-1]):
        return path_text_problem(text)
    return text_problem(text)


def _leaves(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _leaves(value, f"{path}[{index}]")
    else:
        yield path, node
