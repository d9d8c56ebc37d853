"""How a run ends: every exception a user can meet, its exit code, and who prints what.

One table for every entry path (a single process, a spawned rank, a torchrun rank, a SLURM task):

| outcome                         | exception        | exit code | who prints                     |
|---------------------------------|------------------|-----------|--------------------------------|
| done                            |                  | 0         | rank 0: the summary line       |
| config or checkpoint rejected   | Rejected         | 2         | rank 0: one `error:` line      |
| stopped on a signal, saved      | Stopped          | 75 / 130  | rank 0: where it saved         |
| non-finite loss (policy stop)   | NonFiniteLoss    | 1         | rank 0: where it happened      |
| a checkpoint could not be saved | SaveFailed       | 1         | rank 0: one `error:` line      |
| a rank failed (launcher's view) | WorkerFailed     | 1         | the launcher: the root cause   |
| a bug or fault on this rank     | any other        | 1         | that rank: its traceback       |
| a peer vanished mid-collective  | (by its message) | 3         | nobody: the peer or launcher   |
| a collective timed out          | (by its message) | 4         | that rank: one line            |
| out of memory (host or GPU)     | (by its message) | 5         | its launcher, once (or rank)   |

A rank that only lost its peers exits quietly: "connection closed by peer" from every survivor
would bury the one message that matters. A launcher reads its ranks' exit codes back into one
exception naming the root cause (`root_cause`).
"""

from __future__ import annotations

import re
import signal
import sys
import traceback
from dataclasses import dataclass
from enum import IntEnum
from typing import NoReturn

from hydra.errors import CompactHydraException

from framework.core.secrets import scrub_text


def first_line(error: BaseException, limit: int = 160) -> str:
    """An exception's first line, for a one-line message that names its cause; a longer one is
    cut at a word, never inside one."""
    line = (str(error).splitlines() or [type(error).__name__])[0]
    if len(line) <= limit:
        return line
    return line[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."


class ExitCode(IntEnum):
    DONE = 0
    FAILED = 1  # a bug or a fault; the failing rank printed its traceback or message
    CONFIG_REJECTED = 2  # the config (or a checkpoint it names) is wrong; rank 0 said why
    PEER_LOST = 3  # another rank vanished mid-collective; that rank (or the launcher) says why
    COLLECTIVE_TIMEOUT = 4  # no answer within dist.timeout_s; this rank printed one line
    OUT_OF_MEMORY = 5  # a rank's allocation failed (host or GPU); that rank printed one line
    STOPPED = 75  # stopped on a signal with a checkpoint (EX_TEMPFAIL: run it again)
    INTERRUPTED = 130  # the same after Ctrl-C (128 + SIGINT, what shells expect)


class Rejected(Exception):
    """Bad input: one line naming the setting (or file) and the fix. Nothing was trained.

    `reported`: a rank already printed it (the launcher only learned the exit code)."""

    def __init__(self, message: str, reported: bool = False) -> None:
        super().__init__(message)
        self.reported = reported


class ConfigError(Rejected):
    """A configuration mistake."""


class CheckpointError(Rejected):
    """A checkpoint that cannot be used: one line naming the file and the fix."""


class Stopped(Exception):
    """Every rank stopped at the same step on a signal; a checkpoint holds that step (when the
    ranks saved one and this process knows where)."""

    def __init__(
        self, signal_name: str, step: int | None = None, checkpoint: str | None = None
    ) -> None:
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        saved = f"saved {checkpoint}" if checkpoint else "nothing saved (checkpoint.final=false)"
        where = f" at step {step}; {saved}" if step is not None else ""
        super().__init__(f"stopped on {signal_name}{where}")

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.INTERRUPTED if self.signal_name == "SIGINT" else ExitCode.STOPPED


class NonFiniteLoss(RuntimeError):
    """trainer.on_nonfinite=stop: every rank raises this at the same step."""


class SaveFailed(RuntimeError):
    """Rank 0 could not write a checkpoint (a full disk, a file-size limit): the previous
    checkpoint is intact; the message says what happened."""


class ReplicasDiverged(RuntimeError):
    """The ranks' weights differ at the end of training."""


class WorkerFailed(RuntimeError):
    """The job failed; the message names the root-cause rank, `detail` what it said."""

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail


class OutOfMemory(WorkerFailed):
    """A rank ran out of memory; it printed one line saying so (`reported`)."""

    def __init__(self, message: str, reported: bool = False) -> None:
        super().__init__(message)
        self.reported = reported


class JobFailed(CompactHydraException):
    """A sweep job failed: Hydra records it and goes on with the other jobs; the message is
    the job's row in the sweep summary, and Hydra prints it once the sweep is over."""


_PEER_LOST_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "connectFullMesh",
)
_TIMEOUT_MARKERS = ("Timed out", "timed out", "Timeout")
# torch's allocators with no room left (the host's, a GPU's), and a CUDA library's (cuBLAS...).
_OUT_OF_MEMORY_MARKERS = (
    "can't allocate memory",
    "out of memory",  # ("CUDA out of memory" too)
    "std::bad_alloc",
    "_STATUS_ALLOC_FAILED",  # (CUBLAS_, CUDNN_, ...)
)
_TRIED = re.compile(r"tried to allocate (\d+) bytes", re.IGNORECASE)


@dataclass(frozen=True)
class Outcome:
    """What one rank does on its way out."""

    code: ExitCode
    printed: str | None = None  # what this rank prints to stderr (None: nothing)
    reason: str | None = None  # the one-line cause its launcher (and a sweep summary) shows


