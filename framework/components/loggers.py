"""Metric sinks. Rank 0 gets console + metrics.jsonl + summary.json, and every logger the
`logger` group selects (any number: `logger=[wandb,tensorboard,csv,mlflow]`); every other rank
gets a null sink, so the loop never asks which rank it is on.

A logger is built by `_target_` (a partial: the rank supplies the run dir, the redacted config,
and, after a restart, its saved run id and the step the run resumes from), so that a resumed
or requeued run continues the same W&B run, MLflow run, TensorBoard log and CSV file.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import json
import logging
import logging.handlers
import os
import secrets
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from annotated_types import MinLen
from hydra.utils import instantiate
from omegaconf import DictConfig

from framework.config.validation import file_name_problem, tracking_uri_problem
from framework.core.exits import ConfigError, first_line
from framework.core.leaving import when_leaving
from framework.core.secrets import install_log_scrubbing, known_secrets, scrub
from framework.storage.run_dir import RunDir

log = logging.getLogger("framework")


class MetricSink(Protocol):
    run_id: str | None  # what a restart needs to continue the same run (saved in checkpoints)

    def log(self, metrics: dict[str, Any]) -> None: ...
    def summary(self, summary: dict[str, Any]) -> None: ...
    def add_files(self, paths: list[Path]) -> None: ...  # pictures and text made at the end
    def close(self) -> None: ...


class NullSink:
    run_id: str | None = None

    def log(self, metrics: dict[str, Any]) -> None:
        pass

    def summary(self, summary: dict[str, Any]) -> None:
        pass

    def add_files(self, paths: list[Path]) -> None:
        pass

    def close(self) -> None:
        pass


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        key: value
        for key, value in metrics.items()
        if key not in ("step", "epoch")
        and isinstance(value, int | float)
        and not isinstance(value, bool)
    }


@contextlib.contextmanager
def _temp_folder_in(run: RunDir) -> Iterator[None]:
    """W&B makes temp folders as it is imported and leaves their removal to the interpreter's
    shutdown, which a rank skips (exit_now): they go in one of the run dir's (not the temp
    folder), removed as the process leaves (core/leaving.py)."""
    if "wandb" in sys.modules:  # (imported before: its folders exist)
        yield
        return
    folder = tempfile.mkdtemp(prefix=".wandb-temp-", dir=run.path)
    when_leaving(functools.partial(shutil.rmtree, folder, ignore_errors=True))
    before, tempfile.tempdir = tempfile.tempdir, folder
    try:
        yield
    finally:
        tempfile.tempdir = before


def _run_dir(run: Any) -> RunDir:
    """The run dir a sink writes into. Only the rank builds one: a sink named anywhere else in a
    config would get a mapping in its place, and write wherever that said."""
    if not isinstance(run, RunDir):
        raise TypeError(f"a logger writes into the run dir it is given, not {type(run).__name__}")
    return run


class ConsoleSink(NullSink):
    def log(self, metrics: dict[str, Any]) -> None:
        log.info("  ".join(f"{key}={_format(value)}" for key, value in metrics.items()))


class JsonlSink(NullSink):
    """metrics.jsonl: one JSON object per event; summary.json at the end."""

    def __init__(self, run: RunDir) -> None:
        self.run = _run_dir(run)
        self.file = open(run.metrics, "a", buffering=1)  # noqa: SIM115 (lives with the sink)

    def log(self, metrics: dict[str, Any]) -> None:
        self.file.write(json.dumps(metrics) + "\n")

    def summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.write_text(json.dumps(summary, indent=2) + "\n")

    def close(self) -> None:
        self.file.close()


class _Guarded(NullSink):
    """A logger whose service can fail: it holds a copy of metrics.jsonl, and losing it must not
    end the run. (W&B's service is a child process: a signal to the whole job, SLURM's requeue
    or a terminal's Ctrl-C, can end it before the run has saved its checkpoint.)"""

    label = "logger"
    broken = False

    def _guarded(self, call: Any, *args: Any, **kwargs: Any) -> None:
        if self.broken:
            return
        try:
            call(*args, **kwargs)
        except Exception as error:  # noqa: BLE001
            self.broken = True
            log.warning(
                "%s stopped working (%s: %s); metrics.jsonl keeps every metric",
                self.label,
                type(error).__name__,
                error,
            )


def wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")


class WandbSink(_Guarded):
    """logger=wandb: one W&B run per job; offline without credentials. Files go to $WANDB_DIR
    when it is set, else to the run dir."""

    label = "W&B"

    def __init__(
        self,
        run: RunDir,
        config: dict,
        project: str,
        entity: str | None,
        group: str | None,
        run_name: str | None,
        tags: list[str],
        mode: Literal["auto", "online", "offline", "disabled"],
        resume_id: str | None = None,
        resume_step: int = 0,
    ) -> None:
        run = _run_dir(run)
        with _temp_folder_in(run):
            import wandb  # imported here: costs ~1 s and only rank 0 with logger=wandb needs it

        # W&B stores sys.argv in the run's metadata. main() hides secret overrides; should a
        # known secret still be in argv (another entry point), the metadata is left out.
        argv_leaks = scrub(sys.argv, known_secrets()) != sys.argv
        settings = wandb.Settings(save_code=False, x_disable_meta=argv_leaks)
        mode = os.environ.get("WANDB_MODE") or str(mode)  # (the schema's enum, as wandb's string)
        if mode == "auto":
            mode = "online" if wandb_has_credentials() else "offline"
        # W&B run ids are short lowercase alphanumerics; a restart continues the saved one.
        self.run_id = resume_id or secrets.token_hex(4)
        self.run = wandb.init(
            project=project,
            entity=entity,
            group=scrub(group),  # (a name may hold a value read from the environment)
            tags=scrub(list(tags)),
            name=scrub(run_name or run.path.name),
            dir=os.environ.get("WANDB_DIR") or str(run.path),
            config=config,  # redacted once by the caller (redaction.redacted_container)
            mode=mode,
            settings=settings,
            id=self.run_id,
            resume="allow",
        )
        if mode == "offline":
            log.info(
                "W&B is offline (no credentials found); upload later with: wandb sync %s",
                Path(self.run.dir).parent,
            )

    def log(self, metrics: dict[str, Any]) -> None:
        self._guarded(self.run.log, metrics, step=metrics.get("step"))

    def summary(self, summary: dict[str, Any]) -> None:
        self._guarded(self.run.summary.update, summary)

    def close(self) -> None:
        self._guarded(self.run.finish)


class TensorBoardSink(NullSink):
    """logger=tensorboard: event files in <run dir>/tensorboard (`tensorboard --logdir
    <run dir>/tensorboard`). A resumed run drops the events logged after its checkpoint
    (purge_step), as metrics.jsonl does."""

    def __init__(
        self, run: RunDir, config: dict, resume_id: str | None = None, resume_step: int = 0
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter  # only rank 0 with this logger

        self.writer = SummaryWriter(
            str(_run_dir(run).path / "tensorboard"),
            purge_step=resume_step + 1 if resume_step else None,
        )

    def log(self, metrics: dict[str, Any]) -> None:
        for key, value in _numbers(metrics).items():
            self.writer.add_scalar(key, value, global_step=metrics.get("step"))

    def summary(self, summary: dict[str, Any]) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class CsvSink(NullSink):
    """logger=csv: <run dir>/metrics.csv, one row per event, one column per key (the file is
    rewritten when a new key appears). A resumed run drops the rows after its checkpoint."""

    def __init__(
        self,
        run: RunDir,
        config: dict,
        filename: str,
        resume_id: str | None = None,
        resume_step: int = 0,
    ) -> None:
        if problem := file_name_problem(filename):
            raise ValueError(f"logger.csv.filename={filename} {problem}")
        self.path = _run_dir(run).path / filename
        self.rows: list[dict[str, Any]] = []
        if self.path.exists():
            with self.path.open(newline="") as file:
                self.rows = [
                    row
                    for row in csv.DictReader(file)
                    if float(row.get("step") or 0) <= resume_step
                ]
        self.columns = list(dict.fromkeys(key for row in self.rows for key in row))
        self._rewrite()

    def log(self, metrics: dict[str, Any]) -> None:
        self.rows.append(metrics)
        if any(key not in self.columns for key in metrics):
            self.columns += [key for key in metrics if key not in self.columns]
            self._rewrite()
            return
        with self.path.open("a", newline="") as file:
            csv.DictWriter(file, self.columns).writerow(metrics)

    def _rewrite(self) -> None:
        with self.path.open("w", newline="") as file:
            writer = csv.DictWriter(file, self.columns)
            writer.writeheader()
            writer.writerows(self.rows)


class MLflowSink(_Guarded):
    """logger=mlflow: one MLflow run per job in a tracking store (sqlite:///mlflow.db in the
    working dir unless tracking_uri or $MLFLOW_TRACKING_URI says otherwise): the redacted config
    as params, every metric by step, summary.json and the pictures as artifacts. `mlflow ui
    --backend-store-uri sqlite:///mlflow.db` shows them."""

    label = "MLflow"

    def __init__(
        self,
        run: RunDir,
        config: dict,
        tracking_uri: str | None,
        experiment: Annotated[str, MinLen(1)],
        run_name: str | None,
        resume_id: str | None = None,
        resume_step: int = 0,
    ) -> None:
        import mlflow  # imported here: ~2 s, only rank 0 with logger=mlflow needs it
        from mlflow.exceptions import MlflowException

        if problem := tracking_uri_problem(tracking_uri):
            raise ValueError(f"logger.mlflow.tracking_uri={tracking_uri} {problem}")
        self.mlflow = mlflow
        self.run_dir = _run_dir(run)
        uri = (
            tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{Path.cwd() / 'mlflow.db'}"
        )
        name = None if resume_id else scrub(run_name or run.path.name)
        try:
            mlflow.set_tracking_uri(uri)
            with _first_answer_bounded():
                mlflow.set_experiment(experiment)
                self.run_id = mlflow.start_run(run_id=resume_id, run_name=name).info.run_id
        except (MlflowException, OSError, ValueError) as error:  # not a traceback: the URI
            setting = "logger.mlflow.tracking_uri" if tracking_uri else "$MLFLOW_TRACKING_URI"
            raise ConfigError(
                scrub(
                    f"{setting}={uri}: MLflow could not start a run there "
                    f"({type(error).__name__}: {first_line(error)}): start the tracking server "
                    f"or name another one"
                )
            ) from None
        if not resume_id:
            params = {key: json.dumps(value) for key, value in _flat(config).items()}
            self._guarded(mlflow.log_params, params)

    def log(self, metrics: dict[str, Any]) -> None:
        self._guarded(self.mlflow.log_metrics, _numbers(metrics), step=metrics.get("step"))

    def summary(self, summary: dict[str, Any]) -> None:
        self._guarded(self.mlflow.log_artifact, str(self.run_dir.summary))

    def add_files(self, paths: list[Path]) -> None:
        for path in paths:
            self._guarded(self.mlflow.log_artifact, str(path))

    def close(self) -> None:
        self._guarded(self.mlflow.end_run)


# MLflow's client retries a request 7 times over about 4 minutes, a line each: a server that does
# not answer when the run starts is a wrong URI or a server not started, said in one line within
# seconds. Once the run has started, its own retries (or the environment's) ride out a blip.
FIRST_ANSWER = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


@contextlib.contextmanager
def _first_answer_bounded() -> Iterator[None]:
    unset = [name for name in FIRST_ANSWER if name not in os.environ]
    os.environ.update({name: FIRST_ANSWER[name] for name in unset})
    try:
        yield
    finally:
        for name in unset:
            os.environ.pop(name, None)


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    return {
        key: value
        for name, child in node.items()
        for key, value in _flat(child, f"{prefix}{name}.").items()
    }


class FanOut(NullSink):
    """Every sink of this rank. `run_ids`: {logger name: run id} of the loggers that continue
    a run by id after a restart (saved in checkpoints)."""

    def __init__(self, sinks: list[MetricSink], run_ids: dict[str, str] | None = None) -> None:
        self.sinks, self.run_ids = sinks, run_ids or {}

    def log(self, metrics: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(metrics)

    def summary(self, summary: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.summary(summary)

    def add_files(self, paths: list[Path]) -> None:
        for sink in self.sinks:
            sink.add_files(paths)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def build_sink(
    is_main: bool,
    loggers: DictConfig,
    run: RunDir,
    config: dict,
    resume_ids: dict[str, str],
    resume_step: int,
) -> FanOut:
    """Rank 0: console, metrics.jsonl, and every selected logger (continuing the runs in
    `resume_ids` after a restart); other ranks: nothing."""
    if not is_main:
        return FanOut([])
    named: dict[str, MetricSink] = {}
    for name, logger in loggers.items():
        named[str(name)] = instantiate(logger)(
            run=run, config=config, resume_id=resume_ids.get(str(name)), resume_step=resume_step
        )
    return FanOut(
        [ConsoleSink(), JsonlSink(run), *named.values()],
        {name: sink.run_id for name, sink in named.items() if sink.run_id},
    )


def setup_logging(is_main: bool, rank: int, log_file: Path | None) -> None:
    """Rank 0: INFO to the console and to log_file (train.log). Other ranks: warnings only.
    The console's lines wait in a `HeldConsole` until the rank's parts are built."""
    install_log_scrubbing()  # a secret in any record's message or traceback is scrubbed
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        # An earlier job's train.log in this process, and its console's start-up timer.
        if isinstance(handler, (logging.FileHandler, HeldConsole)):
            handler.close()
    fmt = logging.Formatter(f"[%(asctime)s][rank {rank}] %(message)s", datefmt="%H:%M:%S")
    console = logging.StreamHandler()
    console.setFormatter(fmt)
    root.addHandler(HeldConsole(console))
    root.setLevel(logging.INFO if is_main else logging.WARNING)
    if is_main and log_file is not None:
        file_handler = logging.FileHandler(log_file, delay=True)
        file_handler.setFormatter(fmt)
        # An existing run's log (a resume): held until the run is accepted, so that a refused
        # start writes nothing into it.
        root.addHandler(HeldLog(file_handler) if log_file.exists() else file_handler)


class HeldLog(logging.handlers.MemoryHandler):
    """Records kept in memory until `release_held_log` writes them to the file handler."""

    def __init__(self, target: logging.Handler) -> None:
        super().__init__(capacity=1 << 30, flushLevel=logging.CRITICAL + 1, flushOnClose=False)
        self.held_for = target


class HeldConsole(logging.handlers.MemoryHandler):
    """A rank's start-up lines (the layout, `Instantiating ...`), kept until its parts are
    built: a start that a constructor refuses then prints only its one error line, and no line
    naming a run dir that is removed again. Released by `release_held_console` (the parts are
    built, or the rank leaves another way), or after `patience_s`, so that a slow dataset still
    shows what is being built."""

    def __init__(self, target: logging.Handler, patience_s: float = 10.0) -> None:
        super().__init__(capacity=1 << 30, flushLevel=logging.CRITICAL + 1, target=target)
        self.released = False
        self.timer = threading.Timer(patience_s, self.let_through)
        self.timer.daemon = True
        self.timer.start()

    def shouldFlush(self, record: logging.LogRecord) -> bool:
        return self.released

    def let_through(self) -> None:  # (Handler.release is its lock's)
        self.timer.cancel()
        with self.lock:
            self.released = True
            self.flush()

    def forget(self) -> None:
        """The start was refused: its one error line replaces what was held."""
        self.timer.cancel()
        with self.lock:
            self.buffer.clear()
            self.released = True

    def close(self) -> None:
        self.timer.cancel()
        super().close()


def _held_consoles() -> list[HeldConsole]:
    return [h for h in logging.getLogger().handlers if isinstance(h, HeldConsole)]


def release_held_console() -> None:
    """The rank's parts are built (or it leaves for another reason than a refusal): the
    start-up lines are printed, and the later ones as they come."""
    for handler in _held_consoles():
        handler.let_through()


def drop_held_console() -> None:
    for handler in _held_consoles():
        handler.forget()


def _forked_while_held() -> None:
    """A process forked while lines are held (a DataLoader worker, forked for the task's check
    on a real batch) has no timer and is never released: the parent prints the held lines, and
    the child's own go straight out."""
    for handler in _held_consoles():
        handler.forget()


os.register_at_fork(after_in_child=_forked_while_held)


def release_held_log() -> None:
    """The run is accepted: what its log held goes into the file, and the rest straight there."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, HeldLog):
            handler.setTarget(handler.held_for)
            handler.flush()
            root.removeHandler(handler)
            root.addHandler(handler.held_for)
            handler.close()
