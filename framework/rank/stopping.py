"""Stopping together: signals (preemption, Ctrl-C) and non-finite values, agreed by all ranks.

A signal may reach one rank, all of them, or the launcher, at any moment. Each rank only records
it and adds it to a small asynchronous all-reduce on the CPU (`SignalExchange`) at the steps
every rank knows to be exchange steps, so all ranks stop at the same step, with a checkpoint.

A non-finite loss or gradient never makes a step wait for the device: it is recorded on the
device (`NonFiniteWatch`) and read where the host reads anyway (logging steps, checkpoint saves,
the end), where every rank learns the same thing at the same step. With `stop` nothing is
logged or saved after it; with `skip` the update of that step was already dropped on the device
(the optimizer's `found_inf`, as GradScaler does for amp). Non-finite gradients need no
exchange: after DDP's synchronisation they are identical on every rank.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from framework.core.distributed import all_reduce_sum
from framework.core.exits import NonFiniteLoss
from framework.core.launch_context import DistEnv

log = logging.getLogger("framework")
FORCE_AFTER_S = 2.0  # a second Ctrl-C this much later than the first one aborts at once


def stop_signal_names(configured: list[str]) -> list[str]:
    """The signals a run stops on: trainer.stop_signals, and always SIGINT (Ctrl-C)."""
    return sorted({*configured, "SIGINT"})


_RECEIVED: set[str] = set()  # signals are process-wide: so is the record of those that came


def received_signals() -> set[str]:
    """Every stop signal this process has received so far."""
    return set(_RECEIVED)


class StopRequests:
    """Installs handlers for the stop signals; remembers the first one this process got.

    Repeats are one request: under torchrun or a terminal, a Ctrl-C reaches a rank both directly
    and forwarded by its launcher. A second Ctrl-C later than FORCE_AFTER_S aborts at once.
    """

    def __init__(self, names: list[str]) -> None:
        self.names = stop_signal_names(names)
        self.signal_name: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequests:
        for name in self.names:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        _RECEIVED.add(name)
        if self.signal_name is None:
            self.signal_name, self._first_at = name, time.monotonic()
        elif name == "SIGINT" and time.monotonic() - self._first_at > FORCE_AFTER_S:
            raise KeyboardInterrupt


class SignalExchange:
    """At each exchange step every rank starts an asynchronous all-reduce of the stop signal it
    received (0: none) and reads the one started at the exchange step before: all ranks learn
    of a signal at the same step, and no step waits for the exchange (a small gloo all-reduce
    costs ~1 ms of latency here, as much as a whole step of a tiny model). The flags start on
    the host and travel on the CPU (a gloo group, also when training uses NCCL): reading them
    waits for no device work.

    Exchange steps: every logging step (the host reads and the ranks meet there anyway), and
    otherwise steps about EVERY_S apart. On steps of a few milliseconds an exchange per step
    cost about 9% of the throughput (the CPU time of gloo's threads, on 2 cores), and one every
    0.05 s still 2-3% on 9 ms steps; every 0.25 s it costs nothing measurable, and a stop comes
    at most two exchanges (~0.5 s) after its signal, well inside any preemption's grace time.
    Rank 0 measures its steps and proposes the spacing inside each exchange; every rank adopts
    it when it reads that exchange, so every rank keeps the same schedule."""

    EVERY_S = 0.25  # seconds between two exchanges, when steps are shorter than that
    MAX_APART = 64  # steps

    def __init__(
        self, env: DistEnv, requests: StopRequests, group: dist.ProcessGroup | None = None
    ) -> None:
        self.env, self.requests, self.group = env, requests, group
        # [the signal each rank received..., the steps to the next exchange (rank 0's pick)]
        self.buffers = [torch.zeros(env.world_size + 1, dtype=torch.int32) for _ in range(2)]
        self.turn = 0  # one buffer in flight, one being filled
        self.pending: tuple[dist.Work | None, torch.Tensor] | None = None
        self.apart = 1  # steps between exchanges, as last agreed
        self.next_step = 0  # the next exchange step (besides logging steps)
        self._measured_from: tuple[int, float] | None = None  # (step, time) of rank 0's last

    def exchange(self, step: int, logging: bool) -> str | None:
        """Collective at exchange steps (every rank calls it at every step, with the same
        arguments): start this exchange; return the signal agreed at the one before."""
        if not (logging or step >= self.next_step):
            return None
        agreed = self.collect()
        flags = self.buffers[self.turn]
        self.turn ^= 1
        flags.zero_()
        name = self.requests.signal_name
        if name:  # a steady step writes nothing more
            flags[self.env.rank] = getattr(signal, name)
        if self.env.rank == 0:
            flags[-1] = self._proposed_spacing(step)
        work = (
            dist.all_reduce(flags, group=self.group, async_op=True)
            if self.env.distributed
            else None
        )
        self.pending = (work, flags)
        self.next_step = step + self.apart
        return agreed

    def _proposed_spacing(self, step: int) -> int:
        """Rank 0: steps per EVERY_S, from its steps since its last exchange."""
        now, last = time.perf_counter(), self._measured_from
        self._measured_from = (step, now)
        if last is None or step == last[0]:
            return 1
        seconds_per_step = (now - last[1]) / (step - last[0])
        return max(1, min(self.MAX_APART, round(self.EVERY_S / max(seconds_per_step, 1e-9))))

    def collect(self) -> str | None:
        """Wait for the exchange in flight, if any, and decode it (also before the run ends)."""
        if self.pending is None:
            return None
        work, flags = self.pending
        self.pending = None
        if work is not None:
            work.wait()
        *numbers, apart = flags.tolist()
        self.apart = apart or 1
        received = [signal.Signals(number).name for number in numbers if number]
        return (self.requests.signal_name or received[0]) if received else None


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


class NonFinitePolicy:
    """trainer.on_nonfinite: a non-finite loss or gradient, seen by every rank at the same step,
    stops the run (saving nothing after it) or drops that update."""

    def __init__(self, policy: str) -> None:
        self.stops = policy == "stop"

    def handle(
        self, report: NonFiniteReport, epoch_of: Callable[[int], int], last_checkpoint: Path | None
    ) -> None:
        """Raise NonFiniteLoss (stop) or warn (skip)."""
        if report.loss_ranks:
            what = f"loss on rank(s) {', '.join(map(str, report.loss_ranks))}"
        else:
            what = "gradients (identical on every rank)"
        where = f"non-finite {what} at step {report.step} (epoch {epoch_of(report.step)})"
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
