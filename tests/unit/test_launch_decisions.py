"""framework/launch/start.py: how a run's ranks start, for every way this process can have been
started and every launcher (the end-to-end runs of each path are in tests/integration/)."""

from __future__ import annotations

import logging

import pytest

from framework.config.validation import joins_other_node, node_range, validate
from framework.core.exits import ConfigError
from framework.core.launch_context import detect
from framework.launch.forkserver import will_start_local_ranks
from framework.launch.start import Start, adopts_rank_zero_config, how_ranks_start
from framework.launch.torchrun.agent import (
    WORKER_FAILURE_LOGGER,
    OneLineFailures,
    rendezvous_settings,
    report_worker_failures_in_one_line,
)
from tests.conftest import make_cfg

TORCHRUN_RANK_0 = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "j"}
TORCHRUN_RANK_1 = {**TORCHRUN_RANK_0, "RANK": "1", "LOCAL_RANK": "1"}


def slurm_task(monkeypatch: pytest.MonkeyPatch, rank: int) -> dict[str, str]:
    """A task of a 2-task SLURM job as submitit sees it (submitit reads os.environ)."""
    variables = {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "41",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NODELIST": "node1",
    }
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return variables


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], Start.LOCAL_RANKS),  # the default: 2 local ranks
        (["launcher.nproc_per_node=1"], Start.IN_PROCESS),
        (["launcher=torchrun"], Start.TORCHRUN_AGENT),
        (["launcher=torchrun", "launcher.nproc_per_node=1"], Start.TORCHRUN_AGENT),
        # Outside a job: task_rank refuses it with the fix (submit through Hydra's multirun).
        (["launcher=slurm"], Start.SLURM_TASK),
        (["launcher=slurm_local"], Start.SLURM_TASK),
    ],
)
def test_a_typed_command_starts_ranks_as_its_launcher_says(overrides, expected):
    cfg = make_cfg(*overrides)
    assert how_ranks_start(cfg.launcher, detect({})) is expected


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["launcher.nproc_per_node=1"],
        ["launcher=torchrun"],
        ["launcher=torchrun", "launcher.nproc_per_node=1"],
        ["launcher=slurm"],
        ["launcher=slurm_local"],
    ],
)
def test_the_command_starts_the_fork_server_early_when_its_ranks_fork_from_it(overrides):
    """cli.py decides from the command line alone, before composing, so that the server's
    imports run beside the command's own; a late start puts them after."""
    forked = how_ranks_start(make_cfg(*overrides).launcher, detect({})) in {
        Start.LOCAL_RANKS,
        Start.TORCHRUN_AGENT,
    }
    assert will_start_local_ranks(overrides) is forked


@pytest.mark.parametrize("launcher", ["local", "torchrun"])
@pytest.mark.parametrize("environ", [TORCHRUN_RANK_0, TORCHRUN_RANK_1], ids=["rank0", "rank1"])
def test_under_an_external_torchrun_this_process_is_the_rank(launcher, environ):
    cfg = make_cfg(f"launcher={launcher}")
    here = detect(environ)
    assert how_ranks_start(cfg.launcher, here) is Start.EXTERNAL_TORCHRUN_RANK
    assert not adopts_rank_zero_config(here)  # every torchrun rank checks the config itself


def test_a_slurm_task_of_rank_0_is_the_job_and_checks_the_config(monkeypatch):
    here = detect(slurm_task(monkeypatch, rank=0))
    assert not adopts_rank_zero_config(here)
    assert how_ranks_start(make_cfg("launcher=slurm").launcher, here) is Start.SLURM_TASK


def test_a_slurm_task_of_rank_1_adopts_rank_0s_config_without_reading_its_own(monkeypatch):
    here = detect(slurm_task(monkeypatch, rank=1))
    assert adopts_rank_zero_config(here)
    # Decided from the launch context alone: the launcher node is not read (rank 0's comes later).
    assert how_ranks_start(None, here) is Start.SLURM_FOLLOWER


