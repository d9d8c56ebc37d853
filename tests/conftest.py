"""Shared fixtures: compose the real config, shrink it, and run it in a temporary run dir."""

from __future__ import annotations

import copy
import functools
import gc
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from framework.app.config_search_path import CONFIG_PATH_VARIABLE
from framework.config import CONF_DIR
from framework.config.registry import register_configs
from framework.config.validation import validate
from framework.launch import forked, forkserver
from tests.time_budget import TimeBudget

REPO = Path(__file__).resolve().parent.parent
DIST_ENV_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_NUM_NODES",
    "SLURM_RESTART_COUNT",
    "SUBMITIT_EXECUTOR",
)

# A user's own settings for the libraries a run uses: W&B's dir and mode, MLflow's store, Hydra's
# tracebacks. Tests that need one set it themselves.
USER_SETTINGS = ("WANDB_", "MLFLOW_", "HYDRA_FULL_ERROR", "FRAMEWORK_CONFIG_PATH")
# The suite's own test packages (tests.faults, tests.integration.byo_components, ...) stand in
# for a user's project: configs may trust them only because the environment says so
# (docs/security.md: this repository's tests are never trusted by a config alone).
os.environ["FRAMEWORK_TRUSTED_PACKAGES"] = "tests"


def in_ci() -> bool:
    """CI=true (GitHub Actions, GitLab, most CI systems; .ci/run exports it)."""
    return os.environ.get("CI", "").strip().lower() in {"true", "1"}


def unavailable(reason: str) -> NoReturn:
    """A test whose setup cannot start here (a SLURM cluster, network namespaces): skipped with
    the reason, but failed under CI, where a green run must mean that it ran."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: this test must run in CI)", pytrace=False)
    pytest.skip(reason)


# A sitecustomize for PYTHONPATH: importing torch (or torchvision) fails in the interpreters a
# command starts, while its source stays where the callables' signatures are read from. SPARED:
# a word of the command line of the interpreters that may import it (the fork server's), or None.
IMPORT_GUARD = """
import sys


class RefuseTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {{"torch", "torchvision"}}:
            raise ImportError(f"{{name}} was imported")
        return None


SPARED = {spared!r}
if SPARED is None or not any(SPARED in arg for arg in sys.orig_argv):
    sys.meta_path.insert(0, RefuseTorch())
"""


def torch_refused(folder: Path, spared: str | None = None) -> str:
    """A PYTHONPATH entry under which importing torch fails, but (where given) in the
    interpreters whose command line holds `spared`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(IMPORT_GUARD.format(spared=spared))
    return str(folder)


def make_cfg(*overrides: str) -> DictConfig:
    """The composed app config, exactly as `train` would see it (minus Hydra's own node): a copy
    of this process's first composition with the same overrides, working dir (its conf/) and
    $FRAMEWORK_CONFIG_PATH, the inputs of a composition besides the shipped files. A copy costs
    13 ms, a composition 230 ms."""
    return copy.deepcopy(_composed(overrides, os.getcwd(), os.environ.get(CONFIG_PATH_VARIABLE)))


@functools.cache
def _composed(overrides: tuple[str, ...], cwd: str, config_path: str | None) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


# Small and fast: an 8x8 single-channel synthetic task, one thread per rank.
TINY = (
    "data=synthetic",
    "data.in_channels=1",
    "data.image_size=8",
    "data.train_size=256",
    "data.val_size=101",
    "trainer.log_every=1",
)


def prepare_run(cfg: DictConfig, run_dir: Path) -> None:
    """What the Hydra app does after composing: validate, resolve once, make the run dir."""
    validate(cfg)
    OmegaConf.resolve(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)


def train_in_process(cfg: DictConfig, run_dir: Path) -> dict:
    """Prepare, then start the ranks with the configured launcher, as `train` does."""
    from framework.launch.start import launch

    prepare_run(cfg, run_dir)
    return launch(cfg, run_dir)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list[float]:
    return [event["train/loss"] for event in read_metrics(run_dir) if "train/loss" in event]


# A project's files named like modules that Python and torch import (re: in a new interpreter's
# first lines; numbers and random: later). Every process of a run has the working dir last on its
# path, so they shadow nothing.
SHADOWING_MODULE = "the project's own module, imported in place of"


def plant_shadowing_modules(folder: Path) -> None:
    for name in ("re", "numbers", "random"):
        (folder / f"{name}.py").write_text(f'raise SystemExit("{SHADOWING_MODULE} {name}")\n')


