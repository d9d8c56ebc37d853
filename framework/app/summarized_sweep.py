"""What the sweep launchers add to Hydra's (hydra_plugins/framework_launchers mixes these in):
each job's row in summary.csv / summary.md as it ends (app/sweep_summary.py), and, for
submitit's, waiting for each job's rank 0 result (launch/slurm/sweep.py). Hydra imports every
launcher plugin at each start: what these run is imported once a sweep is set up or launched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn


class SummarizedSweep:
    """Mixed into a Hydra launcher (hydra_plugins/framework_launchers)."""

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        from framework.app.sweep_summary import SweepSummary  # (in a sweep only: above)

        self.summary = SweepSummary(Path(str(config.hydra.sweep.dir)), config.objective)

    def job_ended(self, num: int, ret: JobReturn) -> None:
        self.summary.add(num, [ret])

    def launch(self, job_overrides: Any, initial_job_idx: int) -> list[JobReturn]:
        returns = list(super().launch(job_overrides, initial_job_idx))
        if initial_job_idx not in self.summary.rows:  # a launcher that reports no job as it ends
            self.summary.add(initial_job_idx, returns)
        return returns


class SubmittedSweep(SummarizedSweep):
    """A submitit launcher's launch(): the jobs submitted, each job's rank 0 result awaited."""

    def launch(self, job_overrides: Any, initial_job_idx: int) -> list[JobReturn]:
        from framework.launch.slurm.sweep import submit_and_wait  # (in a sweep only: above)

        return submit_and_wait(self, job_overrides, initial_job_idx)
