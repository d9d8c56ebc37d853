"""The precision objects on the CPU: what each option autocasts to, clipping before the step,
amp's loss scaling (unscaled before clipping, an inf/NaN step skipped and counted), and the state
a checkpoint keeps."""

from __future__ import annotations

import io

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from framework.components.precision import AMP, BF16, Precision
from framework.config.registry import option_values
from tests.conftest import make_cfg

CPU = torch.device("cpu")
INF, NAN = float("inf"), float("nan")


def sgd(*values: float, lr: float = 1.0, **kwargs) -> tuple[nn.Parameter, torch.optim.SGD]:
    parameter = nn.Parameter(torch.tensor(values))
    return parameter, torch.optim.SGD([parameter], lr=lr, **kwargs)


def loss_with_gradient(parameter: nn.Parameter, *gradient: float) -> torch.Tensor:
    """A loss whose gradient with respect to `parameter` is `gradient`."""
    return (parameter * torch.tensor(gradient)).sum()


@pytest.mark.parametrize(
    ("option", "kind", "dtype"),
    [
        ("fp32", Precision, torch.float32),
        ("bf16", BF16, torch.bfloat16),
        ("amp", AMP, torch.float16),
    ],
)
def test_each_option_builds_its_object_and_autocasts_the_forward_to_its_dtype(option, kind, dtype):
    precision = instantiate(make_cfg(f"precision={option}").precision)(device=CPU)
    assert type(precision) is kind and precision.name == option
    # The loop checks gradients itself unless the precision's step skips non-finite ones.
    assert precision.skips_nonfinite_grads is (option == "amp")
    layer, inputs = nn.Linear(4, 2), torch.ones(3, 4)
    with precision.forward_context():
        assert layer(inputs).dtype == dtype
    assert layer(inputs).dtype == torch.float32  # only inside the context


@pytest.mark.parametrize("kind", [Precision, BF16])
def test_fp32_and_bf16_step_with_the_gradient_clipped_to_its_norm(kind):
    precision = kind(CPU)
    parameter, optimizer = sgd(0.0, 0.0)
    precision.backward(loss_with_gradient(parameter, 3.0, 4.0))  # gradient norm 5
    assert precision.loss_scale() is None and parameter.grad.tolist() == [3.0, 4.0]
    clipped_step(precision, optimizer, parameter, clip_grad_norm=1.0)
    assert parameter.tolist() == pytest.approx([-0.6, -0.8], rel=1e-5)
    optimizer.zero_grad()
    precision.backward(loss_with_gradient(parameter, 3.0, 4.0))
    clipped_step(precision, optimizer, parameter, clip_grad_norm=None)
    assert parameter.tolist() == pytest.approx([-3.6, -4.8], rel=1e-6)


def clipped_step(
    precision: Precision, optimizer: torch.optim.Optimizer, parameter, clip_grad_norm
) -> None:
    """The update as the loop makes it (framework/rank/loop.py: Runner.update), for the precision
    objects alone; the loop's own order: tests/distributed/test_precision_comm.py."""
    precision.unscale(optimizer)
    if clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([parameter], clip_grad_norm)
    precision.step(optimizer)


@pytest.mark.parametrize(("found_inf", "expected"), [(0.0, [-1.0, -1.0]), (1.0, [0.0, 0.0])])
def test_a_device_flag_drops_the_update_of_a_fused_optimizer(found_inf, expected):
    parameter, optimizer = sgd(0.0, 0.0, fused=True)
    parameter.grad = torch.ones(2)
    Precision(CPU).step(optimizer, found_inf=torch.tensor(found_inf))
    assert parameter.tolist() == expected
    # The flag is lent to this one step only.
    assert not hasattr(optimizer, "found_inf") and not hasattr(optimizer, "grad_scale")
    optimizer.step()
    assert parameter.tolist() == [e - 1.0 for e in expected]


@pytest.mark.parametrize("kind", [Precision, BF16])
def test_fp32_and_bf16_state_is_the_skipped_step_count(kind):
    precision = kind(CPU)
    assert precision.state_dict() == {"skipped_steps": 0}
    precision.load_state_dict({"skipped_steps": 4})
    assert precision.metrics() == {"precision/skipped_steps": 4}
    precision.load_state_dict({})  # a checkpoint from before the counter
    assert precision.state_dict() == {"skipped_steps": 0}


