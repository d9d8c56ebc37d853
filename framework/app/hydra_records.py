"""Hydra's records of a job and of a sweep, redacted (config/redaction.py says what is secret).

Hydra writes its own record of a job before any callback could redact it, so the app runs with
hydra.output_subdir=null and the run-dir callback writes it with `write_hydra_record`; a
multirun's master config is redacted in place before the sweeper saves it.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from framework.config.redaction import (
    is_secret_name,
    plain,
    redact,
    remember_secrets,
    secret_values,
)
from framework.core.allowlist import iter_leaves, matches_prefix


def write_hydra_record(config: DictConfig, folder: Path) -> None:
    """Hydra's config.yaml / hydra.yaml / overrides.yaml, redacted and unresolved as Hydra
    writes them. Hydra writes its own copy before any callback could redact it, so ours runs
    with hydra.output_subdir=null and this writes the record instead (from on_job_start)."""
    secrets = remember_secrets(config)
    task = {key: value for key, value in plain(config, resolve=False).items() if key != "hydra"}
    files = {
        "config.yaml": task,
        "hydra.yaml": {"hydra": plain(config.hydra, resolve=False)},
        "overrides.yaml": plain(config.hydra.overrides.task, resolve=False),
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        text = OmegaConf.to_yaml(OmegaConf.create(redact(content, secrets)))
        (folder / name).write_text(text)


# In a multirun, these parts of the master config are never read again: every job re-composes
# its own config from the overrides, and the sweeper took its parameters when Hydra built it,
# before our callback runs. The rest of Hydra's node (overrides, launcher, sweep dir) is read
# again, so it is left as it is; secrets typed as overrides are already hidden there.
MULTIRUN_MASTER_REDACTED = ("hydra.job.env_set",)


def redact_multirun_master(cfg: DictConfig) -> None:
    """Redact the multirun master config in place, before the sweeper saves it as
    multirun.yaml (and a submitit launcher pickles it)."""
    secrets = secret_values(cfg, os.environ)
    for path, value in iter_leaves(plain(cfg, resolve=False)):
        if matches_prefix(path, ["hydra"]) and not matches_prefix(path, MULTIRUN_MASTER_REDACTED):
            continue
        clean = redact(value, secrets, is_secret_name(path))
        if clean == value:
            continue
        with read_write(cfg), open_dict(cfg), read_write(cfg.get("hydra") or cfg):
            try:
                OmegaConf.update(cfg, path, clean, merge=False)
            except Exception:  # noqa: BLE001 (a typed number node cannot hold REDACTED)
                continue
    _redact_sweeper_params(cfg, secrets)


def _redact_sweeper_params(cfg: DictConfig, secrets: set[str]) -> None:
    """hydra.sweeper.params (`+data.api_token: a,b`): its keys hold dots, so each is redacted
    in its own node."""
    params = OmegaConf.select(cfg, "hydra.sweeper.params")
    if not isinstance(params, DictConfig):
        return
    for key, value in plain(params, resolve=False).items():
        clean = redact(value, secrets, is_secret_name(str(key)))
        if clean != value:
            with read_write(params), open_dict(params):
                params[key] = clean
