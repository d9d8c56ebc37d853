"""A model that does not fit one rank, as a user meets it: each rank's memory capped (RLIMIT_DATA,
set in the rank by tests/faults.py MemoryCappedGPT), a GPT whose parameters and AdamW state
(about 450 MB) exceed the cap fails under strategy=ddp with one out-of-memory line and its own
exit code, and trains under strategy=fsdp on 4 ranks (each builds only its shards, on the meta
device). `train ... mode=estimate` says so beforehand, without a run dir. The runs use 3 of the
experiment's 4 blocks (about 340 MB of states) under a 288 MiB cap: the whole model's states
still exceed the cap by 38 MiB, and a quarter of them leave about the same room (207 MiB) as 4
blocks under 320 MiB (211)."""

from __future__ import annotations

import json
import math
import resource

import pytest
import torch
from hydra.utils import instantiate
from safetensors.torch import save_file

from framework.core.exits import ExitCode
from tests.conftest import REPO, make_cfg, read_metrics
from tests.faults import MEMORY_CAP_ENV

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CAPPED = (f"hydra.searchpath=[file://{REPO / 'tests' / 'conf'}]", "experiment=capped_gpt")
# Three blocks: less to build and train than the experiment's four, the same margins.
CAPPED_RUN = (*CAPPED, "model.layers=3")
CAP_MIB = 288  # each rank's memory beyond what it held when the model was built
MIB = 2**20


def test_a_model_over_one_ranks_memory_fails_under_ddp_and_trains_under_fsdp_on_four(tmp_path, cli):
    env = {MEMORY_CAP_ENV: str(CAP_MIB), "OMP_NUM_THREADS": None}
    # Two ranks, each out of memory at the same step: the command says it once.
    ddp = cli(
        *CAPPED_RUN,
        "strategy=ddp",
        "launcher.nproc_per_node=2",
        f"hydra.run.dir={tmp_path / 'ddp'}",
        cwd=tmp_path,
        env=env,
    )
    assert ddp.returncode == ExitCode.OUT_OF_MEMORY == 5, ddp.stderr[-3000:]
    (line,) = [line for line in ddp.stderr.splitlines() if "ran out of memory" in line]
    assert line.startswith("error: rank ") and "ran out of memory (it asked for " in line
    assert "strategy=fsdp shards the parameters, gradients and optimizer state" in line
    assert "Traceback" not in ddp.stderr

    uncapped = resource.getrlimit(resource.RLIMIT_DATA)
    # Four ranks forked from the fork server, capped there: `train` itself may run here. Without
    # OMP_NUM_THREADS each rank takes one thread of the two cores (a forked rank no longer reads
    # it; a second thread's heap would count against the cap).
    fsdp = cli(
        *CAPPED_RUN,
        "strategy=fsdp",
        "launcher.nproc_per_node=4",
        f"hydra.run.dir={tmp_path / 'fsdp'}",
        cwd=tmp_path,
        env={MEMORY_CAP_ENV: str(CAP_MIB), "OMP_NUM_THREADS": None},
    )
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert resource.getrlimit(resource.RLIMIT_DATA) == uncapped  # only the ranks were capped
    summary = json.loads((tmp_path / "fsdp" / "summary.json").read_text())
    assert summary["steps"] == 2
    ledgers = summary["memory/ledger"]
    whole = sum(ledger["parameters"] for ledger in ledgers)
    for ledger in ledgers:  # a quarter each; the whole model's states would not fit the cap
        assert ledger["parameters"] == pytest.approx(whole / 4, rel=0.01)
        states = ledger["parameters"] + ledger["gradients"] + ledger["optimizer"]
        assert states < CAP_MIB * MIB < 4 * states


