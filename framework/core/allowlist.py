"""What may run: the `_target_` allowlist.

Hydra's `instantiate` calls whatever a `_target_` names, so a config that may name any callable
may run any code. The rule is positive: a target is one public callable of a reviewed family
(`TARGET_FAMILIES`, our own `framework.components`), or lies in your own source code that a
config file trusts with `allowed_targets` (`check_targets`, called by `validate()`). It is judged
on the object Hydra would really call, and no segment of either name may be private (`_`).
What Hydra's own node may call is framework/app/hydra_node.py's.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from hydra._internal.utils import _locate
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.core.exits import ConfigError, first_line
from framework.core.signatures import definition_of, module_suggestion, suggestion

# --- what may run ---------------------------------------------------------------------------
# torchvision.datasets is not one: its readers unpickle or torch.load the files under a root a
# config chooses (CIFAR, LSUN, MNIST), and download and extract archives into it.
# A config may name `<family>.<PublicName>`: one public callable that the package itself exports
# (never a deeper path: `torch.nn.functional.torch.load` is a path through an imported module).
# What it resolves to must be defined inside the family's own package.
TARGET_FAMILIES = (
    "torch.nn",
    "torch.nn.init",
    "torch.optim",
    "torch.optim.lr_scheduler",
    "torch.utils.data",
    "torchvision.models",
    "torchvision.transforms",
    "torchvision.transforms.v2",
)
# Our own components: exactly the targets our schemas name (config/registry.py passes them in):
# the package also holds what a run builds itself (metrics.jsonl's sink takes a run dir).
FRAMEWORK_FAMILY = "framework.components"
# Inside the families, but they load or run what their arguments name (pickles, archives,
# downloads to a chosen folder, functions to call on file contents), or write where a config
# says. Found by tests/unit/test_target_reach.py, which scans every callable the families
# expose for a path to exec, eval, pickle, torch.load, importlib, subprocess or a file write.
DENIED_TARGETS = (
    "torch.utils.data.datapipes",
    "torchvision.models.get_model",
    "torchvision.models.get_weight",
    "torchvision.models.get_model_weights",
    # The base of every *_Weights enum (public in torchvision.models, defined in its private
    # _api): its members' get_state_dict downloads and unpickles.
    "torchvision.models.WeightsEnum",
    "torchvision.models.Weights",
)
# Pretrained weights: torchvision downloads them into torch hub's cache and unpickles whatever
# file it finds there (without a hash check once cached). Load weights in your own code.
# `pretrained=True` is torchvision's older spelling of the same (it still loads the weights).
DENIED_ARGUMENTS = {
    "torchvision.models": ("weights", "weights_backbone", "pretrained", "pretrained_backbone")
}
TARGET_FIX = (
    "name a public class or function of torch.nn, torch.optim, torch.utils.data or "
    "torchvision.models/transforms, a shipped option's target, or one of your own modules "
    "listed in allowed_targets in a config file"
)
TRUST_FIX = (
    "allowed_targets may only list your own project's modules (source outside the Python "
    "installation, its site-packages and this framework's own tree); list the module that "
    "wraps what you need"
)
# This framework's source tree: a clone holds its tests and benchmarks beside it (benchmarks
# start subprocesses), which a config must not trust; in a wheel, site-packages.
FRAMEWORK_TREE = Path(__file__).resolve().parents[2]
# Packages the environment (trusted, unlike a config) lets allowed_targets name all the same.
TRUSTED_PACKAGES = "FRAMEWORK_TRUSTED_PACKAGES"


def matches_prefix(name: str, prefixes: Iterable[str]) -> bool:
    """`torch` matches `torch` and `torch.optim.SGD`, never `torchevil.x` (module boundaries)."""
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def has_private_segment(name: str) -> bool:
    return any(part.startswith("_") for part in name.split("."))


def resolved_name(target: str, by_import: bool = False) -> str | None:
    """The dotted name of what `target` really is: `torch.os.system` is `posix.system`. Read
    from source where it can be (core/signatures.py: the command refuses a mistake before the
    training stack is imported), else, or `by_import`, from the object itself; None when it
    cannot be imported (instantiate then fails on its own, running nothing)."""
    found = None if by_import else definition_of(target)
    return found.qualified_name if found is not None else _imported_name(target)


def _imported_name(target: str) -> str | None:
    # Hydra's own lookup, so we judge exactly the object instantiate would call. Only reached
    # for names inside an allowed family, so importing them is allowed to run their module code.
    try:
        obj = _locate(target)
    except Exception:  # noqa: BLE001 (any import failure: nothing to judge)
        return None
    if isinstance(obj, ModuleType):
        return obj.__name__
    owner = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{owner.__module__}.{owner.__qualname__}"


def _family_of(target: str) -> str | None:
    """The family `target` is one public name of, if any."""
    module, _, name = target.rpartition(".")
    if module in TARGET_FAMILIES and name and not name.endswith("_Weights"):
        return module
    return None


def _is_callable_object(target: str, by_import: bool) -> bool:
    """A class or function (a def or class statement in its source: always callable)."""
    if not by_import and definition_of(target) is not None:
        return True
    try:
        obj = _locate(target)
    except Exception:  # noqa: BLE001 (not importable: instantiate fails on its own)
        return True
    return callable(obj) and not isinstance(obj, ModuleType)


def target_problem(
    target: Any, trusted: Iterable[str] = (), shipped: Iterable[str] = (), by_import: bool = False
) -> str | None:
    """Why `target` may not be instantiated, ending with how to fix it; None when it may.
    `trusted`: module prefixes of your own code (allowed_targets, checked by trusted_prefixes);
    `shipped`: the framework's own targets (config/registry.py's shipped_targets);
    `by_import`: judge the imported object, not its source (a rank, which imports it anyway)."""
    if not isinstance(target, str):
        return f"is a {type(target).__name__}, not a dotted name"
    if has_private_segment(target):
        return "names a private (`_`) module or attribute: " + TARGET_FIX
    if matches_prefix(target, DENIED_TARGETS):
        return "can load or run what its arguments name: it is never allowed, use another target"
    family = _family_of(target)
    own = target in shipped or matches_prefix(target, trusted)
    if family is None and not own:
        return "is outside the allowed families: " + TARGET_FIX
    real = resolved_name(target, by_import)
    if real is None:
        return None
    if not _is_callable_object(target, by_import):
        return f"is {real}, not a class or function: " + TARGET_FIX
    home = family or FRAMEWORK_FAMILY
    if real != target:
        if matches_prefix(real, DENIED_TARGETS) or _private_elsewhere(target, real, home):
            return f"resolves to {real}, which is not allowed: " + TARGET_FIX
        if not matches_prefix(real, [home, FRAMEWORK_FAMILY, *trusted]):
            return f"resolves to {real}, outside the allowed families: " + TARGET_FIX
    return None


def _private_elsewhere(target: str, real: str, home: str) -> bool:
    """A private segment in what `target` resolves to, other than the private module in which
    its own family defines it (torchvision.transforms.v2.RandomCrop is defined in
    torchvision.transforms.v2._geometry, under the same public name)."""
    if not has_private_segment(real):
        return False
    module, _, name = real.rpartition(".")
    same_name = name == target.rpartition(".")[2]
    return not (same_name and home in TARGET_FAMILIES and matches_prefix(module, [home]))


def _top_spec(module: str) -> importlib.machinery.ModuleSpec | None:
    """Where the top package of `module` would be imported from (a top-level find imports
    nothing); None where it is not importable."""
    try:
        return importlib.util.find_spec(module.split(".")[0])
    except (ImportError, ValueError):
        return None


def _is_own_source(module: str) -> bool:
    """Whether the top package of `module` is code outside Python, its installed packages and
    this framework's own source tree: the user's own project (an editable install or the
    working directory)."""
    spec = _top_spec(module)
    if spec is None:
        return False
    places = [spec.origin] if spec.origin else []
    places += list(spec.submodule_search_locations or [])
    installed = {
        Path(path).resolve()
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (path := sysconfig.get_paths().get(key))
    } | {FRAMEWORK_TREE}
    if not places or any(not Path(place).is_absolute() for place in places):
        return False  # built-in or frozen
    return not any(
        installed_dir in Path(place).resolve().parents or Path(place).resolve() == installed_dir
        for place in places
        for installed_dir in installed
    )


def trusted_by_environment(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The packages $FRAMEWORK_TRUSTED_PACKAGES names: the environment is trusted, so it may
    let allowed_targets name an installed package of yours, or this clone's own tests."""
    return tuple(name.strip() for name in environ.get(TRUSTED_PACKAGES, "").split(",") if name)


