"""init=file under strategy=fsdp on 2 ranks: each rank reads only its own rows of each tensor
from the safetensors file (half of each here), and the sharded model evaluates exactly as the
whole one loaded under ddp does."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hydra.utils import instantiate
from safetensors.torch import save_file

from tests.conftest import make_cfg

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
GPT = (
    "experiment=char_gpt",
    "model.layers=1",
    "model.width=256",
    "data.block_size=16",
    "data.stride=16",
    "trainer.eval_batches=1",
)
MIB = 2**20


def held_mib(output: str) -> float:
    return float(re.search(r"at most ([0-9.]+) MiB of them held at once", output)[1])


def test_fsdp_ranks_read_their_own_rows_and_evaluate_as_the_whole_model(cli, tmp_path):
    torch.manual_seed(3)
    model = instantiate(make_cfg(*GPT).model)
    tensors = {key: value.clone() for key, value in model.state_dict().items()}
    save_file(tensors, tmp_path / "model.safetensors")
    largest = max(tensor.nbytes for tensor in tensors.values())
    summaries, held = {}, {}
    for strategy, ranks in (("ddp", 1), ("fsdp", 2)):
        cwd = tmp_path / strategy
        cwd.mkdir()
        result = cli(
            *GPT,
            "mode=eval",
            f"strategy={strategy}",
            f"launcher.nproc_per_node={ranks}",
            "init=file",
            f"init.path={tmp_path / 'model.safetensors'}",
            cwd=cwd,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        [summary] = cwd.glob("outputs/eval/*/summary.json")
        summaries[strategy] = json.loads(summary.read_text())
        held[strategy] = held_mib(result.stderr + result.stdout)
    assert summaries["fsdp"]["val/loss"] == pytest.approx(summaries["ddp"]["val/loss"], rel=1e-6)
    whole = sum(tensor.nbytes for tensor in tensors.values()) / MIB
    assert held["ddp"] == pytest.approx(whole, abs=0.01)
    # each rank held at most half of the largest tensor at once (its rows), never the model
    assert held["fsdp"] == pytest.approx(largest / 2 / MIB, abs=0.01)
    assert held["fsdp"] < whole / 4
