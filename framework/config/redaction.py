"""What may be written: secrets never reach disk or W&B.

Values at secret-looking config keys and of secret-looking environment variables are replaced by
REDACTED in everything we write; secrets typed on the command line are moved into environment
variables before Hydra sees them (`hide_command_line_secrets`), so Hydra's own records only ever
hold `${oc.env:...}`. Hydra writes its own record of a job before any callback could redact it,
so the app runs with hydra.output_subdir=null and `write_hydra_record` writes it instead.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, SCMode, open_dict, read_write

from framework.config import CONF_DIR
from framework.core.allowlist import iter_leaves, matches_prefix, parse_command_line


def is_config_group(key: str) -> bool:
    """`db/credentials=prod` or `credentials=prod` (a folder in conf/) picks a config file:
    its value is an option name, not a secret, and must stay as it is."""
    return "/" in key or (CONF_DIR / key).is_dir()


def secret_env_name(key: str) -> str:
    return "FRAMEWORK_SECRET_" + re.sub(r"[^A-Za-z0-9]", "_", key).upper()


def hide_command_line_secrets(argv: list[str], environ: dict[str, str]) -> list[str]:
    """argv with every plain secret override `KEY=VALUE` (a secret-looking KEY, or a VALUE
    holding a known secret) rewritten to `KEY=${oc.env:NAME}`, and VALUE stored in
    environ[NAME]. Hydra records overrides in .hydra/, multirun.yaml and its console log, and
    W&B records argv: all of them now hold only the variable's name."""
    known = env_secret_values(environ)
    overrides, _ = parse_command_line(argv)
    rewritten = {}
    for override in overrides:
        value = override.value()
        if override.is_delete() or override.is_sweep_override() or override.package is not None:
            continue
        if not isinstance(value, str | int | float) or isinstance(value, bool) or value == "":
            continue
        text = str(value)
        if "${" in text:
            continue  # already a reference, not the secret itself
        key = override.key_or_group
        if is_config_group(key) or not (is_secret_name(key) or redact(text, known) != text):
            continue
        name = secret_env_name(key)
        environ[name] = text
        prefix = override.input_line.split("=", 1)[0]
        rewritten[override.input_line] = f"{prefix}=${{oc.env:{name}}}"
    return [rewritten.get(arg, arg) for arg in argv]


# --- what may be written --------------------------------------------------------------------
REDACTED = "***REDACTED***"
MIN_SECRET_LENGTH = 6  # shorter values (true, 1, dev) would blank out unrelated text
SECRET_WORDS = frozenset(
    {
        "key",
        "apikey",
        "token",
        "password",
        "passwd",
        "passphrase",
        "secret",
        "secrets",
        "credential",
        "credentials",
    }
)
# A secret-looking environment variable ending in one of these holds a location or a setting,
# not the secret (SSL_KEY_FILE=/etc/ssl/key.pem, REDIS_KEY_PREFIX=app): redacting its value
# would blank out unrelated text (paths, host names) in what we write.
NOT_SECRET_LAST_WORDS = frozenset(
    {
        "file",
        "path",
        "dir",
        "sock",
        "socket",
        "url",
        "host",
        "port",
        "name",
        "prefix",
        "region",
        "user",
        "username",
        "type",
        "mode",
    }
)