def trusted_prefixes(cfg: DictConfig | Mapping) -> tuple[str, ...]:
    """allowed_targets, once each entry is known to be a module prefix of your own code: a
    config (perhaps a colleague's) can trust your code, never the libraries installed nor this
    framework's own tests and benchmarks (unless $FRAMEWORK_TRUSTED_PACKAGES names them)."""
    try:
        extra = cfg.get("allowed_targets") or []
    except OmegaConfBaseException as error:  # an interpolation that does not resolve
        raise ConfigError(
            f"allowed_targets cannot be resolved ({first_line(error)}): give a list of module "
            "prefixes"
        ) from None
    by_environment = trusted_by_environment(os.environ)
    for prefix in extra:
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z]\w*(\.[A-Za-z]\w*)*", prefix):
            raise ConfigError(
                f"allowed_targets entry {prefix!r} is invalid: use a dotted module prefix "
                "such as my_package.models"
            )
        if matches_prefix(prefix, by_environment) and not matches_prefix(prefix, ["framework"]):
            continue
        if not matches_prefix(prefix, ["framework"]) and _top_spec(prefix) is None:
            raise ConfigError(
                f"allowed_targets entry {prefix!r}: {prefix.split('.')[0]} is not importable "
                "from here: run train in your project's folder, or install the project there "
                "(uv sync)"
            )
        if matches_prefix(prefix, ["framework"]) or not _is_own_source(prefix):
            raise ConfigError(f"allowed_targets entry {prefix!r} is refused: {TRUST_FIX}")
    return tuple(extra)


