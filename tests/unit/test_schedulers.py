"""Learning-rate schedules, built from their config as the runner builds them: the lr at chosen
optimizer steps, for every parameter group, and after a resume with a longer run."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from tests.conftest import make_cfg


@functools.cache
def scheduler_cfg(*overrides: str) -> DictConfig:
    return make_cfg(*overrides).scheduler  # only read here


def optimizer(*lrs: float) -> torch.optim.Optimizer:
    """SGD with one group per lr (lr multipliers make such groups)."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def lrs_at(cfg: DictConfig, total_steps: int, steps: list[int], *lrs: float) -> dict:
    """{step: lr of each group} once `step` optimizer steps are done (step 0: the first one's)."""
    opt = optimizer(*lrs)
    scheduler = instantiate(cfg)(optimizer=opt, total_steps=total_steps)
    seen = {}
    for step in range(max(steps) + 1):
        if step in steps:
            seen[step] = [group["lr"] for group in opt.param_groups]
        opt.step()
        scheduler.step()
    return seen


def test_constant_keeps_every_groups_lr():
    cfg = scheduler_cfg("scheduler=constant")
    assert lrs_at(cfg, 10, [0, 5, 10, 30], 0.1, 1.0) == {
        step: [0.1, 1.0] for step in (0, 5, 10, 30)
    }


def test_cosine_warms_up_linearly_then_decays_to_the_minimum_and_stays_there():
    cfg = scheduler_cfg(
        "scheduler=cosine", "scheduler.warmup_steps=4", "scheduler.min_lr_ratio=0.1"
    )
    seen = lrs_at(cfg, 14, [0, 1, 3, 4, 9, 14, 20], 2.0)
    assert {step: lr for step, [lr] in seen.items()} == {
        0: pytest.approx(0.4, abs=1e-12),  # 2.0 * 1/5: never 0, the first step learns
        1: pytest.approx(0.8, abs=1e-12),
        3: pytest.approx(1.6, abs=1e-12),
        4: pytest.approx(2.0, abs=1e-12),  # warmup done: the full lr
        9: pytest.approx(1.1, abs=1e-12),  # half way: 2.0 * (0.1 + 0.9 * 0.5)
        14: pytest.approx(0.2, abs=1e-12),  # the last step: min_lr_ratio * lr
        20: pytest.approx(0.2, abs=1e-12),  # past the planned steps: stays at the minimum
    }


def test_cosine_defaults_have_no_warmup_and_decay_to_zero():
    seen = lrs_at(scheduler_cfg("scheduler=cosine"), 10, [0, 5, 10], 1.0)
    assert {step: lr for step, [lr] in seen.items()} == {
        0: 1.0,
        5: pytest.approx(0.5, abs=1e-12),
        10: pytest.approx(0.0, abs=1e-12),
    }


def test_cosine_scales_every_group_by_the_same_factor():
    """Groups with an lr multiplier keep their ratio to the base lr throughout."""
    cfg = scheduler_cfg(
        "scheduler=cosine", "scheduler.warmup_steps=4", "scheduler.min_lr_ratio=0.1"
    )
    for step, (base, head) in lrs_at(cfg, 14, [0, 4, 9, 14], 0.5, 5.0).items():
        assert head == pytest.approx(10 * base, rel=1e-12), step


def test_a_resumed_cosine_follows_the_longer_schedule_from_where_it_stands():
    """trainer.max_steps raised from 14 to 24 at step 9: step 10 is the 24-step schedule's."""
    cfg = scheduler_cfg(
        "scheduler=cosine", "scheduler.warmup_steps=4", "scheduler.min_lr_ratio=0.1"
    )
    first = optimizer(2.0)
    scheduler = instantiate(cfg)(optimizer=first, total_steps=14)
    for _ in range(9):
        first.step()
        scheduler.step()
    resumed = optimizer(2.0)
    longer = instantiate(cfg)(optimizer=resumed, total_steps=24)
    longer.load_state_dict(scheduler.state_dict())
    resumed.step()
    longer.step()
    progress = (10 - 4) / (24 - 4)
    expected = 2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    assert resumed.param_groups[0]["lr"] == pytest.approx(expected, abs=1e-12)


def test_step_decay_multiplies_by_gamma_every_step_size_steps():
    cfg = scheduler_cfg("scheduler=step", "scheduler.step_size=3", "scheduler.gamma=0.5")
    assert lrs_at(cfg, 100, [0, 2, 3, 5, 6, 9], 0.8, 8.0) == {
        0: [0.8, 8.0],
        2: [0.8, 8.0],
        3: [0.4, 4.0],
        5: [0.4, 4.0],
        6: [0.2, 2.0],
        9: [0.1, 1.0],
    }


def test_step_decay_defaults_to_a_tenth_every_100_steps():
    seen = lrs_at(scheduler_cfg("scheduler=step"), 1000, [99, 100], 1.0)
    assert seen == {99: [1.0], 100: [pytest.approx(0.1, abs=1e-15)]}
