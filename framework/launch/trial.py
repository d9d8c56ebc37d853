"""Where the trial of a run's parts (framework/rank/preflight.py) runs, before any rank starts:
in this process where it is a rank itself (it imports the training stack anyway), else in a
process forked from the fork server, which has imported it: a launcher never imports torch.
Either way a part that refuses its settings is one line and exit 2, and no rank is started."""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection
from pathlib import Path

from omegaconf import DictConfig

from framework.core.exits import ExitCode, Rejected, WorkerFailed
from framework.launch import forked, forkserver
from framework.storage.files import is_throwaway
from framework.storage.run_dir import RunDir


def try_here(cfg: DictConfig, world_size: int, run_dir: Path) -> None:
    """The trial in this process (a rank to be, which imports the training stack anyway)."""
    from framework.rank.preflight import preflight  # (the training stack: torch)

    preflight(cfg, world_size, reads_initial_weights(cfg, run_dir))


def reads_initial_weights(cfg: DictConfig, run_dir: Path) -> bool:
    """Whether the ranks will read init's file: not where they resume a checkpoint, nor in a
    follower of an external torchrun (a throwaway dir: it runs rank 0's config, tried there)."""
    return not (is_throwaway(run_dir) or RunDir(run_dir).resumes_a_checkpoint(cfg))


def try_in_a_fork(cfg: DictConfig, world_size: int, run_dir: Path) -> None:
    """The trial in a process forked from the fork server; raises what it found."""
    context = multiprocessing.get_context(forkserver.START_METHOD)
    receiving, sending = context.Pipe(duplex=False)
    trial = context.Process(
        target=_trial,
        args=(cfg, world_size, run_dir, sending, *forked.launcher_context()),
        name="trial",
    )
    trial.start()
    sending.close()
    try:
        refusal = receiving.recv()
    except EOFError:  # it failed before it could say (its traceback is printed)
        refusal = None
    trial.join()
    if refusal is not None:
        raise refusal
    if trial.exitcode != 0:  # a fault, not the config: its traceback is above
        raise WorkerFailed(f"the trial of the run's parts ended with exit code {trial.exitcode}")


def _trial(
    cfg: DictConfig,
    world_size: int,
    run_dir: Path,
    sending: Connection,
    environ: dict[str, str],
    cwd: str,
    stdio: list[int],
) -> None:
    forked.adopt(environ, cwd, stdio)
    try:
        try_here(cfg, world_size, run_dir)
    except Rejected as refusal:  # a setting, or a file a setting names (init.path)
        sending.send(refusal)
        return
    except KeyboardInterrupt:  # a terminal's Ctrl-C reached it too: its launcher ends by it
        raise SystemExit(ExitCode.INTERRUPTED) from None
    sending.send(None)
