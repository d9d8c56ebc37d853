"""Counting what a training step reads back from the device (tests/distributed/test_host_syncs.py).

A read of a tensor the device computed makes the host wait for the device: `.item()`, `bool()`,
`int()`/`float()` (aten._local_scalar_dense, aten.is_nonzero, aten.item), a copy to the CPU, and
`.tolist()` / `.numpy()` (which bypass the dispatcher, so they are patched). Allowed: the
stop-signal flags of SignalExchange (they start on the host and travel on the CPU), and the data
pipeline's own host tensors (torch.utils.data draws its shuffling and seeds on the CPU). On a
CPU-only machine every tensor is on the CPU, so these are told apart by who reads them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.item.default}


def in_data_pipeline() -> bool:
    """Called from torch.utils.data (a sampler's permutation, a loader's seed): host work."""
    frame = sys._getframe(2)
    while frame is not None:
        if "torch/utils/data/" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class DeviceReads(TorchDispatchMode):
    def __init__(self, allowed: Callable[[torch.Tensor], bool]) -> None:
        super().__init__()
        self.allowed, self.reads = allowed, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS and not self.allowed(args[0]) and not in_data_pipeline():
            self.reads.append(func.name())
        if func in (aten._to_copy.default, aten.copy_.default):
            target = kwargs.get("device") if func is aten._to_copy.default else args[0].device
            source = args[0] if func is aten._to_copy.default else args[1]
            if (
                target is not None
                and torch.device(target).type == "cpu"
                and source.device.type != "cpu"
            ):
                self.reads.append(f"{func.name()} to cpu")
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting_reads(allowed: Callable[[torch.Tensor], bool]) -> Iterator[DeviceReads]:
    mode = DeviceReads(allowed)
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def patched(name: str):
        def read(tensor: torch.Tensor, *args, **kwargs):
            if not allowed(tensor) and not in_data_pipeline():
                mode.reads.append(f"Tensor.{name}")
            return originals[name](tensor, *args, **kwargs)

        return read

    for name in originals:
        setattr(torch.Tensor, name, patched(name))
    try:
        with mode:
            yield mode
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def watch_steps(runner_class, first: int, last: int, results: list) -> None:
    """Patch runner_class.train_step: from the start of step `first` to the start of step
    `last` (the steps, and the loop's work between them) reads are counted into `results`."""
    original = runner_class.train_step
    state: dict = {}

    def train_step(self, micro_batches):
        step = self.state.step + 1
        if step == first:
            buffers = {id(buffer) for buffer in self.signals.buffers}
            state["context"] = counting_reads(lambda tensor: id(tensor) in buffers)
            state["mode"] = state["context"].__enter__()
        if step == last and "context" in state:
            state["context"].__exit__(None, None, None)
            results.extend(state["mode"].reads)
        return original(self, micro_batches)

    runner_class.train_step = train_step
