"""trainer.channels_last and trainer.compile change speed, not what is learned; how ranks and
their fork server start and end."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from torch.utils.data import DataLoader, Dataset

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
    them waits for it; tearing down an interpreter with torch loaded took 1.3 s. Its atexit
    handlers run; what only the interpreter's teardown would finalize does not."""
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
    assert (tmp_path / "atexit").exists()
    assert not (tmp_path / "teardown").exists()
