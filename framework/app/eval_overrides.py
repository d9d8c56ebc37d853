"""A run's own overrides, from its record (`<run dir>/.hydra/overrides.yaml`), so that a resume
or an evaluation never needs its training command typed again.

- mode=eval of a checkpoint: what decides which examples and weights it is evaluated on (the
  experiment, task, model, data and precision overrides, and EMA) comes from the training run.
- A resume, from the run dir (`hydra.run.dir=<a run dir>`, a sweep's job dir too) or from a
  checkpoint (`checkpoint.resume=<file>`): every override the run was started with but how its
  ranks were started (launcher, dist, hydra).

The command line may still set anything: an override of its own for a key the run set wins,
and the checkpoint's settings are then compared with it (a resume refuses a change that alters
training; an evaluation, one that alters the examples or the weights), as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from framework.config.redaction import REDACTED
from framework.core.allowlist import matches_prefix, parse_overrides, parsed_arguments

# What the training run chose that decides the examples and the weights an evaluation sees.
ADOPTED = ("experiment", "task", "model", "data", "precision", "trainer.ema_decay")
# What a resume never takes from the record: what this command does, and how and where its
# ranks start (a node joining another node's job in the same run dir is no resume of it).
NOT_RESUMED = ("mode", "checkpoint.resume", "launcher", "dist", "hydra")
RESUME_NOT_A_PATH = ("auto", "never", "last", "best")


def with_training_overrides(argv: list[str]) -> tuple[list[str], Path | None, list[str]]:
    """argv, led by the run's recorded overrides when it evaluates or resumes a run whose dir
    recorded them; the record it read them from (else None) and the overrides it took."""
    args = parsed_arguments(argv)
    if args is None or args.multirun:  # a sweep's jobs take their overrides from the sweep
        return argv, None, []
    overrides = parse_overrides(args.overrides)
    values = {o.key_or_group: o.value() for o in overrides if not o.is_sweep_override()}
    record, adopts = _record_of(values)
    if record is None:
        return argv, None, []
    given = [override.key_or_group for override in overrides]
    adopted = [line for line in _recorded(record, adopts) if not _overridden(line, given)]
    return _before_overrides(argv, list(args.overrides), adopted), record, adopted


def _before_overrides(argv: list[str], overrides: list[str], adopted: list[str]) -> list[str]:
    """argv with `adopted` just before its overrides, after any flag: argparse takes the
    overrides as one run (`-cd conf mode=eval ...` keeps -cd first)."""
    start = next(
        at
        for at in range(len(argv) - len(overrides) + 1)
        if argv[at : at + len(overrides)] == overrides
    )
    return argv[:start] + adopted + argv[start:]


def _record_of(values: dict[str, Any]) -> tuple[Path | None, Any]:
    """The record a command continues from, and what it adopts of it (a test on a key)."""
    resume, run_dir = values.get("checkpoint.resume"), values.get("hydra.run.dir")
    explicit = isinstance(resume, str) and resume not in RESUME_NOT_A_PATH
    if str(values.get("mode")) == "eval":
        record = training_record(Path(resume).expanduser()) if explicit else None
        return record, lambda key: matches_prefix(key, ADOPTED)
    if explicit:
        record = training_record(Path(resume).expanduser())
    elif isinstance(run_dir, str) and resume != "never":
        found = Path(run_dir).expanduser() / ".hydra" / "overrides.yaml"
        record = found if found.is_file() else None
    else:
        record = None
    return record, lambda key: not matches_prefix(key, NOT_RESUMED)


def training_record(checkpoint: Path) -> Path | None:
    """The overrides.yaml of the run dir holding `checkpoint` (its checkpoints/ folder's
    parent, or any folder above)."""
    for folder in checkpoint.resolve().parents:
        record = folder / ".hydra" / "overrides.yaml"
        if record.is_file():
            return record
    return None


def _recorded(record: Path, adopts: Any) -> list[str]:
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
        and adopts(_key(parsed[0]))
        and not parsed[0].is_sweep_override()
        and REDACTED not in str(line)
    ]


def _key(override: Any) -> str:
    return override.key_or_group


def _overridden(line: str, given: list[str]) -> bool:
    """Whether the command line sets the same key, or picks the group option it lies in
    (`model=mlp` replaces the training run's `model.width=16` too)."""
    [override] = parse_overrides([line])
    return any(matches_prefix(_key(override), [mine]) for mine in given)
