"""launcher=torchrun: torch's elastic agent (the engine of the `torchrun` command), run from
this process: restarts (launcher.max_restarts) and multi-node rendezvous, with the config
resolved once here."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import tempfile
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousTimeoutError,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from framework.config.validation import node_range
from framework.core import launch_context, startup_clock
from framework.core.exits import Stopped, WorkerFailed, root_cause
from framework.core.stop_signals import stop_signal_names
from framework.launch import forked, forkserver

# The logger torch's agent reports a failed worker with (logger.exception).
WORKER_FAILURE_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class OneLineFailures(logging.Filter):
    """A record with an exception becomes one line: the exception's text joins the message and
    the traceback (the agent's own frames, which say nothing more) is dropped. Formatting a
    traceback makes torch's log formatter import torch._dynamo (15 to 20 s on 2 busy cores) in
    a launcher that has no other use for it, and the agent restarts the ranks only after it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            record.msg = f"{record.getMessage()}: {record.exc_info[1]}"
            record.args = None
            record.exc_info = record.exc_text = None
        return True


def report_worker_failures_in_one_line() -> None:
    logger = logging.getLogger(WORKER_FAILURE_LOGGER)
    if not any(isinstance(f, OneLineFailures) for f in logger.filters):
        logger.addFilter(OneLineFailures())


def launch_elastic(cfg: DictConfig, run_dir: Path) -> None:
    """The ranks as workers of torch's elastic agent, run from this process."""
    launcher = cfg.launcher
    report_worker_failures_in_one_line()
    min_nodes, max_nodes = node_range(launcher.nnodes)
    # Restarted rounds re-create the store; sharing torchrun's store made gloo reconnects flaky.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # The agent's own log folder (torchelastic_* in the temp dir by default), in the run dir:
    # removed after, and where the launcher is SIGKILLed it stays with the run, not in /tmp.
    agent_logs = tempfile.mkdtemp(prefix=".elastic-", dir=run_dir)
    config = launch_config(cfg, run_dir, agent_logs)
    try:
        forkserver.warm_up()  # (already running when `train` started it)
        elastic_launch(config, _elastic_worker)(cfg, run_dir, *forked.launcher_context())
    except ChildFailedError as error:
        codes = [0] * (launcher.nproc_per_node * max_nodes)
        for rank, failure in error.failures.items():
            codes[rank] = failure.exitcode
        cause = root_cause(codes)
        if cause is not None:
            raise cause from None
    except RendezvousConnectionError:  # a node that does not host it, before or during the run
        raise WorkerFailed(
            f"no rendezvous answered at launcher.rdzv_endpoint={launcher.rdzv_endpoint}: the "
            "node at that address runs the job with launcher.rdzv_host=true, and must be up "
            "for the whole run"
        ) from None
    except RendezvousTimeoutError:
        raise WorkerFailed(
            f"fewer than {min_nodes} node(s) (launcher.nnodes={launcher.nnodes}) joined the "
            f"rendezvous at {launcher.rdzv_endpoint} in time: start the job on every node"
        ) from None
    except SignalException as error:  # the agent waited for the ranks to save and stop
        raise Stopped(signal.Signals(error.sigval).name) from None
    finally:
        shutil.rmtree(agent_logs, ignore_errors=True)


def launch_config(cfg: DictConfig, run_dir: Path, agent_logs: str) -> LaunchConfig:
    """torch's elastic agent's settings, from launcher.*."""
    launcher = cfg.launcher
    min_nodes, max_nodes = node_range(launcher.nnodes)
    return LaunchConfig(
        logs_specs=DefaultLogsSpecs(log_dir=agent_logs),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=launcher.nproc_per_node,
        # Several nodes: every node gives the same hydra.run.dir, so its name is the job's id
        # on every node. One node: its own id, so jobs at localhost:0 never meet.
        run_id=run_dir.name if max_nodes > 1 else run_dir.name + "-" + uuid.uuid4().hex[:8],
        rdzv_backend="c10d",
        rdzv_endpoint=launcher.rdzv_endpoint,
        rdzv_configs=rendezvous_settings(launcher, max_nodes),
        local_addr=launcher.local_addr,
        max_restarts=launcher.max_restarts,
        monitor_interval=launcher.monitor_interval_s,
        # Forked from the fork server that has the training stack imported (forked.adopt
        # keeps the variables the agent sets on top of the launcher's environment).
        start_method=forkserver.START_METHOD,
        # The agent passes these on to the ranks; by default it dies on SIGUSR1/2 instead and
        # leaves its workers running.
        signals_to_handle=",".join(stop_signal_names(list(cfg.trainer.stop_signals))),
    )


def rendezvous_settings(launcher: DictConfig, max_nodes: int) -> dict[str, Any]:
    """The c10d rendezvous' settings: who hosts it, and how soon a round forms without a lost
    node (launcher.rdzv_* in framework/config/schemas.py)."""
    settings: dict[str, Any] = {
        "last_call_timeout": launcher.rdzv_last_call_s,
        "keep_alive_interval": launcher.rdzv_keep_alive_s,
        "keep_alive_max_attempt": launcher.rdzv_keep_alive_attempts,
    }
    if max_nodes > 1:  # torch would guess from the hostname, which fails for a bare address
        settings["is_host"] = bool(launcher.rdzv_host)
    return settings


def _elastic_worker(
    cfg: DictConfig, run_dir: Path, environ: dict[str, str], cwd: str, stdio: list[int]
) -> None:
    forked.adopt(environ, cwd, stdio)
    here = launch_context.current()
    if here.restarted():  # the launcher's marks are those of the first round
        startup_clock.count_from_now()
    startup_clock.mark("start ranks")
    # Imported in the rank (the fork server has it loaded): the launcher never needs it.
    from framework.launch.rank_entry import enter_rank

    # The agent set RANK/WORLD_SIZE/MASTER_*; the config came from our caller, not from Hydra,
    # so this rank must not wait for another rank's config the way an external torchrun does.
    env = dataclasses.replace(here.dist_env(), source="elastic")
    enter_rank(cfg, run_dir, env)
