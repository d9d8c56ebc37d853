"""Stopping together: signals (preemption, Ctrl-C) and non-finite losses, agreed by all ranks.

A signal may reach one rank, all of them, or the launcher, at any moment. Each rank only records
it; every step each rank adds its flags to a small asynchronous all-reduce, so all ranks see the
same verdict at the same step: stop there with a checkpoint, or skip / stop on a non-finite loss.
Non-finite gradients need no exchange: after DDP's synchronisation they are identical on every
rank, so each rank's own check agrees with all the others at that very step.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from framework.context import DistEnv
from framework.outcomes import NonFiniteLoss

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


@dataclass
class Verdict:
    """What every rank learned, identically, about one step."""

    stop_signal: str | None = None  # a stop signal reached some rank
    nonfinite_loss_ranks: list[int] = field(default_factory=list)


class StepAgreement:
    """Each step starts an asynchronous all-reduce of every rank's [stop signal number, loss is
    non-finite] and reads the one started a step earlier: all ranks learn the same thing at the
    same step, and no step waits for this exchange (a small gloo all-reduce costs ~1 ms of
    latency here, as much as a whole step of a tiny model)."""

    def __init__(self, env: DistEnv, device: torch.device, requests: StopRequests) -> None:
        self.env, self.requests = env, requests
        self.buffers = [torch.zeros(2, env.world_size, dtype=torch.int32, device=device)
                        for _ in range(2)]  # fmt: skip  (one in flight, one being filled)
        self.turn = 0
        self.pending: tuple[dist.Work | None, torch.Tensor] | None = None

    def exchange(self, loss_finite: torch.Tensor) -> Verdict:
        """Collective: start this step's exchange; return the previous step's verdict."""
        verdict = self.collect()
        flags = self.buffers[self.turn]
        self.turn ^= 1
        flags.zero_()
        name = self.requests.signal_name
        flags[0, self.env.rank] = getattr(signal, name) if name else 0
        flags[1, self.env.rank] = (~loss_finite).int()  # on device: no host sync
        work = dist.all_reduce(flags, async_op=True) if self.env.distributed else None
        self.pending = (work, flags)
        return verdict

    def collect(self) -> Verdict:
        """Wait for the exchange in flight, if any, and decode it (also before the run ends)."""
        if self.pending is None:
            return Verdict()
        work, flags = self.pending
        self.pending = None
        if work is not None:
            work.wait()
        signals, losses = flags.tolist()
        received = [signal.Signals(number).name for number in signals if number]
        return Verdict(
            stop_signal=(self.requests.signal_name or received[0]) if received else None,
            nonfinite_loss_ranks=[rank for rank, bad in enumerate(losses) if bad],
        )


class NonFinitePolicy:
    """trainer.on_nonfinite: a non-finite loss or gradient, seen by every rank at the same step,
    stops the run there (saving nothing) or drops that update."""

    def __init__(self, policy: str) -> None:
        self.stops = policy == "stop"

    def handle(self, loss_ranks: list[int], step: int, epoch: int, kept: bool,
               last_checkpoint: Path | None) -> bool:  # fmt: skip
        """Raise NonFiniteLoss or warn; `kept`: only the loss of `step` went bad, its gradients
        were finite and its update was applied. Returns whether the update was dropped."""
        if loss_ranks:
            what = f"loss on rank(s) {', '.join(map(str, loss_ranks))}"
        else:
            what = "gradients (identical on every rank)"
        where = f"non-finite {what} at step {step} (epoch {epoch})"
        if kept:
            where += " with finite gradients (that update was applied)"
        if self.stops:
            saved = (f"the last good checkpoint is {last_checkpoint}" if last_checkpoint
                     else "no checkpoint was saved")  # fmt: skip
            raise NonFiniteLoss(
                f"{where}: stopped without saving; {saved}. Lower optimizer.lr, set "
                "trainer.clip_grad_norm, or set trainer.on_nonfinite=skip to skip such steps"
            )
        log.warning("%s: %s (trainer.on_nonfinite=skip)", where,
                    "continuing" if kept else "update skipped")  # fmt: skip
        return not kept
