"""FLOPs counted against the exact matmul count of the MLP, the peak table, and the metrics
made from a log window (framework/components/utilization.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from framework.components.data import to_device
from framework.components.models import GPT, MLP
from framework.components.tasks import Classification, LanguageModel
from framework.components.utilization import (
    UtilizationMeter,
    device_peak_tflops,
    micro_batch_flops,
    peak_memory_mib,
    table_peak_tflops,
)
from framework.config.registry import option_values
from tests.faults import HostReadingMLP

CPU = torch.device("cpu")


def mlp_flops(module: nn.Module, batch_size: int) -> int:
    """Every matmul of one forward and backward, from the layers' shapes: forward 2*B*in*out
    per Linear; backward the same for the weight's gradient and again for the input's, except
    the first layer's (its input, the data, needs no gradient). Biases add no matmul."""
    linears = [layer for layer in module.modules() if isinstance(layer, nn.Linear)]
    flops = 0
    for index, layer in enumerate(linears):
        matmul = 2 * batch_size * layer.in_features * layer.out_features
        flops += matmul * (2 if index == 0 else 3)
    return flops


def batch(size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 1, 8, 8), torch.randint(0, 10, (size,))


def count(model_class: type, hidden: list[int]) -> tuple[int | None, str]:
    return micro_batch_flops(
        Classification(**option_values("task", "classification")),
        lambda: model_class(in_channels=1, image_size=8, num_classes=10, hidden_sizes=hidden),
        batch(),
        CPU,
        lambda b, device: to_device(b, device, False),
    )


def test_mlp_flops_are_the_exact_matmul_count_counted_on_the_meta_device():
    flops, where = count(MLP, [48, 24])
    expected = mlp_flops(MLP(1, 8, 10, [48, 24]), 32)
    assert (flops, where) == (expected, "meta")
    # 64->48, 48->24, 24->10
    assert expected == 2 * 32 * (64 * 48 * 2 + 48 * 24 * 3 + 24 * 10 * 3) == 660_480


def test_a_model_the_meta_device_cannot_run_is_counted_on_the_real_device():
    flops, where = count(HostReadingMLP, [16])
    assert (flops, where) == (mlp_flops(MLP(1, 8, 10, [16]), 32), "cpu")


def test_gpt_flops_are_six_per_parameter_and_token_plus_attention():
    """Every matmul weight (per block qkv 3d^2, proj d^2, MLP 8d^2; the tied head V*d) does 6
    FLOPs per token (forward 2, backward 4); attention's two [T, T] products do 4*B*T^2*d
    forward and twice that backward per layer, the causal mask's zeros included."""
    layers, width, vocab, batch_size, tokens = 2, 32, 50, 3, 16
    flops, where = micro_batch_flops(
        LanguageModel(**option_values("task", "language_model")),
        lambda: GPT(
            vocab,
            block_size=tokens,
            layers=layers,
            heads=4,
            width=width,
            dropout=0.0,
            activation="gelu",
        ),
        (
            torch.randint(0, vocab, (batch_size, tokens)),
            torch.randint(0, vocab, (batch_size, tokens)),
        ),
        CPU,
        lambda b, device: to_device(b, device, False),
    )
    weights = layers * 12 * width**2 + vocab * width
    attention = layers * 12 * batch_size * tokens**2 * width
    assert (flops, where) == (6 * weights * batch_size * tokens + attention, "meta")


@pytest.mark.parametrize(
    ("name", "precision", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", ("H100 SXM", 989.4)),
        ("NVIDIA H100 PCIe", "amp", ("H100 PCIe", 756.5)),
        ("NVIDIA H100 NVL", "fp32", ("H100 NVL", 60.0)),
        ("NVIDIA H200", "bf16", ("H200 SXM", 989.4)),
        ("NVIDIA A100-SXM4-80GB", "fp32", ("A100", 19.5)),
        ("NVIDIA A100 80GB PCIe", "bf16", ("A100", 312.0)),
        ("NVIDIA L40S", "bf16", ("L40S", 362.05)),
        ("NVIDIA L4", "bf16", ("L4", 121.0)),
        ("NVIDIA A10", "bf16", ("A10", 125.0)),
        ("Tesla V100-SXM2-16GB", "amp", ("V100 SXM2", 125.0)),
        ("Tesla V100-PCIE-32GB", "fp32", ("V100 PCIe", 14.0)),
        ("NVIDIA GeForce RTX 4090", "bf16", ("GeForce RTX 4090", 165.2)),
        ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 tensor cores
        ("NVIDIA A10G", "bf16", None),  # not an A10, not an A100: not in the table
        ("Some Future GPU", "bf16", None),
        ("NVIDIA H100 80GB HBM3", "my_precision", None),  # a precision option of a user's own
    ],
)
def test_the_peak_table_matches_torchs_device_names(name, precision, expected):
    assert table_peak_tflops(name, precision) == expected


def test_no_peak_on_a_cpu_unless_configured():
    assert device_peak_tflops(None, CPU, "fp32") is None
    assert device_peak_tflops(2.5, CPU, "fp32") == 2.5


def test_a_log_windows_tflops_mfu_and_memory():
    meter = UtilizationMeter(
        step_flops=3 * 10**12, peak_tflops=4.0, device=CPU, rank=1, world_size=2
    )
    metrics = meter.metrics(steps=5, seconds=2.0, memory_mib=[100.0, 300.0])
    assert metrics == {
        "tflops_per_s": 7.5,  # 5 steps x 3 TFLOP / 2 s
        "mfu": 7.5 / (2 * 4.0),  # of two devices' peak
        "memory/peak_mib_max": 300.0,
        "memory/peak_mib_min": 100.0,
        "memory/peak_mib_max_rank": 1,
    }
    assert "mfu" not in UtilizationMeter(10**12, None, CPU, 0, 1).metrics(1, 1.0, [1.0])
    assert UtilizationMeter(None, 4.0, CPU, 0, 1).summary(10, 1.0) == {}


def test_each_rank_fills_its_own_slot_of_the_memory_rider():
    rider = UtilizationMeter(None, None, CPU, rank=2, world_size=4).memory_rider()
    assert rider.dtype == torch.float64 and rider.shape == (4,)
    assert rider[[0, 1, 3]].tolist() == [0.0, 0.0, 0.0]
    # The peak resident memory of a process that imported torch: more than 50 MiB.
    assert rider[2].item() == pytest.approx(peak_memory_mib(CPU), rel=0.05)
    assert rider[2].item() > 50
