"""init.format: how a file's tensor names and layouts map onto a model's (docs/weights.md says
what a key map for another architecture needs). `auto`: the names are the model's own (a run of
this framework, its export, or a file written from the same module); `hf_gpt2`: Hugging Face's
GPT-2 (GPT2LMHeadModel's save_pretrained) onto framework.components.models.GPT, and back for
framework-export --format hf_gpt2."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from framework.core.exits import ConfigError


class KeyMap(Protocol):
    """A file's names and layouts onto the model's, one tensor at a time."""

    def name_in_model(self, name: str) -> str | None:
        """The model key the file's tensor `name` fills; None for a name that carries no weight
        (a cached mask): it is left out."""
        ...

    def shape_in_model(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape the tensor has once tensor_in_model has laid it out (read before it is)."""
        ...

    def tensor_in_model(self, name: str, tensor: torch.Tensor) -> torch.Tensor: ...

    def rows_in_file(self, name: str) -> int:
        """The file's dimension that holds the model's first one (FSDP shards that one)."""
        ...

    def check_model(self, path: Path, module: nn.Module) -> None:
        """What the names cannot show: the file's own description of the model (its
        config.json) against `module`; ConfigError naming the setting to change."""
        ...


class SameNames:
    """The file's names and layouts are the model's."""

    def name_in_model(self, name: str) -> str | None:
        return name

    def shape_in_model(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape

    def tensor_in_model(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def rows_in_file(self, name: str) -> int:
        return 0

    def check_model(self, path: Path, module: nn.Module) -> None:
        return None


# GPT-2's names (below `transformer.`) -> the shipped GPT's. Per block: h.<i>.<GPT-2's> ->
# blocks.<i>.<ours>.
GPT2_TOP = {
    "wte.weight": "tokens.weight",
    "wpe.weight": "positions.weight",
    "ln_f.weight": "norm.weight",
    "ln_f.bias": "norm.bias",
}
GPT2_BLOCK = {
    "ln_1": "norm1",
    "attn.c_attn": "qkv",
    "attn.c_proj": "proj",
    "ln_2": "norm2",
    "mlp.c_fc": "mlp.0",
    "mlp.c_proj": "mlp.2",
}
# GPT-2's Conv1D layers keep their weight as [in, out], nn.Linear as [out, in].
GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
GPT2_BLOCK_NAME = re.compile(r"h\.(\d+)\.(.+)\.(weight|bias)")
# Buffers older transformers saved: a cached causal mask, no weight.
GPT2_MASKS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")


class HuggingFaceGPT2:
    """GPT2LMHeadModel's tensors onto framework.components.models.GPT (model.activation=
    gelu_tanh, dropout as you like): the names below, Conv1D weights transposed, and the output
    head tied to the token embedding (lm_head.weight, where a file holds it, fills head.weight,
    which is the same tensor)."""

    def name_in_model(self, name: str) -> str | None:
        name = name.removeprefix("transformer.")
        if name == "lm_head.weight":
            return "head.weight"
        if GPT2_MASKS.fullmatch(name):
            return None
        if name in GPT2_TOP:
            return GPT2_TOP[name]
        found = GPT2_BLOCK_NAME.fullmatch(name)
        if found and found.group(2) in GPT2_BLOCK:
            index, layer, kind = found.groups()
            return f"blocks.{index}.{GPT2_BLOCK[layer]}.{kind}"
        return name  # not GPT-2's: named as it is, unexpected unless init.rename maps it

    def shape_in_model(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[::-1] if _is_conv1d_weight(name) else shape

    def tensor_in_model(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.t().contiguous() if _is_conv1d_weight(name) else tensor

    def rows_in_file(self, name: str) -> int:
        return 1 if _is_conv1d_weight(name) else 0

    def check_model(self, path: Path, module: nn.Module) -> None:
        """GPT-2's config.json beside the weights names its activation: the model's GELU must
        be the same one (the shapes would fit either way, the logits would not)."""
        config = (path if path.is_dir() else path.parent) / "config.json"
        try:
            wanted = json.loads(config.read_text()).get("activation_function")
        except (OSError, ValueError, AttributeError):
            return
        approximate = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
        ours = {m.approximate for m in module.modules() if isinstance(m, nn.GELU)}
        if wanted in approximate and ours and ours != {approximate[wanted]}:
            setting = "gelu_tanh" if approximate[wanted] == "tanh" else "gelu"
            raise ConfigError(
                f"init.format=hf_gpt2: {config} says activation_function={wanted}, and the "
                f"model's GELU is another: set model.activation={setting}"
            )

    def name_in_file(self, key: str) -> str | None:
        """The inverse, for framework-export --format hf_gpt2: None for the tied head (GPT-2's
        files leave lm_head.weight out)."""
        if key == "head.weight":
            return None
        top = {ours: theirs for theirs, ours in GPT2_TOP.items()}
        if key in top:
            return f"transformer.{top[key]}"
        block = {ours: theirs for theirs, ours in GPT2_BLOCK.items()}
        found = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", key)
        if found is None or found.group(2) not in block:
            raise ValueError(f"{key} is not a key of framework.components.models.GPT")
        index, layer, kind = found.groups()
        return f"transformer.h.{index}.{block[layer]}.{kind}"

    def tensor_in_file(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.t().contiguous() if _is_conv1d_weight(name) else tensor


def _is_conv1d_weight(name: str) -> bool:
    return name.endswith(".weight") and any(f".{layer}." in name for layer in GPT2_CONV1D)


KEY_MAPS: dict[str, KeyMap] = {"auto": SameNames(), "hf_gpt2": HuggingFaceGPT2()}
