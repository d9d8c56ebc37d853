"""trainer.channels_last and trainer.compile change speed, not what is learned; how ranks and
their fork server start and end."""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import subprocess
import sys
import weakref

import pytest
from torch.utils.data import DataLoader, Dataset

from framework.core import heap
from tests.conftest import REPO, TINY, make_cfg, start_ranks, train_losses, train_many

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_channels_last_and_compile_learn_what_the_eager_default_learns(tmp_path):
    base = (*TINY, "model=cnn", "model.width=8", "trainer.max_steps=6")
    variants = {
        "eager": (),
        "channels_last": ("trainer.channels_last=true",),
        "compile": ("trainer.compile=true",),
        "fsdp_compile": ("strategy=fsdp", "trainer.compile=true"),  # the sharded model compiled
    }
    jobs = [(make_cfg(*base, *extra), tmp_path / name) for name, extra in variants.items()]
    summaries = dict(zip(variants, train_many(jobs), strict=True))
    eager = train_losses(tmp_path / "eager")
    for name in ("channels_last", "compile", "fsdp_compile"):
        assert train_losses(tmp_path / name) == pytest.approx(eager, rel=1e-4), name
        assert summaries[name]["val/accuracy"] == pytest.approx(
            summaries["eager"]["val/accuracy"], abs=0.02
        )


class _ParentPids(Dataset):
    """Each item: the pid of the process that started the DataLoader worker reading it."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        return os.getppid()


def _read_with_two_workers(rank: int) -> None:
    parents = [int(pid) for pid in DataLoader(_ParentPids(), batch_size=1, num_workers=2)]
    assert parents == [os.getpid()] * 2, "workers did not fork from the rank"


def test_a_ranks_data_loader_workers_fork_from_the_rank_instead_of_importing_torch_again():
    """Ranks are forked from the launcher's fork server, whose start method a child inherits:
    each rank's workers would come from a new fork server that imports torch from scratch."""
    start_ranks(_read_with_two_workers, ())


def _page_faults_per_step_of_a_heap_step(rank: int) -> None:
    """A step's worth of heap blocks (40 of 1 MB, below glibc's mmap threshold), written and
    freed as a training step's activations are, repeated: the repeats fault no page in."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

    def step(blocks: int = 40, size: int = 1 << 20) -> None:
        pointers = [libc.malloc(size) for _ in range(blocks)]
        for pointer in pointers:
            libc.memset(pointer, 1, size)
        for pointer in reversed(pointers):
            libc.free(pointer)

    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    per_step = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
    # glibc's defaults trim the 40 MB and fault them in again: about 10,000 faults a step here.
    assert per_step < 100, f"{per_step:.0f} page faults a step: the heap gave the step back"


def test_a_rank_keeps_what_a_step_frees_for_the_next_step_instead_of_faulting_it_in_again():
    """framework/core/heap.py keep_freed_heap: a step that frees its blocks at the top
    of glibc's heap got them trimmed and faulted in again, or not, by chance of the heap's
    layout: our ranks' run-to-run spread (docs/benchmarks.md)."""
    start_ranks(_page_faults_per_step_of_a_heap_step, (), nprocs=1)


class _Cycle:
    def __init__(self) -> None:
        self.itself = self


def _collects_its_own_garbage_and_not_the_stacks(rank: int) -> None:
    """In a forked rank: the server's imports walked by no pass and frozen, the collector on for
    what the rank makes; the same for a module imported for good here, once."""
    young_passes = gc.get_stats()[0]["collections"]  # (the server's, inherited)
    assert young_passes < 200, f"{young_passes} passes: the server's imports were collected"
    stack_frozen = gc.get_freeze_count()
    assert gc.isenabled(), "a rank forked from the fork server runs without its collector"
    assert stack_frozen > 100_000, f"{stack_frozen} objects frozen: the server's imports are not"
    cycle = _Cycle()
    freed = weakref.ref(cycle)
    del cycle
    for _ in range(100):  # (allocations that start the collector's first generation's passes)
        [[] for _ in range(1000)]
    assert freed() is None, "a rank's cyclic garbage outlived the collector's passes"

    assert not {"tabnanny", "netrc"} & set(sys.modules)  # (modules no rank imports)
    heap.import_for_good("tabnanny")
    assert gc.isenabled() and (module_frozen := gc.get_freeze_count()) > stack_frozen
    heap.import_for_good("tabnanny")  # imported already: what lives since is not frozen
    assert gc.get_freeze_count() == module_frozen
    gc.disable()
    heap.import_for_good("netrc")
    assert not gc.isenabled(), "import_for_good turned on a collector the process had off"


def test_a_rank_collects_its_own_garbage_but_never_walks_the_training_stacks_objects():
    """The fork server imports the stack with the collector paused; each process forked from it
    freezes what it inherits (launch/forkserver.py), as a rank that imports the
    stack itself does (heap.import_for_good): passes over those objects were a fifth of an
    import, and touched pages shared since the fork."""
    start_ranks(_collects_its_own_garbage_and_not_the_stacks, (), nprocs=1)


TEARDOWN_PROBE = """
import atexit, os, pathlib
OUT = pathlib.Path(os.environ["PROBE_DIR"])
atexit.register(lambda: (OUT / "atexit").write_text("ran"))
class Probe:
    def __del__(self):
        (OUT / "teardown").write_text("ran")
probe = Probe()
"""
STARTS_A_SERVER = """
import multiprocessing, os
from framework.launch import forkserver
forkserver.PRELOAD = ["framework.launch.forkserver", "teardown_probe"]
forkserver.warm_up()
child = multiprocessing.get_context("forkserver").Process(target=os.getpid)
child.start()
child.join()
"""


def test_the_fork_server_leaves_without_an_interpreter_teardown_once_its_launcher_is_gone(
    tmp_path,
):
    """The server holds the launcher's stdout and stderr until it is gone, so a caller reading
    them waits for it; tearing down an interpreter with torch loaded took 1.3 s. It ends either
    by its atexit handler (it saw the launcher close first) or by the kernel's SIGKILL when the
    launcher dies (PR_SET_PDEATHSIG), whichever comes first: never by a teardown."""
    (tmp_path / "teardown_probe.py").write_text(TEARDOWN_PROBE)
    env = {
        **os.environ,
        "PROBE_DIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
    }
    # Returns once every holder of the pipes (the script and its fork server) has exited.
    result = subprocess.run(
        [sys.executable, "-c", STARTS_A_SERVER],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "teardown").exists()
