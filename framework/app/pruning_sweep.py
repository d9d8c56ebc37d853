"""hydra/sweeper=optuna_prune: hydra-optuna-sweeper's sampling, with a pruner, a study that lives
in the sweep dir, and a sweep that resumes.

Optuna's ask-and-tell: the sweeper asks the study for each trial, launches it as a Hydra job (a
normal multi-rank run, any launcher), and tells the study how it ended: its objective, pruned
(the job's summary says so: framework/rank/pruning.py stopped it), or failed. While the trial
runs, its rank 0 reports each evaluation to the same study and its pruner decides.

The study is an SQLite file the framework names in the sweep dir (core/sweep_study.py). Run again
with the same hydra.sweep.dir, the sweep goes on: trials that ended (completed, pruned or
failed) are not run again, a trial cut off mid-run runs again as the same job, which resumes
from its checkpoint, and new trials are asked until there are hydra.sweeper.n_trials."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_optuna_sweeper._impl import (
    OptunaSweeperImpl,
    create_params_from_overrides,
)
from omegaconf import DictConfig, OmegaConf

from framework.core.pruners import build_pruner
from framework.core.sweep_study import (
    JOB_ATTR,
    OVERRIDES_ATTR,
    PRUNER_ATTR,
    storage_url,
    study_path,
)
from framework.storage.run_dir import RunDir

log = logging.getLogger(__name__)
ENDED = ("COMPLETE", "PRUNED", "FAIL")


class PruningSweeperImpl(OptunaSweeperImpl):
    """hydra-optuna-sweeper's sweeper with `pruner` (median | asha | hyperband) and each
    pruner's settings; its `storage` is the framework's file, whatever the node says."""

    def __init__(
        self,
        pruner: str,
        median: DictConfig,
        asha: DictConfig,
        hyperband: DictConfig,
        **optuna_settings: Any,
    ) -> None:
        super().__init__(**optuna_settings)
        chosen = {"median": median, "asha": asha, "hyperband": hyperband}[pruner]
        self.pruner_name = pruner
        self.pruner_settings = OmegaConf.to_container(chosen, resolve=True)

    def sweep(self, arguments: list[str]) -> None:
        self._process_searchspace_config()
        distributions, fixed = create_params_from_overrides(
            [*self._parse_sweeper_params_config(), *arguments]
        )
        for name in fixed:
            distributions.pop(name, None)
        self._grid_sampler(distributions)
        study = self._open_study()
        trials = study.get_trials(deepcopy=False)
        cut_off = [trial for trial in trials if trial.state.name not in ENDED]
        ended = len(trials) - len(cut_off)
        if trials:
            log.info(
                "resuming the study in %s: %d trials ended, %d cut off run again",
                study_path(Path(self.sweep_dir)),
                ended,
                len(cut_off),
            )
        for trial in cut_off:  # each as the job it was, which resumes from its checkpoint
            if OVERRIDES_ATTR not in trial.user_attrs:  # asked, never launched: nothing to run
                study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
                continue
            self._run(
                study,
                [trial.number],
                [list(trial.user_attrs[OVERRIDES_ATTR])],
                trial.user_attrs[JOB_ATTR],
            )
        self.job_idx = 1 + max((t.user_attrs.get(JOB_ATTR, -1) for t in trials), default=-1)
        to_go = self.n_trials - len(trials)
        while to_go > 0:
            batch = min(to_go, self.n_jobs)
            asked = [study.ask() for _ in range(batch)]
            overrides = self._configure_trials(asked, distributions, fixed)
            for offset, (trial, lines) in enumerate(zip(asked, overrides, strict=True)):
                trial.set_user_attr(JOB_ATTR, self.job_idx + offset)
                trial.set_user_attr(OVERRIDES_ATTR, list(lines))
            self._run(study, [t.number for t in asked], [list(o) for o in overrides], self.job_idx)
            self.job_idx += batch
            to_go -= batch
        self._write_results(study)

    def _open_study(self) -> optuna.Study:
        study_file = study_path(Path(self.sweep_dir))
        study_file.parent.mkdir(parents=True, exist_ok=True)
        # As Hydra's basic sweeper does: the master config (redacted by the run-dir callback),
        # which also marks the dir as this sweep's for the command that resumes it.
        OmegaConf.save(self.config, study_file.parent / "multirun.yaml")
        study = optuna.create_study(
            study_name=self.study_name or "sweep",
            storage=storage_url(study_file),
            sampler=self.sampler,
            pruner=build_pruner(self.pruner_name, self.pruner_settings),
            directions=self._get_directions(),
            load_if_exists=True,
        )
        # What each trial's rank 0 rebuilds its pruner from (framework/rank/pruning.py).
        study.set_user_attr(
            PRUNER_ATTR, {"name": self.pruner_name, "settings": self.pruner_settings}
        )
        log.info(
            "study %s in %s: sampler %s, pruner %s %s",
            study.study_name,
            study_file,
            type(self.sampler).__name__,
            self.pruner_name,
            self.pruner_settings,
        )
        return study

    def _grid_sampler(self, distributions: dict[str, Any]) -> None:
        sampler = self.sampler
        if isinstance(sampler, functools.partial) and sampler.func is optuna.samplers.GridSampler:
            space = {
                name: self._to_grid_sampler_choices(distribution)
                for name, distribution in distributions.items()
            }
            self.sampler = sampler(space)
            size = 1
            for choices in space.values():
                size *= len(choices)
            self.n_trials = min(self.n_trials, size)

    def _run(
        self, study: optuna.Study, numbers: list[int], overrides: list[list[str]], first_job: int
    ) -> None:
        """Launch these trials as jobs first_job, first_job + 1, ... and tell the study how
        each ended; too many failures end the sweep as hydra-optuna-sweeper's does."""
        returns = self.launcher.launch(
            [tuple(lines) for lines in overrides], initial_job_idx=first_job
        )
        failures = [
            ret
            for number, ret in zip(numbers, returns, strict=True)
            if not tell(study, number, ret)
        ]
        if failures and len(failures) / len(returns) > self.max_failure_rate:
            log.error(
                "%d of %d trials failed (hydra.sweeper.max_failure_rate=%s)",
                len(failures),
                len(returns),
                self.max_failure_rate,
            )
            failures[0].return_value  # noqa: B018 (JobReturn raises the job's error)

    def _write_results(self, study: optuna.Study) -> None:
        completed = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
        if not completed or len(study.directions) > 1:
            return
        best = study.best_trial
        log.info("best trial %d: %s = %s", best.number, best.params, best.value)
        OmegaConf.save(
            OmegaConf.create(
                {"name": "optuna", "best_params": best.params, "best_value": best.value}
            ),
            Path(self.sweep_dir) / "optimization_results.yaml",
        )


def tell(study: optuna.Study, number: int, ret: JobReturn) -> bool:
    """Tell the study how the trial's job ended; False for a failure."""
    TrialState = optuna.trial.TrialState
    if ret.status != JobStatus.COMPLETED:
        study.tell(number, state=TrialState.FAIL)
        return False
    if job_summary(ret).get("pruned"):
        study.tell(number, state=TrialState.PRUNED)
        return True
    try:
        values = _values(ret.return_value)
    except (TypeError, ValueError) as error:
        log.warning("trial %d: %s", number, error)
        study.tell(number, state=TrialState.FAIL)
        return False
    study.tell(number, values=values)
    return True


def _values(returned: Any) -> list[float]:
    if isinstance(returned, Sequence) and not isinstance(returned, str):
        return [float(value) for value in returned]
    return [float(returned)]


def job_summary(ret: JobReturn) -> dict[str, Any]:
    """The summary.json a completed job left in its run dir ({} without one)."""
    run_dir = Path(ret.hydra_cfg.hydra.runtime.output_dir if ret.hydra_cfg else ret.working_dir)
    summary = RunDir(run_dir).summary
    try:
        return json.loads(summary.read_text()) if summary.is_file() else {}
    except (OSError, ValueError):
        return {}
