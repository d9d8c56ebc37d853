"""Hugging Face GPT-2 both ways, proven by logits, without a download: a small randomly
initialised transformers.GPT2LMHeadModel saved with save_pretrained starts a model=gpt run
(init.format=hf_gpt2) with the same logits, and framework-export --format hf_gpt2 writes a
fine-tuned run back into a folder transformers loads, with the same logits again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from framework.components.initial_weights import FromFile
from framework.components.models import GPT
from framework.core.exits import ConfigError
from framework.storage.export import export_hf_gpt2, main
from tests.conftest import make_cfg, train_in_process

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
SIZES = {"vocab_size": 128, "block_size": 16, "layers": 2, "heads": 4, "width": 32}
TOKENS = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def hugging_face_folder(tmp_path_factory) -> Path:
    """GPT2LMHeadModel.save_pretrained of a small random GPT-2 (config.json, model.safetensors)."""
    torch.manual_seed(1)
    config = transformers.GPT2Config(
        vocab_size=SIZES["vocab_size"],
        n_positions=SIZES["block_size"],
        n_layer=SIZES["layers"],
        n_head=SIZES["heads"],
        n_embd=SIZES["width"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
        # Weights large enough that the exact GELU's logits miss GPT-2's by 1.2e-3 (at 0.02,
        # GPT-2's own, by 1.6e-6: inside the tolerance); the tanh GELU's by 1.2e-6.
        initializer_range=0.2,
    )
    folder = tmp_path_factory.mktemp("hf") / "gpt2-small-random"
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def hugging_face_logits(folder: Path) -> torch.Tensor:
    model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def loaded_gpt(folder: Path, activation: str = "gelu_tanh") -> GPT:
    """The shipped GPT given the folder's weights as a rank gives them (init=file's plan)."""
    model = GPT(**SIZES, dropout=0.0, activation=activation).eval()
    plan = FromFile(str(folder), format="hf_gpt2", rename={}, skip=[], strict=True).plan(model)
    model.load_state_dict(plan.tensors(), strict=False)
    return model


def test_a_hugging_face_gpt2_gives_the_shipped_gpt_its_logits(hugging_face_folder):
    with torch.no_grad():
        ours = loaded_gpt(hugging_face_folder)(TOKENS)
    theirs = hugging_face_logits(hugging_face_folder)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert ours.abs().max() > 0.1  # (not two zero outputs)


def test_the_exact_gelu_is_refused_naming_the_setting(hugging_face_folder):
    with pytest.raises(ConfigError, match="set model.activation=gelu_tanh"):
        loaded_gpt(hugging_face_folder, activation="gelu")


def test_a_run_fine_tuned_from_gpt2_exports_back_to_the_same_logits_in_transformers(
    tmp_path, hugging_face_folder, capsys
):
    cfg = make_cfg(
        "experiment=char_gpt",
        "launcher.nproc_per_node=1",
        "trainer.max_epochs=null",
        "trainer.max_steps=2",
        "trainer.eval_batches=1",
        *(f"model.{key}={SIZES[key]}" for key in ("layers", "heads", "width")),
        "data.block_size=16",
        "data.stride=16",
        "model.activation=gelu_tanh",
        "init=file",
        f"init.path={hugging_face_folder}",
        "init.format=hf_gpt2",
    )
    train_in_process(cfg, tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoints" / "last.pt"
    main(["--format", "hf_gpt2", str(checkpoint), str(tmp_path / "exported")])
    assert "tensors" in capsys.readouterr().out
    fine_tuned = GPT(**SIZES, dropout=0.0, activation="gelu_tanh").eval()
    fine_tuned.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
    with torch.no_grad():
        ours = fine_tuned(TOKENS)
    torch.testing.assert_close(hugging_face_logits(tmp_path / "exported"), ours, rtol=0, atol=1e-5)
    assert not torch.allclose(ours, hugging_face_logits(hugging_face_folder))  # it trained
    # And the exported folder starts a run again (init.format=hf_gpt2 reads its own export).
    with torch.no_grad():
        torch.testing.assert_close(loaded_gpt(tmp_path / "exported")(TOKENS), ours, rtol=0, atol=0)


def test_a_checkpoint_of_another_model_is_refused_by_the_gpt2_export(tmp_path):
    train_in_process(make_cfg("launcher.nproc_per_node=1", "trainer.max_steps=1"), tmp_path / "r")
    with pytest.raises(Exception, match="export it without --format"):
        export_hf_gpt2(tmp_path / "r" / "checkpoints" / "last.pt", tmp_path / "out")
