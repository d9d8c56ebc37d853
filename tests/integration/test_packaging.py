"""The framework as a dependency, outside the clone: the wheel (with conf/ and experiments/ inside
it) installed into a fresh environment runs `train` from an empty folder, and a project written
by `framework-new` passes its own test right after creation, and a project that already pins the
oldest supported torch adds the framework and keeps that torch. They use uv as a user would; the
packages come from uv's cache or the package registry."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from framework.core.versions import FLOORS
from tests.conftest import DIST_ENV_VARS, REPO

pytestmark = pytest.mark.slow

UV = os.environ.get("UV") or shutil.which("uv")


# This checkout's venv, test run and job variables, and PYTHONDONTWRITEBYTECODE: these machines
# set it, and a fresh venv holds no bytecode, so every process of every command here would
# compile torch's modules again.
NOT_A_SHELLS = {
    *DIST_ENV_VARS,
    "VIRTUAL_ENV",
    "PYTHONPATH",
    "UV_PROJECT_ENVIRONMENT",
    "PYTHONDONTWRITEBYTECODE",
}


def user_env() -> dict[str, str]:
    """A shell's environment: none of NOT_A_SHELLS."""
    return {
        name: value
        for name, value in os.environ.items()
        if name not in NOT_A_SHELLS and not name.startswith(("PYTEST_", "FRAMEWORK_"))
    }


