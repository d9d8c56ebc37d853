"""Variable-length token sequences (the lines of Python's help text), for the exactness test of
token-weighted losses: micro-batches then hold very different numbers of real tokens."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from framework.components.data import Splits, decode_ascii, text


class Lines(Dataset):
    """(inputs, next tokens) of each sample's own length, from 2 to `max_length` + 1 tokens."""

    def __init__(self, tokens: torch.Tensor, count: int, max_length: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(2, max_length + 1, (count,), generator=generator).tolist()
        starts = torch.randint(0, len(tokens) - max_length - 1, (count,), generator=generator)
        self.tokens, self.starts = tokens, starts.tolist()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[self.starts[index] : self.starts[index] + self.lengths[index] + 1]
        return window[:-1], window[1:]


def ragged_text(
    train_size: int = 256, val_size: int = 101, max_length: int = 24, **_: object
) -> Splits:
    windows = text(block_size=max_length, stride=max_length, val_fraction=0.1)
    tokens = torch.cat([windows.train.tokens, windows.val.tokens])
    return Splits(
        Lines(tokens, train_size, max_length, seed=0),
        Lines(tokens, val_size, max_length, seed=1),
        decode=decode_ascii,
    )