def run_cli(*args: str, cwd: Path, timeout: float = 300, env: dict | None = None):
    """`train ARGS` as a user runs it, in cwd: framework.cli is what the console script runs."""
    full_env = {k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS}
    for name, value in (env or {}).items():  # None removes a variable
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    return subprocess.run(
        [sys.executable, "-m", "framework.cli", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@dataclass
class Finished:
    """How an in-process `train` ended: what a user sees of a command."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capfd, monkeypatch):
    """`train ARGS` in this process (train_here), for the tests where a new interpreter is not
    the point: exit code, stdout and stderr (the ranks' too: they take over this process's
    streams). Signals to the launcher need a process of their own: run_cli."""

    def run(*args: str, cwd: Path, env: dict | None = None, timeout: float = 0) -> Finished:
        capfd.readouterr()
        code = train_here(monkeypatch, *args, cwd=cwd, env=env)
        out, err = capfd.readouterr()
        return Finished(code, out, err)

    return run


def train_here(
    monkeypatch: pytest.MonkeyPatch, *args: str, cwd: Path, env: dict | None = None
) -> int:
    """`train ARGS` in this process (main(), as the console script calls it), in `cwd`, with
    `env` changes (None removes), which `monkeypatch` undoes: the exit code."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["train", *args])
    for name in ("FRAMEWORK_STARTUP", *DIST_ENV_VARS):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    handlers = list(logging.getLogger().handlers)
    GlobalHydra.instance().clear()
    try:
        return exit_code_of_train()
    finally:
        GlobalHydra.instance().clear()
        root = logging.getLogger()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)


def exit_code_of_train() -> int:
    """`train.main()` in this process, and the exit code the interpreter would give it."""
    from framework import train

    try:
        train.main()
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    return 0


# `uv run pytest` alone runs the quick tests; the slow ones (multi-process, end to end: most of
# the suite's CPU) run with --all, a -m or -k expression of one's own, --lf, or in the paths one
# names. CI runs them all (.ci/run). README: Tests.
QUICK_TESTS = "not slow"
TIME_BUDGET = "time-budget"
SLOW_LEFT_OUT = pytest.StashKey[bool]()
MARK_EXPRESSION = "framework_mark_expression"


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--all",
        action="store_true",
        dest="run_all",
        help="also run the tests marked slow (multi-process, end to end), as CI does",
    )


def pytest_configure(config) -> None:
    """Each test starts outside any job, without the user's settings; the slow tests are left
    out unless asked for."""
    for name in DIST_ENV_VARS:
        os.environ.pop(name, None)
    for name in [name for name in os.environ if name.startswith(USER_SETTINGS)]:
        os.environ.pop(name)  # the tests set what they test, whatever the user exported
    if _is_xdist_worker(config):
        config.option.markexpr = config.workerinput.get(MARK_EXPRESSION, config.option.markexpr)
    else:
        _leave_slow_tests_out_unless_asked(config)
        config.pluginmanager.register(TimeBudget(), TIME_BUDGET)


def _leave_slow_tests_out_unless_asked(config) -> None:
    """Decided once, where the command line was typed: pytest-xdist's workers are handed the
    resulting -m expression (pytest_configure_node)."""
    asked = (
        config.getoption("run_all")
        or config.option.markexpr
        or config.option.keyword  # -k: tests picked by name
        or getattr(config.option, "lf", False)  # --lf: the last failures (with a cache)
        or config.args_source is pytest.Config.ArgsSource.ARGS  # paths named
    )
    config.stash[SLOW_LEFT_OUT] = not asked
    if not asked:
        config.option.markexpr = QUICK_TESTS


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    node.workerinput[MARK_EXPRESSION] = node.config.option.markexpr


def pytest_collection_finish(session) -> None:
    """Where tests are to run (pytest-xdist's controller collects none), once they are collected.

    The collector's full passes walk every object of this process (torch, Hydra, the test
    modules): about a tenth of the CPU of the files that compose configs. What exists now lives
    to the end: frozen out of the passes, which are also made rarer.

    Then the fork server the slow tests' ranks start from, in an environment outside any job.
    The quick tests start no rank from it: `uv run pytest` does without its imports (about 4 s
    of CPU a worker)."""
    if session.config.option.collectonly or session.testsfailed:  # (a pytest.main in a test)
        return
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    if any(item.get_closest_marker("slow") for item in session.items):
        # The pruning sweeps' Optuna too, as `train` preloads it for a command naming that
        # sweeper: the in-process sweeps' trials run in this one fork server (2-3 s a trial).
        forkserver.warm_up(forkserver.PRUNING_PRELOAD)


