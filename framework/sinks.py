"""Metric sinks. Rank 0 gets console + JSONL (+ W&B); every other rank gets a null sink,
so the loop never asks which rank it is on."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Protocol

from framework.redaction import SecretFilter, known_secrets, redact
from framework.rundir import RunDir

log = logging.getLogger("framework")


class MetricSink(Protocol):
    def log(self, metrics: dict[str, Any]) -> None: ...
    def summary(self, summary: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class NullSink:
    def log(self, metrics: dict[str, Any]) -> None:
        pass

    def summary(self, summary: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class ConsoleSink(NullSink):
    def log(self, metrics: dict[str, Any]) -> None:
        log.info("  ".join(f"{key}={_format(value)}" for key, value in metrics.items()))


class JsonlSink(NullSink):
    """metrics.jsonl: one JSON object per event; summary.json at the end."""

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self.file = open(run.metrics, "a", buffering=1)  # noqa: SIM115 (lives with the sink)

    def log(self, metrics: dict[str, Any]) -> None:
        self.file.write(json.dumps(metrics) + "\n")

    def summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.write_text(json.dumps(summary, indent=2) + "\n")

    def close(self) -> None:
        self.file.close()


def wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")


class WandbSink(NullSink):
    """One W&B run per job, created on rank 0 only; offline without credentials."""

    def __init__(self, cfg: dict, run_dir: Path, config: dict, run_id: str | None = None) -> None:
        import wandb  # imported here: costs ~1 s and only rank 0 with logger=wandb needs it

        secrets = known_secrets()
        # W&B stores sys.argv in the run's metadata. main() hides secret overrides; should a
        # known secret still be in argv (another entry point), the metadata is left out.
        argv_leaks = redact(sys.argv, secrets) != sys.argv
        settings = wandb.Settings(save_code=False, x_disable_meta=argv_leaks)
        mode = os.environ.get("WANDB_MODE") or cfg["mode"]
        if mode == "auto":
            mode = "online" if wandb_has_credentials() else "offline"
        self.run = wandb.init(
            project=cfg["project"],
            entity=cfg["entity"],
            group=cfg["group"],
            tags=list(cfg["tags"]),
            name=cfg["run_name"] or run_dir.name,
            dir=str(run_dir),
            config=config,  # redacted once by the caller (redaction.redacted_container)
            mode=mode,
            settings=settings,
            # The id is saved in checkpoints: a resumed or restarted run continues this W&B run.
            id=run_id,
            resume="allow" if run_id else None,
        )
        self.broken = False
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

    def _guarded(self, call: Any, *args: Any, **kwargs: Any) -> None:
        """W&B holds a copy of metrics.jsonl; losing it must not end the run. Its service is a
        child process, so a signal to the whole job (SLURM's requeue or preemption, a
        terminal's Ctrl-C) can end it before the run has saved its checkpoint."""
        if self.broken:
            return
        try:
            call(*args, **kwargs)
        except Exception as error:  # noqa: BLE001
            self.broken = True
            log.warning("W&B stopped working (%s: %s); metrics.jsonl keeps every metric",
                        type(error).__name__, error)  # fmt: skip


class FanOut(NullSink):
    def __init__(self, sinks: list[MetricSink]) -> None:
        self.sinks = sinks

    def log(self, metrics: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(metrics)

    def summary(self, summary: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.summary(summary)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def build_sink(
    is_main: bool, logger_cfg: dict, run: RunDir, config: dict, run_id: str | None = None
) -> MetricSink:
    if not is_main:
        return NullSink()
    sinks: list[MetricSink] = [ConsoleSink(), JsonlSink(run)]
    if logger_cfg["name"] == "wandb":
        sinks.append(WandbSink(logger_cfg, run.path, config, run_id))
    return FanOut(sinks)


def setup_logging(is_main: bool, rank: int, log_file: Path | None) -> None:
    """Rank 0: INFO to the console and to log_file (train.log). Other ranks: warnings only."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    fmt = logging.Formatter(f"[%(asctime)s][rank {rank}] %(message)s", datefmt="%H:%M:%S")
    console = logging.StreamHandler()
    console.setFormatter(fmt)
    console.addFilter(SecretFilter())  # a secret in a message or traceback is redacted
    root.addHandler(console)
    root.setLevel(logging.INFO if is_main else logging.WARNING)
    if is_main and log_file is not None:
        file_handler = logging.FileHandler(log_file)
        file_handler.setFormatter(fmt)
        file_handler.addFilter(SecretFilter())
        root.addHandler(file_handler)
