"""The non-finite record a rank keeps on the device between two looks: what the report says
for a sequence of steps, whether the steps were folded into the record on the way or not."""

from __future__ import annotations

import math

import pytest
import torch

from framework.core.launch_context import DistEnv
from framework.rank import stopping
from framework.rank.nonfinite import NonFiniteWatch
from framework.rank.stopping import SignalExchange, StopRequests

T, F = torch.tensor(True), torch.tensor(False)


def add(
    watch: NonFiniteWatch,
    step: int,
    loss_finite: torch.Tensor,
    grads_finite: torch.Tensor,
    dropped: torch.Tensor | None,
) -> None:
    """A step as the runner adds it: its [loss sum, item count] and the gradient check's flag."""
    loss = torch.tensor([2.5 if loss_finite else math.nan, 32.0], dtype=torch.float64)
    watch.add(step, loss, torch.tensor(0.0 if grads_finite else 1.0), dropped)


def watched(
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    fold_every: int,
    monkeypatch,
) -> NonFiniteWatch:
    monkeypatch.setattr(NonFiniteWatch, "FOLD_EVERY", fold_every)
    watch = NonFiniteWatch(DistEnv(), torch.device("cpu"))
    for step, (loss_finite, grads_finite, dropped) in enumerate(steps, start=1):
        add(watch, step, loss_finite, grads_finite, dropped)
    return watch


@pytest.mark.parametrize("fold_every", [1024, 3, 2, 1])
def test_the_report_names_the_first_bad_step_what_was_bad_there_the_last_and_the_drops(
    monkeypatch, fold_every
):
    steps = [(T, T, F), (T, T, F), (F, T, F), (T, F, T), (T, T, F), (T, F, T), (T, T, F)]
    report = watched(steps, fold_every, monkeypatch).look()
    assert (report.step, report.loss_ranks, report.gradients) == (3, [0], False)
    assert (report.last_step, report.dropped) == (6, 2)


@pytest.mark.parametrize("fold_every", [1024, 2])
def test_gradients_bad_at_the_first_bad_step_and_no_drops_under_stop(monkeypatch, fold_every):
    report = watched([(T, T, None), (T, F, None), (F, F, None)], fold_every, monkeypatch).look()
    assert (report.step, report.loss_ranks, report.gradients) == (2, [], True)
    assert (report.last_step, report.dropped) == (3, 0)


def test_nothing_bad_no_report_and_a_look_starts_afresh(monkeypatch):
    watch = watched([(T, T, F)] * 5, 2, monkeypatch)
    assert watch.look() is None
    add(watch, 6, F, T, F)
    assert watch.look().step == 6
    add(watch, 7, T, T, F)
    assert watch.look() is None  # step 6 was reported by the look before


class _Clock:
    """time.perf_counter for the exchange: `step_s` seconds per step."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.step = step_s, 0

    def __call__(self) -> float:
        return self.step * self.step_s


@pytest.mark.parametrize(("step_s", "apart"), [(0.005, 50), (0.0001, 64), (0.2, 1)])
def test_exchanges_are_spaced_by_time_and_a_signal_is_agreed_within_two_of_them(
    monkeypatch, step_s, apart
):
    """Steps of 5 ms: an exchange every 50 steps (0.25 s), and logging steps; a stop requested
    at step 130 is agreed at most two exchanges later. Slow steps: every step."""
    clock = _Clock(step_s)
    monkeypatch.setattr(stopping.time, "perf_counter", clock)
    requests = StopRequests([])
    exchange = SignalExchange(DistEnv(), requests)
    exchanged, agreed_at = [], None
    for step in range(1, 400):
        clock.step = step
        if step == 130:
            requests.signal_name = "SIGTERM"
        before = exchange.pending
        if exchange.exchange(step, logging=step % 100 == 0) == "SIGTERM" and agreed_at is None:
            agreed_at = step
        if exchange.pending is not before:
            exchanged.append(step)
    # Between two exchanges that are not logging steps (the first ones measure the steps).
    steady = [b - a for a, b in zip(exchanged, exchanged[1:], strict=False) if a > 3 and b % 100]
    assert set(steady) == {apart}
    assert all(step in exchanged for step in (100, 200, 300))  # logging steps
    assert 130 < agreed_at <= 130 + 2 * apart
