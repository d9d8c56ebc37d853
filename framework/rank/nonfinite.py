"""Non-finite values, agreed by all ranks at one step, without making a step wait for the device.

A non-finite loss or gradient is recorded on the device (`NonFiniteWatch`) and read where the
host reads anyway (logging steps, checkpoint saves, the end), where every rank learns the same
thing at the same step. With trainer.on_nonfinite=stop nothing is logged or saved after it; with
`skip` the update of that step was already dropped on the device (the optimizer's `found_inf`,
as GradScaler does for amp). Non-finite gradients need no exchange: after DDP's synchronisation
they are identical on every rank. `NonFiniteGuard` is the loop's one object for all of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from framework.components.strategy import local
from framework.core.distributed import all_reduce_sum
from framework.core.exits import NonFiniteLoss
from framework.core.launch_context import DistEnv

log = logging.getLogger("framework")


@dataclass
class NonFiniteReport:
    """The first step since the last look at which a loss or the gradients went non-finite."""

    step: int  # 1-based optimizer step
    loss_ranks: list[int]  # ranks whose loss was non-finite at that step
    gradients: bool  # the (synchronised, identical) gradients were non-finite at that step
    dropped: int  # updates dropped since the last look (trainer.on_nonfinite=skip)
    last_step: int  # the last such step since the last look


class NonFiniteWatch:
    """Keeps each step's device tensors (its loss, the gradient check's flag, whether the update
    was dropped); the host reads them only where it looks anyway (logging steps, checkpoint
    saves, the end), as one record per rank (first and last bad step, what was bad at the
    first, updates dropped) in one all-reduce of every rank's record. A step costs no device
    op: the tensors are checked together when folded. A loss may go bad on one rank alone; the
    gradients, synchronised by DDP, go bad on every rank at once."""

    FIELDS = 5  # first bad step, last bad step, loss bad then, gradients bad then, dropped
    FOLD_EVERY = 1024  # steps whose flags are folded into the record, between two looks

    def __init__(self, env: DistEnv, device: torch.device) -> None:
        self.env = env
        self.record = torch.zeros(self.FIELDS, dtype=torch.int64, device=device)
        self.first_step = 0  # of the steps added since the last fold (they follow one another)
        self.losses: list[torch.Tensor] = []
        self.found_inf: list[torch.Tensor] = []
        self.dropped: list[torch.Tensor] = []
        self._none_found = torch.zeros((), device=device)
        self._kept = torch.tensor(False, device=device)

    def add(
        self,
        step: int,
        loss: torch.Tensor,
        found_inf: torch.Tensor | None,
        dropped: torch.Tensor | None,
    ) -> None:
        """Step `step` (1-based): its loss (a tensor of the same shape at every step, the loss
        first), the gradient check's flag (1.0: inf/NaN; None: not checked) and whether its
        update was dropped (None: never). Kept as they are: no device op, no host read."""
        if not self.losses:
            self.first_step = step
        self.losses.append(loss)
        self.found_inf.append(self._none_found if found_inf is None else found_inf)
        self.dropped.append(self._kept if dropped is None else dropped)
        if len(self.losses) == self.FOLD_EVERY:
            self.record = self._merged(self.record, self._fold())

    def _fold(self) -> torch.Tensor:
        """The record of the steps added since the last fold, on the device."""
        if not self.losses:
            return torch.zeros_like(self.record)
        count = len(self.losses)
        losses = torch.stack(self.losses).reshape(count, -1)[:, 0]  # (same shapes)
        loss_bad = ~torch.isfinite(losses)
        grads_bad = torch.stack(self.found_inf).reshape(-1) != 0
        dropped = torch.stack(self.dropped).reshape(-1)
        steps = torch.arange(self.first_step, self.first_step + count, device=self.record.device)
        self.losses, self.found_inf, self.dropped = [], [], []
        bad = loss_bad | grads_bad
        any_bad = bad.any()
        first = torch.argmax(bad.to(torch.int8))  # the first maximum's index
        last = len(steps) - 1 - torch.argmax(bad.flip(0).to(torch.int8))
        at_first = torch.stack(
            (steps[first], steps[last], loss_bad[first].long(), grads_bad[first].long())
        )
        return torch.cat((torch.where(any_bad, at_first, 0), dropped.long().sum().view(1)))

    @staticmethod
    def _merged(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Two records, the older first: the first bad step (and what was bad at it) from the
        older one if it saw one, the last from the newer one if it saw one, drops added."""
        merged = torch.where(old[0] != 0, old, new)
        merged[1] = torch.where(new[1] != 0, new[1], old[1])
        merged[4] = old[4] + new[4]
        return merged

    def look(self) -> NonFiniteReport | None:
        """Collective (every rank at the same step): what happened since the last look."""
        return self.look_carrying(None)[0]

    def look_carrying(
        self, rider: torch.Tensor | None
    ) -> tuple[NonFiniteReport | None, list[float]]:
        """look(), with `rider` (a float64 tensor, e.g. a logging step's loss sums) summed over
        the ranks in the same all-reduce: on a busy machine each blocking collective costs
        milliseconds, and a logging step needs both. Returns the report and the summed rider.
        The records travel as float64, exact for integers below 2**53."""
        record = self._merged(self.record, self._fold())
        self.record = torch.zeros_like(record)
        mine, world = self.env.rank * self.FIELDS, self.env.world_size * self.FIELDS
        extra = 0 if rider is None else rider.numel()
        payload = torch.zeros(world + extra, dtype=torch.float64, device=record.device)
        payload[mine : mine + self.FIELDS] = record
        if rider is not None:
            payload[world:] = rider
        values = (all_reduce_sum(payload) if self.env.distributed else payload).tolist()
        rows = [
            [int(value) for value in values[start : start + self.FIELDS]]
            for start in range(0, world, self.FIELDS)
        ]
        return self._report(rows), values[world:]

    @staticmethod
    def _report(rows: list[list[int]]) -> NonFiniteReport | None:
        """Every rank's record (one row each) as one report, or None if all are clean."""
        firsts = [row[0] for row in rows if row[0]]
        if not firsts:
            return None
        step = min(firsts)
        at_step = [row for row in rows if row[0] == step]
        return NonFiniteReport(
            step=step,
            loss_ranks=[rank for rank, row in enumerate(rows) if row[0] == step and row[2]],
            gradients=any(row[3] for row in at_step),
            dropped=max(row[4] for row in rows),  # the same on every rank: gradients decide
            last_step=max(row[1] for row in rows),
        )


