"""What the framework shipped is decided by content (conf/SHA256SUMS), never by folder: a
colleague's experiment dropped into a clone's experiments/ (or conf/) is a config like any other,
and meets the positive list of Hydra's node (docs/security.md, "Whose file is it")."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from framework.core.config_dir import present_files, recorded_digests, shipped_files
from tests.conftest import REPO

pytestmark = pytest.mark.slow
COPIED = ("framework", "conf", "experiments", "hydra_plugins")


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """This checkout's code and config files, as a fresh clone has them."""
    root = tmp_path_factory.mktemp("clone")
    for name in COPIED:
        shutil.copytree(
            REPO / name, root / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    return root


def train_in(clone: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "framework.cli", *args],
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(clone), "HOME": str(cwd)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def colleagues_experiment(clone: Path, name: str, hydra_node: str) -> None:
    text = f"# @package _global_\ntrainer:\n  max_steps: 2\nhydra:\n{hydra_node}"
    (clone / "experiments" / f"{name}.yaml").write_text(text)


# Each was a working attack while a file in experiments/ counted as shipped (its `hydra:` keys
# were part of the reference they were compared with). `{out}` is a folder outside the run dir.
ATTACKS = {
    "truncates_a_users_file": (
        "  job:\n    env_set:\n      _target_: builtins.open\n      file: {out}/victim.txt\n"
        "      mode: w\n  callbacks:\n    x: ${{hydra.job.env_set}}\n"
    ),
    "writes_a_file_outside_the_run_dir": (
        "  job:\n    env_set:\n      UP: {out}/planted.pth\n  job_logging:\n    handlers:\n"
        "      f:\n        class: logging.FileHandler\n"
        "        filename: ${{hydra.job.env_set.UP}}\n    root:\n      handlers: [f]\n"
    ),
    "copies_a_file_by_callback": (
        "  callbacks:\n    c:\n      _target_: shutil.copyfile\n      src: {out}/victim.txt\n"
        "      dst: {out}/planted.pth\n"
    ),
    "imports_a_module": (
        "  job:\n    env_set:\n      S: ext://planted_module.x\n  hydra_logging:\n    handlers:\n"
        "      console:\n        stream: ${{hydra.job.env_set.S}}\n"
    ),
    "moves_wandbs_files": "  job:\n    env_set:\n      WANDB_DIR: {out}/wandb\n",
}


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_colleagues_experiment_in_the_clone_meets_the_positive_list(clone, tmp_path, attack):
    out = tmp_path / "outside"
    out.mkdir()
    (out / "victim.txt").write_text("the user's data\n")
    # A module whose import would leave a mark: what `ext://` would import.
    (tmp_path / "planted_module.py").write_text(f"open({str(out / 'imported')!r}, 'w')\n")
    colleagues_experiment(clone, attack, ATTACKS[attack].format(out=out))
    try:
        run = train_in(
            clone, f"experiment={attack}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path
        )
    finally:
        (clone / "experiments" / f"{attack}.yaml").unlink()
    assert run.returncode == 2, run.stderr[-2000:]
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert run.stderr.startswith("error: hydra."), run.stderr
    assert sorted(path.name for path in out.iterdir()) == ["victim.txt"]
    assert (out / "victim.txt").read_text() == "the user's data\n"
    assert not (tmp_path / "run").exists()


def test_a_colleagues_experiment_that_keeps_to_the_positive_list_trains(clone, tmp_path):
    colleagues_experiment(clone, "fine", "  job:\n    env_set:\n      OMP_NUM_THREADS: '1'\n")
    try:
        run = train_in(
            clone,
            "experiment=fine",
            "launcher.nproc_per_node=1",
            f"hydra.run.dir={tmp_path / 'run'}",
            cwd=tmp_path,
        )
    finally:
        (clone / "experiments" / "fine.yaml").unlink()
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "run" / "checkpoints" / "step_00000002.pt").is_file()


def test_an_edited_shipped_option_is_no_longer_shipped_and_its_target_not_allowed(clone, tmp_path):
    """An edit of a shipped file makes it the user's: the `_target_` it names is no longer one
    the framework's own options name, and Hydra's node is judged without it."""
    option = clone / "conf" / "model" / "mlp.yaml"
    shipped = option.read_text()
    option.write_text(shipped.replace("framework.components.models.MLP", "shutil.rmtree", 1))
    try:
        run = train_in(clone, "model=mlp", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    finally:
        option.write_text(shipped)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "model._target_=shutil.rmtree" in run.stderr, run.stderr
    assert not (tmp_path / "run").exists()


def test_an_edited_primary_config_is_named_with_the_fix(clone, tmp_path):
    primary = clone / "conf" / "config.yaml"
    shipped = primary.read_text()
    primary.write_text(shipped + "\n# one line more\n")
    try:
        run = train_in(clone, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    finally:
        primary.write_text(shipped)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "config.yaml is not the file this framework shipped" in run.stderr, run.stderr
    assert "git checkout" in run.stderr
    assert not (tmp_path / "run").exists()


def test_the_manifest_records_every_committed_config_file_as_committed():
    """conf/SHA256SUMS is what git holds: a file added, dropped or edited in conf/ or
    experiments/ without `uv run python -m framework.core.config_dir` fails here."""
    tracked = subprocess.run(
        ["git", "ls-files", "conf", "experiments"], cwd=REPO, capture_output=True, text=True
    ).stdout.split()
    committed = {
        name.replace("experiments/", "conf/experiment/", 1).removeprefix("conf/")
        for name in tracked
        if name.endswith(".yaml")
    }
    fix = "record them with: uv run python -m framework.core.config_dir"
    assert set(recorded_digests()) == committed, fix
    assert set(shipped_files()) == set(present_files()) == committed, fix
