"""data=text_stream: a rank's peak resident memory at 1x and 10x the data (the standard
library's source, then ten copies of it, as links), and the stream's throughput against
data=text's map-style windows on the same text (Python's help topics, written to files).

Each memory figure comes from a fresh process: rank 0 of 2 reads 2,000 batches of 16 windows of
64 tokens (its peak RSS, torch's import included). Throughput: one rank, num_workers=0, one
epoch of each loader in turn, three rounds, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import median, table, write_result
from framework.components.data import TokenWindows, train_loader
from framework.components.data_stream import standard_library_sources, text_stream
from framework.core.launch_context import DistEnv

BLOCK, BATCH, BATCHES = 64, 16, 2000
LOADER = {"batch_size": BATCH, "shuffle": True, "num_workers": 0, "drop_last": True}
LOADER |= {"pin_memory": False, "persistent_workers": False}


def linked_corpus(folder: Path, copies: int) -> str:
    """`copies` copies of the standard library's .py files, as links: a glob over them."""
    sources = standard_library_sources()
    root = Path(os.path.commonpath([str(path) for path in sources]))
    for copy in range(copies):
        for path in sources:
            link = folder / f"copy{copy}" / path.relative_to(root)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path)
    return str(folder / "copy*" / "**" / "*.py")


def memory_child(copies: int) -> dict[str, Any]:
    """In a fresh process: rank 0 of 2 reading BATCHES batches of the linked corpus."""
    with tempfile.TemporaryDirectory(prefix="stream-bench-") as scratch:
        pattern = linked_corpus(Path(scratch), copies)
        stdlib = str(Path(standard_library_sources()[0]).parents[0])
        os.environ["FRAMEWORK_DATA_DIRS"] = os.pathsep.join([scratch, stdlib])
        splits = text_stream(pattern, BLOCK, BLOCK, val_files=8, shuffle_buffer=4096)
        env = DistEnv(rank=0, world_size=2, local_world_size=2)
        loader, position = train_loader(splits.train, LOADER, env, 0, torch.device("cpu"))
        position.set_epoch(0)
        started = time.perf_counter()
        for index, _ in enumerate(loader):
            if index + 1 == BATCHES:
                break
        seconds = time.perf_counter() - started
        return {
            "copies": copies,
            "files": len(splits.train.files),  # type: ignore[attr-defined]
            "bytes": sum(splits.train.sizes),  # type: ignore[attr-defined]
            "windows_per_epoch": splits.train.windows(),  # type: ignore[attr-defined]
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "windows_per_s": BATCHES * BATCH / seconds,
        }


def topics_files(folder: Path, parts: int = 50) -> tuple[torch.Tensor, str]:
    """data=text's text, one token per character, and the same bytes in `parts` files."""
    from pydoc_data.topics import topics

    from framework.components.data import _ASCII_FOLD

    corpus = "\n\n".join(topics[key] for key in sorted(topics)).translate(_ASCII_FOLD)
    raw = corpus.encode("ascii", errors="replace")
    step = len(raw) // parts + 1
    for index in range(parts):
        (folder / f"part{index:03d}.txt").write_bytes(raw[index * step : (index + 1) * step])
    return torch.tensor(list(raw), dtype=torch.long), str(folder / "*.txt")


def epoch_rate(dataset: Any) -> float:
    loader, position = train_loader(dataset, LOADER, DistEnv(), 0, torch.device("cpu"))
    position.set_epoch(0)
    started = time.perf_counter()
    windows = sum(len(batch[0]) for batch in loader)
    return windows / (time.perf_counter() - started)


def throughput() -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="stream-bench-") as scratch:
        tokens, pattern = topics_files(Path(scratch))
        os.environ["FRAMEWORK_DATA_DIRS"] = scratch
        stream = text_stream(pattern, BLOCK, BLOCK, val_files=1, shuffle_buffer=4096).train
        in_memory = TokenWindows(tokens, BLOCK, BLOCK)
        rates: dict[str, list[float]] = {"text": [], "text_stream": []}
        for _ in range(3):
            rates["text"].append(epoch_rate(in_memory))
            rates["text_stream"].append(epoch_rate(stream))
    return {name: median(values) for name, values in rates.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks stream", description=__doc__)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # copies, in a fresh process
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(memory_child(args.child)))
        return {}
    memory = [
        json.loads(
            subprocess.run(
                [sys.executable, "-m", "benchmarks.stream", "--child", str(copies)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.splitlines()[-1]
        )
        for copies in (1, 10)
    ]
    rates = throughput()
    print(
        table(
            ["data", "files", "MB", "windows/epoch", "peak RSS (MiB)", "windows/s"],
            [
                [
                    f"{m['copies']}x",
                    m["files"],
                    f"{m['bytes'] / 1e6:.1f}",
                    m["windows_per_epoch"],
                    f"{m['peak_rss_mib']:.0f}",
                    f"{m['windows_per_s']:.0f}",
                ]
                for m in memory
            ],
        )
    )
    ratio = rates["text_stream"] / rates["text"]
    print(
        f"same text (help topics): data=text {rates['text']:.0f} windows/s, data=text_stream "
        f"{rates['text_stream']:.0f} windows/s: {ratio:.2f}x"
    )
    record = {"memory": memory, "windows_per_s": rates, "stream_over_text": ratio}
    write_result("stream", record)
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
