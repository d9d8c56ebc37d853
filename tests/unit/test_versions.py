"""The supported torch range: declared once, checked before torch is imported, refused in one
line. Runs at both ends in CI (the lock's torch and the floor's)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from framework.core import versions
from framework.core.exits import ExitCode
from tests.conftest import REPO


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("2.8.0", (2, 8)),
        ("2.13.0+cu130", (2, 13)),
        ("2.8.0a0+5228986c39.nv25.06", (2, 8)),  # a vendor's pre-release build of 2.8
        ("2.10.0.dev20250101+rocm6.3", (2, 10)),
        ("unknown", None),
    ],
)
def test_release_reads_local_and_vendor_versions(version, expected):
    assert versions.release(version) == expected


@pytest.mark.parametrize(
    "installed", [{"torch": "2.8.0", "torchvision": "0.23.0"}, {"torch": "2.15.0"}, {"torch": None}]
)
def test_the_floor_a_newer_release_and_a_missing_package_pass(installed):
    assert versions.unsupported_packages(installed) is None


def test_an_older_torch_is_named_with_the_supported_range_in_one_line():
    said = versions.unsupported_packages({"torch": "2.7.1+cu126", "torchvision": "0.22.1"})
    assert said == (
        "torch 2.7.1+cu126, torchvision 0.22.1 is older than this framework supports: it needs "
        "torch >= 2.8 (tested 2.8 to 2.13); torchvision >= 0.23 (tested 0.23 to 0.28)"
    )


def test_this_environment_is_supported():
    """Whichever end of the range this suite runs on, `train` accepts it."""
    assert versions.unsupported_packages() is None, versions.unsupported_packages()


def test_pyproject_declares_the_floors_this_module_checks():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = dict(re.match(r"([\w-]+)(.*)", dep).groups() for dep in project["dependencies"])
    for package, (major, minor) in versions.FLOORS.items():
        assert declared[package] == f">={major}.{minor}", package


def test_the_lock_pins_the_newest_tested_releases():
    locked = tomllib.loads((REPO / "uv.lock").read_text())["package"]
    pinned = {entry["name"]: entry["version"] for entry in locked}
    for package, newest in versions.NEWEST_TESTED.items():
        assert pinned[package].startswith(f"{newest}."), (package, pinned[package])


def _fake_torch(folder: Path, version: str) -> None:
    """Metadata saying torch `version` is installed, and a package that fails if imported."""
    info = folder / f"torch-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (folder / "torch").mkdir()
    (folder / "torch" / "__init__.py").write_text("raise ImportError('torch was imported')\n")


def test_train_refuses_an_older_torch_in_one_line_before_importing_it(tmp_path):
    _fake_torch(tmp_path / "site", "2.7.1")
    assert importlib.metadata.version("torch") != "2.7.1"  # only the child sees the fake
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run(
        [sys.executable, "-m", "framework.cli", "trainer.max_steps=1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == ExitCode.CONFIG_REJECTED
    assert done.stderr.splitlines() == [
        "error: torch 2.7.1 is older than this framework supports: it needs torch >= 2.8 "
        "(tested 2.8 to 2.13)"
    ]
    assert not (tmp_path / "outputs").exists()
