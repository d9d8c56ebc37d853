"""Stopping together on a signal (preemption, Ctrl-C), agreed by all ranks.

A signal may reach one rank, all of them, or the launcher, at any moment. Each rank only records
it and adds it to a small asynchronous all-reduce on the CPU (`SignalExchange`) at the steps
every rank knows to be exchange steps, so all ranks stop at the same step, with a checkpoint.
Non-finite values stop (or skip) together too: framework/rank/nonfinite.py.
"""

from __future__ import annotations

import signal
import time
from types import FrameType

import torch
import torch.distributed as dist

from framework.core.launch_context import DistEnv
from framework.core.stop_signals import stop_signal_names

FORCE_AFTER_S = 2.0  # a second Ctrl-C this much later than the first one aborts at once


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
