"""The signals a run stops on, known to the launchers (which forward them to the ranks) and to the
ranks (which stop together on them: framework/rank/stopping.py)."""

from __future__ import annotations


def stop_signal_names(configured: list[str]) -> list[str]:
    """The signals a run stops on: trainer.stop_signals, and always SIGINT (Ctrl-C)."""
    return sorted({*configured, "SIGINT"})
