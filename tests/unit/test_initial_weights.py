"""init=file's matching of a file's names to a model's, on a small module and real safetensors
files: regular-expression renames, strict=false, and an index that would name a file elsewhere
(the CLI's view is tests/integration/test_initial_weights.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from framework.components.initial_weights import FromFile
from framework.core.exits import CheckpointError, ConfigError


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def loaded(module: nn.Module, path, **settings) -> nn.Module:
    given = {"format": "auto", "rename": {}, "skip": [], "strict": True, **settings}
    plan = FromFile(str(path), **given).plan(module)
    module.load_state_dict(plan.tensors(), strict=False)
    return module


def test_a_regular_expression_renames_the_files_names(tmp_path):
    source = model()
    tensors = {f"layers.{key}": value for key, value in source.state_dict().items()}
    save_file(tensors, tmp_path / "model.safetensors")
    torch.manual_seed(1)
    target = loaded(
        nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)),
        tmp_path / "model.safetensors",
        rename={r"^layers\.(\d+)\.": r"\1."},
    )
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value)


def test_strict_false_loads_what_fits_and_leaves_the_rest_as_built(tmp_path):
    source = model()
    save_file({"0.weight": source[0].weight, "extra": torch.ones(2)}, tmp_path / "m.safetensors")
    with pytest.raises(ConfigError, match="3 missing from the file: 0.bias, 2.bias, 2.weight"):
        loaded(
            nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), tmp_path / "m.safetensors"
        )
    torch.manual_seed(5)
    target = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    built = {key: value.clone() for key, value in target.state_dict().items()}
    loaded(target, tmp_path / "m.safetensors", strict=False)
    assert torch.equal(target[0].weight, source[0].weight)
    assert torch.equal(target[2].weight, built["2.weight"])


def test_an_index_that_names_a_file_outside_its_folder_is_refused(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"0.weight": torch.zeros(4, 3)}, tmp_path / "elsewhere.safetensors")
    index = {"weight_map": {"0.weight": "../elsewhere.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="names a file that is not a plain name"):
        loaded(model(), folder)
