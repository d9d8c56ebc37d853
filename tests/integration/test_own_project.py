"""A user's own project, as `train` sees it when run from the project's folder: its conf/ joins
the shipped groups (in `--help` too), its package imports in every rank without PYTHONPATH, and
its data option's own keys are typed by the loader's signature (a typo or a wrong type is
refused before the run dir exists)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from framework.components.data import load_splits
from framework.core.exits import ExitCode
from tests.conftest import DIST_ENV_VARS, SHADOWING_MODULE, plant_shadowing_modules

LOADER = '''
import torch
from torch.utils.data import TensorDataset

from framework.components.data import Splits


def load(size: int = 96, noise: float = 0.1, seed: int = 0) -> Splits:
    """No **kwargs: the framework's own keys (batch_size, ...) must not reach it."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(size, 1, 4, 4, generator=generator)
    labels = (images.sum(dim=(1, 2, 3)) + noise * torch.randn(size, generator=generator) > 0)
    cut = size * 2 // 3
    return Splits(
        TensorDataset(images[:cut], labels[:cut].long()),
        TensorDataset(images[cut:], labels[cut:].long()),
    )
'''
DATA_OPTION = """defaults:
  - /schema/data/base@_here_
  - _self_
_target_: own_pkg.data.load
batch_size: 8
in_channels: 1
image_size: 4
num_classes: 2
size: 96
noise: 0.1
"""
EXPERIMENT = """# @package _global_
defaults:
  - override /data: own
  - override /model: mlp
allowed_targets: [own_pkg]
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project folder: own_pkg/ (a loader) beside conf/ (data=own, experiment=own, and a group
    of its own), as `framework-new` lays one out, without installing anything."""
    (tmp_path / "own_pkg").mkdir()
    (tmp_path / "own_pkg" / "__init__.py").write_text("")
    (tmp_path / "own_pkg" / "data.py").write_text(LOADER)
    for relative, text in {
        "data/own.yaml": DATA_OPTION,
        "experiment/own.yaml": EXPERIMENT,
        "augment/flip.yaml": "probability: 0.5\n",
    }.items():
        path = tmp_path / "conf" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.fixture
def own_pkg_importable(project: Path, monkeypatch) -> None:
    """In this process the console script's working-dir import does not apply (the tests call
    framework.train.main): the parent's key check imports the loader."""
    monkeypatch.syspath_prepend(str(project))


def test_help_lists_the_projects_options_and_groups_beside_the_shipped_ones(cli, project):
    result = cli("--help", cwd=project)
    assert result.returncode == 0, result.stderr
    groups = result.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "data: cifar10, diabetes, digits, own, synthetic, text, text_stream" in groups
    presets = "char_gpt, cifar10_resnet18, diabetes_mlp, digits_cnn, digits_finetune, digits_vae"
    assert f"experiment: {presets}, own" in groups
    assert "augment: flip" in groups


def test_an_option_hidden_by_a_shipped_one_of_the_same_name_is_refused(cli, project):
    """Hydra takes the first option of a name on the search path, the shipped one: the
    project's model/mlp.yaml would never be read."""
    (project / "conf" / "model" / "mlp.yaml").parent.mkdir()
    (project / "conf" / "model" / "mlp.yaml").write_text("hidden_sizes: [7]\n")
    result = cli("trainer.max_steps=1", cwd=project)
    assert result.returncode == ExitCode.CONFIG_REJECTED, result.stderr[-3000:]
    assert result.stderr.strip() == (
        f"error: file://{project.resolve()}/conf/model/mlp.yaml is hidden: model=mlp picks "
        "the shipped option of that name; rename yours"
    )
    assert not (project / "outputs").exists()


@pytest.mark.usefixtures("own_pkg_importable")
@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "data.noize=0.3",
            "error: data.noize is not a setting of own_pkg.data.load: did you mean data.noise?",
        ),
        (
            "+data.sise=8",
            "error: data.sise is not a setting of own_pkg.data.load: did you mean data.size?",
        ),
        (
            "data.noise=abc",
            "error: data.noise='abc' is not of type float: own_pkg.data.load takes noise: float",
        ),
        ("data.size=1.5", "error: data.size=1.5 is not of type int"),
    ],
)
def test_a_mistake_in_an_own_data_key_is_refused_before_the_run_dir(
    cli, project, override, message
):
    result = cli("experiment=own", override, cwd=project)
    assert result.returncode == ExitCode.CONFIG_REJECTED, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]  # one line
    assert result.stderr.startswith(message), result.stderr
    assert not (project / "outputs").exists()


@pytest.mark.usefixtures("own_pkg_importable")
def test_a_loader_without_kwargs_is_called_with_the_keys_it_names():
    """The framework's keys (batch_size, in_channels, ...) stay out: load() would raise."""
    node = OmegaConf.create(DATA_OPTION)
    del node["defaults"]  # (Hydra's, not a key)
    node.size = 48
    splits = load_splits(node)
    assert (len(splits.train), len(splits.val)) == (32, 16)


@pytest.mark.slow
def test_the_projects_own_keys_reach_its_loader_in_two_ranks_without_pythonpath(project):
    """The `train` console script itself (`python -m` would put the working dir on the path
    anyway): own_pkg imports only because the working dir is the project's, and the project's
    re.py, numbers.py and random.py are not what the launcher and its ranks import. data.size=96
    gives 64 training samples, 4 steps of 2 ranks x 8 per epoch; the loader takes no **kwargs,
    so batch_size must not reach it."""
    plant_shadowing_modules(project)
    run_dir = project / "run"
    env = {k: v for k, v in os.environ.items() if k not in {*DIST_ENV_VARS, "PYTHONPATH"}}
    command = [
        str(Path(sys.executable).parent / "train"),
        "experiment=own",
        "data.size=96",
        "trainer.max_epochs=1",
        f"hydra.run.dir={run_dir}",
    ]
    result = subprocess.run(
        command, cwd=project, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert SHADOWING_MODULE not in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["world_size"] == 2
    assert 0 <= summary["val/accuracy"] <= 1
