"""mode=eval without repeating the training command: what decides which examples and weights a
checkpoint is evaluated on (the experiment, task, model, data and precision overrides, and EMA)
comes from the training run's own record, `<run dir>/.hydra/overrides.yaml`.

The command line may still set what an evaluation may change (eval.split, batch sizes,
loggers, the launcher); an override of its own for a key the training run set wins, and the
evaluation then compares it with the checkpoint's settings (run/evaluation.py), as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from framework.core.allowlist import matches_prefix, parse_command_line, parse_overrides

# What the training run chose that decides the examples and the weights an evaluation sees.
ADOPTED = ("experiment", "task", "model", "data", "precision", "trainer.ema_decay")
RESUME_NOT_A_PATH = ("auto", "never", "last", "best")


def with_training_overrides(argv: list[str]) -> tuple[list[str], Path | None]:
    """argv, led by the training run's adopted overrides when it is a mode=eval of a
    checkpoint whose run dir recorded them, and the record it read them from (else None)."""
    overrides, _ = parse_command_line(argv)
    values = {o.key_or_group: o.value() for o in overrides if not o.is_sweep_override()}
    resume = values.get("checkpoint.resume")
    if str(values.get("mode")) != "eval" or not isinstance(resume, str):
        return argv, None
    if resume in RESUME_NOT_A_PATH:
        return argv, None
    record = training_record(Path(resume).expanduser())
    if record is None:
        return argv, None
    given = [override.key_or_group for override in overrides]
    adopted = [line for line in _recorded(record) if not _overridden(line, given)]
    return adopted + argv, record


def training_record(checkpoint: Path) -> Path | None:
    """The overrides.yaml of the run dir holding `checkpoint` (its checkpoints/ folder's
    parent, or any folder above)."""
    for folder in checkpoint.resolve().parents:
        record = folder / ".hydra" / "overrides.yaml"
        if record.is_file():
            return record
    return None


def _recorded(record: Path) -> list[str]:
    try:
        lines = OmegaConf.to_container(OmegaConf.load(record))
    except Exception:  # noqa: BLE001 (a damaged record: nothing adopted, the evaluation compares as before)
        return []
    if not isinstance(lines, list):
        return []
    return [
        str(line)
        for line in lines
        if (parsed := parse_overrides([str(line)]))
        and matches_prefix(_key(parsed[0]), ADOPTED)
        and not parsed[0].is_sweep_override()
    ]


def _key(override: Any) -> str:
    return override.key_or_group


def _overridden(line: str, given: list[str]) -> bool:
    """Whether the command line sets the same key, or picks the group option it lies in
    (`model=mlp` replaces the training run's `model.width=16` too)."""
    [override] = parse_overrides([line])
    return any(matches_prefix(_key(override), [mine]) for mine in given)
