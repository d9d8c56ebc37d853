"""The GPU check (benchmarks/gpu.py) stays ready for a machine with a GPU: its CPU mode runs
every step end to end at toy size, every configuration it will run on the GPU composes and
validates here, and its arithmetic (bitwise comparison, steady rates, MFU by hand, wheel
checks, isolation of a step) is right."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu, gpu_steps
from benchmarks.isolated import run_forked
from benchmarks.plain_gpt import (
    BETAS,
    CLIP,
    LR,
    LR_WARMUP,
    WEIGHT_DECAY,
    GPTWork,
    counted_flops,
    datasheet_peak_tflops,
    mfu,
)
from framework.config.validation import validate
from tests.conftest import REPO, make_cfg

TOY = GPTWork(
    layers=1,
    heads=2,
    width=16,
    block_size=8,
    stride=8,
    batch_size=4,
    warmup=1,
    steps=2,
    log_every=1,
    peak_tflops=1.0,
)


def gpu_check(tmp_path: Path) -> gpu_steps.Check:
    settings = gpu.gpt_settings(gpu.arguments([]))
    return gpu_steps.Check(scratch=tmp_path, **settings)


# --- what it will run on the GPU composes here ---------------------------------------------------
def test_every_configuration_the_gpu_run_uses_composes_and_validates(tmp_path):
    check = gpu_check(tmp_path)
    assert not check.cpu and check.variants == ("bf16", "bf16+compile")
    configs = [check.gpt.with_variant(v).overrides() for v in check.variants]
    configs.append([*gpu_steps.CHECKPOINT_RUN, "trainer.max_steps=30"])
    configs.extend(gpu_steps.variant_cases(check).values())
    for overrides in configs:
        validate(make_cfg(*overrides))
    gpt_cfg = make_cfg(*configs[1])
    assert gpt_cfg.trainer.compile and gpt_cfg.precision._target_.endswith("BF16")
    assert gpt_cfg.model.width == 768 and gpt_cfg.launcher.nproc_per_node == 1


def test_two_local_ranks_on_one_gpu_share_it(monkeypatch):
    """The variants step's two gloo ranks on the GPU machine's one device: both on cuda:0."""
    from framework.core.distributed import pick_device
    from framework.core.launch_context import DistEnv

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    devices = [pick_device(DistEnv(rank=r, local_rank=r, world_size=2)) for r in (0, 1)]
    assert devices == chosen == [torch.device("cuda", 0)] * 2


def test_the_plain_loop_trains_as_the_preset_does():
    cfg = make_cfg("experiment=char_gpt")
    assert cfg.optimizer.lr == LR and cfg.optimizer.weight_decay == WEIGHT_DECAY
    assert tuple(cfg.optimizer.betas) == BETAS and cfg.optimizer.no_weight_decay
    assert cfg.optimizer.fused and cfg.trainer.clip_grad_norm == CLIP
    assert cfg.scheduler.warmup_steps == LR_WARMUP and cfg.scheduler.min_lr_ratio == 0
    assert cfg.data.vocab_size == 128 and cfg.model.dropout == 0


def test_the_hand_count_of_flops_is_the_frameworks():
    from benchmarks.plain_gpt import build_model
    from framework.components.tasks.language_model import LanguageModel
    from framework.components.utilization import micro_batch_flops
    from framework.config.registry import option_values

    tokens = torch.zeros(TOY.batch_size, TOY.block_size, dtype=torch.long)
    flops, where = micro_batch_flops(
        LanguageModel(**option_values("task", "language_model")),
        lambda: build_model(TOY),
        (tokens, tokens),
        torch.device("cpu"),
        lambda batch, device: tuple(t.to(device) for t in batch),
    )
    assert where == "meta" and flops == counted_flops(TOY)


def test_mfu_by_hand_and_the_datasheet_peaks():
    assert mfu(4e12, 50.0, 1000.0) == pytest.approx(0.2)
    assert datasheet_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert datasheet_peak_tflops("NVIDIA H100 PCIe") == 756.5
    assert datasheet_peak_tflops("NVIDIA H200") == 989.4
    assert datasheet_peak_tflops("NVIDIA A100-SXM4-80GB") is None


def test_the_steady_rate_weighs_each_window_by_its_steps():
    events = [
        {"step": 2, "mfu": 9.0},  # warm-up: left out
        {"step": 4, "mfu": 0.4},  # 2 steps
        {"step": 10, "mfu": 0.2},  # 6 steps
    ]
    assert gpu_steps.steady_rate(events, 2, "mfu") == pytest.approx(8 / (2 / 0.4 + 6 / 0.2))


def test_train_and_the_plain_loop_lead_alike():
    assert gpu_steps.alternated(3) == [
        (0, "train"),
        (0, "plain"),
        (1, "plain"),
        (1, "train"),
        (2, "train"),
        (2, "plain"),
    ]


def test_the_gpu_tests_are_found():
    files = [path.name for path in gpu_steps.gpu_test_files()]
    assert "test_cuda.py" in files and "test_gpu_check.py" not in files


# --- bit for bit ------------------------------------------------------------------------------
def test_bitwise_differences_see_one_flipped_bit_and_a_changed_dtype():
    weights = torch.randn(5)
    flipped = weights.clone()
    flipped.view(torch.int32)[3] ^= 1
    assert gpu_steps.bitwise_differences(weights, weights.clone(), "w") == []
    assert gpu_steps.bitwise_differences(flipped, weights, "w") == ["w: the bits differ"]
    assert gpu_steps.bitwise_differences(weights.double(), weights, "w")[0].startswith("w: torch.f")
    zeros = gpu_steps.bitwise_differences(torch.tensor([0.0]), torch.tensor([-0.0]), "z")
    assert zeros == ["z: the bits differ"]  # equal as numbers, not as bits


def test_bitwise_differences_walk_containers():
    now = {"a": [1, 2.0, math.nan], "b": {"c": torch.ones(2)}, "only_now": 1}
    saved = {"a": [1, 2.0, math.nan], "b": {"c": torch.zeros(2)}, "only_saved": 2}
    assert sorted(gpu_steps.bitwise_differences(now, saved, "s")) == [
        "s.b.c: the bits differ",
        "s.only_now: only in this run",
        "s.only_saved: only in the checkpoint",
    ]


# --- the wheels ----------------------------------------------------------------------------
def test_the_carried_wheels_are_pinned_by_the_lock_and_must_be_pure_python():
    versions = gpu.locked_versions(gpu.RUNTIME_WHEELS)
    assert versions["hydra-core"] == "1.3.8" and set(versions) == set(gpu.RUNTIME_WHEELS)
    assert gpu.wheel_problems(["omegaconf-2.3.1-py3-none-any.whl"]) == []
    assert gpu.wheel_problems(["pyyaml-6.0.3-cp312-cp312-manylinux_2_17_x86_64.whl"]) == [
        "pyyaml-6.0.3-cp312-cp312-manylinux_2_17_x86_64.whl is not a pure-Python py3 wheel"
    ]
    assert gpu.wheel_problems(["a-1-py3-none-any.whl", "a-2-py3-none-any.whl"]) == [
        "two versions of a: ['a-1-py3-none-any.whl', 'a-2-py3-none-any.whl']"
    ]


# --- a step in a process of its own ----------------------------------------------------------
def _returns(report):
    report({"so_far": 1})
    return {"done": os.getpid()}


def _raises(report):
    report({"so_far": 2})
    raise ValueError("this step is broken")


def _hangs(report):
    report({"so_far": 3})
    time.sleep(60)
    return {}


def test_a_forked_step_returns_fails_or_is_stopped_with_what_it_found(tmp_path):
    returned = run_forked(_returns, tmp_path / "a.log", timeout_s=30)
    assert returned.finished and returned.result["done"] != os.getpid()
    failed = run_forked(_raises, tmp_path / "b.log", timeout_s=30)
    assert not failed.finished and failed.result == {"so_far": 2}
    assert "ValueError: this step is broken" in failed.error
    assert "this step is broken" in (tmp_path / "b.log").read_text()
    started = time.monotonic()
    stopped = run_forked(_hangs, tmp_path / "c.log", timeout_s=2)
    assert time.monotonic() - started < 20
    assert not stopped.finished and stopped.result == {"so_far": 3}
    assert stopped.error == "stopped at its time limit"


# --- the whole check, at toy size ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.distributed
def test_the_cpu_mode_runs_every_step_and_writes_its_figures(tmp_path):
    out = tmp_path / "out"
    found = subprocess.run(
        [sys.executable, "-m", "benchmarks", "gpu", "--cpu", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    record = json.loads((out / "gpu-check.json").read_text())
    steps = {step["name"]: step for step in record["steps"]}
    assert list(steps) == list(gpu.STEPS), found.stdout[-3000:]
    failed = {n: s["error"] or s["figures"] for n, s in steps.items() if not s["ok"]}
    assert found.returncode == 0 and not failed, (failed, found.stdout[-3000:])
    assert "GPU check (cpu, no GPU)" in found.stdout and "7/7 steps ok" in found.stdout
    assert (out / "gpu-check.log").stat().st_size > 0

    assert steps["tests"]["figures"]["counts"]["skipped"] >= 6  # the CUDA tests, on a CPU
    train = steps["train"]["figures"]
    assert train["backend"] == "gloo" and train["summary_line"].startswith("[rank 0] done:")

    gpt = steps["gpt"]["figures"]
    variant = gpt["variants"]["fp32"]
    assert variant["complete"] and len(variant["round_ratios"]) == 2
    assert all(rate > 0 for rate in variant["train_tokens_per_s"] + variant["plain_tokens_per_s"])
    assert variant["ratio"] > 0 and variant["flops_match"]
    assert variant["train_mfu_logged"] == pytest.approx(variant["train_mfu_by_hand"], rel=1e-6)
    assert gpt["flops_per_step_analytic"] == pytest.approx(gpt["flops_per_step_counted"], rel=0.05)

    assert all(case["ok"] for case in steps["sync"]["figures"]["cases"].values())
    cases = steps["variants"]["figures"]["cases"]
    assert cases["amp + powersgd, 2 ranks"]["comm/compression"] > 1
    assert cases["fsdp + bf16, 2 ranks"]["world_size"] == 2

    legs = steps["checkpoint"]["figures"]["legs"]
    assert [leg["steps"] for leg in legs] == [10, 20, 30]
    assert all(leg["differences"] == [] for leg in legs) and legs[2]["compared"]
    assert legs[1]["tensors_compared"] > 20  # weights, AdamW's moments, the EMA's, ...
