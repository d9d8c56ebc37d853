"""The steps of the GPU check (benchmarks/gpu.py). Each runs in a process of its own
(benchmarks/isolated.py) and returns (ok, figures); an exception is a failed step, reported
with its traceback's tail, and the next step runs regardless.

    environment  the device, the versions, a bf16 matrix product's rate, NCCL on one rank
    tests        the CUDA-marked tests (every test a GPU un-skips carries the `gpu` mark)
    train        the default `train` as a user types it, from an empty folder
    gpt          the GPT preset scaled up, `train` against a plain loop, alternated, per variant
    sync         torch.cuda.set_sync_debug_mode("error") around the steady steps of `train`
    variants     precision=amp (GradScaler), comm=powersgd, strategy=fsdp
    checkpoint   written on the GPU, resumed on the CPU, and back: the state bit-exact
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.isolated import Report, run_forked
from benchmarks.plain_gpt import (
    GPTWork,
    analytic_flops,
    counted_flops,
    datasheet_peak_tflops,
    mfu,
    reset_peak_memory,
    train_plain,
)

REPO = Path(__file__).resolve().parent.parent
StepResult = tuple[bool, dict[str, Any]]
# The steady window of the sync step: steps 11 to 19, between the log events of steps 10 and 20
# (trainer.log_every=10, each a deliberate read of the device).
SYNC_FIRST, SYNC_LAST = 11, 20
MFU_TOLERANCE = 0.01  # relative: the logged and the hand-computed MFU of the same run


@dataclass(frozen=True)
class Check:
    """What every step needs to know about this call."""

    cpu: bool  # toy sizes on the CPU (CUDA hidden), else the GPU
    scratch: Path  # run dirs and logs of this call
    gpt: GPTWork
    variants: tuple[str, ...]  # of the GPT step: "bf16", "bf16+compile", ...
    rounds: int  # of the GPT step, per variant: each round runs both contenders
    site: str | None = None  # where the framework was installed (prepended to PYTHONPATH)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.cpu else torch.device("cuda", 0)

    @property
    def python(self) -> str:
        return sys.executable

    def subprocess_env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.site:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [self.site, env.get("PYTHONPATH")]))
        return env

    def two_ranks(self) -> list[str]:
        """Two ranks on this machine: on one GPU they share it over gloo (NCCL cannot put two
        ranks on one device); on the CPU, gloo as always."""
        if self.cpu:
            return ["launcher.nproc_per_node=2"]
        return ["launcher.nproc_per_node=2", "launcher.oversubscribe=true", "dist.backend=gloo"]


@dataclass(frozen=True)
class StepRun:
    check: Check
    deadline: float  # time.monotonic() by which the step must have returned
    report: Report  # what the step has found so far (kept if it is killed)

    def remaining(self, margin: float = 5.0) -> float:
        return max(1.0, self.deadline - time.monotonic() - margin)


def preload() -> None:
    """What the steps import, imported once in the caller so each forked step has it, and
    Hydra's first composition (its plugin scan and config store), which in each process costs
    about three later ones (0.29 s against 0.09 here)."""
    import hydra  # noqa: F401
    import matplotlib.pyplot  # noqa: F401  (every run draws its curves at the end)
    import torch._dynamo  # noqa: F401

    import benchmarks.common
    import framework.launch.start
    import framework.rank.main  # noqa: F401

    # A composition that fails here fails again in each step that composes, reported there.
    with contextlib.suppress(Exception):
        benchmarks.common.compose([])


# --- environment -------------------------------------------------------------------------------
def environment(run: StepRun) -> StepResult:
    import hydra
    import omegaconf

    import framework

    figures: dict[str, Any] = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "hydra": hydra.__version__,
        "omegaconf": omegaconf.__version__,
        "framework_from": str(Path(framework.__file__).parent),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        figures.update(gpu_figures())
    return run.check.cpu or figures["cuda_available"], figures


def gpu_figures() -> dict[str, Any]:
    """Each figure on its own: one that cannot be read is named with why, the others stay."""
    properties = torch.cuda.get_device_properties(0)
    readers: dict[str, Callable[[], Any]] = {
        "device_name": lambda: torch.cuda.get_device_name(0),
        "capability": lambda: ".".join(map(str, torch.cuda.get_device_capability(0))),
        "memory_gib": lambda: round(properties.total_memory / 2**30, 1),
        "multiprocessors": lambda: properties.multi_processor_count,
        "cudnn": torch.backends.cudnn.version,
        "nccl": lambda: str(torch.cuda.nccl.version()),
        "nvidia_smi": _nvidia_smi,
        "bf16_matmul_tflops": bf16_matmul_tflops,
        "nccl_one_rank": nccl_one_rank,
    }
    figures = {}
    for name, read in readers.items():
        try:
            figures[name] = read()
        except Exception as error:  # noqa: BLE001 (a figure, not the step)
            figures[name] = f"not read: {_first_lines(error, 1)}"
    return figures


def _nvidia_smi() -> str:
    query = "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit"
    try:
        found = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True
        )
    except OSError as error:
        return f"not run: {error}"
    return (found.stdout or found.stderr).strip()


def bf16_matmul_tflops(size: int = 8192, repeats: int = 10) -> float:
    """The ceiling MFU is read against: one size x size x size bf16 product on random data,
    the median of `repeats` timed with CUDA events after 3 warm-ups."""
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * size**3 / statistics.median(times) / 1e12


def nccl_one_rank() -> str:
    """A one-rank NCCL group and an all-reduce: one GPU forms no bigger NCCL group, and a
    one-rank `train` forms none at all."""
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0)
        )
        tensor = torch.ones(4, device="cuda")
        dist.all_reduce(tensor)
        torch.cuda.synchronize()
        return "ok" if tensor.tolist() == [1.0] * 4 else f"wrong sum {tensor.tolist()}"
    except Exception as error:  # noqa: BLE001 (a figure, not a crash)
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# --- tests ---------------------------------------------------------------------------------
def gpu_test_files(tests: Path = REPO / "tests") -> list[Path]:
    """The test files that hold a test a GPU can change: marked `gpu`, or asking for CUDA."""
    return sorted(
        path
        for path in tests.rglob("test_*.py")
        if re.search(r"mark\.gpu|torch\.cuda\.", path.read_text())
    )


def tests(run: StepRun) -> StepResult:
    check = run.check
    junit = check.scratch / "junit-gpu.xml"
    files = gpu_test_files()
    command = [
        check.python,
        "-m",
        "pytest",
        "-o",
        "addopts=",  # the project's -n 2 needs pytest-xdist; one process, in order
        "-p",
        "no:cacheprovider",
        "-ra",
        "--strict-markers",
        "-m",
        "gpu",
        f"--junitxml={junit}",
        *(str(path.relative_to(REPO)) for path in files),
    ]
    returncode = run_pytest(command, run)
    outcomes = junit_outcomes(junit) if junit.exists() else {}
    counts = {
        kind: sum(outcome.startswith(kind) for outcome in outcomes.values())
        for kind in ("passed", "failed", "skipped")
    }
    figures = {
        "command": " ".join(command[1:]),
        "files": [str(path.relative_to(REPO)) for path in files],
        "returncode": returncode,
        "counts": counts,
        "outcomes": outcomes,
    }
    selected = sum(counts.values())
    # On the GPU every selected test must run; on the CPU they all skip, as in the suite.
    ran_as_expected = counts["skipped"] == (selected if check.cpu else 0)
    return returncode == 0 and selected > 0 and ran_as_expected, figures


def run_pytest(command: list[str], run: StepRun) -> int:
    """The command's exit code. On the GPU, a process of its own, as a user runs it; its output
    goes straight to this step's log, which keeps it even if the time runs out. On the CPU,
    where every selected test skips, pytest.main in this step's forked process, which has
    torch and the framework imported: a new interpreter would import them again (2 s of CPU on
    2 shared cores) to prove nothing more."""
    check = run.check
    if not check.cpu:
        env = check.subprocess_env()
        return subprocess.run(command, cwd=REPO, env=env, timeout=run.remaining()).returncode
    import pytest

    os.chdir(REPO)
    # Hydra's pytest plugin cannot be assertion-rewritten once Hydra is imported: not a finding.
    quiet = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
    return int(pytest.main([*command[command.index("pytest") + 1 :], *quiet]))


def junit_outcomes(path: Path) -> dict[str, str]:
    """{test id: "passed" | "skipped" | "failed: <the message's first line>"}."""
    outcomes = {}
    for case in ElementTree.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = next((c for c in case if c.tag in ("failure", "error")), None)
        if problem is not None:
            message = (problem.get("message") or problem.tag).splitlines() or [problem.tag]
            outcomes[name] = f"failed: {message[0][:200]}"
        elif any(c.tag == "skipped" for c in case):
            outcomes[name] = "skipped"
        else:
            outcomes[name] = "passed"
    return outcomes


# --- the default train ---------------------------------------------------------------------
SUMMARY_LINE = re.compile(r"\[rank 0\] done: .*")
FIRST_LINE = re.compile(r"world_size=(\d+) backend=(\w+) device=(\w+)")


def train(run: StepRun) -> StepResult:
    """`train` as a user types it, from an empty folder (so the installed framework runs,
    its config groups from inside the package)."""
    check = run.check
    run_dir, cwd = check.scratch / "train", check.scratch / "empty"
    cwd.mkdir(exist_ok=True)
    # On the CPU the toy check stops early; on the GPU it is the whole default experiment.
    overrides = [f"hydra.run.dir={run_dir}", *(["trainer.max_steps=120"] if check.cpu else [])]
    command = [check.python, "-m", "framework.cli", *overrides]
    started = time.monotonic()
    found = subprocess.run(command, cwd=cwd, env=check.subprocess_env(), timeout=run.remaining())
    seconds = time.monotonic() - started
    log = run_dir / "train.log"  # rank 0's console, as the user saw it
    output = log.read_text() if log.exists() else ""
    line, first = SUMMARY_LINE.search(output), FIRST_LINE.search(output)
    summary = _read_json(run_dir / "summary.json")
    figures = {
        "command": "train " + " ".join(overrides),
        "command_s": round(seconds, 1),
        "returncode": found.returncode,
        "summary_line": line.group(0) if line else None,
        "world_size": int(first.group(1)) if first else None,
        "backend": first.group(2) if first else None,
        "device": first.group(3) if first else None,
        **{key: summary.get(key) for key in ("val/accuracy", "val/loss", "steps", "wall_s")},
        "samples_per_s": summary.get("samples_per_s"),
    }
    accuracy = summary.get("val/accuracy") or 0.0
    right_device = figures["device"] == check.device.type
    return found.returncode == 0 and line is not None and right_device and accuracy > 0.5, figures


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


# --- the GPT: train against the plain loop -----------------------------------------------------
def gpt(run: StepRun) -> StepResult:
    check = run.check
    device, base = check.device, check.gpt
    flops = counted_flops(base)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    peak, source = _peak(check, name)
    figures: dict[str, Any] = {
        "device": name,
        "work": dataclasses.asdict(base),
        "tokens_per_step": base.tokens_per_step,
        "flops_per_step_counted": flops,
        "flops_per_step_analytic": analytic_flops(base),
        "peak_tflops": peak,
        "peak_source": source,
        "framework_table_peak_tflops": _table_peak(name) if device.type == "cuda" else None,
        "variants": {},
    }
    figures["analytic_over_counted"] = figures["flops_per_step_analytic"] / flops
    for variant in check.variants:
        work = base.with_variant(variant)
        runs: dict[str, list[dict[str, Any]]] = {"train": [], "plain": []}
        for index, contender in alternated(check.rounds):
            clean_slate(device)
            if contender == "train":
                found = train_gpt(work, device, check.scratch / f"gpt-{variant}-{index}")
            else:
                found = train_plain(work, device)
            runs[contender].append({**found, "round": index})
            figures["variants"][variant] = compare(runs, work, flops, peak, check.rounds)
            run.report(figures)
            print(f"gpt {variant} round {index} {contender}: {found['tokens_per_s']:.0f} tokens/s")
    ok = bool(check.variants) and all(
        v["complete"] and v["flops_match"] and v["mfu_matches"]
        for v in figures["variants"].values()
    )
    return ok, figures


def cpu_name() -> str:
    from benchmarks.common import machine

    return machine()["cpu"]


def _peak(check: Check, device_name: str) -> tuple[float | None, str]:
    if check.cpu:
        return check.gpt.peak_tflops, "trainer.peak_tflops (a CPU has no datasheet peak)"
    return datasheet_peak_tflops(device_name), "NVIDIA datasheet, dense bf16"


def _table_peak(device_name: str) -> float | None:
    from framework.components.utilization import table_peak_tflops

    found = table_peak_tflops(device_name, "bf16")
    return found[1] if found else None


def alternated(rounds: int) -> list[tuple[int, str]]:
    """(round, contender): train, plain, then plain, train, ...: each leads as often."""
    order = []
    for index in range(rounds):
        pair = ("train", "plain") if index % 2 == 0 else ("plain", "train")
        order += [(index, contender) for contender in pair]
    return order


def clean_slate(device: torch.device) -> None:
    """Nothing of the run before carries over: dynamo's compiled code (each contender
    compiles its own), garbage, cached blocks, the memory peak."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    reset_peak_memory(device)


