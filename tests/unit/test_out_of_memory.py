"""A rank out of memory: one line from that rank, its own exit code from the whole job
(framework/core/exits.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
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


@pytest.mark.parametrize(
    "said",
    [
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    ],
)
def test_a_gpu_library_that_cannot_allocate_is_out_of_memory_too(said):
    """cuBLAS and cuDNN say so in their own words when a full GPU refuses their allocations
    (torch's messages for them, as on a GPU: none here to fill)."""
    outcome = outcome_of(RuntimeError(said), rank=1)
    assert outcome.code == ExitCode.OUT_OF_MEMORY
    assert outcome.printed.startswith("error: rank 1 ran out of memory (")


def test_the_launcher_says_once_what_the_ranks_told_it_and_exits_5():
    said = outcome_of(host_allocation_failure(), rank=1).reason
    cause = root_cause([ExitCode.OUT_OF_MEMORY, ExitCode.OUT_OF_MEMORY], messages={1: said})
    assert isinstance(cause, OutOfMemory) and str(cause) == said
    assert outcome_of(cause) == Outcome(ExitCode.OUT_OF_MEMORY, printed=f"error: {said}")
    # A rank that could not tell it printed its line: the launcher repeats nothing.
    untold = root_cause([ExitCode.PEER_LOST, ExitCode.OUT_OF_MEMORY])
    assert outcome_of(untold) == Outcome(ExitCode.OUT_OF_MEMORY, printed=None, reason=None)


def test_a_constructor_refusing_its_settings_is_a_config_mistake_but_a_lost_peer_is_not():
    """settings_refused turns what a constructor says of its settings into one line, exit 2;
    an allocation that fails, a peer that vanished or a bug keep their own exits."""
    import pytest
    from omegaconf import OmegaConf

    from framework.core.exits import ConfigError
    from framework.rank.build import settings_refused

    node = OmegaConf.create({"_target_": "torch.nn.Linear", "in_features": -1, "out_features": 2})
    with pytest.raises(ConfigError) as refused, settings_refused("model", node):
        raise ValueError("in_features must be positive")  # (the line RAISED_AT names)
    said = str(refused.value)
    assert said.startswith(
        "model: torch.nn.Linear(in_features=-1, out_features=2) refused its settings: "
        "ValueError: in_features must be positive (raised at "
    )
    assert said.endswith("test_out_of_memory.py:" + str(RAISED_AT) + "): check model's settings")
    kept = [
        RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234"),  # exit 3
        RuntimeError("Timed out waiting 30000ms for recv"),  # exit 4
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8"),
        NameError("name 'widht' is not defined"),  # a bug: its traceback
    ]
    for error in kept:
        with pytest.raises(type(error)), settings_refused("model", node):
            raise error


RAISED_AT = next(
    number
    for number, line in enumerate(Path(__file__).read_text().splitlines(), 1)
    if line.endswith("# (the line RAISED_AT names)")
)