def name_words(name: str) -> list[str]:
    """`WANDB_API_KEY` -> wandb, api, key; `apiKey` -> api, key; `data.api_token` -> data,
    api, token. Whole words only: `max_tokens`, `tokenizer`, `keep`, `monkey` hold no secret."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)
    return [word for word in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if word]


def is_secret_name(name: str) -> bool:
    return any(word in SECRET_WORDS for word in name_words(name))


def _secret_text(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return None
    text = str(value)
    return text if len(text) >= MIN_SECRET_LENGTH else None


def env_secret_values(environ: Mapping[str, str]) -> set[str]:
    """Values of secret-looking environment variables (WANDB_API_KEY, HF_TOKEN, ...)."""
    values = set()
    for name, value in environ.items():
        words = name_words(name)
        if is_secret_name(name) and words[-1] not in NOT_SECRET_LAST_WORDS and _secret_text(value):
            values.add(value)
        values |= url_passwords(value)  # MLFLOW_TRACKING_URI=https://user:password@host
    return values


def secret_values(cfg: Any, environ: Mapping[str, str]) -> set[str]:
    """Values at secret-looking config paths (resolved) plus secret environment values."""
    values = env_secret_values(environ)
    for path, value in iter_leaves(cfg):
        text = _secret_text(value)
        if text and is_secret_name(path):
            values.add(text)
        if isinstance(value, str):
            values |= url_passwords(value)
    return values


# The password of a URL's credentials (`https://user:password@host`, a tracking URI, a data
# mirror): redacted wherever a URL appears, under any key.
URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)(?P<password>[^@\s/]+)@")


def url_passwords(text: str) -> set[str]:
    """Passwords long enough to be replaced wherever else they appear (a log line quoting
    one without its URL); a URL itself is always redacted by pattern."""
    return {
        match["password"]
        for match in URL_PASSWORD.finditer(text)
        if len(match["password"]) >= MIN_SECRET_LENGTH
    }


def _redact_url_passwords(text: str) -> str:
    return URL_PASSWORD.sub(lambda match: f"{match['head']}{REDACTED}@", text)


def redact(value: Any, secrets: Iterable[str], secret_key: bool = False) -> Any:
    """A copy of value (str, dict, list, scalar) with each secret replaced by REDACTED, and
    every scalar under a secret-looking key replaced whole."""
    if isinstance(value, Mapping):
        return {
            key: redact(item, secrets, secret_key or is_secret_name(str(key)))
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(item, secrets, secret_key) for item in value]
    if secret_key and _secret_text(value) is not None:
        return REDACTED
    if isinstance(value, str):
        value = _redact_url_passwords(value)
        for secret in sorted(secrets, key=len, reverse=True):  # longest first: no partial leaks
            value = value.replace(secret, REDACTED)
    return value


# Secrets seen in configs this process redacted, so the log filter knows them too.
_seen_secrets: set[str] = set()


def known_secrets() -> set[str]:
    return env_secret_values(os.environ) | _seen_secrets


def plain(cfg: DictConfig | ListConfig, resolve: bool = True) -> Any:
    return OmegaConf.to_container(
        cfg, resolve=resolve, enum_to_str=True, structured_config_mode=SCMode.DICT
    )


def redacted_container(cfg: DictConfig) -> dict:
    """The resolved config as a plain dict with secrets redacted: for config.yaml and W&B."""
    secrets = secret_values(cfg, os.environ)
    _seen_secrets.update(secrets)
    return redact(plain(cfg), secrets)


class SecretFilter(logging.Filter):
    """Redacts known secrets from every record a handler writes (message and traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = known_secrets()
        if not secrets:
            return True
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 (a broken format string: logging reports it)
            return True
        if redact(message, secrets) != message:
            record.msg, record.args = redact(message, secrets), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text, secrets)
        return True


# --- Hydra's records ------------------------------------------------------------------------
def write_hydra_record(config: DictConfig, folder: Path) -> None:
    """Hydra's config.yaml / hydra.yaml / overrides.yaml, redacted and unresolved as Hydra
    writes them. Hydra writes its own copy before any callback could redact it, so ours runs
    with hydra.output_subdir=null and this writes the record instead (from on_job_start)."""
    secrets = secret_values(config, os.environ)
    _seen_secrets.update(secrets)
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
# its own config from the overrides. The rest of Hydra's node (overrides, sweeper, launcher,
# sweep dir) is, so it is left as it is; secrets typed as overrides are already hidden there.
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
