"""A rank out of memory: one line from that rank, its own exit code from the whole job
(framework/core/exits.py)."""

from __future__ import annotations

import torch

from framework.core.exits import ExitCode, Outcome, OutOfMemory, outcome_of, root_cause


def host_allocation_failure() -> RuntimeError:
    """What torch's CPU allocator raises when the OS refuses (a real one: a tensor larger than
    any address space)."""
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as error:
        return error
    raise AssertionError("the allocation succeeded")


def test_a_rank_out_of_memory_prints_one_line_and_exits_5():
    outcome = outcome_of(host_allocation_failure(), rank=3)
    assert outcome.code == ExitCode.OUT_OF_MEMORY == 5
    (line,) = outcome.printed.splitlines()
    assert line.startswith(f"error: rank 3 ran out of memory (it asked for {2**62 / 2**20:.1f} MiB")
    assert "strategy=fsdp shards the parameters" in line
    assert outcome.reason == line.removeprefix("error: ")


def test_the_launcher_exits_5_and_repeats_nothing_the_rank_said():
    said = outcome_of(host_allocation_failure(), rank=1).reason
    cause = root_cause([ExitCode.PEER_LOST, ExitCode.OUT_OF_MEMORY], messages={1: said})
    assert isinstance(cause, OutOfMemory) and str(cause) == said
    assert outcome_of(cause) == Outcome(ExitCode.OUT_OF_MEMORY, printed=None, reason=None)
