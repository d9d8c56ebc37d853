"""What the hardware is doing: model FLOPs per optimizer step (counted once per run), achieved
TFLOP/s and MFU against the device's peak, and peak memory per rank.

The FLOPs are counted by `torch.utils.flop_counter.FlopCounterMode` over one forward and
backward of the task's loss on one micro-batch, on a fresh copy of the model (on the meta
device where the model and task allow, else on the real device), so the trained model, its
optimizer and the RNG streams are never touched. One micro-batch's count x micro-batches per
step x ranks = the FLOPs of one optimizer step of the whole job. Matmuls and convolutions
(what the counter knows) are counted; element-wise work is not, as in the usual MFU definition.

MFU = achieved FLOP/s / (ranks x one device's peak). The peak comes from `trainer.peak_tflops`,
else from `PEAK_TFLOPS` by the GPU's name and the precision; on a CPU, or an unknown GPU, no MFU
is logged unless `trainer.peak_tflops` is set.
"""

from __future__ import annotations

import contextlib
import logging
import re
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from framework.components.tasks import Task

log = logging.getLogger("framework")

# Dense (no sparsity) peak TFLOP/s of one device, (bf16, fp16, fp32), from the vendors'
# datasheets (NVIDIA's "with sparsity" tensor figures halved; fp32 is the non-tensor-core rate,
# what torch's default fp32 matmuls use). First matching pattern (case-insensitive, on
# torch.cuda.get_device_name) wins. bf16 is 0 where the device has no bf16 tensor cores.
PEAK_TFLOPS: list[tuple[str, str, tuple[float, float, float]]] = [
    # (pattern, name shown in the log, (bf16, fp16, fp32))
    (r"H100.*NVL", "H100 NVL", (835.0, 835.0, 60.0)),
    (r"H100.*PCIe", "H100 PCIe", (756.5, 756.5, 51.2)),
    (r"H100", "H100 SXM", (989.4, 989.4, 66.9)),
    (r"H200.*NVL", "H200 NVL", (835.0, 835.0, 60.0)),
    (r"H200", "H200 SXM", (989.4, 989.4, 66.9)),
    (r"GH200", "GH200", (989.4, 989.4, 66.9)),
    (r"A100", "A100", (312.0, 312.0, 19.5)),
    (r"L40S", "L40S", (362.05, 362.05, 91.6)),
    (r"\bL40\b", "L40", (181.0, 181.0, 90.5)),
    (r"\bL4\b", "L4", (121.0, 121.0, 30.3)),
    (r"\bA10\b", "A10", (125.0, 125.0, 31.2)),
    (r"RTX A6000", "RTX A6000", (154.8, 154.8, 38.7)),
    (r"V100S", "V100S PCIe", (0.0, 130.0, 16.4)),
    (r"V100.*PCIE", "V100 PCIe", (0.0, 112.0, 14.0)),
    (r"V100", "V100 SXM2", (0.0, 125.0, 15.7)),
    (r"\bT4\b", "T4", (0.0, 65.0, 8.1)),
    (r"RTX 4090", "GeForce RTX 4090", (165.2, 165.2, 82.6)),
    (r"RTX 3090", "GeForce RTX 3090", (71.0, 71.0, 35.6)),
]
# precision=<option> -> the column of PEAK_TFLOPS its matmuls run at.
PRECISION_COLUMN = {"bf16": 0, "amp": 1, "fp32": 2}
MIB = 2**20


def table_peak_tflops(device_name: str, precision: str) -> tuple[str, float] | None:
    """(the table's name for the device, its dense peak TFLOP/s at this precision), or None
    when the device is not in the table (or lacks that precision's tensor cores)."""
    column = PRECISION_COLUMN.get(precision)  # None: a precision option of your own
    for pattern, name, peaks in PEAK_TFLOPS:
        if column is not None and re.search(pattern, device_name, flags=re.IGNORECASE):
            return (name, peaks[column]) if peaks[column] > 0 else None
    return None


def device_peak_tflops(
    configured: float | None, device: torch.device, precision: str
) -> float | None:
    """One device's peak TFLOP/s for MFU: `configured` (trainer.peak_tflops) if set, else the
    table's for this GPU and precision; None (no MFU) on a CPU or a GPU the table lacks."""
    if configured is not None:
        log.info("MFU against trainer.peak_tflops=%g TFLOP/s per device", configured)
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    found = table_peak_tflops(name, precision)
    if found is None:
        log.info(
            "no MFU: %s at precision=%s is not in the peak table "
            "(framework/components/utilization.py); set trainer.peak_tflops",
            name,
            precision,
        )
        return None
    log.info("MFU against %s's dense %s peak, %g TFLOP/s per device", found[0], precision, found[1])
    return found[1]


