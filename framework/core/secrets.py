"""Secrets, by value: which values are secret, and `scrub`, the one function every writer calls.

A value is a secret when it is (and is 6 characters or more):
- read from the environment through `${oc.env:NAME}`, whatever NAME is, unless NAME is on the
  short list of harmless ones (HOME, USER, PATH, SLURM_* ...): `note_env_read` records the name
  (config/resolvers.py's `oc.env` calls it), and the ranks learn the names from the environment
  they inherit ($FRAMEWORK_ENV_READ holds names, never values);
- the value of a secret-looking environment variable (WANDB_API_KEY, HF_TOKEN, GITHUB_PAT,
  DB_PASS), read or not;
- at a secret-looking config key (data.api_token, db.password), once `remember`ed;
- the password of a URL's userinfo (`https://user:password@host`), whatever its characters.

`scrub` replaces each by REDACTED; URLs' userinfo is replaced by pattern wherever a URL appears,
and a value under a secret-looking key is replaced whole. The choke points: every log record
(`install_log_scrubbing`), the console streams (`scrubbed_console`), the one-line errors and
tracebacks a process prints (core/exits.py), the config turned into what is written
(config/redaction.py), the loggers' names, groups and tags, and the sweep summary.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import unquote

REDACTED = "***REDACTED***"
MIN_SECRET_LENGTH = 6  # shorter values (true, 1, dev) would blank out unrelated text

# --- names ----------------------------------------------------------------------------------
SECRET_WORDS = frozenset(
    {
        "key",
        "apikey",
        "token",
        "password",
        "passwd",
        "pass",
        "pat",
        "passphrase",
        "secret",
        "secrets",
        "credential",
        "credentials",
        "auth",
        "cookie",
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
# Environment variables a config may read through ${oc.env:...} without their values becoming
# secrets: where things are, who and what runs, how many. Their values are paths, names and
# counts that appear all over what a run writes.
HARMLESS_ENV = frozenset(
    {
        "HOME",
        "USER",
        "LOGNAME",
        "PATH",
        "PWD",
        "SHELL",
        "LANG",
        "TERM",
        "TMPDIR",
        "TZ",
        "HOSTNAME",
        "CUDA_VISIBLE_DEVICES",
        "OMP_NUM_THREADS",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
HARMLESS_ENV_PREFIXES = ("SLURM_", "TORCHELASTIC_", "LC_", "XDG_")
ENV_READ = "FRAMEWORK_ENV_READ"  # names read through ${oc.env:...}, comma-separated


def name_words(name: str) -> list[str]:
    """`WANDB_API_KEY` -> wandb, api, key; `apiKey` -> api, key; `data.api_token` -> data,
    api, token. Whole words only: `max_tokens`, `tokenizer`, `keep`, `monkey` hold no secret."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)
    return [word for word in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if word]


def is_secret_name(name: str) -> bool:
    """A secret word names the value, unless it is the unit of a rate (`chars_per_token`)."""
    words = name_words(name)
    return any(
        word in SECRET_WORDS and (at == 0 or words[at - 1] != "per")
        for at, word in enumerate(words)
    )


def is_harmless_env(name: str) -> bool:
    return name in HARMLESS_ENV or name.startswith(HARMLESS_ENV_PREFIXES)


