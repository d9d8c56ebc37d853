"""What every benchmark shares: the work being compared, a pool of rank processes that runs the
compared trials interleaved, medians, and the JSON record.

Why a pool: starting two Python processes that import torch costs seconds per run, more than a
steady-state measurement itself on 2 cores. The pool starts the ranks once; each trial then gets
a fresh process group (its own key prefix in the pool's store), runs, and reports to rank 0.
Trials run in the schedule's order on every rank, so compared contenders interleave
(A B C, B C A, C A B) and slow drift of a noisy machine favours none of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from framework.launch import forked, forkserver

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
CONF_DIR = REPO / "conf"


@dataclass(frozen=True)
class Work:
    """One training workload, identical for every contender: model, in-memory data, per-rank
    batch, SGD, steps. Throughput is measured over the steps after `warmup`."""

    model: str = "cnn"  # cnn | resnet18 | resnet50
    batch_size: int = 64  # per rank
    steps: int = 40  # measured steps, after warmup
    warmup: int = 10
    lr: float = 0.05
    image_size: int = 32
    precision: str = "fp32"  # fp32 | bf16 | amp
    channels_last: bool = False
    compile: bool = False
    num_workers: int = 0
    device: str = "cpu"
    val_size: int = 32

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def train_size(self, world_size: int) -> int:
        # One epoch covers every step: no epoch boundary (sampler reshuffle) in the timing.
        return self.batch_size * world_size * (self.total_steps + 1)

    def overrides(self, world_size: int) -> list[str]:
        """The same work as `train` overrides."""
        return [
            f"model={self.model}",
            "data=synthetic",
            f"data.batch_size={self.batch_size}",
            f"data.train_size={self.train_size(world_size)}",
            f"data.val_size={self.val_size}",
            f"data.image_size={self.image_size}",
            f"data.num_workers={self.num_workers}",
            "optimizer=sgd",
            f"optimizer.lr={self.lr}",
            "scheduler=constant",
            f"precision={self.precision}",
            f"trainer.channels_last={self.channels_last}",
            f"trainer.compile={self.compile}",
            f"trainer.max_steps={self.total_steps}",
            "trainer.max_epochs=null",
            f"trainer.log_every={self.warmup}",
            "trainer.progress_bar=false",
            "checkpoint.every=0",
            "checkpoint.final=false",
            f"launcher.nproc_per_node={world_size}",
        ]


def build_model(work: Work) -> torch.nn.Module:
    """The models the config groups build, for the contenders that are not ours."""
    from framework.components.models import SmallCNN, resnet18_cifar, resnet50
    from framework.config.registry import option_values

    builders = {"cnn": SmallCNN, "resnet18": resnet18_cifar, "resnet50": resnet50}
    values = option_values("model", work.model, in_channels=3, num_classes=10)
    return builders[work.model](**values)


# --- the pool ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trial:
    contender: str  # a key of the benchmark's contender table
    work: Work
    world_size: int = 2
    round: int = 0
    label: str = ""  # what the trial stands for in tables (default: contender)
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.label or self.contender


@dataclass
class TrialContext:
    """What a contender gets: its rank, a store only this trial uses, a scratch dir."""

    rank: int
    world_size: int
    store: dist.Store
    scratch: Path
    index: int

    def init_group(self, backend: str = "gloo") -> None:
        if self.world_size > 1:
            dist.init_process_group(
                backend,
                store=self.store,
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(minutes=5),
            )

    def end_group(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


Contender = Callable[[Trial, TrialContext], dict[str, Any] | None]


def interleave(labels: Sequence[Any], rounds: int, mirror: bool = False) -> list[tuple[int, Any]]:
    """(round, label), each round's order rotated by one: A B C, B C A, C A B, ... Over as many
    rounds as labels, every contender runs once in every position. `mirror`: A B C, C B A, ...
    instead (for two rounds of many labels: each label's mean position is the same)."""
    order = []
    for round_index in range(rounds):
        if mirror:
            ordered = list(labels) if round_index % 2 == 0 else list(reversed(labels))
        else:
            shift = round_index % len(labels)
            ordered = [*labels[shift:], *labels[:shift]]
        order += [(round_index, label) for label in ordered]
    return order


def run_pool(
    schedule: list[Trial],
    contenders: dict[str, Contender],
    nprocs: int = 2,
    namespaces: Sequence[str] | None = None,
    env: dict[str, str] | None = None,
    on_result: Callable[[Trial, dict], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every trial on a pool of `nprocs` rank processes; rank 0's results, in order.
    `namespaces`: one network namespace per rank, entered after joining the pool's store (so
    the store stays on loopback while the trial's traffic crosses the namespaces' link)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    scratch = Path(tempfile.mkdtemp(prefix="bench-"))
    if all(trial.work.device == "cpu" for trial in schedule):
        # `train` picks a GPU whenever one is visible; CPU work must stay on the CPU.
        env = {**(env or {}), "CUDA_VISIBLE_DEVICES": ""}
    forkserver.warm_up()  # the ranks fork from it, as `train`'s do: one import of torch, not two
    context = mp.start_processes(
        _pool_worker,
        args=(
            store.port,
            nprocs,
            schedule,
            contenders,
            scratch,
            namespaces,
            env or {},
            *forked.launcher_context(),
        ),
        nprocs=nprocs,
        join=False,
        start_method=forkserver.START_METHOD,
    )
    results: list[dict[str, Any]] = []
    try:
        for index, trial in enumerate(schedule):
            results.append(_wait_for_result(store, context, index, trial, nprocs))
            if on_result:
                on_result(trial, results[-1])
        while not context.join():
            pass
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        shutil.rmtree(scratch, ignore_errors=True)
    return results


def _wait_for_result(store, context, index: int, trial: Trial, nprocs: int) -> dict[str, Any]:
    """Rank 0's result of trial `index`. The first rank to fail ends the wait with its error,
    instead of its peers waiting out a collective's timeout."""
    errors = [f"error/{index}/{rank}" for rank in range(nprocs)]
    while not store.check([f"result/{index}"]):
        failed = [key for key in errors if store.check([key])]
        if failed:
            raise RuntimeError(f"trial {trial.name} failed: {store.get(failed[0]).decode()}")
        if not all(process.is_alive() for process in context.processes):
            context.join()  # raises with the dead rank's traceback
        time.sleep(0.2)
    return json.loads(store.get(f"result/{index}"))


def _pool_worker(
    rank, port, nprocs, schedule, contenders, scratch, namespaces, env, environ, cwd, stdio
) -> None:
    forked.adopt(environ, cwd, stdio)
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank, whatever the shell exported
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(minutes=30))
    if namespaces:
        enter_network_namespace(namespaces[rank])
    for index, trial in enumerate(schedule):
        if rank < trial.world_size:
            _run_trial(rank, index, trial, contenders[trial.contender], store, scratch)
        # Every rank finishes trial i before any starts trial i+1.
        store.set(f"done/{index}/{rank}", "1")
        store.wait([f"done/{index}/{r}" for r in range(nprocs)])
    from framework.launch.rank_entry import exit_now

    exit_now(0)  # as `train`'s ranks leave: without the interpreter's shutdown (gloo threads)


def _run_trial(rank, index, trial, contender, store, scratch) -> None:
    """One trial on this rank, in a clean slate: the environment, dynamo's caches and the
    garbage of the trial before do not carry over. Rank 0 posts the result; a failing rank
    posts its error (the parent stops the pool on it)."""
    trial_dir = scratch / f"{index:03d}-{trial.name}".replace("/", "_")
    trial_dir.mkdir(exist_ok=True)
    context = TrialContext(
        rank, trial.world_size, dist.PrefixStore(f"trial{index}", store), trial_dir, index
    )
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    gc.collect()
    saved_environ = dict(os.environ)
    try:
        result = contender(trial, context)
    except Exception as error:  # noqa: BLE001 (the parent raises it with the trial's name)
        store.set(f"error/{index}/{rank}", f"rank {rank}: {error}\n{traceback.format_exc()}")
        return
    finally:
        context.end_group()
        os.environ.clear()
        os.environ.update(saved_environ)
    if rank == 0:
        store.set(f"result/{index}", json.dumps({**(result or {}), "trial": index}))


def enter_network_namespace(name: str) -> None:
    """setns(2) into /var/run/netns/<name> (what `ip netns exec` does), for this thread and
    every thread it starts from now on."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    clone_newnet = 0x40000000
    with open(f"/var/run/netns/{name}") as handle:
        if libc.setns(handle.fileno(), clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")


# --- our runner as a contender ------------------------------------------------------------------
def compose(overrides: list[str]):
    """The resolved config `train` would run with these overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from framework.config.registry import register_configs
    from framework.config.validation import validate

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    validate(cfg)
    OmegaConf.resolve(cfg)
    return cfg


def run_ours(trial: Trial, ctx: TrialContext, overrides: Sequence[str] = ()) -> dict | None:
    """`train` on the trial's work (+ overrides): its steady samples/s and its log."""
    return run_train([*trial.work.overrides(trial.world_size), *overrides], ctx, trial.work.warmup)


def run_train(overrides: list[str], ctx: TrialContext, warmup: int) -> dict[str, Any] | None:
    """framework.rank.main.rank_main on this rank, what a spawned rank of `train` runs. Rank 0
    returns the summary, the train events of metrics.jsonl and the steady samples/s after
    `warmup`."""
    from framework.core import startup_clock
    from framework.core.launch_context import DistEnv
    from framework.rank.main import rank_main

    startup_clock.count_from_now()
    cfg = compose(overrides)
    run_dir = ctx.scratch / "run"
    run_dir.mkdir(exist_ok=True)
    env = DistEnv(
        rank=ctx.rank,
        local_rank=ctx.rank,
        world_size=ctx.world_size,
        local_world_size=ctx.world_size,
        source="local",
    )
    summary = rank_main(cfg, run_dir, env, ctx.store if ctx.world_size > 1 else None)
    if ctx.rank != 0:
        return None
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "samples_per_s": steady_samples_per_s(events, warmup),
        "summary": summary,
        "events": [e for e in events if "train/loss" in e],
    }