def train_gpt(work: GPTWork, device: torch.device, run_dir: Path) -> dict[str, Any]:
    """framework.rank.main.rank_main on one rank, as `train` runs a one-rank job in its own
    process: steady tokens/s, MFU and peak memory from its metrics.jsonl."""
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = run_one_rank(work.overrides(), run_dir)
    events = [e for e in read_events(run_dir) if "train/loss" in e]
    samples_per_s = steady_rate(events, work.warmup, "samples_per_s")
    steady = [e for e in events if e["step"] > work.warmup]
    return {
        "tokens_per_s": samples_per_s * work.block_size,
        "steps_per_s": samples_per_s / work.batch_size,
        "mfu_logged": steady_rate(events, work.warmup, "mfu") if _all_have(steady, "mfu") else None,
        "flops_per_step_logged": (summary or {}).get("flops_per_step"),
        "peak_memory_mib": events[-1].get("memory/peak_mib_max") if events else None,
        "last_loss": events[-1]["train/loss"] if events else None,
    }


def run_one_rank(overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """`train` of a one-rank job in this process: what its IN_PROCESS start runs."""
    from benchmarks.common import compose
    from framework.core import startup_clock
    from framework.core.launch_context import DistEnv
    from framework.rank.main import rank_main

    startup_clock.count_from_now()  # its start-up line counts from here, not from the process
    return rank_main(compose(overrides), run_dir, DistEnv()) or {}


def _all_have(events: list[dict[str, Any]], key: str) -> bool:
    return bool(events) and all(key in e for e in events)


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steady_rate(events: list[dict[str, Any]], warmup: int, key: str) -> float:
    """A per-time rate (samples_per_s, mfu, tflops_per_s) over the log windows after warm-up:
    the windows' rates weighted by their steps, harmonically (their time is what adds up)."""
    steady = [e for e in events if e["step"] > warmup]
    starts = [warmup] + [e["step"] for e in steady[:-1]]
    steps = [e["step"] - start for e, start in zip(steady, starts, strict=True)]
    time_units = sum(n / e[key] for n, e in zip(steps, steady, strict=True))
    return sum(steps) / time_units if time_units else math.nan


def compare(
    runs: dict[str, list[dict[str, Any]]],
    work: GPTWork,
    flops: int,
    peak: float | None,
    rounds: int,
) -> dict[str, Any]:
    """One variant's figures: tokens/s of each contender (median of its runs), their ratio
    (of the medians, and round by round), MFU logged by `train` against MFU by hand from the
    counted FLOPs, the measured rate and the peak, and peak memory."""
    ours, plain = runs["train"], runs["plain"]
    figures: dict[str, Any] = {
        "complete": len(ours) == len(plain) == rounds,
        "train_tokens_per_s": [round(r["tokens_per_s"], 1) for r in ours],
        "plain_tokens_per_s": [round(r["tokens_per_s"], 1) for r in plain],
        "flops_match": bool(ours) and all(r["flops_per_step_logged"] == flops for r in ours),
        "train_peak_memory_mib": _median([r["peak_memory_mib"] for r in ours]),
        "plain_peak_memory_mib": _median([r["peak_memory_mib"] for r in plain]),
        "train_last_loss": ours[-1]["last_loss"] if ours else None,
        "plain_last_loss": plain[-1]["last_loss"] if plain else None,
    }
    if ours and plain:
        figures["ratio"] = _median(figures["train_tokens_per_s"]) / _median(
            figures["plain_tokens_per_s"]
        )
        by_round = {r["round"]: r["tokens_per_s"] for r in plain}
        figures["round_ratios"] = [
            round(r["tokens_per_s"] / by_round[r["round"]], 4)
            for r in ours
            if r["round"] in by_round
        ]
        figures["goal_met"] = figures["ratio"] >= 0.98
    figures.update(_mfu_figures(ours, plain, flops, peak))
    return figures


def _mfu_figures(
    ours: list[dict[str, Any]], plain: list[dict[str, Any]], flops: int, peak: float | None
) -> dict[str, Any]:
    if peak is None:
        return {"mfu_matches": False, "mfu_note": "no peak for this device: no MFU by hand"}
    logged = [r["mfu_logged"] for r in ours]
    by_hand = [mfu(flops, r["steps_per_s"], peak) for r in ours]
    errors = [
        abs(found / expected - 1) if found is not None else math.inf
        for found, expected in zip(logged, by_hand, strict=True)
    ]
    return {
        "train_mfu_logged": _median([m for m in logged if m is not None]),
        "train_mfu_by_hand": _median(by_hand),
        "plain_mfu_by_hand": _median([mfu(flops, r["steps_per_s"], peak) for r in plain]),
        "mfu_largest_relative_error": max(errors) if errors else None,
        "mfu_matches": bool(errors) and max(errors) <= MFU_TOLERANCE,
    }


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


# --- no host sync in the steady steps ------------------------------------------------------
def sync(run: StepRun) -> StepResult:
    check = run.check
    gpt_variant = check.variants[-1] if check.variants else "bf16"
    gpt_work = dataclasses.replace(
        check.gpt.with_variant(gpt_variant), warmup=10, steps=15, log_every=10
    )
    cases = {
        "default": [
            "launcher.nproc_per_node=1",
            "trainer.max_steps=25",
            "trainer.progress_bar=false",
            "checkpoint.every=0",
            "checkpoint.final=false",
        ],
        f"gpt {gpt_variant}": gpt_work.overrides(),
    }
    figures = {
        "how": "the CUDA sync debug mode at 'error'"
        if not check.cpu
        else "reads of device-computed tensors counted (tests/sync_counting.py)",
        "steps_watched": [SYNC_FIRST, SYNC_LAST - 1],
        "cases": {},
    }
    for name, overrides in cases.items():
        figures["cases"][name] = watched_run(overrides, check, name)
        run.report(figures)
    return all(case["ok"] for case in figures["cases"].values()), figures


def watched_run(overrides: list[str], check: Check, name: str) -> dict[str, Any]:
    """One `train` run on one rank in this process, steps SYNC_FIRST..SYNC_LAST-1 watched."""
    run_dir = check.scratch / f"sync-{name.replace(' ', '-').replace('+', '-')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    clean_slate(check.device)
    seen: list[str] = []
    reads: list[str] = []
    try:
        with watching_steps(check.cpu, seen, reads):
            run_one_rank(overrides, run_dir)
    except Exception as error:  # noqa: BLE001 (a synchronising call raises here: the finding)
        return {"ok": False, "window": seen, "error": _first_lines(error)}
    window_ran = seen == ["armed", "disarmed"]
    return {"ok": window_ran and not reads, "window": seen, "reads": reads}


@contextlib.contextmanager
def watching_steps(cpu: bool, seen: list[str], reads: list[str]) -> Iterator[None]:
    """Runner.train_step patched, as tests/distributed/test_cuda.py does: from the start of
    step SYNC_FIRST to the start of step SYNC_LAST (those steps and the loop's work between
    them) a synchronising CUDA call raises (GPU), or each read of a computed tensor is
    recorded into `reads` (CPU, where every tensor is a host tensor)."""
    from framework.rank.loop import Runner

    original = Runner.train_step
    if cpu:
        from tests.sync_counting import watch_steps

        watch_steps(Runner, first=SYNC_FIRST, last=SYNC_LAST, results=reads)
    counted = Runner.train_step

    def train_step(self, micro_batches):
        step = self.state.step + 1
        if step == SYNC_FIRST:
            seen.append("armed")
            if not cpu:
                torch.cuda.set_sync_debug_mode("error")
        if step == SYNC_LAST:
            if not cpu:
                torch.cuda.set_sync_debug_mode("default")
            seen.append("disarmed")
        return counted(self, micro_batches)

    Runner.train_step = train_step
    try:
        yield
    finally:
        Runner.train_step = original
        if not cpu:
            torch.cuda.set_sync_debug_mode("default")


def _first_lines(error: BaseException, lines: int = 6) -> str:
    return "\n".join(f"{type(error).__name__}: {error}".splitlines()[:lines])


# --- amp, powersgd, fsdp ---------------------------------------------------------------------
def variants(run: StepRun) -> StepResult:
    """Each as `train` starts it (launcher=local): one rank in this process, two forked
    from the fork server."""
    from framework.launch import forkserver

    forkserver.warm_up()  # two-rank cases fork from it: its imports overlap the first case
    check = run.check
    cases = variant_cases(check)
    figures: dict[str, Any] = {
        "two_ranks": "gloo, both on CPU"
        if check.cpu
        else "gloo, both ranks on cuda:0 (launcher.oversubscribe=true): NCCL cannot put two "
        "ranks on one GPU",
        "cases": {},
    }
    for name, overrides in cases.items():
        figures["cases"][name] = launched_run(overrides, check, name)
        run.report(figures)
    return all(case["ok"] for case in figures["cases"].values()), figures


def variant_cases(check: Check) -> dict[str, list[str]]:
    """Each case's overrides. fp16/bf16 on a CPU run torch's reference kernels (about 10x
    fp32): the CPU's toy sizes take the fewest steps that still show one logged loss, a loss
    scale and compressed steps, a narrower CNN on smaller batches, a smaller GPT and a small
    validation split."""
    steps = 4 if check.cpu else 40
    common = [
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=null",
        "trainer.log_every=4",
        "trainer.progress_bar=false",
        "checkpoint.every=0",
    ]
    # channels_last: the CPU's fp16 convolutions are about twice as fast in it; a narrower CNN
    # and smaller batches: the default CNN's 4 steps in fp16 took 3 to 10 s a case there.
    toy_cnn = (
        [
            "trainer.channels_last=true",
            "model.width=8",
            "data.batch_size=8",
            "data.val_fraction=0.05",
        ]
        if check.cpu
        else []
    )
    width, block, val = (32, 16, ["data.val_fraction=0.01"]) if check.cpu else (64, 32, [])
    cases = {
        "amp, 1 rank": ["precision=amp", "launcher.nproc_per_node=1", *toy_cnn],
        "amp + powersgd, 2 ranks": [
            "precision=amp",
            "comm=powersgd",
            "comm.start_iter=2",
            *check.two_ranks(),
            *toy_cnn,
        ],
        "fsdp + bf16, 2 ranks": [
            "experiment=char_gpt",
            "model.layers=2",
            f"model.width={width}",
            f"data.block_size={block}",
            "task.sample_tokens=0",
            "strategy=fsdp",
            "precision=bf16",
            *check.two_ranks(),
            *val,
        ],
    }
    return {name: [*overrides, *common] for name, overrides in cases.items()}


def launched_run(overrides: list[str], check: Check, name: str) -> dict[str, Any]:
    """What `train` does after composing: validate, resolve, launch the ranks."""
    from benchmarks.common import compose
    from framework.launch.start import launch

    run_dir = check.scratch / f"variant-{re.sub(r'[^a-z0-9]+', '-', name)}"
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        launch(compose(overrides), run_dir)
    except (Exception, SystemExit) as error:  # noqa: BLE001 (the finding)
        return {"ok": False, "overrides": overrides, "error": _first_lines(error)}
    events = [e for e in read_events(run_dir) if "train/loss" in e]
    first = FIRST_LINE.search((run_dir / "train.log").read_text())
    summary = _read_json(run_dir / "summary.json")
    last = events[-1] if events else {}
    figures = {
        "overrides": overrides,
        "seconds": round(time.monotonic() - started, 1),
        "world_size": int(first.group(1)) if first else None,
        "backend": first.group(2) if first else None,
        "device": first.group(3) if first else None,
        "steps": summary.get("steps"),
        "losses": [e["train/loss"] for e in events],
        **{k: v for k, v in last.items() if k.startswith(("precision/", "comm/", "memory/"))},
    }
    figures["problems"] = variant_problems(figures, overrides, check.device.type)
    figures["ok"] = not figures["problems"]
    return figures


def variant_problems(figures: dict[str, Any], overrides: list[str], device: str) -> list[str]:
    """What a finished run of the variants step shows that it should not."""
    losses = figures["losses"]
    problems = [] if losses and all(map(math.isfinite, losses)) else ["a loss is not finite"]
    if figures["device"] != device:
        problems.append(f"trained on {figures['device']}, not {device}")
    if "precision=amp" in overrides and not figures.get("precision/loss_scale", 0) > 0:
        problems.append("no positive precision/loss_scale")
    if "comm=powersgd" in overrides and not figures.get("comm/compression", 1) > 1:
        problems.append("comm/compression is not above 1: PowerSGD did not compress")
    ranks = 2 if "launcher.nproc_per_node=2" in overrides else 1
    if figures["world_size"] != ranks:
        problems.append(f"world_size={figures['world_size']}, not {ranks}")
    return problems


# --- a checkpoint across devices -----------------------------------------------------------------
CHECKPOINT_RUN = [
    "optimizer=adamw",
    "trainer.ema_decay=0.9",
    "launcher.nproc_per_node=1",
    "trainer.max_epochs=null",
    "trainer.log_every=5",
    "trainer.progress_bar=false",
    "checkpoint.every=0",
]
NOT_CARRIED = ("rng.cuda",)  # a CPU has no CUDA generator: its state cannot cross a CPU leg
# Applied only once the epoch's iterator exists: compared as the first resumed step starts.
LAZILY_RESTORED = {"rng", "loader_generator"}


def checkpoint(run: StepRun) -> StepResult:
    """Three legs, each one `train` process on one rank: 10 steps on the GPU; resumed on the
    CPU to 20; resumed on the GPU to 30. Each resume compares what it holds right after
    loading (and the RNG streams and loader position as the first step starts) with the file,
    bit for bit."""
    check = run.check
    gpu = "cpu" if check.cpu else "cuda"
    legs = [(gpu, 10), ("cpu", 20), (gpu, 30)]
    figures: dict[str, Any] = {"legs": []}
    previous: Path | None = None
    for index, (device, steps) in enumerate(legs):
        run_dir = check.scratch / f"checkpoint-{index}-{device}"
        overrides = [*CHECKPOINT_RUN, f"trainer.max_steps={steps}"]
        if previous is not None:
            overrides.append(f"checkpoint.resume={previous}")
        outcome = run_forked(
            lambda report, o=overrides, d=run_dir: checkpoint_leg(o, d),
            log=check.scratch / f"checkpoint-{index}.log",
            timeout_s=run.remaining() / (len(legs) - index),
            env={"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {},
        )
        _copy_log(check.scratch / f"checkpoint-{index}.log")
        leg = {"device_asked": device, **(outcome.result or {}), "error": outcome.error}
        leg["ok"] = outcome.finished and _leg_ok(leg, device, resumed=previous is not None)
        figures["legs"].append(leg)
        run.report(figures)
        if not leg["ok"] or not leg.get("saved"):
            break
        previous = Path(leg["saved"])
    ok = len(figures["legs"]) == len(legs) and all(leg["ok"] for leg in figures["legs"])
    return ok, figures


def _leg_ok(leg: dict[str, Any], device: str, resumed: bool) -> bool:
    right_place = leg.get("device") == device and leg.get("placement_ok", False)
    exact = not resumed or (leg.get("compared", False) and not leg.get("differences"))
    return right_place and exact and bool(leg.get("saved"))


def _copy_log(path: Path) -> None:
    """A leg's log into this step's own (the caller keeps one log per step)."""
    if path.exists():
        print(f"--- {path.name}\n{path.read_text()}", flush=True)


def checkpoint_leg(overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """One leg, in its own process: train (resuming where overrides say), comparing the
    loaded state with the checkpoint's."""
    from framework.rank.loop import Runner

    found: dict[str, Any] = {}
    original_load, original_step = Runner.load_checkpoint, Runner.train_step

    def load_checkpoint(self, path, payload):
        original_load(self, path, payload)
        found.update(loaded_state_figures(self, payload), resumed_from=str(path))
        self._gpu_check_payload = payload

    def train_step(self, micro_batches):
        payload = getattr(self, "_gpu_check_payload", None)
        if payload is not None:
            found["differences"] += stream_differences(self, payload)
            found["compared"] = True
            del self._gpu_check_payload
        placement = placement_of(self)  # as this step starts; the last step's is kept
        wanted = self.device.type
        found["placement"] = placement
        found["placement_ok"] = all(
            kinds == [wanted] for name, kinds in placement.items() if name != "step"
        )
        return original_step(self, micro_batches)

    Runner.load_checkpoint, Runner.train_step = load_checkpoint, train_step
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        summary = run_one_rank(overrides, run_dir)
    finally:
        Runner.load_checkpoint, Runner.train_step = original_load, original_step
    saved = sorted((run_dir / "checkpoints").glob("step_*.pt"))
    found["not_carried"] = [d for d in found.get("differences", []) if d.startswith(NOT_CARRIED)]
    found["differences"] = [
        d for d in found.get("differences", []) if d not in found["not_carried"]
    ]
    train_log = (run_dir / "train.log").read_text()
    first = FIRST_LINE.search(train_log)
    return {
        **found,
        "device": first.group(3) if first else None,
        "steps": summary.get("steps"),
        "val/accuracy": summary.get("val/accuracy"),
        "saved": str(saved[-1]) if saved else None,
    }


def loaded_state_figures(runner, payload: dict[str, Any]) -> dict[str, Any]:
    """What the runner holds right after loading, against the file: every state a checkpoint
    saves, bit for bit, and where the weights and the optimizer's state now live."""
    differences: list[str] = []
    shared = runner.states.shared_state_dict()  # model, optimizer, ema, scheduler, precision...
    for key, state in shared.items():
        differences += bitwise_differences(state, payload.get(key), key)
    per_rank = runner.states.rank_state_dict()
    for key in per_rank.keys() - LAZILY_RESTORED:
        differences += bitwise_differences(per_rank[key], payload["ranks"][0].get(key), key)
    return {
        "differences": differences,
        "tensors_compared": tensor_count([shared, per_rank]),  # a comparison of nothing shows
        "loaded_placement": placement_of(runner),
    }


def tensor_count(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, dict):
        return sum(tensor_count(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_count(v) for v in value)
    return 0


def stream_differences(runner, payload: dict[str, Any]) -> list[str]:
    """As the first resumed step starts: the RNG streams and the loader's epoch generator are
    the checkpoint's (they are applied only when the epoch's iterator exists)."""
    from framework.storage.checkpoint import rng_state

    saved = payload["ranks"][0]
    return bitwise_differences(rng_state(), saved["rng"], "rng") + bitwise_differences(
        runner.position.state_dict(), saved["loader_generator"], "loader_generator"
    )


def placement_of(runner) -> dict[str, list[str]]:
    """Device types of the parameters and of each kind of optimizer state."""
    placement = {"parameters": sorted({p.device.type for p in runner.model.module.parameters()})}
    for state in runner.optimizer.state.values():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                placement.setdefault(name, [])
                if value.device.type not in placement[name]:
                    placement[name].append(value.device.type)
    return {name: sorted(kinds) for name, kinds in placement.items()}


def bitwise_differences(now: Any, saved: Any, path: str) -> list[str]:
    """Where `now` and `saved` differ: tensors by dtype, shape and every bit (on the host),
    containers entry by entry, NaN equal to NaN. Each difference is a path and what differs."""
    if isinstance(now, torch.Tensor) or isinstance(saved, torch.Tensor):
        return _tensor_difference(now, saved, path)
    if isinstance(now, dict) and isinstance(saved, dict):
        found = [f"{path}.{k}: only in the checkpoint" for k in saved.keys() - now.keys()]
        found += [f"{path}.{k}: only in this run" for k in now.keys() - saved.keys()]
        for key in sorted(now.keys() & saved.keys(), key=str):
            found += bitwise_differences(now[key], saved[key], f"{path}.{key}")
        return found
    if isinstance(now, list | tuple) and isinstance(saved, list | tuple):
        if len(now) != len(saved):
            return [f"{path}: {len(now)} entries, {len(saved)} in the checkpoint"]
        return [
            d
            for index, (a, b) in enumerate(zip(now, saved, strict=True))
            for d in bitwise_differences(a, b, f"{path}.{index}")
        ]
    if (
        isinstance(now, float)
        and isinstance(saved, float)
        and math.isnan(now)
        and math.isnan(saved)
    ):
        return []
    return [] if now == saved else [f"{path}: {now!r} now, {saved!r} in the checkpoint"]


def _tensor_difference(now: Any, saved: Any, path: str) -> list[str]:
    if not (isinstance(now, torch.Tensor) and isinstance(saved, torch.Tensor)):
        return [f"{path}: {type(now).__name__} now, {type(saved).__name__} in the checkpoint"]
    if now.dtype != saved.dtype or now.shape != saved.shape:
        return [f"{path}: {now.dtype} {tuple(now.shape)} now, {saved.dtype} {tuple(saved.shape)}"]
    a, b = (t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (now, saved))
    return [] if torch.equal(a, b) else [f"{path}: the bits differ"]


STEPS: dict[str, Callable[[StepRun], StepResult]] = {
    "environment": environment,
    "tests": tests,
    "train": train,
    "gpt": gpt,
    "sync": sync,
    "variants": variants,
    "checkpoint": checkpoint,
}
