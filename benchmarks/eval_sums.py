"""What adding evaluation states up in float64 costs (`state_sum`): the reduction of one batch's
per-item losses, float32 sum against float64 sum, beside the forward that makes them, for the
digits CNN (256 samples) and the char_gpt GPT (16 x 128 tokens). One thread, medians.

    uv run python -m benchmarks.eval_sums
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from framework.components.models import GPT, SmallCNN
from framework.config.registry import option_values


def median_ms(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def compare(name: str, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    with torch.no_grad():
        forward = median_ms(lambda: model(inputs), 7)
        logits = model(inputs).float().flatten(0, -2)
        flat = targets.flatten()
        in_float32 = median_ms(lambda: F.cross_entropy(logits, flat, reduction="sum"), 200)
        in_float64 = median_ms(
            lambda: F.cross_entropy(logits, flat, reduction="none").double().sum(), 200
        )
    print(
        f"{name}: forward {forward:.1f} ms; loss summed in float32 {in_float32:.4f} ms, "
        f"in float64 {in_float64:.4f} ms (+{in_float64 - in_float32:.4f} ms, "
        f"{(in_float64 - in_float32) / forward:.4%} of the forward)"
    )


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cnn = SmallCNN(**option_values("model", "cnn", in_channels=1, num_classes=10)).eval()
    compare("digits CNN, 256 samples", cnn, torch.randn(256, 1, 8, 8), torch.randint(0, 10, (256,)))
    gpt = GPT(**option_values("model", "gpt", vocab_size=100, block_size=128)).eval()
    tokens = torch.randint(0, 100, (16, 128))
    compare("char_gpt GPT, 16 x 128 tokens", gpt, tokens, tokens)


if __name__ == "__main__":
    main()
