"""`uv run pytest` alone runs the quick tests; --all, a -m or -k expression, --lf or named paths
run the slow ones too (tests/conftest.py, README: Tests). Checked through pytest itself, on two
workers as pyproject.toml's addopts start it: the choice is made where the command is typed and
must reach the workers, which collect and run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

SLOW_FILE = "tests/distributed/test_versions.py"
SLOW_TEST = SLOW_FILE + "::test_fsdp_averages_gradients_over_gloo_ranks_in_every_supported_torch"
QUICK_TEST = "tests/unit/test_versions.py::test_release_reads_local_and_vendor_versions"
# The suite's whole collection stands in for these two files: one slow test, and quick ones.
TWO_FILES = ["-o", f"testpaths={SLOW_FILE} tests/unit/test_versions.py"]
LEFT_OUT = "The slow tests (multi-process, end to end) were left out: `uv run pytest --all`"


def pytest_run(tmp_path: Path, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    cache = ["-o", f"cache_dir={tmp_path / 'cache'}"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", *cache, "-rA", *TWO_FILES, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def ran(result: subprocess.CompletedProcess[str], test: str) -> bool:
    return any(line.startswith("PASSED " + test) for line in result.stdout.splitlines())


def test_the_bare_command_runs_the_quick_tests_on_its_workers_and_says_what_it_left_out(tmp_path):
    result = pytest_run(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 workers" in result.stdout
    assert ran(result, QUICK_TEST)
    assert SLOW_TEST not in result.stdout
    assert LEFT_OUT in result.stdout


@pytest.mark.parametrize(
    "asked", [["--all"], ["-m", "slow or not slow"], ["-k", "fsdp"], ["--lf"], [SLOW_FILE]]
)
def test_all_an_expression_or_a_named_path_runs_the_slow_tests(tmp_path, asked):
    result = pytest_run(tmp_path, "-n", "0", "--collect-only", "-q", *asked)
    assert result.returncode == 0, result.stdout[-3000:]
    assert SLOW_TEST in result.stdout
    assert LEFT_OUT not in result.stdout


def test_the_bare_command_in_a_subfolder_leaves_them_out_too(tmp_path):
    """Outside the rootdir pytest collects the folder it was started in, not testpaths: the
    whole tests/ folder here, so only collected."""
    result = pytest_run(tmp_path, "-n", "0", "--collect-only", "-q", cwd=REPO / "tests")
    assert result.returncode == 0, result.stdout[-3000:]
    assert QUICK_TEST in result.stdout
    assert SLOW_TEST not in result.stdout
    assert LEFT_OUT in result.stdout
