"""A streamed data option (data=__project___stream): text files read from disk in windows by the
framework's stream (framework/components/data_stream.py: sharded over ranks and DataLoader
workers, each window read once per epoch, resumed exactly mid-epoch on any number of ranks),
through a transform and a collate of this project's own."""

import torch

from framework.components.data import Splits, TokenWindows, decode_ascii
from framework.components.data_stream import (
    TextStream,
    ascii_tokens,
    file_text,
    matched_files,
    stable_order,
)

NEWLINE, SPACE = 10, 32


def whole_lines(window: torch.Tensor) -> dict[str, torch.Tensor]:
    """The transform: a window of tokens cut after its last line's end, so that every sample
    ends where a line does (a window without a newline stays whole)."""
    ends = torch.nonzero(window[1:] == NEWLINE).flatten()
    if len(ends):
        window = window[: int(ends[-1]) + 2]
    return {"inputs": window[:-1], "targets": window[1:]}


class WholeLines(TextStream):
    """The training split: the framework's stream, each window through whole_lines."""

    def sample(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        return whole_lines(tokens)


class WholeLineWindows(TokenWindows):
    """The validation split, held in memory: the held-out files' windows through whole_lines."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        start = index * self.stride
        return whole_lines(self.tokens[start : start + self.block_size + 1])


class PadToBlock:
    """The collate (data.collate_fn): samples of different lengths padded to `length` tokens,
    inputs with spaces and targets with `ignore_index` (no loss, not counted)."""

    def __init__(self, length: int, ignore_index: int = -100) -> None:
        self.length, self.ignore_index = length, ignore_index

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        inputs = torch.full((len(samples), self.length), SPACE)
        targets = torch.full((len(samples), self.length), self.ignore_index)
        for row, sample in enumerate(samples):
            inputs[row, : len(sample["inputs"])] = sample["inputs"]
            targets[row, : len(sample["targets"])] = sample["targets"]
        return {"inputs": inputs, "targets": targets}


def text_lines(
    files: str, block_size: int, stride: int, val_files: int, shuffle_buffer: int
) -> Splits:
    """This signature is the schema of the option's own keys (conf/data/__project___stream.yaml).
    `files`: a glob of text files under this folder (or under a folder $FRAMEWORK_DATA_DIRS
    names); the first `val_files` of them in a stable order are the validation split."""
    corpus = matched_files(files)
    if len(corpus) <= val_files:
        raise ValueError(
            f"data.files={files} matches {len(corpus)} files, and data.val_files={val_files} of "
            "them are for validation: give more files"
        )
    held_out = stable_order(corpus)[:val_files]
    val_tokens = torch.cat([ascii_tokens(file_text(path, "text").whole()) for path in held_out])
    training = sorted(set(corpus) - set(held_out))
    return Splits(
        train=WholeLines(training, block_size, stride, shuffle_buffer),
        val=WholeLineWindows(val_tokens, block_size, block_size),
        decode=decode_ascii,
    )