def secret_text(value: Any) -> str | None:
    """value as text, if it is a scalar long enough to be told apart from ordinary text."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return None
    text = str(value)
    return text if len(text) >= MIN_SECRET_LENGTH else None


# --- URLs -----------------------------------------------------------------------------------
# A URL's userinfo: `scheme://user:password@`, the password of any characters but blanks and
# `@` (a `/` included); `host:8080/path@x` is a port and a path, not a password. A userinfo
# without a password (`https://<token>@host`) is replaced whole, unless it is short enough to
# be a user name (`ssh://git@host`).
URL_PASSWORD = re.compile(
    r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*:)(?P<password>(?!\d*/)[^\s@]+)@"
)
URL_USER_ONLY = re.compile(
    rf"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^\s:/@]{{{MIN_SECRET_LENGTH},}})@"
)


def url_passwords(text: str) -> set[str]:
    """Passwords long enough to be replaced wherever else they appear (an error quoting one
    without its URL), as written and percent-decoded."""
    found = set()
    for match in URL_PASSWORD.finditer(text):
        password = match["password"]
        found |= {password, unquote(password)}
    return {password for password in found if len(password) >= MIN_SECRET_LENGTH}


def _scrub_urls(text: str) -> str:
    if "://" not in text:
        return text
    text = URL_PASSWORD.sub(lambda match: f"{match['head']}{REDACTED}@", text)
    return URL_USER_ONLY.sub(
        lambda match: f"{match['head']}{REDACTED}@" if match["user"] != REDACTED else match[0],
        text,
    )


# --- which values are secret ----------------------------------------------------------------
def note_env_read(name: str) -> None:
    """The config read $name: its value is a secret from now on, in this process and in every
    process started from it (ranks, fork server children), unless the name is harmless."""
    if is_harmless_env(name):
        return
    names = env_read_names(os.environ)
    if name not in names:
        os.environ[ENV_READ] = ",".join([*names, name])


def env_read_names(environ: Mapping[str, str]) -> list[str]:
    return [name for name in environ.get(ENV_READ, "").split(",") if name]


def env_secret_values(environ: Mapping[str, str]) -> set[str]:
    """Values of secret-looking environment variables (WANDB_API_KEY, HF_TOKEN, ...), of those
    a config read, and the passwords of every URL in the environment."""
    read = set(env_read_names(environ))
    values = set()
    for name, value in environ.items():
        if is_harmless_env(name):
            continue
        looks_secret = is_secret_name(name) and name_words(name)[-1] not in NOT_SECRET_LAST_WORDS
        if (looks_secret or name in read) and secret_text(value):
            values.add(value)
        if "://" in value:  # MLFLOW_TRACKING_URI=https://user:password@host
            values |= url_passwords(value)
    return values


_remembered: set[str] = set()  # secrets found in configs by this process
# The environment's secrets, for the environment they were found in: every log record and
# console write asks, and reading each name and value again cost ~1 ms.
_from_environment: tuple[tuple[tuple[str, str], ...], frozenset[str]] = ((), frozenset())


def remember(values: Iterable[str]) -> None:
    _remembered.update(values)


def known_secrets() -> set[str]:
    global _from_environment
    environ = tuple(os.environ.items())
    if environ != _from_environment[0]:
        _from_environment = environ, frozenset(env_secret_values(dict(environ)))
    return set(_from_environment[1]) | _remembered


# --- scrubbing ------------------------------------------------------------------------------
def scrub(value: Any, secrets: Iterable[str] | None = None, secret_key: bool = False) -> Any:
    """A copy of value (str, dict, list, scalar) with each secret (default: every known one)
    replaced by REDACTED, URLs' userinfo replaced, and every scalar under a secret-looking key
    replaced whole."""
    if secrets is None:
        secrets = known_secrets()
    ordered = sorted(set(secrets), key=len, reverse=True)  # longest first: no partial leaks
    return _scrub(value, ordered, secret_key)


def _scrub(value: Any, secrets: list[str], secret_key: bool) -> Any:
    if isinstance(value, Mapping):
        return {
            key: _scrub(item, secrets, secret_key or is_secret_name(str(key)))
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [_scrub(item, secrets, secret_key) for item in value]
    if secret_key and secret_text(value) is not None:
        return REDACTED
    if isinstance(value, int | float) and not isinstance(value, bool) and str(value) in secrets:
        return REDACTED  # a number read from the environment (${oc.env:PIN} in an int key)
    if isinstance(value, str):
        value = _scrub_urls(value)
        for secret in secrets:
            value = value.replace(secret, REDACTED)
    return value


def scrub_text(text: str | None) -> str | None:
    return None if text is None else scrub(text)


# --- the choke points -----------------------------------------------------------------------
def _scrub_record(record: logging.LogRecord) -> None:
    """A log record's message, arguments and traceback, scrubbed before any handler sees it."""
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 (a broken format string: logging reports it)
        return
    secrets = sorted(known_secrets(), key=len, reverse=True)
    clean = _scrub(message, secrets, False)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and not record.exc_text:
        record.exc_text = logging.Formatter().formatException(record.exc_info)
    if record.exc_text:
        record.exc_text = _scrub(record.exc_text, secrets, False)
    if record.stack_info:
        record.stack_info = _scrub(record.stack_info, secrets, False)


def install_log_scrubbing() -> None:
    """Every log record this process makes is scrubbed as it is made: whichever logger makes it
    (ours, Hydra's "Launching" lines, a library's) and whichever handler writes it (the console,
    train.log), even after Hydra configures logging again."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "scrubs_secrets", False):
        return

    def scrubbing_factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        _scrub_record(record)
        return record

    scrubbing_factory.scrubs_secrets = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(scrubbing_factory)


def install_traceback_scrubbing() -> None:
    """An exception nobody caught (HYDRA_FULL_ERROR=1, a bug) is printed after `train` left
    its scrubbed console: its traceback is scrubbed here."""
    if getattr(sys.excepthook, "scrubs_secrets", False):
        return

    def scrubbing_hook(kind: Any, error: Any, trace: Any) -> None:
        if not issubclass(kind, KeyboardInterrupt):  # (Ctrl-C: Python then ends by SIGINT)
            sys.stderr.write(scrub("".join(traceback.format_exception(kind, error, trace))))

    scrubbing_hook.scrubs_secrets = True  # type: ignore[attr-defined]
    sys.excepthook = scrubbing_hook


class SecretFilter(logging.Filter):
    """Scrubs known secrets from every record a handler writes (message and traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        _scrub_record(record)
        return True


class ScrubbedStream:
    """A console stream whose writes are scrubbed; everything else is the stream's own."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(scrub(text) if text else text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def __getattr__(self, name: str) -> Any:
        if name == "stream":  # (not set yet: a copy being built)
            raise AttributeError(name)
        return getattr(self.stream, name)


@contextlib.contextmanager
def scrubbed_console() -> Iterator[None]:
    """sys.stdout and sys.stderr scrubbed while the block runs: what Hydra prints (--cfg, its
    errors), Python's tracebacks, our own lines."""
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (
        stream if isinstance(stream, ScrubbedStream) else ScrubbedStream(stream)
        for stream in streams
    )
    try:
        yield
    finally:
        sys.stdout, sys.stderr = streams
