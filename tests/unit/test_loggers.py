"""Metric sinks: what rank 0 writes (console, metrics.jsonl, summary.json, CSV, TensorBoard),
that every other rank writes nothing, and that no secret reaches the console or train.log."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from framework.components.loggers import (
    ConsoleSink,
    CsvSink,
    HeldConsole,
    NullSink,
    TensorBoardSink,
    _Guarded,
    build_sink,
    drop_held_console,
    release_held_console,
    setup_logging,
    wandb_has_credentials,
)
from framework.config.redaction import REDACTED
from framework.storage.run_dir import RunDir
from tests.conftest import make_cfg

SECRET = "PLANTED-SECRET-789"


class RecordingSink(NullSink):
    """A user's own logger (`logger.mine._target_=...`): records what build_sink gives it."""

    def __init__(
        self, run: RunDir, config: dict, resume_id: str | None = None, resume_step: int = 0
    ) -> None:
        self.run_id = resume_id  # continues a run only when one was saved
        self.config, self.resume_step = config, resume_step
        self.events: list[dict[str, Any]] = []
        self.files: list[Path] = []
        self.closed = False

    def log(self, metrics: dict[str, Any]) -> None:
        self.events.append(metrics)

    def add_files(self, paths: list[Path]) -> None:
        self.files += paths

    def close(self) -> None:
        self.closed = True


def recording_loggers(*names: str):
    return OmegaConf.create(
        {name: {"_target_": f"{__name__}.RecordingSink", "_partial_": True} for name in names}
    )


# --- rank 0: console, metrics.jsonl, summary.json -------------------------------------------
def test_rank_0_logs_each_event_to_the_console_and_metrics_jsonl_and_writes_summary_json(
    tmp_path, caplog
):
    run = RunDir(tmp_path)
    sink = build_sink(True, make_cfg().logger, run, config={}, resume_ids={}, resume_step=0)
    events = [{"step": 1, "train/loss": 0.123456, "lr": 0.1}, {"step": 2, "note": "eval"}]
    with caplog.at_level(logging.INFO, logger="framework"):
        for event in events:
            sink.log(event)
            # Line-buffered: each event is on disk as soon as it is logged (tail -f, a kill).
            assert [json.loads(line) for line in run.metrics.read_text().splitlines()][-1] == event
        sink.summary({"steps": 2, "val/accuracy": 0.75})
    sink.close()
    assert caplog.messages == ["step=1  train/loss=0.1235  lr=0.1", "step=2  note=eval"]
    assert run.metrics.read_text() == "".join(json.dumps(event) + "\n" for event in events)
    assert run.summary.read_text() == '{\n  "steps": 2,\n  "val/accuracy": 0.75\n}\n'
    assert sink.run_ids == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "summary.json"]


def test_the_console_shows_floats_with_four_significant_digits(caplog):
    with caplog.at_level(logging.INFO, logger="framework"):
        ConsoleSink().log({"step": 7, "loss": 2.0 / 3.0, "lr": 1e-5, "big": 123456.0, "ok": True})
    assert caplog.messages == ["step=7  loss=0.6667  lr=1e-05  big=1.235e+05  ok=True"]


def test_a_resumed_run_appends_to_metrics_jsonl(tmp_path):
    run = RunDir(tmp_path)
    run.metrics.write_text('{"step": 1}\n')
    sink = build_sink(True, make_cfg().logger, run, config={}, resume_ids={}, resume_step=1)
    sink.log({"step": 2})
    sink.close()
    assert run.metrics.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_other_ranks_write_nothing_whatever_loggers_are_selected(tmp_path, caplog):
    cfg = make_cfg("logger=[csv,tensorboard]")
    sink = build_sink(
        False, cfg.logger, RunDir(tmp_path), {}, resume_ids={"csv": "x"}, resume_step=5
    )
    with caplog.at_level(logging.DEBUG):
        sink.log({"step": 1, "train/loss": 0.5})
        sink.summary({"steps": 1})
        sink.add_files([tmp_path / "curves.png"])
        sink.close()
    assert list(tmp_path.iterdir()) == []
    assert caplog.records == []
    assert sink.sinks == [] and sink.run_ids == {}


