"""What a rank holds and sends, on real 2-rank gloo jobs: the memory ledger each run logs equals
`train ... mode=estimate`'s figures, FSDP's logged bytes are its collectives' sizes, and
activation checkpointing changes no loss under either strategy."""

from __future__ import annotations

import pytest

from framework.rank.estimate import estimate_ledgers
from tests.conftest import PADDED_GPT, make_cfg, read_metrics, train_losses, train_many

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

GPT = (
    *PADDED_GPT,
    "data.stride=16",
    "data.batch_size=2",
    "data.eval_batch_size=16",
    "data.val_fraction=0.002",
    "task.sample_tokens=0",
    "optimizer=adamw",
    "launcher.nproc_per_node=2",
    "trainer.max_steps=3",
    "trainer.grad_accum=2",
    "trainer.log_every=1",
    "checkpoint.every=0",
)
RUNS = {
    "ddp": ("strategy=ddp",),
    "ddp-ac": ("strategy=ddp", "strategy.activation_checkpointing=true"),
    "fsdp": ("strategy=fsdp",),
    "fsdp-ac": ("strategy=fsdp", "strategy.activation_checkpointing=true"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    jobs = [(make_cfg(*GPT, *extra), root / name) for name, extra in RUNS.items()]
    summaries = train_many(jobs)
    return {name: (summary, root / name) for name, summary in zip(RUNS, summaries, strict=True)}


def test_activation_checkpointing_changes_no_loss_under_ddp_or_fsdp(runs):
    for strategy in ("ddp", "fsdp"):
        plain, checkpointed = (train_losses(runs[name][1]) for name in (strategy, f"{strategy}-ac"))
        assert len(plain) == 3
        assert checkpointed == plain, strategy
        log = (runs[f"{strategy}-ac"][1] / "train.log").read_text()
        assert "2 block(s) of TransformerBlock recompute their forward in backward" in log


def test_each_ranks_logged_ledger_is_the_estimate_for_two_ranks(runs):
    for strategy in ("ddp", "fsdp"):
        summary, run_dir = runs[strategy]
        estimated, _, count = estimate_ledgers(make_cfg(*GPT, *RUNS[strategy]), world_size=2)
        logged = summary["memory/ledger"]
        assert len(logged) == 2
        for rank, (ledger, expected) in enumerate(zip(logged, estimated, strict=True)):
            assert ledger == {
                "parameters": expected.parameters,
                "gradients": expected.gradients,
                "optimizer": expected.optimizer,
            }, (strategy, rank)
        held = sum(ledger["parameters"] for ledger in logged)
        # ddp: every rank holds all of it; fsdp: the ranks' shards add up to the model.
        assert held == count * 4 * (2 if strategy == "ddp" else 1)
        log = (run_dir / "train.log").read_text()
        assert log.count("memory ledger, rank") == 2


def test_fsdp_logs_the_bytes_its_all_gathers_and_reduce_scatters_move(runs):
    # Padded to 2 ranks (rows rounded up to even), per block: norm1, norm2 4 x 34; qkv
    # 100 x 33 + 100; proj 34 x 33 + 34; mlp 132 x 33 + 132 and 34 x 132 + 34.
    block = 4 * 34 + 100 * 33 + 100 + 34 * 33 + 34 + 132 * 33 + 132 + 34 * 132 + 34
    # The root: token embedding 128 x 33 (the head shares it), positions 16 x 33, norm 2 x 34.
    root = 128 * 33 + 16 * 33 + 2 * 34
    padded_bytes = (2 * block + root) * 4
    # Every micro-batch (2 a step) gathers each unit for forward and again for backward
    # (reshard_after_forward); the step's last micro-batch reduce-scatters the gradients.
    all_gather, reduce_scatter = 2 * 2 * padded_bytes, padded_bytes
    for event in (e for e in read_metrics(runs["fsdp"][1]) if "train/loss" in e):
        assert event["comm/all_gather_bytes_per_step"] == all_gather == 515_584
        assert event["comm/reduce_scatter_bytes_per_step"] == reduce_scatter == 128_896
        assert event["comm/bytes_per_step"] == all_gather + reduce_scatter
    ddp = [e for e in read_metrics(runs["ddp"][1]) if "train/loss" in e]
    assert "comm/all_gather_bytes_per_step" not in ddp[0]
    assert ddp[0]["comm/bytes_per_step"] == runs["ddp"][0]["memory/ledger"][0]["gradients"]
