"""How many GPUs this process may use, as torch.cuda.device_count() would say, without importing
torch: a config mistake about ranks and devices is refused before the training stack loads.

NVIDIA's driver lists each GPU under /proc/driver/nvidia/gpus; CUDA_VISIBLE_DEVICES narrows the
list the way the CUDA runtime does (entries up to the first invalid one). Where neither tells
(another vendor's devices, a driver without /proc), the answer is None: ask torch.
"""

from __future__ import annotations

import os
from pathlib import Path

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
OTHER_ACCELERATORS = (Path("/dev/kfd"), Path("/dev/dxg"))  # ROCm, WSL's GPU paravirtualisation


def visible_gpus() -> int | None:
    """The number of GPUs torch would see here; None when only torch can tell."""
    installed = len(list(NVIDIA_GPUS.iterdir())) if NVIDIA_GPUS.is_dir() else 0
    if not installed:
        return None if any(path.exists() for path in OTHER_ACCELERATORS) else 0
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if chosen is None:
        return installed
    return _visible_among(chosen, installed)


def _visible_among(chosen: str, installed: int) -> int:
    count = 0
    for entry in (part.strip() for part in chosen.split(",")) if chosen.strip() else ():
        if entry.startswith(("GPU-", "MIG-")) or entry.isdigit() and int(entry) < installed:
            count += 1
        else:
            break  # the runtime stops at the first invalid entry (-1 hides every device)
    return count