def check_targets(
    cfg: DictConfig | Mapping, shipped: Iterable[str] = (), by_import: bool = False
) -> None:
    """Every `_target_` of the app config (Hydra's node excluded) must be allowed, and so must
    the arguments it is given. The command judges each from its source; every rank judges the
    imported objects again (`by_import`) before it builds anything."""
    trusted, shipped = trusted_prefixes(cfg), frozenset(shipped)
    for path, value in iter_leaves(cfg, skip=("hydra",)):
        if path.rsplit(".", 1)[-1] != "_target_":
            continue
        near = None if by_import else misspelt(value, trusted, shipped)
        if near is not None:
            raise ConfigError(f"{path}={value} names nothing: did you mean {near}?")
        # A module named where its class is meant (torch.optim.adam), read from source too.
        meant = None if by_import else _allowed_near(value, module_suggestion, trusted, shipped)
        if meant is not None:
            raise ConfigError(
                f"{path}={value} is a module, not a class or function: did you mean {meant}?"
            )
        problem = target_problem(value, trusted, shipped, by_import)
        if problem:
            raise ConfigError(f"{path}={value} is not allowed: it {problem}")
        _check_arguments(cfg, path.rpartition(".")[0], value)


def misspelt(target: Any, trusted: Iterable[str], shipped: Iterable[str]) -> str | None:
    """The allowed name `target` was meant to be, when it names nothing (read from source and
    the import path: nothing is imported) and an allowed name is near it; else None."""
    return _allowed_near(target, suggestion, trusted, shipped)


def _allowed_near(
    target: Any,
    near_to: Callable[[str], str | None],
    trusted: Iterable[str],
    shipped: Iterable[str],
) -> str | None:
    """What `near_to` finds for `target`, where a config may name it; else None."""
    if not isinstance(target, str) or has_private_segment(target):
        return None
    near = near_to(target)
    if near is None:
        return None
    allowed = _family_of(near) is not None or near in shipped or matches_prefix(near, trusted)
    return near if allowed else None


def _check_arguments(cfg: DictConfig | Mapping, node_path: str, target: str) -> None:
    node = OmegaConf.select(cfg, node_path) if isinstance(cfg, DictConfig) else None
    for family, names in DENIED_ARGUMENTS.items():
        if node is None or not matches_prefix(target, [family]):
            continue
        for name in names:
            if node.get(name) not in (None, False):
                raise ConfigError(
                    f"{node_path}.{name}={node.get(name)} is not allowed: pretrained weights "
                    "are unpickled from torch hub's cache; load them in your own model code "
                    "(a module listed in allowed_targets)"
                )


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
        except Exception:  # noqa: BLE001 (OmegaConf raises several kinds here)
            continue
        yield from iter_leaves(child, child_path, skip)
