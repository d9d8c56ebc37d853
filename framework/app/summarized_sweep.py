"""A sweep launcher's summary: each job's row in the sweep dir's summary.csv / summary.md as it
ends (framework/app/sweep_summary.py), whichever launcher ran it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn


class SummarizedSweep:
    """Mixed into a Hydra launcher (hydra_plugins/framework_launchers)."""

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        # Imported here: Hydra imports every launcher plugin at each start, and the summary's
        # run-dir reading imports the training stack.
        from framework.app.sweep_summary import SweepSummary

        self.summary = SweepSummary(Path(str(config.hydra.sweep.dir)), config.objective)

    def job_ended(self, num: int, ret: JobReturn) -> None:
        self.summary.add(num, [ret])

    def launch(self, job_overrides: Any, initial_job_idx: int) -> list[JobReturn]:
        returns = list(super().launch(job_overrides, initial_job_idx))
        if initial_job_idx not in self.summary.rows:  # a launcher that reports no job as it ends
            self.summary.add(initial_job_idx, returns)
        return returns
