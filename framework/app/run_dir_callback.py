"""The Hydra callback conf/config.yaml installs (hydra.callbacks.run_dir): the run dir is checked
before Hydra writes anything in it, and Hydra's record of the job is written with secrets
redacted."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, read_write
from omegaconf.errors import OmegaConfBaseException

from framework.app.hydra_records import redact_multirun_master, write_hydra_record
from framework.config.validation import joins_other_node, require, spans_nodes
from framework.core import launch_context
from framework.core.exits import ConfigError, end
from framework.launch.slurm.partition import check_cluster
from framework.storage.run_dir import RunDir, make_folder


class RunDirCallback(Callback):
    """The run dir (a sweep's dir) before anything is written in it: where it really is, that it
    can be made, that it holds nothing it must not reuse; then held, and Hydra's record of the
    job written redacted. The config itself was checked before Hydra started
    (framework/train.py)."""

    def __init__(self, output_subdir: str | None = ".hydra") -> None:
        # Hydra's own hydra.output_subdir stays null: Hydra saves its record before any
        # callback runs, secrets included. This is where the redacted record goes instead.
        self.output_subdir = output_subdir

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Judged where it really is (`..` and links resolved), and used as judged.
        run = RunDir(real_path(config.hydra.run.dir))
        try:
            _check_shared_run_dir(config)
            run.note_missing_folders()
            _make("hydra.run.dir", run.path)
            if not joins_other_node(config.launcher):  # the host node's start checks it
                overrides = list(config.hydra.overrides.task)
                run.check_reusable(config, sweep_job=False, overrides=overrides)
        except ConfigError as error:
            end(error, rank=launch_context.current().global_rank())
        with read_write(config.hydra.run):
            config.hydra.run.dir = str(run.path)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:  # before anything is submitted
            sweep_dir = real_path(config.hydra.sweep.dir)
            check_sweep_dir(sweep_dir, list(config.hydra.overrides.task))
            check_cluster(config.launcher)
            _make("hydra.sweep.dir", sweep_dir)
        except ConfigError as error:
            end(error)
        redact_multirun_master(config)  # the sweeper saves it next, as multirun.yaml

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Rank 0 writes the record; of a multi-node torchrun job, the rendezvous host.
        if launch_context.current().is_follower or joins_other_node(config.launcher):
            return
        run = RunDir(Path(config.hydra.runtime.output_dir))
        if config.hydra.mode == RunMode.MULTIRUN:
            try:
                _check_inside_sweep_dir(run.path, real_path(config.hydra.sweep.dir))
            except ConfigError as error:
                end(error)
        # Held before anything is written: a start that finds it taken changes nothing (the
        # app refuses it, naming the holder).
        if not run.take_at_start():
            return
        run.note_start()
        # (a foreign dir, or one holding a link, is refused next, untouched)
        if self.output_subdir is None or run.is_foreign() or run.links():
            return
        record = run.path / self.output_subdir
        # A resumed run dir keeps the record of the command that created it: a resume that is
        # then refused must not have changed anything.
        if not (record / "config.yaml").exists():
            write_hydra_record(config, record)


def _check_shared_run_dir(config: DictConfig) -> None:
    """The nodes of a multi-node torchrun job find each other by their run dir's name: the
    default one (a timestamp per node) would never match."""
    if not spans_nodes(config.launcher):
        return
    chosen = OmegaConf.to_container(config.hydra.run, resolve=False)["dir"]
    require(
        not str(chosen).startswith("${output_dir:"),
        f"launcher.nnodes={config.launcher.nnodes}: the nodes of a job share one run dir and "
        "find each other by its name: give every node the same hydra.run.dir=<a folder on a "
        "shared file system>",
    )


def real_path(path: Any) -> Path:
    """Where `path` really is: `..` and links resolved as far as the path exists, the rest as
    the file system will resolve it once made (`new/../../mine` is `mine`)."""
    return Path(os.path.realpath(os.path.expanduser(str(path))))


def check_sweep_dir(sweep_dir: Path, overrides: list[str]) -> None:
    """A sweep dir that holds files is only reused by the same sweep (to resume it): a user's
    folder, or another sweep's dir (whose summary this sweep's rows would replace), is refused."""
    if not sweep_dir.is_dir() or not any(sweep_dir.iterdir()):
        return
    master = sweep_dir / "multirun.yaml"
    foreign = ConfigError(
        f"hydra.sweep.dir={sweep_dir} holds files that are not a sweep's; it is left "
        "untouched. Choose a new hydra.sweep.dir"
    )
    if not master.is_file() or master.is_symlink():
        raise foreign
    try:
        earlier = OmegaConf.select(OmegaConf.load(master), "hydra.overrides.task", default=None)
    except (OSError, ValueError, OmegaConfBaseException, yaml.YAMLError):
        raise foreign from None
    require(
        earlier is None or list(earlier) == overrides,
        f"hydra.sweep.dir={sweep_dir} holds another sweep ({' '.join(map(str, earlier or []))}); "
        "only the same command resumes it, and it is left untouched. Choose a new "
        "hydra.sweep.dir",
    )


def _check_inside_sweep_dir(job_dir: Path, sweep_dir: Path) -> None:
    real = real_path(job_dir)
    require(
        sweep_dir in real.parents,
        f"hydra.sweep.subdir puts a job's dir at {real}, outside hydra.sweep.dir={sweep_dir}: "
        "name a folder inside it",
    )


def _make(setting: str, path: Path) -> None:
    problem = make_folder(path)
    require(problem is None, f"{setting}={path} cannot be created ({problem}): choose another")