def outcome_of(error: BaseException, rank: int = 0, timeout_s: float = 0.0) -> Outcome:
    """The exit code of a process (rank `rank`, or a launcher: 0) that ends with `error`, and
    what it prints (call from `except`: a failure prints the current traceback), secrets
    scrubbed from both."""
    outcome = _outcome_of(error, rank, timeout_s)
    return Outcome(outcome.code, scrub_text(outcome.printed), scrub_text(outcome.reason))


def _outcome_of(error: BaseException, rank: int, timeout_s: float) -> Outcome:
    if isinstance(error, OutOfMemory):  # the rank printed its line
        return Outcome(ExitCode.OUT_OF_MEMORY, None if error.reported else f"error: {error}")
    if isinstance(error, WorkerFailed):  # a launcher names the rank that caused it
        return Outcome(ExitCode.FAILED, f"error: {error}", str(error))
    if isinstance(error, Rejected):
        said = None if error.reported or rank != 0 else f"error: {error}"
        return Outcome(ExitCode.CONFIG_REJECTED, said, str(error) if rank == 0 else None)
    if isinstance(error, Stopped):  # rank 0 logged where the checkpoint is
        return Outcome(error.exit_code)
    if isinstance(error, NonFiniteLoss):  # rank 0 logged where it happened
        return Outcome(ExitCode.FAILED, reason=str(error))
    if isinstance(error, SaveFailed):
        return Outcome(ExitCode.FAILED, f"error: {error}", str(error))
    if isinstance(error, KeyboardInterrupt):  # a second Ctrl-C: stopped without a checkpoint
        return Outcome(ExitCode.INTERRUPTED)
    text = str(error)
    if is_out_of_memory(error):
        said = out_of_memory(rank, error)
        return Outcome(ExitCode.OUT_OF_MEMORY, f"error: {said}", said)
    if any(marker in text for marker in _PEER_LOST_MARKERS):
        return Outcome(ExitCode.PEER_LOST)
    if any(marker in text for marker in _TIMEOUT_MARKERS):
        return Outcome(
            ExitCode.COLLECTIVE_TIMEOUT,
            (
                f"error: rank {rank} waited dist.timeout_s={timeout_s:g} s in a collective without "
                "an answer: another rank hung or died (raise dist.timeout_s if a step or a save "
                "legitimately takes longer)"
            ),
        )
    return Outcome(
        ExitCode.FAILED,
        f"rank {rank} failed:\n{traceback.format_exc()}",
        f"{type(error).__name__}: {error}",
    )


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation failed: Python's MemoryError, or torch's allocators saying so."""
    text = str(error)
    return isinstance(error, MemoryError) or any(m in text for m in _OUT_OF_MEMORY_MARKERS)


def out_of_memory(rank: int, error: BaseException) -> str:
    """One line for a rank that ran out of memory: how much it asked for, and what to change."""
    text = str(error)
    asked = _TRIED.search(text)
    if asked:
        what = f"it asked for {int(asked.group(1)) / 2**20:.1f} MiB more"
    else:
        what = first_line(error, 120) or type(error).__name__
    return (
        f"rank {rank} ran out of memory ({what}): `train ... mode=estimate` prints what each "
        "rank holds; strategy=fsdp shards the parameters, gradients and optimizer state over "
        "the ranks, and strategy.activation_checkpointing=true or a smaller data.batch_size "
        "cut the activations"
    )


def announce(outcome: Outcome) -> None:
    if outcome.printed:
        print(outcome.printed, file=sys.stderr, flush=True)


def end(error: BaseException, rank: int = 0) -> NoReturn:
    """Leave this process as the table says for `error` (printing, then SystemExit)."""
    outcome = outcome_of(error, rank)
    announce(outcome)
    raise SystemExit(outcome.code) from None


def root_cause(
    codes: list[int | None],
    victims: set[int] | frozenset = frozenset(),
    messages: dict[int, str] | None = None,
) -> Exception | None:
    """Every rank's exit code read back into nothing (all 0) or one exception naming the cause.

    Negative codes are deaths by signal (multiprocessing's convention). `victims` are ranks
    the launcher stopped after another failed: never the cause. `messages`: what ranks said
    before they exited (kept on WorkerFailed as `detail`)."""
    if all(code == 0 for code in codes):
        return None
    messages = messages or {}
    causes = [(rank, code) for rank, code in enumerate(codes) if rank not in victims]
    rejected = [rank for rank, code in causes if code == ExitCode.CONFIG_REJECTED]
    if rejected:
        said = [messages[rank] for rank in rejected if rank in messages]
        return ConfigError(
            said[0] if said else "a rank rejected the config (see above)", reported=True
        )
    starved = [rank for rank, code in causes if code == ExitCode.OUT_OF_MEMORY]
    if starved:
        if told := [rank for rank in starved if rank in messages]:  # not printed: said once
            return OutOfMemory(messages[told[0]])
        return OutOfMemory(f"rank {starved[0]} ran out of memory (see above)", reported=True)
    stops = (ExitCode.STOPPED, ExitCode.INTERRUPTED)
    stopped = [code for _, code in causes if code in stops]
    if stopped and all(code in (*stops, 0) for _, code in causes):
        return Stopped("SIGINT" if ExitCode.INTERRUPTED in stopped else "SIGTERM")
    for wanted, describe in (
        (lambda c: c == ExitCode.FAILED, "failed (its output is above)"),
        (lambda c: c is not None and c < 0, None),
        (lambda c: c == ExitCode.COLLECTIVE_TIMEOUT, "timed out in a collective (see above)"),
        (lambda c: c == ExitCode.PEER_LOST, "lost contact with the other ranks"),
        (lambda c: c != 0, None),
    ):
        for rank, code in causes or list(enumerate(codes)):
            if wanted(code):
                return WorkerFailed(
                    f"rank {rank} {describe or _describe(code)}", messages.get(rank)
                )
    return None


def _describe(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