def test_mode_estimate_prints_each_ranks_ledger_and_launches_nothing(tmp_path, cli):
    result = cli(
        *CAPPED, "strategy=fsdp", "launcher.nproc_per_node=4", "mode=estimate", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("memory estimate per rank: strategy=fsdp on 4 rank(s), ")
    ranks = [line for line in lines if line.lstrip().startswith("rank ")]
    assert len(ranks) == 4
    assert "parameters 27.15 MiB, gradients 27.15 MiB, optimizer state 54.29 MiB" in ranks[0]
    assert list(tmp_path.iterdir()) == []  # no run dir, no outputs/


# A GPT of 193 MiB of float32 tensors in 16 blocks of 12 MiB, fine-tuned by SGD without
# momentum: a step under fsdp holds the shards' parameters and gradients (half of the model over
# 4 ranks) and a few blocks gathered whole, which leaves the load to decide.
FILE_RUN = (
    *CAPPED,
    "model.layers=16",
    "model.width=512",
    "optimizer=sgd",
    "optimizer.momentum=0",
    "data.block_size=8",
    "data.stride=8",
    "trainer.max_steps=1",
    "trainer.eval_batches=1",
)
FILE_CAP_MIB = 176


def test_a_file_too_large_for_one_capped_rank_fine_tunes_under_fsdp_each_rank_reading_its_rows(
    tmp_path, cli
):
    """init=file under the cap: one rank cannot hold the model (ddp is refused before a rank
    starts); each of 4 fsdp ranks reads only its own rows of the file and fine-tunes from its
    weights: its first loss is the one an uncapped rank that read the file whole gets on the
    same 4 samples.

    The least cap each run passes under, bisected in steps of 2-4 MiB (2026-11-28, torch 2.13,
    CPU; docs/weights.md): the fsdp run 153 MiB, 23 under the cap. Every fsdp rank reading the
    whole file (plan.tensors(), then its rows kept: its 48 MiB of shards beside the file's 193)
    about 245 MiB, 69 over: the test fails so, as it did before safetensors_reader.py, when
    safe_open mapped the whole file (RLIMIT_DATA charges the mapping in full). ddp's trial, which
    builds the model whole before any rank starts, about 202 MiB, 26 over. (Between 202 and 245
    a ddp rank would build the model and run out of memory reading the file beside it: too
    narrow a window to decide both legs by a margin.) 21-25 s on 2 cores shared with other
    jobs, 15 of them the fsdp run."""
    torch.manual_seed(7)
    model = instantiate(make_cfg(*FILE_RUN).model)
    tensors = {key: value.detach().clone() for key, value in model.state_dict().items()}
    del tensors["head.weight"], model  # tied to tokens.weight: the file holds it once
    # Unlike any fresh model: a first loss far above a fresh one's ln(vocab) is the file's.
    tensors["tokens.weight"] *= 10
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    assert 190 * MIB < path.stat().st_size < 200 * MIB
    del tensors
    from_file = (*FILE_RUN, "init=file", f"init.path={path}")

    ddp = cli(
        *from_file,
        "strategy=ddp",
        f"hydra.run.dir={tmp_path / 'ddp'}",
        cwd=tmp_path,
        env={MEMORY_CAP_ENV: str(FILE_CAP_MIB), "OMP_NUM_THREADS": None},
    )
    assert ddp.returncode == ExitCode.CONFIG_REJECTED, ddp.stderr[-3000:]
    (line,) = ddp.stderr.strip().splitlines()
    assert line.startswith(
        "error: model: tests.faults.MemoryCappedGPT is too large for the cpu memory of this "
        "machine: it asked for "
    ), line
    assert (
        " MiB at once; make it smaller (its largest setting is model.width=512), or shard " in line
    )
    assert line.endswith(
        " over the ranks with strategy=fsdp (built on the meta device, no rank holds it whole)"
    ), line
    assert not (tmp_path / "ddp").exists()

    fsdp = cli(
        *from_file,
        "strategy=fsdp",
        "launcher.nproc_per_node=4",
        "data.batch_size=1",
        f"hydra.run.dir={tmp_path / 'fsdp'}",
        cwd=tmp_path,
        env={MEMORY_CAP_ENV: str(FILE_CAP_MIB), "OMP_NUM_THREADS": None},
    )
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert json.loads((tmp_path / "fsdp" / "summary.json").read_text())["steps"] == 1
    # The same 4 samples on one uncapped rank (an epoch's order does not depend on the world
    # size), the file read whole.
    whole = cli(
        *from_file,
        "launcher.nproc_per_node=1",
        "data.batch_size=4",
        f"hydra.run.dir={tmp_path / 'whole'}",
        cwd=tmp_path,
        env={MEMORY_CAP_ENV: None},
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = read_metrics(tmp_path / "fsdp")[0]["train/loss"]
    assert first == pytest.approx(read_metrics(tmp_path / "whole")[0]["train/loss"], rel=1e-5)
    assert first > 3 * math.log(128)
