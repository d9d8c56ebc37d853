"""What may be written: secrets never reach disk or W&B.

Values at secret-looking config keys and of secret-looking environment variables are replaced by
REDACTED in everything we write; secrets typed on the command line are moved into environment
variables before Hydra sees them (framework/app/command_line.py), so Hydra's own records only
ever hold `${oc.env:...}`. Hydra writes its own record of a job before any callback could redact it,
so the app runs with hydra.output_subdir=null and writes it itself (app/hydra_records.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, SCMode

from framework.core.allowlist import iter_leaves
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
