"""DDP gradient communication: which hook runs, and how many bytes a step sends.

- `allreduce`: DDP's built-in bucketed allreduce of fp32 gradients (no Python hook).
- `fp16` / `bf16`: torch's compression hooks (gradients cast for the allreduce, cast back).
- `powersgd`: our PowerSGD (Vogels et al., 2019). Same algorithm and knobs as torch's
  `powerSGD_hook`, but every collective is issued from the hook call itself, in DDP's bucket
  order, and waited for there. torch's hook chains the P and Q allreduces of different buckets
  through future callbacks whose order differs between ranks; on gloo that mismatches the
  collectives and aborts the job (see the field notes). Waiting costs little overlap because
  PowerSGD sends a few hundred KB per step.

Built from `comm=<option>` by `_target_` (a partial: the rank supplies its DistEnv). Every hook
counts the bytes it puts on the wire; `comm/compression` is the fp32 gradient
size over the bytes actually sent in the last synchronisation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist
from annotated_types import Ge
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from framework.core.launch_context import DistEnv

log = logging.getLogger(__name__)
ScaleSource = Callable[[], torch.Tensor | None]


WireDtype = Literal["fp16", "bf16"]  # what gradients travel as


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of one full set of gradients (what a plain allreduce moves per step)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _run_hook(comm, bucket):  # unannotated: DDP checks the annotation, which would be a string
    """The one function DDP calls for every hooked bucket (it needs a real __qualname__)."""
    future = comm.communicate(bucket)
    if bucket.is_last():  # DDP reduces bucket 0 last: one synchronisation is complete
        comm.end_round()
    return future


class Comm:
    """DDP's default allreduce; the base that the hooks extend."""

    name = "allreduce"
    uses_hook = False

    def __init__(self, env: DistEnv) -> None:
        self.env = env
        # Keep per-rank memory (PowerSGD) untouched by a step whose gradients are inf/NaN, as
        # with amp: set when such steps are skipped (trainer.on_nonfinite=skip).
        self.guard_nonfinite = False
        self.uncompressed_bytes = 0
        self.last_step_bytes = 0
        self._round_bytes = 0
        # Bytes a sharded model's collectives move per step, by kind (strategy.wire_bytes).
        self.sharded: dict[str, int] | None = None

    def attach(self, ddp_model: nn.Module, model: nn.Module, grad_scale: ScaleSource) -> None:
        """Register the hook on a (new) DDP instance; call again after restoring state."""
        self.uncompressed_bytes = gradient_bytes(model)
        self.grad_scale = grad_scale
        if not self.env.distributed:
            if self.uses_hook:
                log.warning(
                    "comm=%s has no effect with world_size=1: no gradients are communicated, "
                    "so the run is uncompressed",
                    self.name,
                )
            return
        if self.uses_hook:
            ddp_model.register_comm_hook(state=self, hook=_run_hook)
        else:
            self.last_step_bytes = self.uncompressed_bytes

    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        raise NotImplementedError

    def count(self, numel: int, itemsize: int) -> None:
        """Bytes this rank puts on the wire in the current synchronisation."""
        self._round_bytes += numel * itemsize

    def end_round(self) -> None:
        """The last bucket of a step is done."""
        self.last_step_bytes, self._round_bytes = self._round_bytes, 0

    def metrics(self) -> dict[str, float]:
        if self.sharded is not None:  # strategy=fsdp: its collectives, no gradient all-reduce
            return {
                "comm/bytes_per_step": sum(self.sharded.values()),
                "comm/all_gather_bytes_per_step": self.sharded["all_gather"],
                "comm/reduce_scatter_bytes_per_step": self.sharded["reduce_scatter"],
                "comm/compression": 1.0,
            }
        sent = self.last_step_bytes
        return {
            "comm/bytes_per_step": sent,
            "comm/compression": self.uncompressed_bytes / sent if sent else 1.0,
        }

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class CompressedAllreduce(Comm):
    """torch's fp16/bf16 compression hooks: half the bytes of fp32, same algorithm."""

    uses_hook = True
    torch_hooks = {
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook,
    }

    def __init__(self, env: DistEnv, wire: WireDtype) -> None:
        super().__init__(env)
        self.name = wire
        self.hook = self.torch_hooks[wire]
        self.wire_itemsize = WIRE_DTYPES[wire].itemsize

    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # One allreduce per bucket, issued right here in bucket order: safe on gloo.
        self.count(bucket.buffer().numel(), self.wire_itemsize)
        return self.hook(None, bucket)


