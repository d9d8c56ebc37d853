"""The torch versions this framework runs on, and every place where they differ.

Supported: torch >= 2.8 with its torchvision (>= 0.23), on Python >= 3.11. Tested at both
ends: the lock's torch 2.13 / torchvision 0.28 (Python 3.11, and 3.13 for the not-slow tests)
and the floor's torch 2.8.0 / torchvision 0.23.0 on Python 3.11 (.ci/run). There is no upper
bound: a newer torch is allowed until one is known to break.

Where the supported versions differ, found by running the suite on each (not from changelogs):

- torch 2.8: gloo's reduce_scatter with ReduceOp.AVG returns the sum (2.9 averages), and
  FSDP2 reduces fp32 and bf16 gradients with AVG, so on CPU every sharded gradient came out
  world_size times too large (fsdp's losses left ddp's from the second step).
  `reduce_fsdp_gradients_by_sum` makes FSDP sum and divide by itself there.
- torch 2.8 and 2.9: Adam and AdamW keep `betas` as given (2.10 makes a tuple); a ListConfig
  would be pickled into the checkpoint, which loading refuses. components/optim.py hands the
  optimizer plain values in every version.
- torch 2.8: `dcp.async_save` takes no `no_dist=`; storage/sharded.py passes it to no DCP call
  (every version infers it when no process group exists).
- Python 3.13 pickles pathlib's PosixPath as `pathlib._local.PosixPath` (3.11 and 3.12 as
  `pathlib.PosixPath`); DCP's index holds one, so the index reader allows `PATH_PICKLED_AS`.

Below the floor, found the same way: torch 2.7 also averages wrongly on gloo and its FSDP2 has
no sum-only switch (the fix would patch torch internals); torch 2.6's FSDP2 cannot run on CPU
(`'Stream' object has no attribute 'record_event'`) and its `dcp.save` takes no `no_dist=`.

`unsupported_packages` reads installed versions from package metadata without importing torch,
so `train` refuses a torch outside the range with one line before any rank starts.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

# The oldest (major, minor) release of each package the framework runs on.
FLOORS: dict[str, tuple[int, int]] = {"torch": (2, 8), "torchvision": (0, 23)}
# The newest releases tested (the lock); newer ones are allowed.
NEWEST_TESTED: dict[str, str] = {"torch": "2.13", "torchvision": "0.28"}
# The names under which pickle finds pathlib.PosixPath (Python 3.13 moved it; see above).
PATH_PICKLED_AS = (("pathlib", "PosixPath"), ("pathlib._local", "PosixPath"))
# torch releases whose gloo reduce_scatter sums where AVG is asked for.
GLOO_AVERAGES_FROM = (2, 9)


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string: '2.8.0+cu128' and a vendor's '2.8.0a0+nv25.06' both
    give (2, 8), so a vendor's pre-release build of a supported release counts as that release."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def supported_range(package: str) -> str:
    major, minor = FLOORS[package]
    return f"{package} >= {major}.{minor} (tested {major}.{minor} to {NEWEST_TESTED[package]})"


def unsupported_packages(versions: dict[str, str | None] | None = None) -> str | None:
    """One line naming each installed package below its floor and the supported range, or
    None. `versions`: package -> installed version (default: this environment's); a package
    that is not installed is left to the import that needs it."""
    found = versions if versions is not None else {name: installed(name) for name in FLOORS}
    old = [
        (name, version)
        for name, version in found.items()
        if version is not None and (release(version) or (0, 0)) < FLOORS[name]
    ]
    if not old:
        return None
    said = ", ".join(f"{name} {version}" for name, version in old)
    wanted = "; ".join(supported_range(name) for name, _ in old)
    return f"{said} is older than this framework supports: it needs {wanted}"


def reduce_fsdp_gradients_by_sum(module: nn.Module) -> None:
    """On a gloo process group before torch 2.9, make every FSDP unit of `module` (after
    `fully_shard`) reduce its gradients with SUM and divide by the world size itself: gloo's
    AVG sums there. Elsewhere FSDP's own AVG is right and this does nothing."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if (release(torch.__version__) or (0, 0)) >= GLOO_AVERAGES_FROM or dist.get_backend() != "gloo":
        return
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_force_sum_reduction_for_comms(True)
