"""A config mistake is refused before anything imports torch: one line, exit 2, no run dir, and no
process left behind (the fork server `train` starts early ends with it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from benchmarks import front_door
from framework.core.exits import ExitCode
from tests.conftest import DIST_ENV_VARS, torch_refused

MISTAKES = [
    ("data.standardise=true", "error: data.standardise is not a setting of"),
    ("data.batch_size=abc", "data.batch_size"),
    ("model=nosuch", "model"),
    ("model=mlp model.hiden_sizes=[8]", "did you mean model.hidden_sizes?"),
    ("optimizer.momentum=abc", "optimizer.momentum='abc' is not of type float"),
    ("optimizer._target_=torch.optim.SDG", "did you mean torch.optim.SGD?"),
    ("task=autoencoder task.reconstruction=l1", "not one of 'mse', 'bce'"),
    ("objective=val/acuracy", "objective='val/acuracy' is not a metric"),
    ("trainer.grad_accum=0", "trainer.grad_accum=0 must be >= 1"),
    # Refused in the rank, after torch, until a rule read them from source.
    ("experiment=digits_vae objective=val/accuracy", "is not a metric this run reports"),
    # A module named where a class is meant, and a class in the wrong case: from source, with
    # torch never imported.
    (
        "optimizer._target_=torch.optim.adam",
        "torch.optim.adam is a module, not a class or function: did you mean torch.optim.Adam?",
    ),
    ("optimizer._target_=torch.optim.Adamw", "names nothing: did you mean torch.optim.AdamW?"),
    (
        "precision._target_=framework.components.precision.Amp",
        "did you mean framework.components.precision.AMP?",
    ),
    (
        "launcher=torchrun launcher.rdzv_endpoint=localhost:abc",
        "error: launcher.rdzv_endpoint=localhost:abc: give host:port with a port from 0 to 65535",
    ),
    # Overrides that do not parse: Hydra's line.
    ("optimizer.lr=${", "error: Error parsing override 'optimizer.lr=${'"),
    ("-m optimizer.lr=${", "error: Error parsing override 'optimizer.lr=${'"),
    # A key the config lacks, without +: Hydra's fix (append it with +) is the wrong one.
    (
        "trainer.max_step=2",
        "error: trainer.max_step is not a setting: did you mean trainer.max_steps?",
    ),
    ("+launcher.nproc_per_nod=1", "launcher.nproc_per_nod is not a setting: did you mean"),
    # A sweep: what would fail every job is refused before the first starts.
    ("-m data.batch_sizee=1,2", "data.batch_sizee is not a setting of"),
    ("-m optimizer.lr=0.1,abc", "Error merging override optimizer.lr=abc"),
    ("-m trainer.max_step=2,3", "did you mean trainer.max_steps?"),
    # Values out of the bounds a shipped component's signature declares (it would fail on them
    # inside a rank, or at its first step).
    ("model.width=-4", "error: model.width=-4 must be >= 1"),
    ("model=mlp model.hidden_sizes=[8,0]", "error: model.hidden_sizes=[8, 0] must be >= 1"),
    ("scheduler=step scheduler.step_size=0", "error: scheduler.step_size=0 must be >= 1"),
    # A parameter without a default that nothing gives, and a null where it takes none.
    (
        "~model.width",
        "error: model.width is not set and framework.components.models.SmallCNN has no default",
    ),
    (
        "model=gpt",
        "error: model.vocab_size is null (from ${data.vocab_size}) but framework.components."
        "models.GPT takes vocab_size: int: pick a data option that sets data.vocab_size",
    ),
]


# Hydra's own flags and commands, which Hydra itself refused with a traceback (or a line of its
# own) and exit 1.
FLAG_MISTAKES = [
    ("--resolve", "error: --resolve resolves what --cfg or --help shows: add --cfg job"),
    ("-m --cfg job", "error: --multirun and --cfg: Hydra runs one of --run, --multirun, --cfg"),
    ("--cfg job logger=null", "logger is a config group: name one of its options (csv, mlflow"),
    ("-m logger=null", "logger=null: logger is a config group"),
    ("--help model=nosuch", "Could not find 'model/nosuch'"),
    ("--help data.batch_size=abc", "Error merging override data.batch_size=abc"),
    ("--config-dir nope --cfg job", "error: --config-dir nope: no such folder of config files"),
    ("--cfg job -p model.nosuch", "error: --package model.nosuch: not a key, or null"),
    ("--cfg job ~logger optimizer=1", "error: optimizer=1: optimizer is a config group"),
    ("-p model", "error: --package model picks what --cfg shows: add --cfg job"),
    # The config --cfg or --help shows is the one meant: a misspelt key is refused as the run
    # would refuse it.
    ("--cfg job data.batch_sizee=3", "error: data.batch_sizee is not a setting of"),
    ("--help optimizer.lrr=1", "is not a setting of torch.optim.SGD: did you mean optimizer.lr?"),
    # What argparse refused with its whole usage text.
    ("--cfgg job", "error: --cfgg is not a flag of train: did you mean --cfg?"),
    ("--cfg jb", "error: argument --cfg/-c: invalid choice: 'jb' (choose from 'job', 'hydra'"),
    # Hydra's shell completion raised a traceback for what it does not take.
    (
        "--shell-completion install=fishy",
        "error: --shell-completion install=fishy: no completion for that shell: did you mean "
        "install=fish?",
    ),
    ("-sc query=nosuch", "no completion for that shell: SHELL is one of ['bash', 'fish', 'zsh']"),
    ("-sc", "error: --shell-completion takes one of install=SHELL, uninstall=SHELL or query="),
    ("-sc install=bash uninstall=bash", "error: --shell-completion takes one of install=SHELL"),
    (
        "data.batch_size=3 -m optimizer.lr=0.1,0.2",
        "error: optimizer.lr=0.1,0.2 comes after a flag that follows other overrides: put the "
        "flags (-m, --cfg job, ...) before every override",
    ),
]


ONE_RANK = "launcher.nproc_per_node=1"  # no fork server, which would import torch


def command_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {*DIST_ENV_VARS, "PYTHONPATH"}}
    return {**env, **extra}


def train_without_torch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`train <args>` in a new interpreter where torch cannot be imported (which shows whether
    anything tried)."""
    return subprocess.run(
        [sys.executable, "-m", "framework.cli", *args],
        cwd=tmp_path,
        env=command_env(PYTHONPATH=torch_refused(tmp_path / "guard")),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_under_the_guard_a_command_that_imports_torch_fails_and_a_spared_one_does_not(tmp_path):
    """The positive control of every test here that runs `train` under the guard, in a new
    interpreter or forked (and of test_cli.py's, which spares the fork server): a guard that
    refused nothing would let them all pass with torch imported. A run on one rank imports
    torch in the command itself."""
    run = train_without_torch(tmp_path, ONE_RANK, "trainer.max_steps=1")
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1] == "ImportError: torch was imported"
    [forked] = trains_without_torch(tmp_path / "forked", [[ONE_RANK, "trainer.max_steps=1"]])
    assert forked.returncode != 0
    assert forked.stderr.strip().splitlines()[-1] == "ImportError: torch was imported"
    find_torch = "import importlib.util; print(importlib.util.find_spec('torchvision').origin)"
    guard = torch_refused(tmp_path / "sparing", spared="multiprocessing.forkserver")
    for words, refused in (((), True), (("multiprocessing.forkserver",), False)):
        found = subprocess.run(
            [sys.executable, "-c", find_torch, *words],
            env=command_env(PYTHONPATH=guard),
            capture_output=True,
            text=True,
            timeout=60,
        )
        if refused:
            assert found.stderr.strip().splitlines()[-1] == "ImportError: torchvision was imported"
        else:
            assert found.returncode == 0, found.stderr
            assert found.stdout.strip().endswith("torchvision/__init__.py")


