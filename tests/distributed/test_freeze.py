"""optimizer.freeze under real 2-rank gloo jobs: frozen parameters keep their values bit for bit,
the others train, and DDP needs no find_unused_parameters for them; the start-up lines say what
each parameter group holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from framework.storage.export import export
from tests.conftest import make_cfg, train_in_process

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TWO_RANKS = ("launcher.nproc_per_node=2", "model.width=4", "data.batch_size=8")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A 2-step run's weights, exported to safetensors."""
    root = tmp_path_factory.mktemp("pretrained")
    train_in_process(make_cfg(*TWO_RANKS, "trainer.max_steps=2"), root / "run")
    export(root / "run" / "checkpoints" / "last.pt", root / "model.safetensors")
    return root / "model.safetensors"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_frozen_trunk_keeps_its_values_bit_for_bit_on_two_ranks(tmp_path, pretrained, strategy):
    before = load_file(pretrained)
    run = tmp_path / "fine-tuned"
    cfg = make_cfg(
        *TWO_RANKS,
        f"strategy={strategy}",
        "checkpoint.format=file",
        "trainer.max_steps=4",
        "init=file",
        f"init.path={pretrained}",
        "optimizer.freeze=[features.*]",
        "dist.ddp.find_unused_parameters=false",
    )
    train_in_process(cfg, run)
    after = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["model"]
    for key, value in before.items():
        if key.startswith("features."):
            assert torch.equal(after[key], value), key
        else:
            assert not torch.equal(after[key], value), key
    log = (run / "train.log").read_text()
    assert "group 0: 90 parameters in 2 tensors (lr=0.1, weight_decay=0.0005)" in log, log
    assert "frozen: 920 parameters in 6 tensors" in log, log


def test_a_freeze_pattern_that_matches_nothing_is_refused():
    from framework.rank.preflight import preflight

    with pytest.raises(Exception, match="optimizer.freeze: trunk.\\* matches no parameter"):
        preflight(make_cfg(*TWO_RANKS, "optimizer.freeze=[trunk.*]"), 2)