# --- amp ---------------------------------------------------------------------------------------
def test_amp_scales_the_loss_for_backward():
    amp = AMP(CPU, **option_values("precision", "amp", init_scale=1024.0))
    assert amp.loss_scale() is None  # until the first backward
    parameter, _ = sgd(0.0, 0.0)
    amp.backward(loss_with_gradient(parameter, 3.0, 4.0))
    assert parameter.grad.tolist() == [3072.0, 4096.0]
    assert amp.loss_scale().item() == 1024.0


def test_amp_unscales_the_gradients_before_clipping_them():
    amp = AMP(CPU, **option_values("precision", "amp", init_scale=1024.0))
    parameter, optimizer = sgd(0.0, 0.0)
    amp.backward(loss_with_gradient(parameter, 3.0, 4.0))
    clipped_step(amp, optimizer, parameter, clip_grad_norm=1.0)
    # Clipping the scaled gradient (norm 5120) to 1, then unscaling, would move it 1024x less.
    assert parameter.tolist() == pytest.approx([-0.6, -0.8], rel=1e-5)


@pytest.mark.parametrize("bad", [INF, NAN])
def test_amp_skips_a_step_with_a_non_finite_gradient_and_counts_it(bad):
    amp = AMP(
        CPU,
        **option_values(
            "precision", "amp", init_scale=1024.0, backoff_factor=0.25, growth_interval=1000
        ),
    )
    parameter, optimizer = sgd(1.0, 1.0, lr=0.5)
    amp.backward(loss_with_gradient(parameter, bad, 1.0))
    clipped_step(amp, optimizer, parameter, clip_grad_norm=1.0)
    assert parameter.tolist() == [1.0, 1.0]  # not updated
    assert amp.metrics() == {"precision/loss_scale": 256.0, "precision/skipped_steps": 1}
    optimizer.zero_grad()
    amp.backward(loss_with_gradient(parameter, 2.0, 1.0))
    clipped_step(amp, optimizer, parameter, clip_grad_norm=None)
    assert parameter.tolist() == [0.0, 0.5]  # the true gradient, unscaled
    assert amp.metrics() == {"precision/loss_scale": 256.0, "precision/skipped_steps": 1}


def test_amp_growing_the_scale_is_not_a_skipped_step():
    amp = AMP(
        CPU,
        **option_values(
            "precision", "amp", init_scale=1024.0, growth_factor=2.0, growth_interval=2
        ),
    )
    parameter, optimizer = sgd(0.0, 0.0)
    scales = []
    for _ in range(4):
        optimizer.zero_grad()
        amp.backward(loss_with_gradient(parameter, 1.0, 1.0))
        clipped_step(amp, optimizer, parameter, clip_grad_norm=None)
        scales.append(amp.metrics()["precision/loss_scale"])
    assert scales == [1024.0, 2048.0, 2048.0, 4096.0]
    assert amp.metrics()["precision/skipped_steps"] == 0
    assert parameter.tolist() == [-4.0, -4.0]


def test_amp_state_survives_a_checkpoint_and_the_count_goes_on():
    amp = AMP(CPU, **option_values("precision", "amp", init_scale=1024.0))
    parameter, optimizer = sgd(1.0, 1.0)
    amp.backward(loss_with_gradient(parameter, INF, 1.0))
    clipped_step(amp, optimizer, parameter, clip_grad_norm=None)
    buffer = io.BytesIO()
    torch.save(amp.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # as checkpoints are read
    assert state["skipped_steps"] == 1 and state["scaler"]["scale"] == 512.0

    restored = AMP(
        CPU, **option_values("precision", "amp")
    )  # built from the config's init_scale, 65536
    restored.load_state_dict(state)
    assert restored.metrics() == {"precision/loss_scale": 512.0, "precision/skipped_steps": 1}
    optimizer.zero_grad()
    restored.backward(loss_with_gradient(parameter, NAN, 1.0))
    assert parameter.grad.tolist()[1] == 512.0  # the restored scale, not 65536
    clipped_step(restored, optimizer, parameter, clip_grad_norm=None)
    assert restored.state_dict()["skipped_steps"] == 2
    assert restored.metrics() == {"precision/loss_scale": 256.0, "precision/skipped_steps": 2}