def test_rank_0_builds_every_selected_logger(tmp_path):
    sink = build_sink(
        True, make_cfg("logger=[csv,tensorboard]").logger, RunDir(tmp_path), {}, {}, 0
    )
    sink.log({"step": 1, "train/loss": 0.5})
    sink.close()
    assert [type(s).__name__ for s in sink.sinks] == [
        "ConsoleSink",
        "JsonlSink",
        "CsvSink",
        "TensorBoardSink",
    ]
    assert (tmp_path / "metrics.csv").read_text().splitlines() == ["step,train/loss", "1,0.5"]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_a_users_logger_gets_the_config_and_resume_point_and_every_call(tmp_path):
    """A logger with a saved run id continues it; one without has none in run_ids."""
    sink = build_sink(
        True,
        recording_loggers("mine", "other"),
        RunDir(tmp_path),
        config={"optimizer": {"lr": 0.1}},
        resume_ids={"mine": "run-abc"},
        resume_step=12,
    )
    sink.log({"step": 13, "train/loss": 0.5})
    sink.add_files([tmp_path / "curves.png"])
    sink.close()
    mine, other = sink.sinks[2:]
    assert sink.run_ids == {"mine": "run-abc"}
    assert (mine.config, mine.resume_step, other.resume_step) == (
        {"optimizer": {"lr": 0.1}},
        12,
        12,
    )
    assert mine.events == other.events == [{"step": 13, "train/loss": 0.5}]
    assert mine.files == [tmp_path / "curves.png"]
    assert mine.closed and other.closed


# --- CSV ---------------------------------------------------------------------------------------
def test_csv_has_a_column_per_key_and_rewrites_the_header_when_a_key_appears(tmp_path):
    sink = CsvSink(RunDir(tmp_path), config={}, filename="metrics.csv")
    sink.log({"step": 1, "train/loss": 0.5})
    sink.log({"step": 2, "train/loss": 0.25})
    sink.log({"step": 2, "val/accuracy": 0.75})
    sink.log({"step": 3, "train/loss": 0.125})
    sink.close()
    assert (tmp_path / "metrics.csv").read_text().splitlines() == [
        "step,train/loss,val/accuracy",
        "1,0.5,",
        "2,0.25,",
        "2,,0.75",
        "3,0.125,",
    ]


def test_a_resumed_csv_drops_the_rows_after_the_checkpoint(tmp_path):
    cfg = make_cfg("logger=csv", "logger.csv.filename=train.csv")

    def csv_sink(resume_step: int) -> CsvSink:
        return instantiate(cfg.logger.csv)(
            run=RunDir(tmp_path), config={}, resume_id=None, resume_step=resume_step
        )

    first = csv_sink(0)
    for step in range(1, 6):
        first.log({"step": step, "train/loss": step / 2})
    first.close()
    resumed = csv_sink(3)
    resumed.log({"step": 4, "train/loss": 9.0})
    resumed.close()
    assert (tmp_path / "train.csv").read_text().splitlines() == [
        "step,train/loss",
        "1,0.5",
        "2,1.0",
        "3,1.5",
        "4,9.0",
    ]


# --- TensorBoard -----------------------------------------------------------------------------
def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(event.step, event.value) for event in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }


def test_tensorboard_gets_every_number_by_step_and_nothing_else(tmp_path):
    sink = TensorBoardSink(RunDir(tmp_path), config={})
    sink.log({"step": 1, "epoch": 0, "train/loss": 0.5, "lr": 0.25, "ok": True, "note": "x"})
    sink.log({"step": 2, "train/loss": 0.25, "lr": 0.125, "samples": 64})
    sink.summary({"steps": 2})
    sink.close()
    assert scalars(tmp_path / "tensorboard") == {
        "train/loss": [(1, 0.5), (2, 0.25)],
        "lr": [(1, 0.25), (2, 0.125)],
        "samples": [(2, 64.0)],
    }


def test_a_resumed_tensorboard_log_replaces_the_steps_after_the_checkpoint(tmp_path):
    first = TensorBoardSink(RunDir(tmp_path), config={})
    for step in range(1, 6):
        first.log({"step": step, "train/loss": float(step)})
    first.close()
    resumed = TensorBoardSink(RunDir(tmp_path), config={}, resume_step=3)
    for step in (4, 5):
        resumed.log({"step": step, "train/loss": 10.0 * step})
    resumed.close()
    assert scalars(tmp_path / "tensorboard")["train/loss"] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
        (5, 50.0),
    ]


# --- a logger's service failing ----------------------------------------------------------------
class FlakyService(_Guarded):
    """A logger whose service is gone (as W&B's and MLflow's can be)."""

    label = "Flaky"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, metrics: dict[str, Any]) -> None:
        self._guarded(self._send, metrics)

    def _send(self, metrics: dict[str, Any]) -> None:
        self.calls += 1
        raise ConnectionError("service gone")


def test_a_logger_whose_service_fails_warns_once_and_the_run_goes_on(caplog):
    sink = FlakyService()
    with caplog.at_level(logging.INFO, logger="framework"):
        sink.log({"step": 1})
        sink.log({"step": 2})
    assert sink.calls == 1  # not tried again
    assert caplog.messages == [
        "Flaky stopped working (ConnectionError: service gone); metrics.jsonl keeps every metric"
    ]


