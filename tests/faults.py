"""Faults injected into real training processes, for the fault-tolerance tests.

FRAMEWORK_TEST_FAULT=<kind>:<rank>:<step> makes that rank act at its <step>-th training
forward (1-based; with grad_accum=1 that is optimizer step <step>):
  nan             its loss turns NaN
  hang            it sleeps (outside any collective) until killed
  kill            SIGKILL to itself; only in the first attempt of a torchrun job
  slow            it sleeps 0.3 s at this and every later step (time to act on a running job)
  hold            at this and every later step it waits while the file FRAMEWORK_TEST_GATE
                  names exists, until a stop signal comes (the test paces the job)
  SIGxxx          that signal to itself
  parent-SIGxxx   that signal to its launcher (`train`, or the torchrun agent)
  group-SIGINT    SIGINT to its whole process group, as a terminal's Ctrl-C does
  busy-SIGKILL    it makes the DataLoader workers of data=gated_synthetic busy with their next
                  items (they take a minute each while FRAMEWORK_TEST_GATE's file exists), and
                  gets SIGKILL a second later, as from the memory killer
The variable is read when the model is built, so a resumed run without it runs clean.
"""

from __future__ import annotations

import os
import random
import resource
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from framework.components.data import Splits, synthetic
from framework.components.models import GPT, MLP

FAULT_ENV = "FRAMEWORK_TEST_FAULT"
GATE_ENV = "FRAMEWORK_TEST_GATE"


class _Faults:
    """Counts training forwards and says when the fault in FRAMEWORK_TEST_FAULT is due."""

    def _init_faults(self) -> None:
        # A copy built on the meta device (the FLOP count's) acts no fault: only the trained model.
        on_meta = any(parameter.is_meta for parameter in self.parameters())
        self.fault = None if on_meta else os.environ.get(FAULT_ENV)
        self.calls = 0
        if self.fault and self.fault.split(":")[2] == "0":  # step 0: as the model is built
            _act(self.fault.split(":")[0])

    def _fault_due(self) -> str | None:
        """The fault's kind when this training forward is where it acts, else None."""
        self.calls += 1
        if not self.fault:
            return None
        kind, rank, step = self.fault.split(":")
        this_rank = dist.get_rank() if dist.is_initialized() else 0
        due = self.calls >= int(step) if kind in ("slow", "hold") else self.calls == int(step)
        return kind if this_rank == int(rank) and due else None


class FaultyMLP(_Faults, MLP):
    """framework.components.models.MLP plus input noise from all three RNGs (python, numpy, torch
    dropout), so a resume that restores any stream wrongly changes the losses; and the injected
    fault."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_faults()

    def forward(self, x):
        if self.training:
            noise = (random.random() + float(np.random.rand())) * 1e-3
            x = F.dropout(x + noise, p=0.1)
            kind = self._fault_due()
            if kind == "nan":
                return super().forward(x) * float("nan")
            if kind:
                _act(kind)
        return super().forward(x)


class SteadyMLP(_Faults, MLP):
    """framework.components.models.MLP and the injected fault, without FaultyMLP's noise: its
    losses depend only on which samples each step sees, not on which rank drew which random
    numbers (a job that changes its number of ranks is compared with one that does not)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_faults()

    def forward(self, x):
        if self.training and (kind := self._fault_due()):
            _act(kind)
        return super().forward(x)


class HostReadingMLP(FaultyMLP):
    """FaultyMLP whose forward reads a value on the host, which the meta device cannot give:
    the FLOP count then runs on the real device (framework/components/utilization.py)."""

    def forward(self, x):
        if float(x.abs().amax()) < 0:  # never true: only the host read matters
            x = -x
        return super().forward(x)


