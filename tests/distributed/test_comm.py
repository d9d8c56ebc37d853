"""Communication hooks on real 2-rank gloo groups: accuracy, exactness, AMP safety, state,
and the byte accounting against the analytic value."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP

from framework.components.comm import PowerSGD
from framework.components.models import MLP, resnet18_cifar
from framework.components.precision import AMP
from framework.config.registry import option_values
from framework.core.distributed import DistEnv  # (imports torch._dynamo before any process group)
from tests.conftest import make_cfg, spawn_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def env_of(rank: int, world_size: int) -> DistEnv:
    return DistEnv(rank=rank, world_size=world_size, local_world_size=world_size, source="local")


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return MLP(in_channels=1, image_size=8, num_classes=10, hidden_sizes=[64, 32])


def batch(rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * seed + rank)  # different data per rank
    return torch.randn(16, 1, 8, 8, generator=generator), torch.randint(
        0, 10, (16,), generator=generator
    )


def build_comm(options: dict, env: DistEnv):
    """comm=<name> with these knobs, built as a rank builds it (the option's node composed)."""
    options = dict(options)
    node = make_cfg(f"comm={options.pop('name')}").comm
    return instantiate(OmegaConf.merge(node, options))(env=env)


def grads_with(comm_cfg: dict | None, rank: int, world_size: int, bucket_cap_mb: float = 25):
    model = mlp()
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    if comm_cfg is not None:
        build_comm(comm_cfg, env_of(rank, world_size)).attach(ddp, model, grad_scale=lambda: None)
    inputs, targets = batch(rank)
    torch.nn.functional.cross_entropy(ddp(inputs), targets).backward()
    return [p.grad.clone() for p in model.parameters()]


def check_close_to_allreduce(rank, world_size, comm_cfg, rtol, atol, bucket_cap_mb):
    reference = grads_with(None, rank, world_size)
    hooked = grads_with(comm_cfg, rank, world_size, bucket_cap_mb)
    for ref, got in zip(reference, hooked, strict=True):
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize(("name", "tol"), [("fp16", 2e-3), ("bf16", 2e-2)])
def test_fp16_and_bf16_compression_stay_within_their_precision_of_allreduce(name, tol):
    spawn_ranks(check_close_to_allreduce, {"name": name}, tol, tol * 1e-2, 25)


def test_powersgd_at_full_rank_reproduces_allreduce_across_several_buckets():
    exact = {
        "name": "powersgd",
        "rank": 1000,
        "start_iter": 0,
        "min_compression_rate": 0.0,
        "error_feedback": False,
        "warm_start": False,
    }
    spawn_ranks(check_close_to_allreduce, exact, 1e-4, 1e-6, 0.01)  # 0.01 MB: 3+ buckets


def skipped_amp_step_leaves_powersgd_state_finite(rank, world_size):
    model = mlp()
    ddp = DDP(model, bucket_cap_mb=0.01)
    precision = AMP(torch.device("cpu"), **option_values("precision", "amp", init_scale=1024.0))
    comm = PowerSGD(env_of(rank, world_size), **option_values("comm", "powersgd", start_iter=0))
    comm.attach(ddp, model, grad_scale=precision.loss_scale)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(poison: bool) -> None:
        inputs, targets = batch(rank, seed=comm.iter)
        if poison and rank == 0:
            inputs[0, 0, 0, 0] = float("inf")  # one rank's gradient becomes inf/NaN
        with precision.forward_context():
            loss = torch.nn.functional.cross_entropy(ddp(inputs), targets)
        precision.backward(loss)
        precision.unscale(optimizer)  # as the loop's update: unscale, clip, step
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        precision.step(optimizer)
        optimizer.zero_grad()

    step(poison=False)
    step(poison=False)  # DDP rebuilds its buckets after step 1; compare from a stable layout
    errors_before = {i: e.clone() for i, e in comm.errors.items()}
    params_before = [p.detach().clone() for p in model.parameters()]
    step(poison=True)
    assert errors_before and precision.metrics()["precision/skipped_steps"] == 1  # every rank
    for p, before in zip(model.parameters(), params_before, strict=True):
        assert torch.equal(p.detach(), before)
    for index, error in comm.errors.items():
        assert torch.isfinite(error).all()
        assert torch.equal(error, errors_before[index])  # the skipped step left it alone
    assert all(torch.isfinite(q).all() for q in comm.q_memory.values())
    step(poison=False)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(
        not torch.equal(p.detach(), b)
        for p, b in zip(model.parameters(), params_before, strict=True)
    )


def test_an_amp_step_skipped_for_inf_does_not_poison_powersgd_error_feedback():
    spawn_ranks(skipped_amp_step_leaves_powersgd_state_finite)


def restored_powersgd_continues_identically(rank, world_size):
    def make():
        model = mlp()
        ddp = DDP(model, bucket_cap_mb=0.01)
        comm = PowerSGD(env_of(rank, world_size), **option_values("comm", "powersgd", start_iter=1))
        return model, ddp, comm, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def train(model, ddp, optimizer, steps, first):
        for step in range(first, first + steps):
            inputs, targets = batch(rank, seed=step)
            torch.nn.functional.cross_entropy(ddp(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()

    model, ddp, comm, optimizer = make()
    comm.attach(ddp, model, grad_scale=lambda: None)
    train(model, ddp, optimizer, steps=3, first=0)
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), comm.state_dict()))
    assert saved[2]["errors"] and saved[2]["iter"] == 3
    train(model, ddp, optimizer, steps=3, first=3)
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    # A new DDP instance (as after a restart): restore this rank's state, register the hook again.
    model, ddp, comm, optimizer = make()
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    comm.load_state_dict(saved[2])
    comm.attach(ddp, model, grad_scale=lambda: None)
    train(model, ddp, optimizer, steps=3, first=3)
    for p, expected in zip(model.parameters(), uninterrupted, strict=True):
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=0)


