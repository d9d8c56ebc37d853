"""The suite's time, reported at the end of every run with the slow tests (`--all`, as CI runs
it): worker seconds per file, and each test over its allowance in tests/time_budget.toml (a test
it does not name has the default). Reported, not asserted: a loaded machine must not turn CI
red; the next addition that breaks the budget shows itself in the lines printed."""

from __future__ import annotations

import tomllib
from collections import defaultdict
from pathlib import Path

BUDGET_FILE = Path(__file__).with_name("time_budget.toml")
SHOWN_FILES = 12


def read_budget() -> tuple[float, dict[str, float]]:
    budget = tomllib.loads(BUDGET_FILE.read_text())
    return float(budget["default_s"]), {k: float(v) for k, v in budget["tests"].items()}


def allowance_of(test: str, default: float, named: dict[str, float]) -> float:
    """A parametrized test's allowance is its function's (each case on its own)."""
    return named.get(test, named.get(test.split("[", 1)[0], default))


class TimeBudget:
    """A pytest plugin: setup, call and teardown of each test, as the process reporting them
    sees them (with pytest-xdist, the controller: every worker's tests)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report) -> None:
        self.spent[report.nodeid] += report.duration

    def lines(self) -> list[str]:
        default, named = read_budget()
        files: dict[str, float] = defaultdict(float)
        for test, seconds in self.spent.items():
            files[test.split("::", 1)[0]] += seconds
        lines = [f"worker seconds per file (of {sum(files.values()):.0f} s in all):"]
        for name, seconds in sorted(files.items(), key=lambda item: -item[1])[:SHOWN_FILES]:
            lines.append(f"  {seconds:6.1f} s  {name}")
        over = [
            (test, seconds, allowance)
            for test, seconds in self.spent.items()
            if seconds > (allowance := allowance_of(test, default, named))
        ]
        for test, seconds, allowance in sorted(over, key=lambda item: item[2] - item[1]):
            lines.append(f"over its time budget: {test}: {seconds:.1f} s, allowed {allowance:g}")
        return lines
