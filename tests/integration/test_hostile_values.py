"""No traceback from any value, by construction: hostile values for every key whose value is a
path, a server, an interpolation or a size, each through one of the command's entries (a run,
a sweep, --cfg job, --help, mode=eval, mode=estimate, a resume), in turn. Each is one line,
exit 2, nothing written, no process left (docs/security.md)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from framework.core.exits import ExitCode
from tests.conftest import make_cfg, train_here

pytestmark = pytest.mark.slow
TINY = ("launcher.nproc_per_node=1", "trainer.max_steps=2", "model.width=4")
LOGGERS = "logger=[csv,tensorboard,mlflow,wandb]"
UNSET = "${oc.env:FRAMEWORK_TEST_NEVER_SET}"
# Keys that name a file, a folder or a server (they are judged as paths), and keys of sizes.
PATHS = ("dir", "root", "path", "file", "filename", "resume", "uri", "url")
TOO_LONG = "x" * 300


def keys_of(*overrides: str) -> dict[str, object]:
    """Every leaf of the app config (Hydra's node aside) these overrides compose."""
    plain = OmegaConf.to_container(make_cfg(*overrides), resolve=False)
    found: dict[str, object] = {}

    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else str(key))
        else:
            found[path] = node

    walk(plain, "")
    return {key: value for key, value in found.items() if not key.startswith("hydra.")}


def hostile_cases() -> list[tuple[tuple[str, ...], str]]:
    """(overrides, the key the one line must name): a path key with each hostile text, every
    size key unresolvable or of a size no machine holds."""
    cases = []
    keys = keys_of("data=cifar10", LOGGERS, "logger.mlflow.tracking_uri=http://h:1", "init=file")
    for key in [k for k in keys if k.rsplit(".", 1)[-1].endswith(PATHS)]:
        extra = ("data=cifar10",) if key.startswith("data.") else ()
        extra += (LOGGERS,) if key.startswith("logger.") else ()
        extra += ("init=file",) if key.startswith("init.") else ()
        for value in (TOO_LONG, UNSET, "a\u202eb", "a\x01b"):
            cases.append(((*extra, f"{key}='{value}'"), key))
    for key in ("hydra.run.dir", "hydra.sweep.dir"):
        for value in (f"/tmp/{TOO_LONG}", UNSET, "a\u202eb"):
            cases.append(((f"{key}='{value}'",), key))
    sizes = [k for k, v in keys_of().items() if isinstance(v, int) and not isinstance(v, bool)]
    for key in sizes:
        cases.append(((f"{key}={UNSET}",), key))
    return cases


ENTRIES = ("run", "sweep", "cfg", "help", "eval", "estimate", "resume")
# A folder whose parent cannot exist is judged where it is made: the run's, the sweep's.
FOLDERS_MADE = [
    ("run", ("hydra.run.dir=/proc/nope/x",), "hydra.run.dir"),
    ("sweep", ("hydra.sweep.dir=/proc/nope/x",), "hydra.sweep.dir"),
]
# Sizes no machine holds are found where the parts are built (--cfg job and --help show a value
# as it is), so their entries are fixed: those that build.
TOO_LARGE = [
    ("estimate", ("model.width=10000000000000",), "model"),
    ("resume", ("data.num_workers=100000",), "data"),
]
CASES = [
    *((entry, *case) for entry, case in zip(itertools.cycle(ENTRIES), hostile_cases())),
    *TOO_LARGE,
    *FOLDERS_MADE,
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished run: what mode=eval evaluates and a resume continues."""
    root = tmp_path_factory.mktemp("finished")
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert train_here(monkeypatch, *TINY, f"hydra.run.dir={root / 'run'}", cwd=root) == 0
    return root / "run"


def entry_arguments(entry: str, run: Path) -> tuple[str, ...]:
    return {
        "run": (),
        "sweep": ("-m",),
        "cfg": ("--cfg", "job"),
        "help": ("--help",),
        "eval": ("mode=eval", f"checkpoint.resume={run / 'checkpoints' / 'last.pt'}"),
        "estimate": ("mode=estimate",),
        "resume": (f"hydra.run.dir={run}", "trainer.max_steps=3"),
    }[entry]


def files_under(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def processes_in(folder: Path) -> list[str]:
    found = []
    for process in Path("/proc").glob("[0-9]*"):
        if process.name == str(os.getpid()):  # (the in-process `train` works in it)
            continue
        try:
            if os.readlink(process / "cwd").startswith(str(folder)):
                found.append(process.name)
        except OSError:
            continue
    return found


@pytest.mark.parametrize(
    ("entry", "overrides", "key"), CASES, ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)]
)
def test_a_hostile_value_is_one_line_exit_2_and_leaves_nothing(
    cli, tmp_path, finished_run, entry, overrides, key
):
    before = files_under(finished_run)
    argv = (*entry_arguments(entry, finished_run), *TINY, *overrides)
    result = cli(*argv, cwd=tmp_path)
    assert result.returncode == ExitCode.CONFIG_REJECTED, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    if entry in ("resume", "eval"):  # (first, the line naming what the run's record gave)
        lines = [line for line in lines if not line.startswith(("resuming with", "mode=eval"))]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert key.rsplit(".", 1)[-1] in lines[0], lines[0]  # (or a key that reads it)
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []
    assert files_under(finished_run) == before
    assert processes_in(tmp_path) == []
