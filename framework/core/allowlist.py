"""What may run: the `_target_` allowlist, and the command-line checks for Hydra's own node.

Hydra's `instantiate` calls whatever a `_target_` names, so an override such as
`+model.x._target_=shutil.copy` runs code. Targets in the app config must come from built-in
module prefixes or from `allowed_targets` set in a config file (`check_targets`, called by
`validate()`). Hydra's own node (callbacks, launcher, sweeper, logging factories) is instantiated
before any callback of ours runs, so the command line is checked for it before Hydra starts
(`check_command_line`, called by `main()`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from types import ModuleType
from typing import Any

from hydra._internal.utils import _locate, get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, Glob, IntervalSweep, RangeSweep
from omegaconf import DictConfig, ListConfig

from framework.core.exits import ConfigError

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
    try:
        return OverridesParser.create().parse_overrides(lines)
    except Exception:  # the override grammar: Hydra reports it
        return []


def parse_command_line(argv: list[str]) -> tuple[list[Any], str | None]:
    """Hydra's own parsing of argv: (overrides, --experimental-rerun file)."""
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
