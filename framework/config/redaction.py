"""What may be written: secrets never reach disk or W&B.

Values at secret-looking config keys and of secret-looking environment variables are replaced by
REDACTED in everything we write; secrets typed on the command line are moved into environment
variables before Hydra sees them (framework/app/command_line.py), so Hydra's own records only
ever hold `${oc.env:...}`. Hydra writes its own record of a job before any callback could redact it,
so the app runs with hydra.output_subdir=null and `write_hydra_record` writes it instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, SCMode, open_dict, read_write

from framework.core.allowlist import iter_leaves, matches_prefix
from framework.core.secrets import (
    REDACTED,
    SecretFilter,
    env_secret_values,
    is_secret_name,
    known_secrets,
    remember,
    scrub,
    secret_text,
    url_passwords,
)

__all__ = ["REDACTED", "SecretFilter", "is_secret_name", "known_secrets"]  # (for the writers)


# --- what may be written: which values are secret is core/secrets.py's ------------------
def redact(value: Any, secrets: Iterable[str], secret_key: bool = False) -> Any:
    """A copy of value (str, dict, list, scalar) with each secret replaced by REDACTED, and
    every scalar under a secret-looking key replaced whole (core/secrets.py's `scrub`)."""
    return scrub(value, secrets, secret_key)


def secret_values(cfg: Any, environ: Mapping[str, str]) -> set[str]:
    """Values at secret-looking config paths (resolved: reading ${oc.env:...} makes its value
    a secret too) plus the environment's secrets."""
    values = set()
    for path, value in iter_leaves(cfg):
        text = secret_text(value)
        if text and is_secret_name(path):
            values.add(text)
        if isinstance(value, str):
            values |= url_passwords(value)
    return values | env_secret_values(environ)  # after the leaves: they note what they read


def remember_secrets(cfg: Any) -> set[str]:
    """cfg's secrets, remembered by this process for every later scrub (its log records, its
    console)."""
    secrets = secret_values(cfg, os.environ)
    remember(secrets)
    return secrets


def plain(cfg: DictConfig | ListConfig, resolve: bool = True) -> Any:
    return OmegaConf.to_container(
        cfg, resolve=resolve, enum_to_str=True, structured_config_mode=SCMode.DICT
    )


def redacted_container(cfg: DictConfig) -> dict:
    """The resolved config as a plain dict with secrets redacted: for config.yaml and W&B."""
    return redact(plain(cfg), remember_secrets(cfg))


# --- Hydra's records ------------------------------------------------------------------------
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
