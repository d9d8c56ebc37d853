"""Stopping together: signals (preemption, Ctrl-C) and non-finite losses, agreed by all ranks.

A signal may reach one rank, all of them, or the launcher, at any moment. Each rank only records
it; once per step every rank contributes its flags to one small all-reduce, so all ranks see the
same verdict at the same step: stop there with a checkpoint, or skip / stop on a non-finite loss.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from types import FrameType

import torch

from framework.distributed import DistEnv, all_reduce_sum

STOPPED = 75  # exit code: stopped on a signal with a checkpoint; run the same command to resume
INTERRUPTED = 130  # the same, after Ctrl-C (128 + SIGINT, what shells expect)
FORCE_AFTER_S = 2.0  # a second Ctrl-C this much later than the first one aborts at once


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
        self.names = sorted({*names, "SIGINT"})
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
        if self.signal_name is None:
            self.signal_name, self._first_at = name, time.monotonic()
        elif name == "SIGINT" and time.monotonic() - self._first_at > FORCE_AFTER_S:
            raise KeyboardInterrupt


# What a rank reports about its step (worst wins).
FINITE, NONFINITE_GRADS, NONFINITE_LOSS = 0, 1, 2


@dataclass
class Verdict:
    stop_signal: str | None = None  # a stop signal reached some rank
    nonfinite: dict[int, int] = field(default_factory=dict)  # rank -> NONFINITE_*

    def nonfinite_where(self) -> str:
        """The ranks where it started: a rank's bad loss reaches every rank's gradients."""
        loss = [r for r, kind in self.nonfinite.items() if kind == NONFINITE_LOSS]
        if loss:
            return f"loss on rank(s) {', '.join(map(str, loss))}"
        return "gradients (identical on every rank after synchronisation)"


class StepAgreement:
    """One all-reduce per step of each rank's [stop signal number, loss/gradients non-finite]."""

    def __init__(self, env: DistEnv, device: torch.device, requests: StopRequests) -> None:
        self.env, self.requests = env, requests
        self.flags = torch.zeros(2, env.world_size, dtype=torch.int32, device=device)

    def check(self, local_status: torch.Tensor) -> Verdict:
        """Collective; `local_status` is this rank's FINITE / NONFINITE_* as a 0-dim tensor."""
        self.flags.zero_()
        name = self.requests.signal_name
        self.flags[0, self.env.rank] = getattr(signal, name) if name else 0
        self.flags[1, self.env.rank] = local_status
        signals, status = all_reduce_sum(self.flags).tolist()  # the one host sync of a step
        verdict = Verdict(nonfinite={rank: kind for rank, kind in enumerate(status) if kind})
        received = [signal.Signals(number).name for number in signals if number]
        if received:
            verdict.stop_signal = name or received[0]
        return verdict
