"""`uv run pytest` alone runs the quick tests; --all, a -m or -k expression, --lf or named paths
run the slow ones too (tests/conftest.py, README: Tests). The bare command is checked through a
pytest of its own, on two workers as pyproject.toml's addopts start it: the choice is made where
the command is typed and must reach the workers, which collect and run. The other command lines
are only collected, by pytest.main in this process: the same arguments parsed into the same
config by the same conftest, without a new interpreter importing torch (4 s a case)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

SLOW_FILE = "tests/distributed/test_versions.py"
SLOW_TEST = SLOW_FILE + "::test_fsdp_averages_gradients_over_gloo_ranks_in_every_supported_torch"
QUICK_TEST = "tests/unit/test_versions.py::test_release_reads_local_and_vendor_versions"
# The suite's whole collection stands in for these two files: one slow test, and quick ones.
TWO_FILES = ["-o", f"testpaths={SLOW_FILE} tests/unit/test_versions.py"]
# Outside the rootdir pytest collects the folder it was started in, not testpaths: there, the
# files named test_versions.py stand in for every test file (the same two).
TWO_FILES_BY_NAME = ["-o", "python_files=test_versions.py"]
LEFT_OUT = "The slow tests (multi-process, end to end) were left out: `uv run pytest --all`"


@dataclass
class Collected:
    """What a user sees of a pytest command: its exit code and its output."""

    returncode: int
    stdout: str


def common_options(tmp_path: Path) -> list[str]:
    return ["-o", f"cache_dir={tmp_path / 'cache'}", "-rA", *TWO_FILES]


def pytest_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m pytest ARGS` in the repository's root, in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", *common_options(tmp_path), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def collect(tmp_path, capsys, monkeypatch):
    """`pytest -n 0 --collect-only -q ARGS` typed in `cwd`, run by pytest.main here."""

    def run(*args: str, cwd: Path = REPO) -> Collected:
        monkeypatch.chdir(cwd)  # where the command is typed: testpaths apply in the rootdir only
        capsys.readouterr()
        options = [*common_options(tmp_path), "-n", "0", "--collect-only", "-q"]
        returncode = pytest.main([*options, *args])
        return Collected(int(returncode), capsys.readouterr().out)

    return run


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
def test_all_an_expression_or_a_named_path_runs_the_slow_tests(collect, asked):
    result = collect(*asked)
    assert result.returncode == 0, result.stdout[-3000:]
    assert SLOW_TEST in result.stdout
    assert LEFT_OUT not in result.stdout


def test_the_bare_command_in_a_subfolder_leaves_them_out_too(collect):
    result = collect(*TWO_FILES_BY_NAME, cwd=REPO / "tests")
    assert result.returncode == 0, result.stdout[-3000:]
    assert QUICK_TEST in result.stdout
    assert SLOW_TEST not in result.stdout
    assert LEFT_OUT in result.stdout
