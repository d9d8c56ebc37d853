"""How this process was started, and its place in the job: the one module that reads the
variables launchers set (torchrun's RANK / TORCHELASTIC_*, SLURM_*, submitit's).

One small class per way a process can be started, behind one interface, chosen by `current()`:

- `Standalone`: a command a user typed (`train ...`); it may be one task of an `srun` step.
- `TorchElastic`: a rank started by torchrun (or its elastic agent): RANK, WORLD_SIZE, ...
- `SubmititTask`: one task of a submitit job (launcher=slurm|slurm_local): one rank.

The ranks our own launchers spawn (`launcher=local`) get their `DistEnv` from the launcher, not
from the environment.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

# Derived rendezvous ports: 20000-32767, below Linux's ephemeral range (32768+).
PORT_BASE, PORT_SPAN = 20000, 12768
_LAUNCH_PREFIXES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_",
    "GROUP_",
    "TORCHELASTIC_",
    "SLURM_",
    "SUBMITIT_",
)


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, discovered once and never mutated."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    source: str = "single"  # single | local | elastic (launcher=torchrun) | torchrun | slurm

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def composed_own_config(self) -> bool:
        """Every rank entered the app and composed a config (external torchrun, SLURM tasks):
        the ranks then run rank 0's."""
        return self.source in ("torchrun", "slurm")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Ranks from torchrun's variables, else one process."""
        return TorchElastic(os.environ if environ is None else environ).dist_env()


class LaunchContext:
    """A way this process can have been started. The base: nothing started it but a user."""

    name: ClassVar[str] = "standalone"
    # Every rank enters `train` itself and composes its own config (torchrun, SLURM).
    creates_processes_externally: ClassVar[bool] = False

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = dict(environ)

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return True

    def global_rank(self) -> int:
        """This process's rank as its launcher announced it, before any process group."""
        return 0

    @property
    def is_follower(self) -> bool:
        """A rank > 0 that entered the app: it runs rank 0's config and writes nothing."""
        return self.creates_processes_externally and self.global_rank() != 0

    def restarted(self) -> bool:
        """A restart of a job that ran before (torchrun's restart, a requeued SLURM job), which
        may have been killed before it saved a checkpoint."""
        return False

    def run_id(self) -> str | None:
        """The job's id, the same for every restart of it, if the launcher gives one."""
        return None

    def srun_step(self) -> tuple[int, int]:
        """(tasks, nodes) of the `srun` step this command is one task of; (1, 1) outside one."""
        return (
            int(self.environ.get("SLURM_STEP_NUM_TASKS", "1")),
            int(self.environ.get("SLURM_STEP_NUM_NODES", "1")),
        )


class Standalone(LaunchContext):
    pass


class TorchElastic(LaunchContext):
    """A rank of torchrun (or of torch's elastic agent started by launcher=torchrun)."""

    name = "torchrun"
    creates_processes_externally = True

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in environ or all(
            name in environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
        )

    def global_rank(self) -> int:
        return int(self.environ.get("RANK", "0"))

    def restarted(self) -> bool:
        return int(self.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0

    def run_id(self) -> str | None:
        run_id = self.environ.get("TORCHELASTIC_RUN_ID", "none")
        return None if run_id == "none" else run_id

    def dist_env(self) -> DistEnv:
        if "RANK" not in self.environ or "WORLD_SIZE" not in self.environ:
            return DistEnv()
        world_size = int(self.environ["WORLD_SIZE"])
        return DistEnv(
            rank=int(self.environ["RANK"]),
            local_rank=int(self.environ.get("LOCAL_RANK", 0)),
            world_size=world_size,
            local_world_size=int(self.environ.get("LOCAL_WORLD_SIZE", world_size)),
            source="torchrun",
        )


class SubmititTask(LaunchContext):
    """One task (one rank) of a job submitted through submitit: SLURM's or its local executor."""

    name = "submitit"
    creates_processes_externally = True

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return "SUBMITIT_EXECUTOR" in environ

    @functools.cached_property
    def job(self):  # submitit.JobEnvironment: SLURM's variables, or the local executor's
        # Imported here: only submitit tasks pay for it.
        import submitit

        return submitit.JobEnvironment()

    def global_rank(self) -> int:
        return self.job.global_rank

    def restarted(self) -> bool:
        return int(self.environ.get("SLURM_RESTART_COUNT", "0")) > 0

    def dist_env(self) -> DistEnv:
        return DistEnv(
            rank=self.job.global_rank,
            local_rank=self.job.local_rank,
            world_size=self.job.num_tasks,
            local_world_size=self.job.num_tasks // self.job.num_nodes,
            source="slurm",
        )

    def num_tasks(self) -> int:
        return self.job.num_tasks

    def rendezvous(self, master_port: int | None) -> tuple[str, int]:
        """Rank 0's address (the job's first node) and port: `master_port`, or one derived from
        the job id, the same on every task and requeued run of the job, and different for the
        jobs of an array, so jobs sharing a node do not collide."""
        address = "127.0.0.1" if self.job.cluster == "local" else self.job.hostnames[0]
        return address, master_port or rendezvous_port(self.job.raw_job_id)


def rendezvous_port(job_id: str) -> int:
    return PORT_BASE + int(job_id) % PORT_SPAN


CONTEXTS: tuple[type[LaunchContext], ...] = (SubmititTask, TorchElastic, Standalone)


def detect(environ: Mapping[str, str]) -> LaunchContext:
    """The first context whose variables are present. A submitit task comes first: a site's
    SLURM prolog may set LOCAL_RANK without torchrun."""
    return next(kind for kind in CONTEXTS if kind.detect(environ))(environ)


def current() -> LaunchContext:
    """This process's context, detected once per distinct set of launch variables (a launcher
    or a test may change them within one process)."""
    launch_variables = tuple(
        sorted(
            (name, value) for name, value in os.environ.items() if name.startswith(_LAUNCH_PREFIXES)
        )
    )
    return _detect_cached(launch_variables)


@functools.lru_cache(maxsize=8)
def _detect_cached(launch_variables: tuple[tuple[str, str], ...]) -> LaunchContext:
    return detect(dict(launch_variables))


def export_rendezvous(address: str, port: int) -> None:
    """Where torch's env:// initialisation finds rank 0 (MASTER_ADDR / MASTER_PORT)."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