@pytest.hookimpl(trylast=True)  # after the durations, where the run's last lines are read
def pytest_terminal_summary(terminalreporter, config) -> None:
    if config.stash.get(SLOW_LEFT_OUT, False):
        terminalreporter.write_line(
            "The slow tests (multi-process, end to end) were left out: "
            "`uv run pytest --all` runs them, as CI does."
        )
    elif (budget := config.pluginmanager.get_plugin(TIME_BUDGET)) is not None:
        for line in budget.lines():
            terminalreporter.write_line(line)


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


# torch elastic's agent (an in-process launcher=torchrun) installs handlers for these and leaves
# them: the processes a later test starts would inherit another disposition than the worker's.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def clean_distributed_env(monkeypatch):
    """Each test starts outside any job, and leaves no process group and the signal handlers
    as it found them."""
    for name in DIST_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    handlers = {signum: signal.getsignal(signum) for signum in SIGNALS}
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for signum, handler in handlers.items():
        if handler is not None:  # None: set outside Python, not ours to restore
            signal.signal(signum, handler)


def start_ranks(fn, args: tuple, nprocs: int = 2, join: bool = True):
    """fn(rank, *args) in nprocs processes, started the way `train` starts its ranks: forked
    from the fork server that has imported the training stack, with this process's environment
    and output streams.
    Assertions inside fn fail the test (the child's traceback is re-raised here). With
    join=False, returns at once torch's ProcessContext (its .processes: to signal them)."""
    import torch.multiprocessing as mp

    forkserver.warm_up()
    return mp.start_processes(
        _as_launched,
        args=(*forked.launcher_context(), fn, args),
        nprocs=nprocs,
        join=join,
        start_method=forkserver.START_METHOD,
    )


def _as_launched(
    rank: int, environ: dict[str, str], cwd: str, stdio: list[int], fn, args: tuple
) -> None:
    forked.adopt(environ, cwd, stdio)
    fn(rank, *args)


def spawn_ranks(fn, *args, world_size: int = 2) -> None:
    """Run fn(rank, world_size, *args) in world_size processes joined by a real gloo group."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    start_ranks(_rank_entry, (fn, world_size, store.port, args), nprocs=world_size)


def _rank_entry(rank: int, fn, world_size: int, port: int, args: tuple) -> None:
    import torch
    import torch._dynamo

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def train_many(jobs: list[tuple[DictConfig, Path]], world_size: int = 2) -> list[dict]:
    """Train several configs in one set of rank processes. Each run gets its own process group
    and run dir."""
    for cfg, run_dir in jobs:
        prepare_run(cfg, run_dir)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    start_ranks(_train_many_entry, (jobs, world_size, store.port), nprocs=world_size)
    return [json.loads((run_dir / "summary.json").read_text()) for _, run_dir in jobs]


def _train_many_entry(rank: int, jobs, world_size: int, port: int) -> None:
    from framework.core import startup_clock
    from framework.core.launch_context import DistEnv
    from framework.rank.main import rank_main

    env = DistEnv(
        rank=rank,
        local_rank=rank,
        world_size=world_size,
        local_world_size=world_size,
        source="local",
    )
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    for index, (cfg, run_dir) in enumerate(jobs):
        startup_clock.count_from_now()
        rank_main(cfg, run_dir, env, dist.PrefixStore(f"job{index}", store))


# --- fault tests: tiny 2-rank runs with a fault from FRAMEWORK_TEST_FAULT (tests/faults.py) ----
FAULTS = (f"hydra.searchpath=[file://{REPO / 'tests' / 'conf'}]", "experiment=faults")
FAULT_COMMS = {"allreduce": (), "powersgd": ("comm=powersgd", "comm.start_iter=3")}


@pytest.fixture(scope="session")
def fault_references(tmp_path_factory) -> dict[str, Path]:
    """Uninterrupted runs of the fault experiment, one per comm, in one pair of processes."""
    root = tmp_path_factory.mktemp("reference")
    jobs = [(make_cfg(*FAULTS, *extra), root / name) for name, extra in FAULT_COMMS.items()]
    train_many(jobs)
    return {name: run_dir for name, (_, run_dir) in zip(FAULT_COMMS, jobs, strict=True)}


# A GPT whose rows of 33 and 99 (width 33, 3 heads) do not split evenly over 2 ranks, so FSDP
# pads them: the memory ledger's and FSDP's byte counts must see the padding.
PADDED_GPT = (
    "task=language_model",
    "model=gpt",
    "data=text",
    "model.layers=2",
    "model.width=33",
    "model.heads=3",
    "model.dropout=0.1",  # recomputed blocks must draw the same dropout masks
    "data.block_size=16",
)
