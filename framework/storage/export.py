"""`framework-export <checkpoint> <output.pt>`: any checkpoint of this framework (a step_*.pt
file or a sharded step_*.dcp folder, from any number of ranks) as one file holding the bare
model's state_dict, for inference:

    model.load_state_dict(torch.load("model.pt", weights_only=True))

One process, no process group: a sharded checkpoint's tensors are read whole from every
rank's files. `--ema` exports the EMA's weights (trainer.ema_decay). An output that exists is
refused, never overwritten.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from framework.core.exits import CheckpointError, ExitCode
from framework.storage.checkpoint import read
from framework.storage.files import atomic_write
from framework.storage.sharded import ShardedState


def whole_weights(path: Path, ema: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint's model (or EMA) weights, every tensor whole, on the host."""
    payload = read(path)
    key = "ema" if ema else "model"
    weights = payload.get(key)
    if weights is None:
        raise CheckpointError(
            f"checkpoint {path} holds no EMA weights (it was trained without "
            "trainer.ema_decay): export without --ema"
        )
    return weights.whole() if isinstance(weights, ShardedState) else dict(weights)


def export(checkpoint: Path, output: Path, ema: bool = False) -> int:
    """Write the weights to `output` (atomically); returns the number of tensors."""
    output = output.expanduser()
    if output.exists() or output.is_symlink():
        raise CheckpointError(f"{output} already exists: give a new file (nothing is overwritten)")
    if not output.parent.is_dir():
        raise CheckpointError(f"{output.parent} is no folder: create it first")
    weights = whole_weights(checkpoint.expanduser(), ema)
    atomic_write(output, lambda file: torch.save(weights, file))
    return len(weights)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="framework-export",
        description="Turn a checkpoint (a file or a sharded folder) into one torch.load-able "
        "state_dict of the bare model.",
    )
    parser.add_argument("checkpoint", type=Path, help="<run dir>/checkpoints/last.pt, or a step")
    parser.add_argument("output", type=Path, help="the file to write (must not exist)")
    parser.add_argument("--ema", action="store_true", help="the EMA's weights instead")
    args = parser.parse_args(argv)
    try:
        count = export(args.checkpoint, args.output, args.ema)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(ExitCode.CONFIG_REJECTED) from None
    print(f"{args.output}: {count} tensors from {args.checkpoint}")


if __name__ == "__main__":
    main()
