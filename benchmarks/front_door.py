"""What the command does in the user's process before it answers or runs: the framework's modules
it loads (and their lines), and how many times it composes the config (Hydra's
ConfigLoaderImpl.load_configuration calls, each sweep job's included), for a refused key typo, a
single run and a 2-job sweep of the default experiment. Counted by a sitecustomize the command
is started with (nothing of the framework is changed); whole commands, from an empty folder.

    uv run python -m benchmarks front_door
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import table, write_result

TRAIN = str(Path(sys.executable).with_name("train"))
COMMANDS = {
    "refused key typo": ["optimizer.lrr=0.1"],
    "single run": ["trainer.max_steps=2"],
    "2-job sweep": ["-m", "optimizer.lr=0.1,0.05", "trainer.max_steps=2"],
}
# Counts of each interpreter started with it, written at its exit, whichever way it leaves, in a
# file named by its pid: the command's own is the one measured (the fork server is another).
COUNTER = """
import atexit, json, os, sys

_pid, _composed = os.getpid(), []


def _count() -> None:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    compose = ConfigLoaderImpl.load_configuration

    def counted(self, *args, **kwargs):
        _composed.append(1)
        return compose(self, *args, **kwargs)

    ConfigLoaderImpl.load_configuration = counted


class _AfterHydraLoads:
    def find_spec(self, name, path=None, target=None):
        if name == "framework.app.composition":  # (imports Hydra's loader first)
            _count()
            sys.meta_path.remove(self)
        return None


def _report() -> None:
    if os.getpid() != _pid:
        return
    files = [
        m.__file__
        for n, m in list(sys.modules.items())
        if n.split(".")[0] == "framework" and getattr(m, "__file__", None)
    ]
    lines = sum(len(open(f).read().splitlines()) for f in files if f.endswith(".py"))
    with open(os.path.join(os.environ["FRONT_DOOR_OUT"], f"{_pid}.json"), "w") as out:
        json.dump({"modules": len(files), "lines": lines, "compositions": len(_composed)}, out)


sys.meta_path.insert(0, _AfterHydraLoads())
atexit.register(_report)
"""


def measured(name: str, arguments: list[str], scratch: Path) -> dict[str, Any]:
    folder = scratch / name.replace(" ", "-")
    folder.mkdir()
    (scratch / "sitecustomize.py").write_text(COUNTER)
    env = {**os.environ, "PYTHONPATH": str(scratch), "FRONT_DOOR_OUT": str(folder)}
    command = subprocess.Popen(
        [TRAIN, *arguments],
        cwd=folder,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = command.communicate(timeout=600)
    expected = 2 if name == "refused key typo" else 0
    if command.returncode != expected:
        raise RuntimeError(f"{name}: exit {command.returncode}\n{stderr[-2000:]}")
    counts = json.loads((folder / f"{command.pid}.json").read_text())
    return {"command": " ".join(["train", *arguments]), **counts}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argparse.ArgumentParser(prog="python -m benchmarks front_door").parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        counts = {name: measured(name, args, Path(scratch)) for name, args in COMMANDS.items()}
    rows = [
        [name, f"`{' '.join(COMMANDS[name])}`", c["modules"], f"{c['lines']:,}", c["compositions"]]
        for name, c in counts.items()
    ]
    headers = ["what", "arguments of `train`", "framework modules", "their lines", "compositions"]
    print(table(headers, rows))
    write_result("front_door", counts)
    return counts
