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
import resource

import pytest

from framework.core.exits import ExitCode
from tests.conftest import REPO, run_cli
from tests.faults import MEMORY_CAP_ENV

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CAPPED = (f"hydra.searchpath=[file://{REPO / 'tests' / 'conf'}]", "experiment=capped_gpt")
# Three blocks: less to build and train than the experiment's four, the same margins.
CAPPED_RUN = (*CAPPED, "model.layers=3")
CAP_MIB = 288  # each rank's memory beyond what it held when the model was built
MIB = 2**20


def test_a_model_over_one_ranks_memory_fails_under_ddp_and_trains_under_fsdp_on_four(tmp_path, cli):
    env = {MEMORY_CAP_ENV: str(CAP_MIB), "OMP_NUM_THREADS": "1"}
    # Two ranks, each out of memory at the same step: the command says it once.
    ddp = run_cli(
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
