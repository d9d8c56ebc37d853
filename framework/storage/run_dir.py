"""The run dir's files and lifecycle: created by Hydra, accepted or refused before anything is
written, resumed, trimmed after a restart, discarded after a rejected config. Only rank 0
writes here.

<run dir>/
    .hydra/          Hydra's record of the composition (redacted: framework/config/redaction.py)
    config.yaml      the resolved config every rank ran with (written once the run is accepted)
    metrics.jsonl    one JSON object per log event
    summary.json     the final metrics
    train.log        rank 0's console log
    curves.png       the curves of metrics.jsonl
    checkpoints/     step_<N>.pt + .json, last.pt (framework/storage/checkpoint.py)
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.core import launch_context
from framework.core.exits import ConfigError
from framework.storage.checkpoint import atomic_write, step_files

THROWAWAY_PREFIX = "framework-rank"  # the temporary Hydra dir of torchrun ranks > 0


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def record(self) -> Path:
        return self.path / ".hydra"

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def log(self) -> Path:
        return self.path / "train.log"

    @property
    def curves(self) -> Path:
        return self.path / "curves.png"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    # --- accept or refuse ---------------------------------------------------------------------
    def holds_run(self) -> bool:
        return self.metrics.exists() or self.summary.exists()

    def continues(self, cfg: DictConfig) -> bool:
        """A run dir with a run in it is only reused to resume it: from its checkpoints, or as
        a restart of the same job (torchrun's restart, a requeued SLURM job), which may have
        been killed before its first checkpoint."""
        if cfg.checkpoint.resume == "never":
            return False
        return launch_context.current().restarted() or bool(step_files(self.checkpoints))

    def check_reusable(self, cfg: DictConfig, sweep_job: bool) -> None:
        """Refuse a dir that holds a run this config would not continue: it stays untouched."""
        if not self.holds_run() or self.continues(cfg):
            return
        where, fix = (
            (str(self.path), "Choose a new hydra.sweep.dir")
            if sweep_job
            else (
                f"hydra.run.dir={self.path}",
                "Choose a new hydra.run.dir (or leave it unset for a fresh timestamped dir)",
            )
        )
        raise ConfigError(
            f"{where} already holds a run with no checkpoint to continue from (or "
            f"checkpoint.resume=never); it is left untouched. {fix}"
        )

    # --- a run's life -------------------------------------------------------------------------
    def save_config(self, record: dict[str, Any]) -> None:
        """config.yaml, written once the run is accepted: a refused resume changes nothing."""
        OmegaConf.save(OmegaConf.create(record), self.config)

    def trim_metrics(self, step: int) -> int:
        """Drop events after `step` (they are re-run after a resume); returns how many went."""
        if not self.metrics.exists():
            return 0
        lines = self.metrics.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _event_step(line) <= step]
        if len(kept) != len(lines):
            atomic_write(self.metrics, lambda file: file.write("".join(kept).encode()))
        return len(lines) - len(kept)

    def read_summary(self) -> dict[str, Any]:
        return json.loads(self.summary.read_text())

    def resume_hint(self, cfg: DictConfig) -> str:
        """How to continue a stopped run."""
        if cfg.launcher.name == "slurm":
            return "SLURM requeues the job if it was preempted or timed out; it then resumes here"
        hydra_record = self.record / "hydra.yaml"  # rank 0's record of the job: run or sweep
        if hydra_record.exists() and OmegaConf.load(hydra_record).hydra.mode == "MULTIRUN":
            # The job dir is <sweep dir>/<job number>; running the sweep again resumes every job.
            return f"To continue, run the same command with hydra.sweep.dir={self.path.parent}"
        return f"To continue, run the same command with hydra.run.dir={self.path}"

    def discard(self, sweep_job: bool = False) -> None:
        """After a rejected config: remove what this run wrote, and the dir if nothing else is
        in it. A dir that holds an earlier run (a refused resume) keeps everything; a sweep's
        dir and its parents stay (the sweep's other jobs and summary go there)."""
        if self.metrics.exists() or self.checkpoints.exists():
            return
        shutil.rmtree(self.record, ignore_errors=True)
        for name in (self.config, self.log):
            name.unlink(missing_ok=True)
        # The run dir, then the dated folders Hydra made for it, while they are empty.
        for folder in (self.path,) if sweep_job else (self.path, *self.path.parents):
            with contextlib.suppress(OSError):  # another process may have removed or filled it
                if not folder.is_dir() or any(folder.iterdir()) or folder == Path.cwd():
                    break
                folder.rmdir()


def _event_step(line: str) -> float:
    try:
        return json.loads(line).get("step", -1)
    except json.JSONDecodeError:
        return float("inf")  # a line cut short by a kill: drop it


def throwaway_dir() -> Path:
    """Hydra's dir for a torchrun rank > 0, which adopts rank 0's run dir: removed again once
    the rank has it (so a rank killed later leaves nothing behind)."""
    return Path(tempfile.mkdtemp(prefix=THROWAWAY_PREFIX))


def is_throwaway(path: Path) -> bool:
    return path.name.startswith(THROWAWAY_PREFIX)
