"""DDP gradient communication: which hook runs, and how many bytes a step sends.

`allreduce` is DDP's built-in bucketed allreduce (no Python hook). Bytes are counted per
optimizer step from what the hook puts on the wire, so `comm/compression` compares like with
like: uncompressed gradient bytes / bytes actually sent.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from framework.distributed import DistEnv

log = logging.getLogger(__name__)


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of one full set of gradients (what a plain allreduce moves per step)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class Comm:
    """DDP's default allreduce; the base other hooks extend."""

    name = "allreduce"

    def __init__(self, env: DistEnv, **_: Any) -> None:
        self.env = env
        self.uncompressed_bytes = 0

    def attach(self, ddp_model: nn.Module, model: nn.Module) -> None:
        self.uncompressed_bytes = gradient_bytes(model)

    def bytes_per_step(self) -> int:
        return self.uncompressed_bytes if self.env.distributed else 0

    def metrics(self) -> dict[str, float]:
        sent = self.bytes_per_step()
        return {
            "comm/bytes_per_step": sent,
            "comm/compression": self.uncompressed_bytes / sent if sent else 1.0,
        }

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


COMMS: dict[str, type[Comm]] = {"allreduce": Comm}


def build_comm(cfg: dict, env: DistEnv) -> Comm:
    options = dict(cfg)
    name = options.pop("name")
    if name not in COMMS:
        raise ValueError(f"comm={name} is unknown: choose one of {sorted(COMMS)}")
    return COMMS[name](env, **options)