class FaultyGPT(_Faults, GPT):
    """framework.components.models.GPT (with dropout: the torch stream matters on resume) and the
    injected fault, for exact-resume tests of the language model."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_faults()

    def forward(self, tokens):
        if self.training and (kind := self._fault_due()):
            _act(kind)
        return super().forward(tokens)


MEMORY_CAP_ENV = "FRAMEWORK_TEST_MEMORY_CAP_MIB"


class MemoryCappedGPT(GPT):
    """framework.components.models.GPT in a rank whose memory is capped: its first construction
    in the process (on the meta device under strategy=fsdp) sets RLIMIT_DATA (private writable
    memory: the heap and anonymous mappings, where tensors live) to what the rank holds now plus
    FRAMEWORK_TEST_MEMORY_CAP_MIB. Every later allocation past that fails as on a full host."""

    def __init__(self, *args, **kwargs) -> None:
        cap_memory_once()
        super().__init__(*args, **kwargs)


_capped: list[int] = []


def cap_memory_once() -> None:
    budget = os.environ.get(MEMORY_CAP_ENV)
    if not budget or _capped:
        return
    # torch's autograd engine sets up its device threads once, at a process's first backward;
    # in an FSDP rank on the CPU that made 8 of them, each a stack mapping of 8 MiB that
    # RLIMIT_DATA counts though nothing touches it (64 MiB). One backward here, before the cap
    # (in a thread of its own: the meta device's recording of the constructor is this
    # thread's), leaves that to the runtime, as its libraries are, and the cap to what the
    # model and its steps hold.
    warm_up = threading.Thread(target=lambda: torch.ones(1, requires_grad=True).sum().backward())
    warm_up.start()
    warm_up.join()
    with open("/proc/self/status") as status:
        held_kib = next(int(line.split()[1]) for line in status if line.startswith("VmData:"))
    cap = held_kib * 1024 + int(budget) * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    _capped.append(cap)


def _act(kind: str) -> None:
    if kind == "busy-SIGKILL":
        Path(os.environ[GATE_ENV]).touch()
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return
    if kind == "slow":
        time.sleep(0.3)
        return
    if kind == "hold":
        _hold()
        return
    if kind == "hang":
        while True:
            time.sleep(3600)
    if kind == "kill":
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        return
    if kind.startswith("parent-"):
        os.kill(_launcher(), getattr(signal, kind.removeprefix("parent-")))
    elif kind.startswith("group-"):
        os.killpg(os.getpgrp(), getattr(signal, kind.removeprefix("group-")))
    else:
        os.kill(os.getpid(), getattr(signal, kind))
    time.sleep(0.2)  # let the signal land before this step's agreement


def _hold() -> None:
    """Wait while the gate file exists; a stop signal (the elastic agent stopping the ranks to
    restart them) ends the wait, so the rank can save and stop."""
    from framework.rank.stopping import received_signals

    gate = os.environ[GATE_ENV]
    while os.path.exists(gate) and not received_signals():
        time.sleep(0.05)


def _launcher() -> int:
    """The process that started this rank: its parent, or for a rank forked from a fork server
    (launcher=local), the server's parent."""
    parent = os.getppid()
    with open(f"/proc/{parent}/cmdline", "rb") as cmdline:
        forked = b"multiprocessing.forkserver" in cmdline.read()
    if not forked:
        return parent
    with open(f"/proc/{parent}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    """The model's and the EMA's final weights, from the final checkpoint."""
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    ema = {f"ema.{k}": v for k, v in (saved["ema"] or {}).items()}
    return {**saved["model"], **ema}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ: {different}"


class GatedItems(torch.utils.data.Dataset):
    """A dataset whose items take a minute each while FRAMEWORK_TEST_GATE's file exists: a
    slow file system or decoder, which keeps a DataLoader worker busy inside an item."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int):
        if os.path.exists(os.environ.get(GATE_ENV, "")):
            time.sleep(60)
        return self.dataset[index]


def gated_synthetic(
    train_size: int, val_size: int, in_channels: int, image_size: int, num_classes: int, seed: int
) -> Splits:
    """data=synthetic, its training items behind the gate (GatedItems)."""
    splits = synthetic(train_size, val_size, in_channels, image_size, num_classes, seed)
    return Splits(train=GatedItems(splits.train), val=splits.val)