def steady_samples_per_s(events: list[dict], warmup: int) -> float:
    """Steady-state samples/s over the log windows after warm-up: each window's rate is
    steps x global batch / its seconds, so the whole span's rate is the step-weighted harmonic
    mean of the windows' rates."""
    steady = [e for e in events if "train/loss" in e and e["step"] > warmup]
    steps = [
        later["step"] - earlier
        for later, earlier in zip(steady, [warmup] + [e["step"] for e in steady], strict=False)
    ]
    seconds_per_sample = sum(n / e["samples_per_s"] for n, e in zip(steps, steady, strict=True))
    return sum(steps) / seconds_per_sample if seconds_per_sample else float("nan")


# --- statistics and records ---------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float]) -> str:
    """The median, and how far the highest and the lowest run lie from it."""
    middle = median(values)
    return f"{middle:.4g} (+{max(values) / middle - 1:.1%} / -{1 - min(values) / middle:.1%})"


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "date": date.today().isoformat(),
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_result(name: str, record: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(
        json.dumps({"benchmark": name, "machine": machine(), **record}, indent=2, default=_jsonable)
        + "\n"
    )
    print(f"\nwrote {path.relative_to(REPO)}")
    return path


def _jsonable(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return str(value)


def pyplot():
    """matplotlib's pyplot on the file-only backend (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(figure, name: str) -> Path:
    """benchmarks/results/<name>.png, shown in the README."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    path = RESULTS / f"{name}.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    print(f"wrote {path.relative_to(REPO)}")
    return path


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (printed, and pasted into the README as is)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