@dataclass
class _BucketPlan:
    """How one bucket's tensors are split: matrices to compress (with their rank) and the rest."""

    shapes: tuple[torch.Size, ...]  # the gradients this plan was made for
    compressed: list[int]  # indexes into bucket.gradients()
    ranks: list[int]
    uncompressed: list[int]
    p_numel: int  # elements of all P matrices together


class PowerSGD(Comm):
    """Rank-r gradient compression with error feedback and warm start, gloo-safe."""

    name = "powersgd"
    uses_hook = True

    def __init__(
        self,
        env: DistEnv,
        rank: Annotated[int, Ge(1)],  # 1, 2 and 4 are usual
        start_iter: Annotated[int, Ge(0)],  # steps of plain allreduce first
        min_compression_rate: Annotated[float, Ge(0)],
        error_feedback: bool,
        warm_start: bool,
        orthogonalization_epsilon: Annotated[float, Ge(0)],
        compress: WireDtype | None,
        seed: int,
    ) -> None:
        super().__init__(env)
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.epsilon = orthogonalization_epsilon
        self.wire_dtype = WIRE_DTYPES[compress] if compress else None
        self.seed = seed
        self.iter = 0
        self.errors: dict[str, torch.Tensor] = {}  # per parameter, in unscaled gradient units
        self.q_memory: dict[str, torch.Tensor] = {}  # per compressed parameter: last Q
        self._plans: dict[int, _BucketPlan] = {}
        self._scratch_buffers: dict[str, torch.Tensor] = {}

    def attach(self, ddp_model: nn.Module, model: nn.Module, grad_scale: ScaleSource) -> None:
        # State is keyed by parameter name, so it survives bucket rebuilds and restarts.
        self.param_names = {id(p): name for name, p in model.named_parameters()}
        self.param_index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        self.device = next(model.parameters()).device
        self._to_device()
        super().attach(ddp_model, model, grad_scale)

    def _to_device(self) -> None:
        """State restored from a checkpoint arrives on CPU."""
        self.errors = {name: t.to(self.device) for name, t in self.errors.items()}
        self.q_memory = {name: t.to(self.device) for name, t in self.q_memory.items()}

    def end_round(self) -> None:
        super().end_round()
        self.iter += 1

    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if self.iter >= self.start_iter:
            self._compress_and_reduce(bucket)
        else:
            self._allreduce_mean(buffer)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future

    # --- the algorithm ----------------------------------------------------------------------
    def _compress_and_reduce(self, bucket: dist.GradBucket) -> None:
        grads = bucket.gradients()  # views into the bucket's buffer, one per parameter
        names = [self.param_names[id(p)] for p in bucket.parameters()]
        plan = self._plan_for(bucket.index(), grads)
        # With AMP, gradients carry the loss scale and a step may hold inf/NaN that the
        # GradScaler will skip: error feedback is kept unscaled and guarded against that step.
        scale = self.grad_scale()
        if scale is None and self.guard_nonfinite:
            scale = torch.ones((), device=grads[0].device)  # x1 and /1 are exact
        checks: list[torch.Tensor] = []  # small tensors in which any inf/NaN shows up
        feedback = self._add_errors(names, grads, scale) if self.error_feedback else None
        if plan.uncompressed:
            checks.append(self._reduce_uncompressed(grads, plan.uncompressed))
        if plan.compressed:
            self._reduce_compressed(names, grads, plan, scale is not None, checks)
        if feedback is not None:
            self._keep_errors(*feedback, grads, scale, checks)

    def _add_errors(
        self, names: list[str], grads: list[torch.Tensor], scale: torch.Tensor | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each rank's last compression error added to its gradients. Returns the error buffers
        and the pre-communication gradients (the same buffers, unguarded)."""
        # Per parameter, not per bucket: DDP rebuilds buckets after the first step and a
        # restarted job starts with other buckets. Updated in place: no big allocations.
        errors = [self._error(name, grad) for name, grad in zip(names, grads, strict=True)]
        if scale is not None:
            befores = [self._scratch(name, g) for name, g in zip(names, grads, strict=True)]
            torch._foreach_copy_(befores, errors)
            torch._foreach_mul_(befores, scale)  # stored unscaled, applied at today's scale
            torch._foreach_add_(grads, befores)
        else:
            torch._foreach_add_(grads, errors)
            befores = errors  # the error buffers hold the pre-communication gradient
        torch._foreach_copy_(befores, grads)
        return errors, befores

    def _reduce_uncompressed(self, grads: list[torch.Tensor], which: list[int]) -> torch.Tensor:
        """The parameters compression would not shrink, averaged as one flat tensor."""
        flat = torch.cat([grads[i].reshape(-1) for i in which])
        self._allreduce_mean(flat)
        parts = flat.split([grads[i].numel() for i in which])
        for i, part in zip(which, parts, strict=True):
            grads[i].copy_(part.view_as(grads[i]))
        return flat

    def _reduce_compressed(
        self,
        names: list[str],
        grads: list[torch.Tensor],
        plan: _BucketPlan,
        guarded: bool,
        checks: list[torch.Tensor],
    ) -> None:
        """M ~ P Q^T for each matrix: P and Q all-reduced, the gradient replaced by P Q^T."""
        matrices = [_as_matrix(grads[i]) for i in plan.compressed]
        compressed_names = [names[i] for i in plan.compressed]
        p_shapes = [(m.shape[0], r) for m, r in zip(matrices, plan.ranks, strict=True)]
        q_shapes = [(m.shape[1], r) for m, r in zip(matrices, plan.ranks, strict=True)]
        q_flat = torch.cat(
            [
                self._initial_q(name, shape, grads[0]).reshape(-1)
                for name, shape in zip(compressed_names, q_shapes, strict=True)
            ]
        )
        start_q = q_flat.clone() if guarded and self.warm_start else None
        p_flat = grads[0].new_empty(plan.p_numel)
        ps, qs = _split(p_flat, p_shapes), _split(q_flat, q_shapes)
        # P = M Q and Q = M^T P are written as (Q^T M^T)^T and (P^T M)^T: a BLAS product
        # with 2..4 output columns ran 10x slower than one with 2..4 output rows on CPU
        # (ResNet-18 at rank 2: 29 -> 15 ms a step for the three products).
        for matrix, p, q in zip(matrices, ps, qs, strict=True):
            p.copy_(torch.mm(q.t(), matrix.t()).t())
        self._allreduce_sum(p_flat)  # inf/NaN in any rank's gradient reaches every P
        checks.append(p_flat.clone())
        for p in ps:
            self._orthogonalize(p)
        for matrix, p, q in zip(matrices, ps, qs, strict=True):
            q.copy_(torch.mm(p.t(), matrix).t())
        self._allreduce_sum(q_flat)
        q_flat.div_(self.env.world_size)
        for matrix, p, q in zip(matrices, ps, qs, strict=True):
            torch.matmul(p, q.t(), out=matrix)
        if self.warm_start:
            kept = q_flat
            if start_q is not None:
                kept = torch.where(_all_finite(checks), q_flat, start_q)
            for name, q in zip(compressed_names, _split(kept, q_shapes), strict=True):
                self.q_memory[name] = q

    def _keep_errors(
        self,
        errors: list[torch.Tensor],
        befores: list[torch.Tensor],
        grads: list[torch.Tensor],
        scale: torch.Tensor | None,
        checks: list[torch.Tensor],
    ) -> None:
        """The new errors: the pre-communication gradient minus what was applied (kept as it
        was on a step whose gradients were not finite)."""
        if scale is None:
            torch._foreach_sub_(errors, grads)
            return
        finite = _all_finite(checks)  # on device: no host sync
        for error, before, grad in zip(errors, befores, grads, strict=True):
            before.sub_(grad).div_(scale)
            torch.where(finite, before, error, out=error)  # a skipped step keeps it

    def _error(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        error = self.errors.get(name)
        if error is None or error.shape != grad.shape:
            error = self.errors[name] = torch.zeros_like(grad)
        return error

    def _scratch(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        buffer = self._scratch_buffers.get(name)
        if buffer is None or buffer.shape != grad.shape:
            buffer = self._scratch_buffers[name] = torch.empty_like(grad)
        return buffer

    def _plan_for(self, index: int, grads: list[torch.Tensor]) -> _BucketPlan:
        plan = self._plans.get(index)
        if plan is None or plan.shapes != tuple(g.shape for g in grads):  # DDP rebuilt buckets
            plan = self._plans[index] = self._plan(grads)
        return plan

    def _initial_q(self, name: str, shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
        remembered = self.q_memory.get(name) if self.warm_start else None
        if remembered is not None and remembered.shape == shape:
            return remembered
        # Same seed on every rank, so all ranks project onto the same random subspace.
        seed = self.seed * 1_000_003 + self.param_index[name] * 7919 + self.iter
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=generator).to(device=like.device, dtype=like.dtype)

    def _plan(self, grads: list[torch.Tensor]) -> _BucketPlan:
        """torch's rule: compress an n x m matrix at rank r when (n+m)*r*min_rate < n*m."""
        compressed, ranks, uncompressed = [], [], []
        p_numel = 0
        for i, grad in enumerate(grads):
            n, m = _as_matrix(grad).shape
            r = min(n, m, self.rank)
            if (n + m) * r * self.min_compression_rate < n * m:
                compressed.append(i)
                ranks.append(r)
                p_numel += n * r
            else:
                uncompressed.append(i)
        shapes = tuple(g.shape for g in grads)
        return _BucketPlan(shapes, compressed, ranks, uncompressed, p_numel)

    def _orthogonalize(self, matrix: torch.Tensor) -> None:
        """Orthonormal columns, in place: Gram-Schmidt for rank <= 2 or a nonzero epsilon
        (cheaper than a LAPACK call for one or two columns), QR otherwise."""
        if self.epsilon == 0 and matrix.shape[1] > 2:
            matrix.copy_(torch.linalg.qr(matrix).Q)
            return
        for col_index in range(matrix.shape[1]):
            col = matrix[:, col_index : col_index + 1]
            norm = torch.linalg.vector_norm(col)
            # An all-zero column (a layer with no gradient) stays zero instead of turning NaN.
            col /= norm + self.epsilon if self.epsilon else norm.clamp_min(1e-30)
            rest = matrix[:, col_index + 1 :]
            rest -= (col * rest).sum(dim=0, keepdim=True) * col

    # --- the wire ---------------------------------------------------------------------------
    def _allreduce_sum(self, tensor: torch.Tensor) -> None:
        self.count(tensor.numel(), tensor.element_size())
        dist.all_reduce(tensor)

    def _allreduce_mean(self, tensor: torch.Tensor) -> None:
        wire = tensor if self.wire_dtype is None else tensor.to(self.wire_dtype)
        wire.div_(self.env.world_size)
        self._allreduce_sum(wire)
        if wire is not tensor:
            tensor.copy_(wire)

    # --- per-rank state (checkpoints) -------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "iter": self.iter,
            "errors": {i: t.cpu() for i, t in self.errors.items()},
            "q_memory": {i: t.cpu() for i, t in self.q_memory.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's state, before or after attach() to a DDP model."""
        self.iter = state["iter"]
        self.errors = {name: t.clone() for name, t in state["errors"].items()}
        self.q_memory = {name: t.clone() for name, t in state["q_memory"].items()}
        if hasattr(self, "device"):
            self._to_device()


def _all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.isfinite(t).all() for t in tensors]).all()


def _as_matrix(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as rows x everything-else (a bias is a column; a scalar is 1 x 1)."""
    return grad.view(grad.shape[0] if grad.dim() else 1, -1)


def _split(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Matrix views of consecutive pieces of a flat buffer."""
    parts = flat.split([rows * cols for rows, cols in shapes])
    return [part.view(shape) for part, shape in zip(parts, shapes, strict=True)]
