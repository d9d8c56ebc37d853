"""What may run and what may be written.

1. `_target_` allowlist. Hydra's `instantiate` calls whatever a `_target_` names, so an override
   such as `+model.x._target_=shutil.copy` runs code. Targets in the app config must come from
   built-in module prefixes or from `allowed_targets` set in a config file (`check_targets`,
   called by `validate()`). Hydra's own node (callbacks, launcher, sweeper, logging factories) is
   instantiated before any callback of ours runs, so the command line is checked for it before
   Hydra starts (`check_command_line`, called by `main()`).
2. Secrets never reach disk or W&B. Values at secret-looking config keys and of secret-looking
   environment variables are replaced by REDACTED in everything we write; secrets typed on the
   command line are moved into environment variables before Hydra sees them
   (`hide_command_line_secrets`), so Hydra's own records only ever hold `${oc.env:...}`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, SCMode, open_dict, read_write

from framework.config import ConfigError

# --- what may run ---------------------------------------------------------------------------
BUILTIN_TARGET_PREFIXES = ("torch", "torchvision", "framework", "experiments")
# Hydra's node needs Hydra's own classes and plugins (our callback lives in framework).
HYDRA_NODE_PREFIXES = ("hydra", "hydra_plugins", *BUILTIN_TARGET_PREFIXES)
# Inside allowed packages, but they load or run code named by their arguments (pickles, C++
# sources, hub repos, scripts, statements) or hand any config to instantiate.
DENIED_TARGET_PREFIXES = (
    "torch.hub",
    "torch.load",
    "torch.serialization",
    "torch.jit.load",
    "torch.jit._serialization",
    "torch.package",
    "torch.ops",
    "torch.classes",
    "torch.utils.cpp_extension",
    "torch.utils.benchmark",
    "torch.utils.collect_env",
    "torch.distributed.run",
    "torch.distributed.launch",
    "torch.distributed.launcher",
    "torch.distributed.elastic",
    "torch.multiprocessing",
    "hydra.utils",
    "hydra._internal.utils",
    "hydra._internal.instantiate",
)
# Keys whose value names something to call: instantiate's `_target_`, and the factories of
# logging.config.dictConfig (`()` for any factory, `class` for handlers), which Hydra applies to
# hydra.job_logging / hydra.hydra_logging.
HYDRA_CALLABLE_KEYS = ("_target_", "()", "class")
# Subtrees of Hydra's node that Hydra instantiates or hands to logging.config; an interpolation
# there could pull in a target from elsewhere, so the command line may not use one.
HYDRA_CODE_NODES = (
    "hydra.callbacks",
    "hydra.launcher",
    "hydra.sweeper",
    "hydra.job_logging",
    "hydra.hydra_logging",
)
VALIDATE_CALLBACK = "hydra.callbacks.validate"
# Variables that make every process started afterwards load code (hydra.job.env_set sets them).
CODE_LOADING_ENV = re.compile(r"^(LD_.*|DYLD_.*|PYTHON.*|BASH_ENV|ENV|PERL5OPT|NODE_OPTIONS)$")
TARGET_FIX = "add the module prefix to allowed_targets in a config file"


def matches_prefix(name: str, prefixes: Iterable[str]) -> bool:
    """`torch` matches `torch` and `torch.optim.SGD`, never `torchevil.x` (module boundaries)."""
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def resolved_name(target: str) -> str | None:
    """The dotted name of what `target` really is: `torch.os.system` is `posix.system`.
    None when it cannot be imported (instantiate then fails on its own, running nothing)."""
    # Hydra's own lookup, so we judge exactly the object instantiate would call. Only reached
    # for names inside an allowed prefix, so importing them is allowed to run their module code.
    from hydra._internal.utils import _locate

    try:
        obj = _locate(target)
    except Exception:  # any import failure: nothing to judge
        return None
    if isinstance(obj, ModuleType):
        return obj.__name__
    owner = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{owner.__module__}.{owner.__qualname__}"


def target_problem(target: Any, allowed: Iterable[str], fix: str) -> str | None:
    """Why `target` may not be instantiated, ending with how to fix it; None when it may."""
    allowed = tuple(allowed)
    outside = f"outside the allowed module prefixes ({', '.join(allowed)}); {fix}"
    if not isinstance(target, str):
        return f"is a {type(target).__name__}, not a dotted name"
    if matches_prefix(target, DENIED_TARGET_PREFIXES):
        return "can load or run arbitrary code: it is never allowed, use another target"
    if not matches_prefix(target, allowed):
        return f"is {outside}"
    real = resolved_name(target)
    if real is None or real == target:
        return None
    # An allowed module may import a dangerous one: torchvision.datasets.mnist.shutil.copy.
    if matches_prefix(real, DENIED_TARGET_PREFIXES):
        return f"resolves to {real}, which can load or run arbitrary code: use another target"
    if not matches_prefix(real, allowed):
        return f"resolves to {real}, {outside}"
    return None


def allowed_target_prefixes(cfg: DictConfig | Mapping) -> tuple[str, ...]:
    extra = cfg.get("allowed_targets") or []
    for prefix in extra:
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z_][\w.]*", prefix):
            raise ConfigError(
                f"allowed_targets entry {prefix!r} is invalid: use a dotted module prefix "
                "such as my_package.models"
            )
    return (*BUILTIN_TARGET_PREFIXES, *extra)


def check_targets(cfg: DictConfig | Mapping) -> None:
    """Every `_target_` of the app config (Hydra's node excluded) must be allowed."""
    allowed = allowed_target_prefixes(cfg)
    for path, value in iter_leaves(cfg, skip=("hydra",)):
        if path.rsplit(".", 1)[-1] != "_target_":
            continue
        problem = target_problem(value, allowed, TARGET_FIX)
        if problem:
            raise ConfigError(f"{path}={value} is not allowed: it {problem}")


def iter_leaves(node: Any, path: str = "", skip: Iterable[str] = ()) -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every leaf, interpolations resolved where they can be.
    An unresolvable leaf (missing value, `${hydra:...}` outside a job) is skipped: the app
    validates again, fully resolvable, before it instantiates anything."""
    if isinstance(node, DictConfig | Mapping):
        keys: Iterable[Any] = node.keys()
    elif isinstance(node, ListConfig | list | tuple):
        keys = range(len(node))
    else:
        yield path, node
        return
    for key in keys:
        child_path = f"{path}.{key}" if path else str(key)
        if child_path in skip:
            continue
        try:
            child = node[key]
        except Exception:  # OmegaConf raises several kinds here
            continue
        yield from iter_leaves(child, child_path, skip)


# --- the command line -----------------------------------------------------------------------
def parse_overrides(lines: list[str]) -> list[Any]:
    """Hydra's own override parser; [] for what Hydra will refuse itself, before running."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(lines)
    except Exception:  # the override grammar: Hydra reports it
        return []


def parse_command_line(argv: list[str]) -> tuple[list[Any], str | None]:
    """Hydra's own parsing of argv: (overrides, --experimental-rerun file)."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def refuse(message: str) -> None:
        raise ValueError(message)

    parser.error = refuse  # type: ignore[method-assign]  (no usage text and exit from us)
    try:
        args = parser.parse_args(argv)
    except ValueError:  # Hydra reports it and stops before running anything
        return [], None
    return parse_overrides(args.overrides), args.experimental_rerun


def override_leaves(override: Any) -> Iterator[tuple[str, Any]]:
    """(path, value) for every value an override can set, sweep choices and dicts included.
    Group selections (`hydra/launcher=submitit_slurm`) pick config files and yield nothing."""
    from hydra.core.override_parser.types import ChoiceSweep, Glob, IntervalSweep, RangeSweep

    key = override.key_or_group
    if "/" in key or override.package is not None:
        return
    value = override.value()
    if isinstance(value, ChoiceSweep):
        values = value.list
    elif isinstance(value, Glob):
        values = [*value.include, *value.exclude]
    elif isinstance(value, RangeSweep | IntervalSweep):
        values = []  # numbers
    else:
        values = [value]
    yield key, None  # the key itself, for rules on whole subtrees (also deletions)
    for item in values:
        yield from iter_leaves(item, key)


def command_line_problem(path: str, value: Any) -> str | None:
    """Why setting `path` to `value` from the command line is refused, or None."""
    if matches_prefix(path, ["allowed_targets"]):
        return f"{path} cannot be set on the command line: {TARGET_FIX}"
    if not matches_prefix(path, ["hydra"]):
        return None
    holds_callback = path in ("hydra", "hydra.callbacks") or matches_prefix(
        path, [VALIDATE_CALLBACK]
    )
    if holds_callback and path != f"{VALIDATE_CALLBACK}.output_subdir":
        return f"{path} cannot be changed on the command line: it holds {VALIDATE_CALLBACK}"
    if path == "hydra.output_subdir" and value is not None:
        return (
            f"hydra.output_subdir={value} would make Hydra write its unredacted records: use "
            f"{VALIDATE_CALLBACK}.output_subdir={value} (the redacted copy) instead"
        )
    if matches_prefix(path, ["hydra.job.env_set"]) and CODE_LOADING_ENV.match(path.split(".")[-1]):
        return f"{path} cannot be set on the command line: it makes new processes load code"
    if value is None:
        return None
    if matches_prefix(path, HYDRA_CODE_NODES) and isinstance(value, str) and "${" in value:
        return f"{path}={value}: interpolations are not allowed here on the command line"
    if path.rsplit(".", 1)[-1] in HYDRA_CALLABLE_KEYS:
        problem = target_problem(value, HYDRA_NODE_PREFIXES, "set it in a config file")
        if problem:
            return f"{path}={value} is not allowed on the command line: it {problem}"
    return None


def sweeper_param_overrides(override: Any) -> list[str]:
    """hydra.sweeper.params maps override keys to values the sweeper applies to every job:
    those overrides, as the sweeper writes them (`f"{key}={value}"`)."""
    key, value, params = override.key_or_group, override.value(), "hydra.sweeper.params"
    if key == params and isinstance(value, dict):
        return [f"{name}={item}" for name, item in value.items()]
    if matches_prefix(key, [params]) and key != params and value is not None:
        return [f"{key[len(params) + 1 :]}={value}"]
    return []


def check_command_line(argv: list[str]) -> None:
    """Refuse overrides that would run code Hydra instantiates before our callback runs, or
    that change the allowlist. Raises ConfigError naming the override and the fix."""
    overrides, rerun = parse_command_line(argv)
    if rerun is not None:
        raise ConfigError("--experimental-rerun loads a pickle, which can run any code: refused")
    pending = list(overrides)
    while pending:
        override = pending.pop(0)
        for path, value in override_leaves(override):
            problem = command_line_problem(path, value)
            if problem:
                raise ConfigError(problem)
        pending += parse_overrides(sweeper_param_overrides(override))


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


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
    {"file", "path", "dir", "sock", "socket", "url", "host", "port", "name", "prefix", "region",
     "user", "username", "type", "mode"}
)  # fmt: skip


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
    return values


def secret_values(cfg: Any, environ: Mapping[str, str]) -> set[str]:
    """Values at secret-looking config paths (resolved) plus secret environment values."""
    values = env_secret_values(environ)
    for path, value in iter_leaves(cfg):
        text = _secret_text(value)
        if text and is_secret_name(path):
            values.add(text)
    return values


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
        except Exception:  # a broken format string: logging reports it
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
            except Exception:  # a typed number node cannot hold REDACTED
                continue