# A table's commands, each `train` in a process of its own, forked from one interpreter that
# has imported what every `train` imports before it reads its command line (framework.cli, then
# framework.train): those imports are paid once per table, not once per command. A child leaves
# as the command does (SystemExit through the interpreter's exit, atexit handlers included),
# with its own working dir, output files and exit code; the guard, installed as the parent
# started, holds in every child (the positive control checks both ways of running `train`, and
# test_a_forked_train_answers_as_a_new_interpreter_does compares them).
FORKED_TRAIN = """
import json, os, signal, sys

import framework.cli
import framework.train

with open(sys.argv[1]) as cases:
    commands = json.load(cases)
for command in commands:
    child = os.fork()
    if child == 0:
        signal.alarm(120)  # a command that hangs is ended (SIGALRM), not the suite
        os.chdir(command["cwd"])
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(command[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = [framework.cli.__file__, *command["args"]]
        sys.exit(framework.cli.main())
    print(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), flush=True)
"""


@dataclass
class Answered:
    """How one `train` command ended, and the folder it ran in."""

    cwd: Path
    returncode: int
    stdout: str
    stderr: str


def trains_without_torch(
    tmp_path: Path, commands: list[list[str]], cwd: Path | None = None
) -> list[Answered]:
    """`train <args>` for each command, where torch cannot be imported, each in a new empty
    folder (or all in `cwd`)."""
    streams = tmp_path / "streams"
    streams.mkdir(parents=True)
    cases = []
    for index, args in enumerate(commands):
        folder = cwd or tmp_path / "commands" / str(index)
        folder.mkdir(parents=True, exist_ok=True)
        out, err = streams / f"{index}.out", streams / f"{index}.err"
        cases.append({"args": args, "cwd": str(folder), "stdout": str(out), "stderr": str(err)})
    (tmp_path / "commands.json").write_text(json.dumps(cases))
    parent = subprocess.run(
        [sys.executable, "-c", FORKED_TRAIN, str(tmp_path / "commands.json")],
        cwd=tmp_path,
        env=command_env(PYTHONPATH=torch_refused(tmp_path / "guard")),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert parent.returncode == 0 and not parent.stderr, parent.stderr[-3000:]
    codes = [int(line) for line in parent.stdout.split()]
    return [
        Answered(
            Path(case["cwd"]),
            code,
            Path(case["stdout"]).read_text(),
            Path(case["stderr"]).read_text(),
        )
        for case, code in zip(cases, codes, strict=True)
    ]


def not_a_refusal(answered: Answered, said: str) -> str | None:
    """What keeps `answered` from being the refusal that says `said`, before anything imported
    torch (one rank, so no fork server imports it either): exit 2, one `error:` line, and
    nothing written where it ran. None when it is one."""
    lines = answered.stderr.strip().splitlines()
    if answered.returncode != ExitCode.CONFIG_REJECTED:
        return f"exit {answered.returncode}: {answered.stderr[-3000:]}"
    if len(lines) != 1 or not lines[0].startswith("error:"):
        return f"not one error line: {answered.stderr[-3000:]}"
    if said not in lines[0]:
        return f"{lines[0]!r} does not say {said!r}"
    if written := sorted(path.name for path in answered.cwd.iterdir()):
        return f"wrote {written}"
    return None


def assert_refused(tmp_path: Path, table: list[tuple[str, str]]) -> None:
    commands = [[*command.split(), ONE_RANK] for command, _ in table]
    answers = trains_without_torch(tmp_path, commands)
    wrong = [
        f"train {command}: {problem}"
        for (command, said), answered in zip(table, answers, strict=True)
        if (problem := not_a_refusal(answered, said))
    ]
    assert not wrong, "\n".join(wrong)


def test_a_config_mistake_is_refused_before_anything_imports_torch(tmp_path):
    assert_refused(tmp_path, MISTAKES)


def test_a_mistake_with_hydras_flags_is_one_line_too(tmp_path):
    assert_refused(tmp_path, FLAG_MISTAKES)


def test_a_temp_dir_too_long_for_the_fork_servers_socket_is_one_line(tmp_path):
    """Python's fork server listens on a Unix socket in the temp dir, whose path may not exceed
    107 bytes: a longer TMPDIR (a job's scratch folder) is refused in one line naming it, before
    the config's mistake here (Python 3.14 puts that socket in /tmp instead: then the mistake is
    the one line)."""
    temp = tmp_path / ("t" * 110)
    temp.mkdir()
    (tmp_path / "work").mkdir()
    answered = subprocess.run(
        [sys.executable, "-m", "framework.cli", "optimizer.lrr=0.1"],
        cwd=tmp_path / "work",
        env=command_env(TMPDIR=str(temp)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert answered.returncode == ExitCode.CONFIG_REJECTED, answered.stderr[-3000:]
    [line] = answered.stderr.strip().splitlines()
    said = "optimizer.lrr" if _socket_fits(temp) else f"TMPDIR={temp}: AF_UNIX path too long"
    assert line.startswith(f"error: {said}"), line
    assert not list((tmp_path / "work").iterdir()) and not list(temp.iterdir())


def _socket_fits(temp: Path) -> bool:
    """Whether this Python's multiprocessing, under TMPDIR=temp, puts its sockets in a path
    that fits (3.14 falls back to /tmp)."""
    length = subprocess.run(
        [sys.executable, "-c", SOCKET_PATH_LENGTH],
        env=command_env(TMPDIR=str(temp)),
        capture_output=True,
        text=True,
        check=True,
    )
    return int(length.stdout) <= 107


SOCKET_PATH_LENGTH = (
    "from multiprocessing import connection; print(len(connection.arbitrary_address('AF_UNIX')))"
)


def test_a_forked_train_answers_as_a_new_interpreter_does(tmp_path):
    """The premise of trains_without_torch: a refusal and an answer, each from a new
    interpreter and from a forked child, are the same exit code and the same bytes."""
    commands = [[*MISTAKES[0][0].split(), ONE_RANK], ["--cfg", "job", "-p", "trainer", ONE_RANK]]
    forked = trains_without_torch(tmp_path / "forked", commands)
    for args, answered in zip(commands, forked, strict=True):
        new = train_without_torch(tmp_path, *args)
        assert (new.returncode, new.stdout, new.stderr) == (
            answered.returncode,
            answered.stdout,
            answered.stderr,
        )
    assert [answered.returncode for answered in forked] == [2, 0]


# What Hydra answers, which the checks of those flags must leave to it.
FLAGS_HYDRA_ANSWERS = [
    (["--cfg", "job", "-p", "trainer.stop_signals[0]", ONE_RANK], "SIGTERM"),  # as Hydra selects
    (["--hydra-help", "--cfg", "job", "-p", "nosuch"], "Hydra ("),  # its help answers first
    (["--config-dir", "", "--cfg", "job", "-p", "mode", ONE_RANK], "train"),  # "": the working dir
    (["--info", "-p", "model", ONE_RANK], "Hydra "),  # --info ignores -p
    # A value a rule refuses is shown as it is (what is wrong with it is the run's to say).
    (["--cfg", "job", "-p", "model.width", "model.width=-4", ONE_RANK], "-4"),
]


def test_right_uses_of_hydras_flags_are_answered(tmp_path):
    answers = trains_without_torch(tmp_path, [args for args, _ in FLAGS_HYDRA_ANSWERS])
    for (args, said), answered in zip(FLAGS_HYDRA_ANSWERS, answers, strict=True):
        command = " ".join(["train", *args])
        assert answered.returncode == 0, (command, answered.stderr[-3000:])
        assert answered.stdout.strip().splitlines()[0].startswith(said), (command, answered.stdout)


# Command lines whose --cfg job train prints from the composition its checks made, where
# Hydra's own --cfg composes it again (`-p _global_` is the whole config: Hydra's path).
SHOWN = [
    [],
    ["experiment=char_gpt", "model.heads=2"],
    ["model=resnet18", "optimizer=adamw", "logger=[csv,wandb]", "logger.wandb.group='a b: c'"],
    ["-cd", "conf", "experiment=mine"],
    ["--config-name", "config", "scheduler=cosine", "~optimizer.nesterov"],
]


def test_cfg_job_prints_the_bytes_hydras_own_cfg_prints(tmp_path):
    project = tmp_path / "project"
    (project / "conf" / "experiment").mkdir(parents=True)
    (project / "conf" / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /optimizer: adamw\n"
        "trainer:\n  max_steps: ${data.batch_size}\n"
    )
    commands = [
        command
        for args in SHOWN
        for command in (["--cfg", "job", *args], ["--cfg", "job", "-p", "_global_", *args])
    ]
    answers = trains_without_torch(tmp_path, commands, cwd=project)
    for args, ours, hydras in zip(SHOWN, answers[::2], answers[1::2], strict=True):
        command = " ".join(["train --cfg job", *args])
        assert ours.returncode == hydras.returncode == 0, (command, ours.stderr + hydras.stderr)
        assert ours.stdout == hydras.stdout and "trainer:" in ours.stdout, command


def test_cfg_job_shows_a_config_whose_hydra_node_only_a_run_refuses(tmp_path):
    """What --cfg job prints holds no Hydra node and runs nothing: the node is checked when the
    config runs (one composition fewer for --cfg job)."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "moves.yaml").write_text(
        "# @package _global_\nhydra:\n  job:\n    chdir: true\n"
    )
    command = ["-cd", "conf", "experiment=moves", ONE_RANK]
    shown = train_without_torch(tmp_path, "--cfg", "job", *command)
    assert shown.returncode == 0 and "trainer:" in shown.stdout, shown.stderr[-3000:]
    run = train_without_torch(tmp_path, *command)
    assert run.returncode == ExitCode.CONFIG_REJECTED and "hydra.job.chdir" in run.stderr


def marked_processes(mark: str) -> list[int]:
    """The processes whose environment holds `mark`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def test_a_refused_command_leaves_no_fork_server_behind(tmp_path):
    """The fork server starts before the config is read (it imports torch while the command
    composes); a refused command must not leave it importing, holding the command's output
    streams open, for seconds after the error."""
    mark = f"FRAMEWORK_TEST_MARK_{uuid.uuid4().hex}"
    train = Path(sys.executable).parent / "train"
    with open(tmp_path / "out", "w") as out:
        command = subprocess.Popen(
            [str(train), "model.hiden=16"],
            cwd=tmp_path,
            env=command_env(**{mark: "1"}),
            stdout=out,
            stderr=out,
        )
        assert command.wait(timeout=120) == ExitCode.CONFIG_REJECTED
    deadline = time.monotonic() + 2.0  # the kernel's signal, delivered as the command ends
    while marked_processes(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked_processes(mark) == []
    assert "model.hiden is not a setting" in (tmp_path / "out").read_text()


# `train`, with the run itself (Hydra's app) replaced by a line saying whether Python's cycle
# collector is on: a config that passes its checks must reach the run with it on.
COLLECTOR_AT_THE_RUN = (
    "import gc, sys\n"
    "import framework.train\n"
    "framework.train._run = lambda *parts: print('collector on:', gc.isenabled())\n"
    "from framework.cli import main\n"
    "sys.argv[0] = 'train'\n"
    "main()\n"
)


def test_the_collector_paused_for_the_checks_is_on_for_the_run(tmp_path):
    """cli.py turns Python's cycle collector off while the config is checked (a refusal is
    faster without its passes); a run of hours must not go on without it."""
    result = subprocess.run(
        [sys.executable, "-c", COLLECTOR_AT_THE_RUN, ONE_RANK, "trainer.max_steps=1"],
        cwd=tmp_path,
        env=command_env(PYTHONPATH=torch_refused(tmp_path / "guard")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "collector on: True"


def test_a_refused_key_typo_loads_at_most_4500_lines_of_the_framework_and_composes_once(tmp_path):
    """The front door's budget (python -m benchmarks front_door counts the same way): what a
    typo loads grows with every check placed before the keys' walk instead of after it."""
    counts = front_door.measured("refused key typo", ["optimizer.lrr=0.1"], tmp_path)
    assert counts["lines"] <= 4500, counts
    assert counts["compositions"] == 1, counts
