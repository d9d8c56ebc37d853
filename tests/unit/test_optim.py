"""The optimizer's parameter groups: no weight decay on 1-D parameters, lr multipliers by name
(first matching pattern wins, an unused pattern is refused), and what build_optimizer makes of
them. (lr scaling to the global batch: tests/unit/test_config.py.)"""

from __future__ import annotations

import pytest
import torch
from omegaconf import DictConfig, open_dict
from torch import nn

from framework.components.optim import build_optimizer, parameter_groups
from framework.core.exits import ConfigError
from tests.conftest import make_cfg


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)
        self.head = nn.Linear(3, 2)


def optimizer_cfg(option: str, **changes) -> DictConfig:
    cfg = make_cfg(f"optimizer={option}").optimizer
    with open_dict(cfg):
        for key, value in changes.items():
            cfg[key] = value
    return cfg


def described(groups: list[dict], model: nn.Module) -> list[tuple[list[str], float, float]]:
    """(parameter names, weight decay, lr) of each group, in order."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [([names[id(p)] for p in g["params"]], g["weight_decay"], g["lr"]) for g in groups]


def test_no_weight_decay_on_biases_and_normalisation_weights():
    model = Net()
    cfg = optimizer_cfg("adamw", weight_decay=0.05)
    assert described(parameter_groups(cfg, model, lr=0.01), model) == [
        (["body.weight", "head.weight"], 0.05, 0.01),
        (["body.bias", "norm.weight", "norm.bias", "head.bias"], 0.0, 0.01),
    ]


def test_without_no_weight_decay_every_parameter_decays():
    model = Net()
    cfg = optimizer_cfg("sgd", weight_decay=0.05)
    assert cfg.no_weight_decay is False  # SGD's default
    assert described(parameter_groups(cfg, model, lr=0.01), model) == [
        (
            ["body.weight", "body.bias", "norm.weight", "norm.bias", "head.weight", "head.bias"],
            0.05,
            0.01,
        )
    ]


def test_frozen_parameters_are_in_no_group():
    model = Net()
    model.body.requires_grad_(False)
    cfg = optimizer_cfg("adamw", weight_decay=0.05)
    assert described(parameter_groups(cfg, model, lr=0.01), model) == [
        (["norm.weight", "norm.bias", "head.bias"], 0.0, 0.01),
        (["head.weight"], 0.05, 0.01),
    ]


def test_lr_multipliers_first_matching_pattern_wins():
    model = Net()
    cfg = optimizer_cfg(
        "adamw", weight_decay=0.05, lr_multipliers={"head.weight": 2.0, "head.*": 10.0}
    )
    assert described(parameter_groups(cfg, model, lr=0.01), model) == [
        (["body.weight"], 0.05, 0.01),
        (["body.bias", "norm.weight", "norm.bias"], 0.0, 0.01),
        (["head.weight"], 0.05, 0.02),
        (["head.bias"], 0.0, 0.1),
    ]


def test_the_base_lr_groups_come_first_so_the_logged_lr_is_the_base_one():
    model = Net()
    cfg = optimizer_cfg("adamw", weight_decay=0.05, lr_multipliers={"body.*": 0.5})
    assert described(parameter_groups(cfg, model, lr=0.01), model) == [
        (["norm.weight", "norm.bias", "head.bias"], 0.0, 0.01),
        (["head.weight"], 0.05, 0.01),
        (["body.weight"], 0.05, 0.005),
        (["body.bias"], 0.0, 0.005),
    ]


def test_a_pattern_that_matches_no_parameter_is_refused_naming_it_and_the_names():
    """A pattern shadowed by an earlier one matches nothing either."""
    cfg = optimizer_cfg("adamw", lr_multipliers={"haed.*": 10.0, "head.*": 10.0, "head.bias": 1.5})
    with pytest.raises(ConfigError) as refusal:
        parameter_groups(cfg, Net(), lr=0.01)
    assert str(refusal.value) == (
        "optimizer.lr_multipliers: haed.*, head.bias matches no parameter of the model "
        "(they are named like body.weight, body.bias, norm.weight, norm.bias)"
    )


def test_build_optimizer_makes_the_configured_optimizer_whose_decay_skips_1d_parameters():
    torch.manual_seed(0)
    model = Net()
    cfg = optimizer_cfg("adamw", weight_decay=0.5, lr_multipliers={"head.*": 2.0})
    optimizer = build_optimizer(cfg, model, lr=0.1)
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["lr"] == 0.1 and optimizer.defaults["eps"] == 1e-8
    assert [(g["lr"], g["weight_decay"], len(g["params"])) for g in optimizer.param_groups] == [
        (0.1, 0.5, 1),
        (0.1, 0.0, 3),
        (0.2, 0.5, 1),
        (0.2, 0.0, 1),
    ]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # Adam's update is 0: only the decoupled decay moves them
    optimizer.step()
    after = dict(model.named_parameters())
    torch.testing.assert_close(after["body.weight"], before["body.weight"] * (1 - 0.1 * 0.5))
    torch.testing.assert_close(after["head.weight"], before["head.weight"] * (1 - 0.2 * 0.5))
    for name in ("body.bias", "norm.weight", "norm.bias", "head.bias"):
        assert torch.equal(after[name], before[name]), name
