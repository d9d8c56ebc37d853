"""init.format: how a file's tensor names and layouts map onto a model's (docs/weights.md says
what a key map for another architecture needs). `auto`: the names are the model's own (a run of
this framework, its export, or a file written from the same module)."""

from __future__ import annotations

from typing import Protocol

import torch


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


class SameNames:
    """The file's names and layouts are the model's."""

    def name_in_model(self, name: str) -> str | None:
        return name

    def shape_in_model(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape

    def tensor_in_model(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


KEY_MAPS: dict[str, KeyMap] = {"auto": SameNames()}
