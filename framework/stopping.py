"""Stopping together: signals (preemption, Ctrl-C) and non-finite losses, agreed by all ranks.

A signal may reach one rank, all of them, or the launcher, at any moment. Each rank only records
it; every step each rank adds its flags to a small asynchronous all-reduce, so all ranks see the
same verdict at the same step: stop there with a checkpoint, or skip / stop on a non-finite loss.
Non-finite gradients need no exchange: after DDP's synchronisation they are identical on every
rank, so each rank's own check agrees with all the others at that very step.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from types import FrameType

import torch
import torch.distributed as dist

from framework.distributed import DistEnv

STOPPED = 75  # exit code: stopped on a signal with a checkpoint; run the same command to resume
INTERRUPTED = 130  # the same, after Ctrl-C (128 + SIGINT, what shells expect)
FORCE_AFTER_S = 2.0  # a second Ctrl-C this much later than the first one aborts at once


def stop_signal_names(configured: list[str]) -> list[str]:
    """The signals a run stops on: trainer.stop_signals, and always SIGINT (Ctrl-C)."""
    return sorted({*configured, "SIGINT"})


_RECEIVED: set[str] = set()  # signals are process-wide: so is the record of those that came


def received_signals() -> set[str]:
    """Every stop signal this process has received so far."""
    return set(_RECEIVED)


class StopRun(Exception):
    """Every rank stopped at the same step on a signal; a checkpoint holds that step."""

    def __init__(self, signal_name: str, step: int, checkpoint: str | None) -> None:
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        saved = f"saved {checkpoint}" if checkpoint else "nothing saved (checkpoint.final=false)"
        super().__init__(f"stopped on {signal_name} at step {step}; {saved}")

    @property
    def exit_code(self) -> int:
        return INTERRUPTED if self.signal_name == "SIGINT" else STOPPED


class NonFiniteLoss(RuntimeError):
    """trainer.on_nonfinite=stop: every rank raises this at the same step."""


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
