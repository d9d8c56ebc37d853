"""Resolvers the YAML files use: values that depend on how and where this process started."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigSource
from omegaconf import OmegaConf
from omegaconf.resolvers import oc

from framework.core import launch_context
from framework.core.devices import visible_gpus
from framework.core.secrets import note_env_read


def run_stamp() -> str:
    """The run dir below outputs/: date/time, or under an external torchrun the job's
    rendezvous id, which every restart of the job shares, so a restarted rank 0 comes back
    to the run dir (and checkpoints) of the first attempt."""
    run_id = launch_context.current().run_id()
    if run_id is not None:
        return f"torchrun/{run_id}"
    return datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f")


def output_dir(mode: str, checkpoint: str, split: str) -> str:
    """The run dir: outputs/<run_stamp>, or for mode=eval a folder of its own inside the run
    dir of the evaluated checkpoint, <run dir>/eval/<split>-<date>_<time> (outputs/eval/... for
    a checkpoint outside a run dir), so the training run's own files are never overwritten."""
    if mode != "eval":
        return f"outputs/{run_stamp()}"
    stamp = f"{split}-{datetime.now():%Y-%m-%d_%H-%M-%S-%f}"
    path = Path(checkpoint).expanduser().absolute()
    run = next((folder.parent for folder in path.parents if folder.name == "checkpoints"), None)
    return str(run / "eval" / stamp) if run is not None else f"outputs/eval/{stamp}"


def default_ranks() -> int:
    """launcher.nproc_per_node's default: one rank per visible GPU, else 2 ranks on CPU."""
    return gpu_count() or 2


def gpu_count() -> int:
    """The GPUs torch sees, read without torch where the driver tells (core/devices.py)."""
    found = visible_gpus()
    if found is None:  # only torch can tell here
        import torch

        return torch.cuda.device_count()
    return found


def config_groups() -> str:
    """The groups a user picks options from, one line each (`train --help`): Hydra's own list
    would also show the internal schema/* groups that the options extend."""
    return group_listing(GlobalHydra.instance().config_loader().get_sources())


def group_listing(sources: Sequence[ConfigSource]) -> str:
    """Asked of the config sources themselves: the loader's own listing copies its whole config
    store for every group asked (about 0.2 s a group here)."""
    lines: list[str] = []

    def found(group: str, kind: ObjectType) -> list[str]:
        names = {
            name.removesuffix(".yaml")
            for source in sources
            if source.is_group(group)
            for name in source.list(group, kind)
        }
        return sorted(names)

    def walk(parent: str) -> None:
        for group in found(parent, ObjectType.GROUP):
            path = f"{parent}/{group}" if parent else group
            if path in ("hydra", "schema", "experiment_options"):  # not picked by users
                continue
            options = found(path, ObjectType.CONFIG)
            if options:
                lines.append(f"{path}: {', '.join(options)}")
            walk(path)

    walk("")
    return "\n".join(lines)


def env(key: str, *default: Any) -> Any:
    """OmegaConf's own `oc.env`, which also records the name it read: the value is a secret from
    then on, scrubbed from all that is written (core/secrets.py)."""
    note_env_read(key)
    return oc.env(key, *default)


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("oc.env", env, replace=True)
    OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("default_ranks", default_ranks, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("config_groups", config_groups, replace=True)
    OmegaConf.register_new_resolver("output_dir", output_dir, use_cache=True, replace=True)
