"""Numeric precision as one small object: forward context, backward, optimizer step, state.

Built from `precision=<option>` by `_target_` (a partial: the rank supplies the device).

fp32: plain. bf16: autocast to bfloat16, no scaling (bf16 has fp32's exponent range).
amp: autocast to float16 with a dynamically scaled loss (GradScaler); `unscale` lets the loop
clip true gradients, and a step with inf/NaN gradients is skipped.
"""

from __future__ import annotations

import contextlib
from typing import Annotated, Any

import torch
from annotated_types import Ge, Gt, Interval
from torch.optim import Optimizer


class Precision:
    """fp32: the reference; subclasses change only what differs."""

    name = "fp32"
    skips_nonfinite_grads = False  # True where the step itself skips inf/NaN gradients
    # What strategy=fsdp gathers parameters and reduces gradients in (None: as they are, fp32)
    param_dtype: torch.dtype | None = None

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.skipped_steps = 0

    def forward_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale(self, optimizer: Optimizer) -> None:
        """Before clipping: the gradients as they are (only amp's carry a scale)."""

    def step(self, optimizer: Optimizer, found_inf: torch.Tensor | None = None) -> None:
        """The optimizer's step. `found_inf` (a device flag, 1: drop this update) reaches the
        optimizer the way GradScaler tells a fused optimizer to skip: no host read."""
        if found_inf is None:
            optimizer.step()
            return
        optimizer.grad_scale, optimizer.found_inf = None, found_inf
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf

    def loss_scale(self) -> torch.Tensor | None:
        """The factor gradients carry during backward (AMP), as a device tensor."""
        return None

    def metrics(self) -> dict[str, float]:
        """Host-side numbers for a log event (called only when logging)."""
        return {"precision/skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = state.get("skipped_steps", 0)


class BF16(Precision):
    name = "bf16"
    param_dtype = torch.bfloat16

    def forward_context(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


class AMP(Precision):
    name = "amp"
    skips_nonfinite_grads = True

    def __init__(
        self,
        device: torch.device,
        init_scale: Annotated[float, Gt(0)],
        growth_factor: Annotated[float, Gt(1)],
        backoff_factor: Annotated[float, Interval(gt=0, lt=1)],
        growth_interval: Annotated[int, Ge(1)],
    ) -> None:
        super().__init__(device)
        self.scaler = torch.amp.GradScaler(
            device.type,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )
        self._skipped = torch.zeros((), dtype=torch.long, device=device)

    def forward_context(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.float16)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale(self, optimizer: Optimizer) -> None:
        self.scaler.unscale_(optimizer)  # clip true gradients, not scaled ones

    def step(
        self,
        optimizer: Optimizer,
        found_inf: torch.Tensor | None = None,  # GradScaler finds inf/NaN gradients itself
    ) -> None:
        # update() shrinks the scale exactly when it skipped the step for inf/NaN gradients.
        # Compared on device (GradScaler has no public async getter): no per-step host sync.
        scale_before = self.scaler._get_scale_async().clone()
        self.scaler.step(optimizer)
        self.scaler.update()
        self._skipped += (self.scaler._get_scale_async() < scale_before).long()

    def loss_scale(self) -> torch.Tensor | None:
        return self.scaler._get_scale_async()  # None until the first scale(loss)

    def metrics(self) -> dict[str, float]:
        self.skipped_steps = int(self._skipped.item())
        return {
            "precision/loss_scale": self.scaler.get_scale(),
            "precision/skipped_steps": self.skipped_steps,
        }

    def state_dict(self) -> dict[str, Any]:
        self.skipped_steps = int(self._skipped.item())
        return {"skipped_steps": self.skipped_steps, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._skipped.fill_(self.skipped_steps)
        self.scaler.load_state_dict(state["scaler"])