def test_wandb_credentials_are_an_api_key_or_a_netrc_entry(tmp_path, monkeypatch):
    netrc = tmp_path / "netrc"
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(netrc))
    assert not wandb_has_credentials()
    netrc.write_text("machine github.com login me password abcdef\n")
    assert not wandb_has_credentials()
    netrc.write_text("machine api.wandb.ai\n  login user\n  password abcdef\n")
    assert wandb_has_credentials()
    netrc.unlink()
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    assert wandb_has_credentials()


# --- what the logs of a rank hold --------------------------------------------------------------
@contextlib.contextmanager
def rank_logging(is_main: bool, rank: int, log_file: Path | None) -> Iterator[None]:
    """setup_logging for one test: the root logger's handlers and level are restored after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    setup_logging(is_main, rank, log_file)
    try:
        yield
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


def test_rank_0_console_and_train_log_redact_secrets(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MY_SERVICE_TOKEN", SECRET)
    run = RunDir(tmp_path)
    with rank_logging(True, 0, run.log):
        ConsoleSink().log({"step": 1, "note": f"token={SECRET}"})
        logging.getLogger("framework").warning("could not reach %s", f"https://{SECRET}@host")
    written = run.log.read_text()
    printed = capsys.readouterr().err
    for text in (written, printed):
        lines = text.splitlines()
        assert SECRET not in text
        assert len(lines) == 2 and all(line.startswith("[") for line in lines)
        assert lines[0].endswith(f"][rank 0] step=1  note=token={REDACTED}")
        assert lines[1].endswith(f"][rank 0] could not reach https://{REDACTED}@host")


def test_start_up_lines_wait_for_the_parts_and_a_refusal_drops_them(tmp_path, capsys):
    """A rank's start-up lines are printed once its parts are built, in order; a start that
    is refused prints none of them (its one error line is printed apart)."""
    log = logging.getLogger("framework")
    with rank_logging(True, 0, None):
        log.info("run dir /somewhere")
        assert capsys.readouterr().err == ""
        release_held_console()
        log.info("step=1")
    assert [line.split("] ", 1)[1] for line in capsys.readouterr().err.splitlines()] == [
        "run dir /somewhere",
        "step=1",
    ]
    with rank_logging(True, 0, None):
        log.info("Instantiating model <x>")
        drop_held_console()
        log.warning("after the refusal")
    assert [line.split("] ", 1)[1] for line in capsys.readouterr().err.splitlines()] == [
        "after the refusal"
    ]


def test_a_process_forked_while_lines_are_held_prints_its_own_warnings(capfd):
    """A DataLoader worker forked during the build: its warning is printed, not held forever,
    and the parent's held lines are printed once, by the parent."""
    log = logging.getLogger("framework")
    with rank_logging(True, 0, None):
        log.info("held in the parent")
        child = os.fork()
        if child == 0:
            log.warning("from the worker")
            os._exit(0)
        os.waitpid(child, 0)
        assert capfd.readouterr().err.count("] from the worker") == 1
        release_held_console()
    assert capfd.readouterr().err.count("] held in the parent") == 1


def test_held_start_up_lines_show_after_patience(capsys):
    """A slow build (a large dataset) still shows what is being built."""
    console = logging.StreamHandler()
    held = HeldConsole(console, patience_s=0.05)
    record = logging.LogRecord("framework", logging.INFO, __file__, 1, "loading", None, None)
    held.handle(record)
    assert capsys.readouterr().err == ""
    held.timer.join(timeout=5)
    assert capsys.readouterr().err == "loading\n"
    held.close()


def test_other_ranks_print_warnings_only_and_write_no_train_log(tmp_path, capsys):
    run = RunDir(tmp_path)
    with rank_logging(False, 3, run.log):
        ConsoleSink().log({"step": 1})
        logging.getLogger("framework").warning("slow rank")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].endswith("][rank 3] slow rank")
    assert not run.log.exists()


@pytest.mark.parametrize("log_file", [None, "train.log"])
def test_setup_logging_replaces_earlier_handlers(tmp_path, log_file, capsys):
    """A second setup (the next job of a sweep in the same process) does not print twice."""
    path = tmp_path / log_file if log_file else None
    with rank_logging(True, 0, path):
        setup_logging(True, 0, path)
        logging.getLogger("framework").info("once")
    assert len(capsys.readouterr().err.splitlines()) == 1
    if path:
        assert len(path.read_text().splitlines()) == 1


def test_a_second_setup_closes_the_first_jobs_train_log(tmp_path):
    """The jobs of a sweep run in one process: each job's train.log is closed when the next
    job sets up its logging, not left open."""
    with rank_logging(True, 0, tmp_path / "first.log"):
        first = next(h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler))
        setup_logging(True, 0, tmp_path / "second.log")
        assert first.stream is None  # closed (FileHandler.close drops its stream)
