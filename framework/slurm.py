"""launcher=slurm|slurm_local: one submitit job per run, one task per rank.

The submitting process checks the cluster before anything is submitted. Inside a job every task
runs Hydra's job (the same sweep config, the same run dir); this module turns the task's
submitit environment into its rank and rendezvous, and hands a preemption or time-out back to
submitit once the ranks have saved.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable

from omegaconf import DictConfig

from framework.config import ConfigError
from framework.distributed import DistEnv

# Derived rendezvous ports: 20000-32767, below Linux's ephemeral range (32768+).
PORT_BASE, PORT_SPAN = 20000, 12768


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
        ["sinfo", "--all", "--noheader", "--format=%P"], capture_output=True, text=True,
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
    unknown = [name for name in str(launcher.partition or "").split(",") if name
               and name not in partitions]  # fmt: skip  (sbatch takes a list: a,b)
    if unknown:
        raise ConfigError(
            f"launcher.partition={launcher.partition}: {', '.join(unknown)} does not exist on "
            f"this cluster: choose from {', '.join(partitions) or '(none listed by sinfo)'}"
        )


def task_env(launcher: DictConfig) -> DistEnv:
    """This task's rank, from submitit's view of SLURM (or of its local executor). Exports the
    rendezvous of rank 0 (the first node) for torch's env:// initialisation."""
    import submitit

    if "SUBMITIT_EXECUTOR" not in os.environ:
        raise ConfigError(
            f"launcher={launcher.name} submits jobs through Hydra's multirun: leave hydra.mode "
            "alone (`train launcher=slurm ...` or `train -m launcher=slurm ...`)"
        )
    job = submitit.JobEnvironment()
    expected = launcher.get("nodes", 1) * launcher.tasks_per_node
    if job.num_tasks != expected:
        raise ConfigError(
            f"this job has {job.num_tasks} tasks, but launcher.nodes x launcher.tasks_per_node "
            f"= {expected}: the submitted resources come from the sweep's launcher settings, "
            "which cannot differ between the jobs of one sweep (run one sweep per setting)"
        )
    env = DistEnv(
        rank=job.global_rank,
        local_rank=job.local_rank,
        world_size=job.num_tasks,
        local_world_size=job.num_tasks // job.num_nodes,
        source="slurm",
    )
    if env.distributed:
        local = job.cluster == "local"
        os.environ["MASTER_ADDR"] = "127.0.0.1" if local else job.hostnames[0]
        os.environ["MASTER_PORT"] = str(launcher.master_port or rendezvous_port(job.raw_job_id))
    return env


def rendezvous_port(job_id: str) -> int:
    """The same on every task of a job and on its requeued runs; different for the jobs of an
    array (each has its own SLURM job id), so jobs sharing a node do not collide."""
    return PORT_BASE + int(job_id) % PORT_SPAN


def requeue_signal() -> str:
    """The signal submitit asks SLURM for before the time limit (and sends on preemption)."""
    import submitit

    return signal.Signals(submitit.JobEnvironment._usr_sig()).name


def hand_back_to_submitit(received: set[str]) -> Callable[[], None] | None:
    """After the ranks stopped with a checkpoint: if submitit's signal was among those this task
    received, its handler (restored once training let go of the signals) decides: requeue the
    job (time-outs count against launcher.max_num_timeout) and exit, or raise
    submitit's UncompletedJobError when the job may not come back. Returns that call, or None
    when SLURM itself requeues (preemption, `scontrol requeue`) or the job was cancelled."""
    name = requeue_signal()
    handler = signal.getsignal(getattr(signal, name))
    if name not in received or not callable(handler):
        return None
    return lambda: handler(getattr(signal, name), None)
