"""A model built on the meta device, then replayed tensor by tensor, gets exactly a whole build's
values, draws exactly its random numbers, and never holds the whole model at once
(framework/components/meta_init.py); what it holds is measured by torch's profiler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hydra.utils import instantiate
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from framework.components.meta_init import MetaUnsupported, build_on_meta, materialize
from tests.conftest import make_cfg

# Every shipped model, with the options' own values (its data option fills in the shapes).
SHIPPED = {
    "cnn": (),
    "mlp": ("model=mlp",),
    "resnet18": ("model=resnet18", "data=synthetic"),
    "resnet50": ("model=resnet50", "data=synthetic"),
    "gpt": ("task=language_model", "model=gpt", "data=text"),
    "feed_forward": ("experiment=diabetes_mlp",),
    "vae": ("experiment=digits_vae",),
}


def peak_host_bytes(work: Callable[[], Any]) -> tuple[Any, int]:
    """work()'s result, and the most bytes it held at once on the host beyond what it started
    with: every CPU allocation and free, as torch's profiler records them (not the replay's
    own count)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        result = work()
    events = profiled.profiler.kineto_results.events()
    changes = sorted(
        (event.start_ns(), event.nbytes())
        for event in events
        if event.name() == "[memory]" and event.device_type() == DeviceType.CPU
    )
    held = peak = 0
    for _, change in changes:
        held += change
        peak = max(peak, held)
    return result, peak


def whole_and_replayed(build) -> tuple[nn.Module, nn.Module, int, bool]:
    """A whole build and a meta build replayed, from the same seed; the replay's most bytes
    held at once, as measured (its own count, materialize's result, is not the measure), and
    whether both left the generator in the same state."""
    torch.manual_seed(1234)
    whole = build()
    after_whole = torch.get_rng_state()
    torch.manual_seed(1234)
    module, recipe = build_on_meta(build)
    assert all(t.is_meta for t in module.state_dict().values())
    module.to_empty(device="cpu")
    _, held = peak_host_bytes(lambda: materialize(recipe, [module]))
    return whole, module, held, torch.equal(torch.get_rng_state(), after_whole)


def assert_same_state(whole: nn.Module, replayed: nn.Module) -> None:
    expected, got = whole.state_dict(), replayed.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_model_replayed_from_meta_equals_its_whole_build_bit_for_bit(name):
    cfg = make_cfg(*SHIPPED[name])
    whole, replayed, held, same_generator = whole_and_replayed(lambda: instantiate(cfg.model))
    # state_dict of a to_empty'd module: a tie broken by to_empty would show as a difference
    # (sharded modules keep it: tests/distributed/test_fsdp.py).
    for module in (whole, replayed):
        if hasattr(module, "tokens"):  # the GPT's tied embedding
            module.head.weight = module.tokens.weight
    assert_same_state(whole, replayed)
    assert same_generator
    # One tensor at a time: each is dropped once final (or overwritten, as nn's default inits
    # that the model replaces), so the replay never held more than the largest.
    assert held == max(t.numel() * t.element_size() for t in whole.state_dict().values())


def test_the_gpts_replay_holds_exactly_its_largest_tensor_at_most():
    cfg = make_cfg("task=language_model", "model=gpt", "data=text", "model.width=256")
    whole, _, held, _ = whole_and_replayed(lambda: instantiate(cfg.model))
    sizes = [p.numel() * p.element_size() for p in whole.parameters()]
    assert held == max(sizes) == 256 * 1024 * 4  # one MLP weight; the model is 13 times that
    assert sum(sizes) > 12 * held
    # The same measurement sees a whole build hold the whole model.
    torch.manual_seed(1234)
    _, whole_build = peak_host_bytes(lambda: instantiate(cfg.model))
    assert whole_build >= sum(sizes)


class Unusual(nn.Module):
    """What constructors do besides nn's defaults: a parameter from randn, a buffer from Python
    data and arithmetic, an orthogonal init (QR, a view written in place), a padding row, a
    tied weight, uniform_ on a slice."""

    def __init__(self) -> None:
        super().__init__()
        self.free = nn.Parameter(torch.randn(5, 3))
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))
        self.register_buffer("scale", torch.tensor([1.0, 2.0]) * 3)
        self.embed = nn.Embedding(6, 3, padding_idx=2)
        self.linear = nn.Linear(3, 6)
        nn.init.orthogonal_(self.linear.weight)
        self.out = nn.Linear(3, 6, bias=False)
        self.out.weight = self.embed.weight
        with torch.no_grad():
            self.linear.bias[2:].uniform_(-1, 1)


def test_unusual_constructors_replay_exactly():
    whole, replayed, _, same_generator = whole_and_replayed(Unusual)
    replayed.out.weight = replayed.embed.weight
    assert_same_state(whole, replayed)
    assert same_generator
    assert torch.equal(replayed.scale, torch.tensor([3.0, 6.0]))
    assert torch.equal(replayed.embed.weight[2], torch.zeros(3))


class Rejection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        # Rejection sampling written out: it reads the values it drew. (`nn.init.trunc_normal_`
        # samples by rejection in newer torch but by the inverse CDF in torch 2.8.)
        nn.init.normal_(self.weight)
        while (self.weight.abs() > 2).any():
            nn.init.normal_(self.weight)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Rejection()


def test_a_constructor_that_reads_values_is_named_with_its_reason():
    with pytest.raises(MetaUnsupported) as raised:
        build_on_meta(Outer)
    assert raised.value.module == f"{__name__}.Rejection"
    assert "Tensor.item() cannot be called on meta tensors" in raised.value.reason


def test_fsdp_refuses_a_model_it_cannot_build_on_meta_in_one_line_naming_the_module():
    from framework.components.strategy import FSDP
    from framework.core.exits import ConfigError, ExitCode, outcome_of
    from framework.core.launch_context import DistEnv

    with pytest.raises(ConfigError) as raised:
        FSDP(block_classes=None, reshard_after_forward=True, activation_checkpointing=False).build(
            Outer, DistEnv(world_size=2)
        )
    outcome = outcome_of(raised.value)
    assert outcome.code == ExitCode.CONFIG_REJECTED == 2
    (line,) = str(raised.value).splitlines()
    assert f"strategy=fsdp: {__name__}.Rejection cannot be built on the meta device" in line
    assert "Tensor.item() cannot be called on meta tensors" in line


def test_fsdp_block_classes_that_name_no_module_are_refused_on_one_rank_too():
    """One rank trains the whole model, but the same config on more ranks would be refused:
    a trial run on one rank must not pass it."""
    from framework.components.models import SmallCNN
    from framework.components.strategy import FSDP
    from framework.core.exits import ConfigError
    from framework.core.launch_context import DistEnv

    strategy = FSDP(["NoSuchBlock"], reshard_after_forward=True, activation_checkpointing=False)
    with pytest.raises(ConfigError, match="NoSuchBlock is no module class of SmallCNN"):
        strategy.wrap(SmallCNN(1, 10, 4), None, DistEnv(), torch.device("cpu"), {})
