"""launcher=slurm, before anything is submitted: SLURM's commands answer and the partition
exists."""

from __future__ import annotations

import shutil
import subprocess

from omegaconf import DictConfig

from framework.core.exits import ConfigError


def check_cluster(launcher: DictConfig) -> None:
    """Before submitting: SLURM's commands are reachable and the partition exists."""
    if launcher.name != "slurm":
        return
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        raise ConfigError(
            "launcher=slurm needs SLURM's sbatch and sinfo on PATH: run on a login node of the "
            "cluster, or try the same job on this machine with launcher=slurm_local"
        )
    listing = subprocess.run(
        ["sinfo", "--all", "--noheader", "--format=%P"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if listing.returncode != 0:
        raise ConfigError(
            f"launcher=slurm: `sinfo` failed ({listing.stderr.strip() or listing.returncode}): "
            "is slurmctld reachable from here (SLURM_CONF)?"
        )
    names = [name.strip() for name in listing.stdout.split()]
    default = [name.rstrip("*") for name in names if name.endswith("*")]
    partitions = [name.rstrip("*") for name in names]
    if launcher.partition is None and not default:
        raise ConfigError(
            "launcher.partition is not set and this cluster has no default partition: set "
            f"launcher.partition to one of {', '.join(partitions) or '(none listed by sinfo)'}"
        )
    unknown = [
        name for name in str(launcher.partition or "").split(",") if name and name not in partitions
    ]  # sbatch takes a list: a,b
    if unknown:
        raise ConfigError(
            f"launcher.partition={launcher.partition}: {', '.join(unknown)} does not exist on "
            f"this cluster: choose from {', '.join(partitions) or '(none listed by sinfo)'}"
        )