class NonFiniteGuard:
    """trainer.on_nonfinite, in one object with two calls: `step` at every optimizer step (the
    gradients checked on the device, the update applied or dropped) and `look` where the host
    reads anyway (a non-finite loss or gradient since the last look stops the run, saving
    nothing after it, or is reported as skipped)."""

    def __init__(
        self,
        policy: str,
        env: DistEnv,
        device: torch.device,
        skips_itself: bool,
        agree: Callable[[torch.Tensor], torch.Tensor],
        epoch_of: Callable[[int], int],
    ) -> None:
        self.stops = policy == "stop"
        self.watch = NonFiniteWatch(env, device)
        self.skips_itself = skips_itself  # amp: GradScaler checks and skips the step itself
        self.agree = agree  # the strategy's: under fsdp each rank checks only its shard
        self.epoch_of = epoch_of
        self.skipped = 0  # updates dropped so far (trainer.on_nonfinite=skip)
        self._one = torch.ones((), device=device)  # the "scale" of the gradient check
        self._true = torch.ones((), dtype=torch.bool, device=device)

    def step(
        self,
        step: int,
        loss: torch.Tensor,
        params: list[torch.Tensor],
        update: Callable[[torch.Tensor | None], None],
        skip_on_device: bool,
    ) -> torch.Tensor | None:
        """Step `step`'s update: `update(found_inf)` steps the optimizer (found_inf, a device
        flag, drops it on the device where the optimizer can). Returns whether the update was
        applied (a device flag), or None under `stop` (nothing after it is ever saved). Reads
        nothing from the device, except with an optimizer that cannot skip on it."""
        found_inf = None if self.skips_itself else self._grads_found_inf(params)
        if self.stops or found_inf is None:
            update(None)
            applied = None if self.stops else self._true
        elif skip_on_device:
            update(found_inf)
            applied = found_inf == 0
        else:  # an optimizer that cannot skip on the device: one host read per step
            applied = found_inf == 0
            if bool(applied):
                update(None)
        self.watch.add(step, loss, found_inf, dropped=None if applied is None else ~applied)
        return applied

    def _grads_found_inf(self, params: list[torch.Tensor]) -> torch.Tensor:
        """A device flag as GradScaler makes it (1.0: some gradient is inf or NaN), found in one
        fused pass by GradScaler's own check with the scale 1 (a multiplication by 1 leaves
        every gradient bit-identical). After DDP's synchronisation the gradients are identical
        on every rank, so this rank's answer is every rank's, at the same step, with no
        exchange (under strategy=fsdp each rank checks its shard, and `agree` makes the answer
        everyone's)."""
        found_inf = torch.zeros_like(self._one)
        grads = [local(p.grad) for p in params if p.grad is not None]
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, self._one)
        return self.agree(found_inf)

    def look(self, last_checkpoint: Path | None, rider: torch.Tensor | None = None) -> list[float]:
        """Collective, before anything is logged or saved: raise NonFiniteLoss (stop) or warn
        (skip) about what went non-finite since the last look. `rider` is summed over the ranks
        in the same all-reduce and returned."""
        report, summed = self.watch.look_carrying(rider)
        if report is not None:
            self._handle(report, last_checkpoint)
            self.skipped += report.dropped
        return summed

    def _handle(self, report: NonFiniteReport, last_checkpoint: Path | None) -> None:
        if report.loss_ranks:
            what = f"loss on rank(s) {', '.join(map(str, report.loss_ranks))}"
        else:
            what = "gradients (identical on every rank)"
        where = f"non-finite {what} at step {report.step} (epoch {self.epoch_of(report.step)})"
        if not report.gradients:
            where += " with finite gradients (that update was applied)"
        if self.stops:
            saved = (
                f"the last good checkpoint is {last_checkpoint}"
                if last_checkpoint
                else "no checkpoint was saved"
            )
            raise NonFiniteLoss(
                f"{where}: stopped without saving; {saved}. Lower optimizer.lr, set "
                "trainer.clip_grad_norm, or set trainer.on_nonfinite=skip to skip such steps"
            )
        more = (
            f"; {report.dropped} updates dropped in steps {report.step}-{report.last_step}"
            if report.dropped > 1
            else ""
        )
        log.warning(
            "%s: %s (trainer.on_nonfinite=skip)%s",
            where,
            "update skipped" if report.gradients else "continuing",
            more,
        )