def count_flops(task: Task, module: nn.Module, batch: Any) -> int:
    """FLOPs of one forward and backward of the task's loss on `batch` (what FlopCounterMode
    counts: matmuls, convolutions, attention)."""
    with FlopCounterMode(display=False) as counter:
        task.loss(module, batch).total.backward()
    return int(counter.get_total_flops())


def micro_batch_flops(
    task: Task,
    build_module: Callable[[], nn.Module],
    batch: Any,
    device: torch.device,
    to_device: Callable[[Any, torch.device], Any],
) -> tuple[int | None, str]:
    """One micro-batch's FLOPs on a fresh model from `build_module` (never the trained one), and
    where they were counted: on the meta device (no memory, no compute) where the model and
    the task run there, else on `device` with the real batch. None (and why) if neither could
    run it: the run goes on without tflops_per_s and mfu. The caller keeps the RNG streams
    unchanged around it."""
    try:
        with torch.device("meta"):
            module = build_module()
        return count_flops(task, module.train(), to_device(batch, torch.device("meta"))), "meta"
    except (NotImplementedError, RuntimeError, TypeError, ValueError) as error:
        log.info("FLOPs counted on %s: the meta device cannot run this (%s)", device, _line(error))
    try:
        with torch.device(device):
            module = build_module()
        flops = count_flops(task, module.train(), to_device(batch, device))
    except Exception as error:  # noqa: BLE001 (a metric must not end the run)
        log.warning(
            "FLOPs not counted (%s): no tflops_per_s or mfu is logged; trainer.count_flops=false "
            "skips the count",
            _line(error),
        )
        return None, _line(error)
    finally:
        module = None
        if device.type == "cuda":  # the copy's memory is no part of training's peak
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    return flops, device.type


def _line(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:200]


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory so far, in MiB: tensors allocated on the GPU
    (torch.cuda.max_memory_allocated, a host-side counter: no device sync), else resident
    memory (VmHWM, the peak RSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MIB
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / MIB  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB  # kB on Linux


class UtilizationMeter:
    """The logging step's hardware metrics: achieved TFLOP/s and MFU over the log window, and
    every rank's peak memory, which travels to rank 0 on the logging step's one all-reduce
    (`memory_rider`: each rank fills its own slot)."""

    def __init__(
        self,
        step_flops: int | None,  # FLOPs of one optimizer step of the whole job; None: not counted
        peak_tflops: float | None,  # one device's peak; None: no MFU
        device: torch.device,
        rank: int,
        world_size: int,
    ) -> None:
        self.step_flops, self.peak_tflops = step_flops, peak_tflops
        self.device, self.rank, self.world_size = device, rank, world_size

    def memory_rider(self) -> torch.Tensor:
        """[0, ..., this rank's peak MiB, ..., 0]: summed over the ranks, every rank's value."""
        rider = torch.zeros(self.world_size, dtype=torch.float64)
        rider[self.rank] = peak_memory_mib(self.device)
        if self.device.type == "cuda":  # pinned, the copy waits for no device work
            rider = rider.pin_memory()
        return rider.to(self.device, non_blocking=True)

    def metrics(self, steps: int, seconds: float, memory_mib: list[float]) -> dict[str, float]:
        """A log window of `steps` optimizer steps in `seconds`, and every rank's peak memory
        (`memory_mib`, by rank)."""
        metrics: dict[str, float] = {}
        if self.step_flops is not None and seconds > 0:
            tflops = self.step_flops * steps / seconds / 1e12
            metrics["tflops_per_s"] = tflops
            if self.peak_tflops:
                metrics["mfu"] = tflops / (self.world_size * self.peak_tflops)
        if memory_mib:
            most = max(range(len(memory_mib)), key=memory_mib.__getitem__)
            metrics["memory/peak_mib_max"] = memory_mib[most]
            metrics["memory/peak_mib_min"] = min(memory_mib)
            metrics["memory/peak_mib_max_rank"] = most
        return metrics

    def summary(self, steps: int, seconds: float) -> dict[str, float]:
        """The run's FLOPs per step, and its TFLOP/s and MFU over all of its training time."""
        if self.step_flops is None:
            return {}
        summary: dict[str, float] = {"flops_per_step": self.step_flops}
        return {**summary, **self.metrics(steps, seconds, [])}