def run(
    *command: str | Path, cwd: Path, timeout: float = 600, **more_env: str
) -> subprocess.CompletedProcess:
    started = time.perf_counter()
    result = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env={**user_env(), **more_env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    # The times the README quotes: `pytest -s` shows them.
    print(f"{time.perf_counter() - started:6.1f} s  {' '.join(map(str, command))[:120]}")
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding only the wheel built from this checkout and its dependencies (at
    uv.lock's versions, so they come from uv's cache). Returns the venv's bin folder."""
    if UV is None:
        pytest.skip("uv is not on PATH")
    root = tmp_path_factory.mktemp("wheel")
    built = run(UV, "build", "--wheel", "--out-dir", root / "dist", REPO, cwd=root)
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (root / "dist").glob("framework-*.whl")
    pins = root / "pins.txt"
    export = ["export", "--frozen", "--no-dev", "--no-hashes", "--no-emit-project"]
    exported = run(UV, *export, "--project", REPO, "--output-file", pins, cwd=root)
    assert exported.returncode == 0, exported.stderr[-3000:]
    venv = root / "venv"
    created = run(UV, "venv", "--python", sys.executable, venv, cwd=root)
    assert created.returncode == 0, created.stderr[-3000:]
    python = venv / "bin" / "python"
    install = run(UV, "pip", "install", "--python", python, wheel, "-c", pins, cwd=root)
    assert install.returncode == 0, install.stderr[-3000:]
    return venv / "bin"


def test_the_installed_wheel_trains_from_an_empty_folder(installed, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    where = run(
        installed / "python", "-c", "import framework; print(framework.__file__)", cwd=empty
    )
    assert Path(where.stdout.strip()).is_relative_to(installed.parent)  # not the clone
    result = run(installed / "train", "trainer.max_steps=2", "hydra.run.dir=run", cwd=empty)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((empty / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["world_size"] == 2
    assert "done: val/accuracy=" in result.stderr.strip().splitlines()[-1]
    assert sorted(p.name for p in empty.iterdir()) == ["run"]


def test_the_installed_wheel_ships_every_preset_and_option(installed, tmp_path):
    result = run(installed / "train", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    presets = sorted(path.stem for path in (REPO / "experiments").glob("*.yaml"))
    assert f"experiment: {', '.join(presets)}" in result.stdout
    models = sorted(path.stem for path in (REPO / "conf" / "model").glob("*.yaml"))
    assert f"model: {', '.join(models)}" in result.stdout
    composed = run(installed / "train", "experiment=diabetes_mlp", "--cfg", "job", cwd=tmp_path)
    assert composed.returncode == 0, composed.stderr[-3000:]
    assert "_target_: framework.components.data.diabetes" in composed.stdout


def test_framework_new_from_the_wheel_depends_on_that_wheel(installed, tmp_path):
    result = run(installed / "framework-new", tmp_path / "from-wheel", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    pyproject = (tmp_path / "from-wheel" / "pyproject.toml").read_text()
    assert "framework = { path = " in pyproject and ".whl" in pyproject


def test_a_new_project_passes_its_own_test(tmp_path):
    """`framework-new` outside the clone, then `uv run pytest` in the new folder: uv makes the
    project's venv (the framework built from this checkout as a path dependency) and the
    project's tests train 2 steps on 2 ranks (its own data, and its own streamed data through
    its own transform and collate) and refuse a misspelt key of its own."""
    if UV is None:
        pytest.skip("uv is not on PATH")
    assert not tmp_path.is_relative_to(REPO)
    project = tmp_path / "sine-lab"
    created = run(Path(sys.executable).parent / "framework-new", project, cwd=tmp_path)
    assert created.returncode == 0, created.stderr[-3000:]
    # The project's own resolution takes the newest releases its ranges allow (torch from PyPI,
    # newer than this checkout is tested on, downloaded anew); the lock's versions instead.
    pins = tmp_path / "pins.txt"
    export = ["export", "--frozen", "--no-hashes", "--no-emit-project"]
    exported = run(UV, *export, "--project", REPO, "--output-file", pins, cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    test = ["run", "pytest", "-q", "-p", "no:cacheprovider"]
    result = run(UV, *test, cwd=project, timeout=900, UV_CONSTRAINT=str(pins))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "3 passed" in result.stdout


def test_a_project_on_a_clone_of_the_framework_runs_its_next_commit_without_a_reinstall(tmp_path):
    """A project that `framework-new` wrote against a clone: after a `git pull` there (a new
    commit), the project's next `uv run` runs the new code (pyproject.toml: cache-keys)."""
    if UV is None or shutil.which("git") is None:
        pytest.skip("uv or git is not on PATH")
    clone = tmp_path / "framework"
    cloned = run("git", "clone", "--quiet", REPO, clone, cwd=tmp_path)
    assert cloned.returncode == 0, cloned.stderr[-3000:]
    project = tmp_path / "lab"
    new = run(
        Path(sys.executable).parent / "framework-new", "--framework", clone, project, cwd=tmp_path
    )
    assert new.returncode == 0, new.stderr[-3000:]
    pins = tmp_path / "pins.txt"
    export = ["export", "--frozen", "--no-hashes", "--no-emit-project"]
    assert run(UV, *export, "--project", REPO, "--output-file", pins, cwd=tmp_path).returncode == 0
    probe = ("run", "python", "-c", "import framework.pulled; print(framework.pulled.COMMIT)")
    before = run(UV, *probe, cwd=project, UV_CONSTRAINT=str(pins))
    assert before.returncode == 1 and "No module named 'framework.pulled'" in before.stderr

    (clone / "framework" / "pulled.py").write_text("COMMIT = 'pulled'\n")
    git = ("git", "-c", "user.name=a", "-c", "user.email=a@example.org")
    assert run(*git, "add", "framework/pulled.py", cwd=clone).returncode == 0
    assert run(*git, "commit", "--quiet", "-m", "a pulled commit", cwd=clone).returncode == 0
    after = run(UV, *probe, cwd=project, UV_CONSTRAINT=str(pins))
    assert after.returncode == 0, after.stderr[-3000:]
    assert after.stdout.strip() == "pulled"


def test_adding_the_framework_keeps_the_older_torch_a_project_already_has(tmp_path):
    """A project that pins the oldest supported torch (a cluster's, a container's) adds the
    framework with `uv add`: the lock keeps that torch, and `train` runs on it."""
    if UV is None:
        pytest.skip("uv is not on PATH")
    (major, minor), (vision_major, vision_minor) = FLOORS["torch"], FLOORS["torchvision"]
    older = (f"torch=={major}.{minor}.0", f"torchvision=={vision_major}.{vision_minor}.0")
    project = tmp_path / "lab"
    init = run(UV, "init", "--package", "--python", sys.executable, project, cwd=tmp_path)
    assert init.returncode == 0, init.stderr[-3000:]
    own = run(UV, "add", *older, cwd=project)
    assert own.returncode == 0, own.stderr[-3000:]
    added = run(UV, "add", REPO, cwd=project)
    assert added.returncode == 0, added.stderr[-3000:]
    versions = run(
        UV,
        "run",
        "python",
        "-c",
        "import importlib.metadata as m; print(m.version('torch'), m.version('torchvision'))",
        cwd=project,
    )
    assert versions.stdout.split() == [f"{major}.{minor}.0", f"{vision_major}.{vision_minor}.0"]
    trained = run(UV, "run", "train", "trainer.max_steps=2", "hydra.run.dir=run", cwd=project)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert json.loads((project / "run" / "summary.json").read_text())["steps"] == 2