@pytest.mark.parametrize(
    ("overrides", "joins", "is_host"),
    [
        ([], False, None),  # one node hosts its own rendezvous (torch sees localhost)
        (["launcher.nnodes=2"], True, False),
        (["launcher.nnodes=1:2", "launcher.max_restarts=1"], True, False),
        (
            ["launcher.nnodes=1:2", "launcher.max_restarts=1", "launcher.rdzv_host=true"],
            False,
            True,
        ),
    ],
)
def test_the_rendezvous_host_holds_a_multi_node_jobs_run_dir(overrides, joins, is_host):
    """Every node of a multi-node launcher=torchrun job gives the same hydra.run.dir; the node
    that hosts the rendezvous holds it, the others join it (and c10d is told which is which)."""
    launcher = make_cfg("launcher=torchrun", *overrides).launcher
    assert joins_other_node(launcher) is joins
    settings = rendezvous_settings(launcher, node_range(launcher.nnodes)[1])
    assert settings.get("is_host") is is_host
    assert settings["last_call_timeout"] == launcher.rdzv_last_call_s


def test_only_torchrun_jobs_join_another_nodes_run_dir():
    assert not joins_other_node(make_cfg().launcher)


class Kept(logging.Handler):
    """The records and lines a logger's own handler receives: torch's loggers may not propagate
    to the root logger where pytest's caplog listens (torch 2.8 once torch._logging has set up
    the `torch` logger)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.lines.append(logging.Formatter().format(record))


def test_the_agents_report_of_a_failed_worker_is_one_line_without_a_traceback():
    """A traceback in it made torch's log formatter import torch._dynamo in the launcher (15 s
    here) before every restart (framework/launch/torchrun/agent.py)."""
    report_worker_failures_in_one_line()
    report_worker_failures_in_one_line()  # once per launch: the filter is not stacked
    logger = logging.getLogger(WORKER_FAILURE_LOGGER)
    assert sum(isinstance(f, OneLineFailures) for f in logger.filters) == 1
    kept = Kept()
    logger.addHandler(kept)
    try:
        raise RuntimeError("process 0 terminated with exit code 3")
    except RuntimeError:
        logger.exception("failed (exitcode: %s) local_rank: %s", 3, 0)
    finally:
        logger.removeHandler(kept)
    [record] = kept.records
    assert record.exc_info is None and record.exc_text is None
    assert kept.lines == [
        "failed (exitcode: 3) local_rank: 0: process 0 terminated with exit code 3"
    ]


@pytest.mark.parametrize(
    ("endpoint", "refused"),
    [
        ("localhost:0", False),
        ("node1", False),  # torch's default port
        ("[::1]:29500", False),
        ("::1", False),
        ("localhost:abc", True),
        ("node1:²", True),  # a digit to str.isdigit, not to int()
        ("localhost:000000", True),  # torch takes 1 to 5 digits
        ("localhost:70000", True),
        ("[::1]:70000", True),
    ],
)
def test_a_rendezvous_port_torch_would_refuse_is_refused_first(endpoint, refused):
    """torch's rendezvous refuses it only after the run dir exists, with a traceback."""
    cfg = make_cfg("launcher=torchrun", f"launcher.rdzv_endpoint='{endpoint}'")
    if refused:
        with pytest.raises(ConfigError, match="give host:port with a port from 0 to 65535"):
            validate(cfg)
    else:
        validate(cfg)


def test_a_pruning_sweeps_fork_server_preloads_optuna(monkeypatch):
    """Its ranks' rank 0 reports to the study through Optuna: imported in each trial's rank it
    cost about 3 s a trial (docs/benchmarks.md, pruning); preloaded, nothing."""
    from framework.launch import forkserver

    preloads = []
    monkeypatch.setattr(forkserver, "warm_up", lambda extra=None: preloads.append(extra))
    for name in ("RANK", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "SUBMITIT_EXECUTOR"):
        monkeypatch.delenv(name, raising=False)
    forkserver.warm_up_if_forking(["-m", "hydra/sweeper=optuna_prune", "optimizer.lr=0.1"])
    forkserver.warm_up_if_forking(["-m", "hydra/sweeper=optuna", "optimizer.lr=0.1"])
    assert preloads == [["optuna"], None]