def test_powersgd_state_is_saved_and_restored_per_rank_with_the_hook_reregistered():
    spawn_ranks(restored_powersgd_continues_identically)


def analytic_powersgd_bytes(model: torch.nn.Module, rank: int, min_rate: float = 2.0) -> int:
    """What PowerSGD sends per step: P and Q for matrices worth compressing, the rest as is."""
    total = 0
    for p in model.parameters():
        n = p.shape[0]
        m = p.numel() // n
        r = min(n, m, rank)
        compress = (n + m) * r * min_rate < n * m
        total += 4 * ((n + m) * r if compress else p.numel())
    return total


def resnet18_accounting(rank, world_size, out):
    torch.manual_seed(0)
    model = resnet18_cifar(in_channels=3, num_classes=10)
    inputs = torch.randn(2, 3, 8, 8)
    results = {}
    for approximation_rank in (1, 2, 4):
        values = option_values("comm", "powersgd", rank=approximation_rank, start_iter=1)
        comm = PowerSGD(env_of(rank, world_size), **values)
        ddp = DDP(model)  # default 25 MB buckets: several; a new hook needs a new DDP instance
        comm.attach(ddp, model, grad_scale=lambda: None)
        ddp(inputs).sum().backward()  # step 1: plain allreduce
        assert comm.metrics()["comm/bytes_per_step"] == 4 * sum(
            p.numel() for p in model.parameters()
        )
        ddp(inputs).sum().backward()  # step 2: compressed
        results[approximation_rank] = comm.metrics()
    if rank == 0:
        out.write_text(json.dumps(results))


def test_powersgd_bytes_match_the_analytic_count_for_resnet18(tmp_path):
    out = tmp_path / "metrics.json"
    spawn_ranks(resnet18_accounting, out)
    results = json.loads(out.read_text())
    model = resnet18_cifar(in_channels=3, num_classes=10)
    params = sum(p.numel() for p in model.parameters())
    assert params == pytest.approx(11.17e6, rel=1e-3)
    for approximation_rank, expected_ratio in ((1, 243.3), (2, 135.8), (4, 72.1)):
        metrics = results[str(approximation_rank)]
        assert metrics["comm/bytes_per_step"] == analytic_powersgd_bytes(model, approximation_rank)
        assert metrics["comm/compression"] == pytest.approx(expected_ratio, rel=0.01)
