"""Where the supported torch versions differ (framework/core/versions.py), checked on real gloo
ranks. CI runs this file on the lock's torch and on the floor's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from framework.core.versions import reduce_fsdp_gradients_by_sum
from tests.conftest import spawn_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _sharded_gradient_is_the_mean(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    whole = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    whole.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model[0], mesh=mesh)  # a block, then the root: two FSDP units
    fully_shard(model, mesh=mesh)
    reduce_fsdp_gradients_by_sum(model)
    torch.manual_seed(1 + rank)  # each rank its own batch
    inputs = torch.randn(5, 6)
    model(inputs).square().sum().backward()
    everyone = [torch.empty_like(inputs) for _ in range(world_size)]
    dist.all_gather(everyone, inputs)
    for batch in everyone:  # the mean over ranks of each rank's gradient
        (whole(batch).square().sum() / world_size).backward()
    for (name, sharded), expected in zip(model.named_parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(sharded.grad.full_tensor(), expected.grad, msg=name)


def test_fsdp_averages_gradients_over_gloo_ranks_in_every_supported_torch():
    """torch 2.8's gloo sums where FSDP asks for an average; the shim makes it average."""
    spawn_ranks(_sharded_gradient_is_the_mean)
