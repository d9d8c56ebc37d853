"""The docs are true: every command line in README.md and docs/*.md composes, and every relative
link and every repository path they name exists.

A command line runs the app: `uv run train ARGS`, `train ARGS`, `python -m framework.train ARGS`,
`torchrun ... -m framework.train ARGS` or `launchers/torchrun.sh ARGS` (which hands ARGS to
framework.cli, the `train` script). They are found in the shell blocks of a page (`\\` continuations
joined, `# comments` dropped, a leading `$ ` of a transcript dropped) and in its inline code
(`uv run train --cfg job`); leading `NAME=value` environment assignments are applied. Each is
checked as `train` checks it before training, without training (framework/train.py's `checked`: the
command line read, the config composed in the run mode Hydra picks, every job of a sweep, and
checked), and each job of a sweep as the job checks it (`validate()`); where a value names the
reader's own files (`data.root`, `checkpoint.resume`, which validate() would look for), only the
keys are checked.

An HTML comment on the line before a block changes how its commands are checked:

    <!-- docs test: not composed: WHY -->    the block is skipped (keep these rare, say why)
    <!-- docs test: with NAME=value -->      environment assignments that replace the line's own
    <!-- docs test: refused -->              each `$ ...` line must be refused, with the message
                                             on the line under it

A YAML block whose leading comments name a file in conf/<group>/ or experiments/ that the
repository does not have (`# experiments/my_digits.yaml`) is written to a config folder on the
search path of its page's commands, so a page's example files compose with its commands.
"""

from __future__ import annotations

import ast
import io
import os
import re
import shlex
import tokenize
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, OverrideType

from framework.app.command_line import read_command_line
from framework.app.composition import OnceLoader, compose, search_path
from framework.config.registry import register_configs
from framework.config.validation import check_keys, validate
from framework.train import check_sweep_job, checked

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_BLOCKS = ("", "sh", "bash", "shell", "console")  # a fence's info string
DIRECTIVE = re.compile(r"<!--\s*docs test:\s*(.*?)\s*-->")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# Values that name the reader's own files: validate() would look for them (compose does not).
READERS_FILES = ("data.root=", "checkpoint.resume=", "init.path=")
# A documented example file: conf/<group>/<name>.yaml or experiments/<name>.yaml.
EXAMPLE_FILE = re.compile(r"^#\s*((?:conf/(\w+)|(experiments))/(\w+)\.yaml)\b")
REPO_PATH = re.compile(
    r"^(?:framework|conf|tests|benchmarks|launchers|experiments|hydra_plugins|docs|\.ci)/[\w./-]*$"
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`([^`]+)`")


# --- reading a page -------------------------------------------------------------------------
@dataclass
class Block:
    """A fenced code block: its opening line (1-based), info string, directive and lines."""

    line: int
    info: str
    directive: str
    lines: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class Command:
    """One command line of a page: where it is, train's arguments, its environment."""

    where: str
    argv: list[str]
    env: dict[str, str]
    refused_with: str | None = None  # the documented message, for a command that must fail


def fenced_blocks(text: str) -> list[Block]:
    blocks, block, previous = [], None, ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if block is None:
                found = DIRECTIVE.search(previous)
                info = line.strip().removeprefix("```").strip()
                block = Block(number, info, found.group(1) if found else "")
            else:
                blocks.append(block)
                block = None
        elif block is not None:
            block.lines.append((number, line))
        if line.strip():
            previous = line
    return blocks


def prose(text: str) -> str:
    """The page with its fenced blocks blanked out (line numbers kept): what reads as text."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            line = ""
        lines.append("" if fenced else line)
    return "\n".join(lines)


def joined_lines(block: Block) -> list[tuple[int, str]]:
    """(first line number, text) of each logical line: `\\` continuations joined."""
    joined, pending, start = [], "", 0
    for number, line in block.lines:
        if not pending:
            start = number
        text = line.rstrip()
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        joined.append((start, pending + text))
        pending = ""
    if pending:
        joined.append((start, pending))
    return joined


def parse_command(text: str) -> tuple[list[str], dict[str, str]] | None:
    """(train's arguments, environment assignments) if `text` runs the app, else None."""
    try:
        words = shlex.split(text.removeprefix("$ "), comments=True)
    except ValueError:  # not shell: output, a table
        return None
    env = {}
    while words and ENV_ASSIGNMENT.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if words[:2] == ["uv", "run"]:
        words = words[2:]
    if words[:1] == ["train"] or (words and words[0].endswith("launchers/torchrun.sh")):
        return words[1:], env
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] in ("framework.train", "framework.cli"):
            return words[i + 2 :], env
    return None


def page_commands(page: Path) -> tuple[list[Command], list[str]]:
    """The page's command lines, and the problems found in reading them."""
    commands, problems = [], []
    relative = page.relative_to(REPO)
    text = page.read_text()
    for block in fenced_blocks(text):
        if block.info not in SHELL_BLOCKS:
            continue
        directive, where = block.directive, f"{relative}:{block.line}"
        if directive.startswith("not composed:"):
            if not directive.removeprefix("not composed:").strip():
                problems.append(f"{where}: say why a block is not composed")
            continue
        if directive and directive != "refused" and not directive.startswith("with "):
            problems.append(f"{where}: unknown directive {directive!r}")
        words = directive.removeprefix("with ").split() if directive.startswith("with ") else []
        directive_env = dict(word.split("=", 1) for word in words if ENV_ASSIGNMENT.match(word))
        refused = directive == "refused"
        lines = joined_lines(block)
        for index, (number, line) in enumerate(lines):
            if refused and not line.startswith("$ "):
                continue  # the output under a refused command
            if not (parsed := parse_command(line)):
                continue
            argv, env = parsed
            message = None
            if refused:
                following = lines[index + 1][1].strip() if index + 1 < len(lines) else ""
                message = following.removeprefix("error:").strip()
                if not message or following.startswith("$ "):
                    problems.append(f"{relative}:{number}: a refused command needs its message")
                    continue
            commands.append(
                Command(f"{relative}:{number}", argv, {**env, **directive_env}, message)
            )
    text = prose(text)
    for span in INLINE_CODE.finditer(text):
        if parsed := parse_command(" ".join(span.group(1).split())):
            number = text.count("\n", 0, span.start()) + 1
            commands.append(Command(f"{relative}:{number}", *parsed))
    return commands, problems


def example_file(block: Block) -> re.Match | None:
    """The file a YAML block shows, named in its leading comments (after `# @package ...`,
    which Hydra reads only as a file's first line)."""
    for _, line in block.lines:
        if not line.startswith("#"):
            return None
        if found := EXAMPLE_FILE.match(line):
            return found
    return None


def example_files(page: Path) -> dict[str, str]:
    """{group/name.yaml: text} of the page's YAML examples of files the repository lacks."""
    files = {}
    for block in fenced_blocks(page.read_text()):
        found = example_file(block)
        if found and not (REPO / found.group(1)).exists():
            group = found.group(2) or "experiment"
            files[f"{group}/{found.group(4)}.yaml"] = "\n".join(text for _, text in block.lines)
    return files


# --- checking a command as train would -------------------------------------------------------
@dataclass
class Sweep:
    """What to check of a sweep's jobs: the overrides to compose (every sweep at its first
    value, and each other value of a sweep that picks config files), and the other values of
    the sweeps over plain keys, which Hydra applies to a composed config with OmegaConf.update
    (checked on a copy of the first job's). An interval, which optuna samples from, at its
    start. Hydra's basic sweeper would run the product of all of them."""

    jobs: list[list[str]]
    values: list[tuple[str, Any]]


def sweep(overrides: list[str]) -> Sweep:
    choices, values = [], []
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        if not override.is_sweep_override():
            choices.append([f"{key}={override.get_value_element_as_str()}"])
        elif not override.is_discrete_sweep():
            assert isinstance(override.value(), IntervalSweep), override.input_line
            choices.append([f"{key}={override.value().start}"])
        elif "." in key and override.type == OverrideType.CHANGE and override.package is None:
            _, *others = override.sweep_iterator()
            choices.append([f"{key}={next(override.sweep_string_iterator())}"])
            values += [(key, value) for value in others]
        else:  # a config group, or a key added or deleted
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
    first = [options[0] for options in choices]
    jobs = [first]
    for i, options in enumerate(choices):
        jobs += [[*first[:i], option, *first[i + 1 :]] for option in options[1:]]
    return Sweep(jobs, values)


def compose_as_train(argv: list[str], check: bool) -> None:
    """What `train ARGS` does before it trains, and what each job of a sweep checks first:
    raises what it would refuse."""
    if check:
        _, hydra, _ = checked(argv)
        for job in hydra.config_loader.composed_jobs():
            validate(job)
        return
    command = read_command_line(argv, os.environ)
    composition = compose(command, OnceLoader(search_path(command.args), check_sweep_job))
    check_keys(composition.cfg)


@contextmanager
def environment(changes: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(changes)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def outcome(command: Command) -> str | None:
    """None if the command does what its page says, else what went wrong."""
    check = not any(a.startswith(READERS_FILES) for a in command.argv)
    try:
        compose_as_train(command.argv, check)
    except Exception as error:  # noqa: BLE001 (what train would refuse, with exit code 2)
        if command.refused_with is None:
            return f"{type(error).__name__}: {error}"
        if command.refused_with not in str(error):
            return f"refused, but not with the documented message: {error}"
        return None
    finally:
        GlobalHydra.instance().clear()
    if command.refused_with is not None:
        return f"documented as refused ({command.refused_with}), but it composes"
    return None


# Commands repeat across pages (`uv run train`): each distinct one is checked once.
outcomes: dict[tuple, str | None] = {}


def check(command: Command, example_config: Path | None) -> str | None:
    env = dict(command.env)
    if example_config is not None:  # after the user's own folders, as a user would add it
        paths = [env.get("FRAMEWORK_CONFIG_PATH", ""), f"file://{example_config}"]
        env["FRAMEWORK_CONFIG_PATH"] = ",".join(path for path in paths if path)
    key = (tuple(command.argv), tuple(sorted(env.items())), command.refused_with)
    if key not in outcomes:
        with environment(env):
            outcomes[key] = outcome(command)
    return outcomes[key]


# --- the tests ------------------------------------------------------------------------------
# Packages the pages' examples name as the reader's own: allowed_targets trusts only modules
# that exist in the reader's source tree, so the test gives them one.
READERS_PACKAGES = ("my_package", "my_experiments")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_command_line_composes(page, tmp_path, monkeypatch):
    register_configs()
    for package in READERS_PACKAGES:
        (tmp_path / "src" / package).mkdir(parents=True)
        (tmp_path / "src" / package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    commands, problems = page_commands(page)
    example_config = None
    if files := example_files(page):
        example_config = tmp_path / "conf"
        for name, text in files.items():
            (example_config / name).parent.mkdir(parents=True, exist_ok=True)
            (example_config / name).write_text(text + "\n")
    for command in commands:
        if problem := check(command, example_config):
            shown = shlex.join(command.argv)
            problems.append(f"{command.where}: train {shown}\n    {problem.strip()}")
    assert not problems, "\n".join(problems)


def test_the_docs_have_command_lines():
    """Commands are found where readers find them: a change to how pages show them shows here."""
    counted = {page.name: len(page_commands(page)[0]) for page in PAGES}
    assert counted["README.md"] >= 10, counted
    assert sum(counted.values()) >= 60, counted


def test_the_documented_task_is_the_one_the_tests_train():
    """docs/tasks.md shows tests/integration/my_experiments/tasks.py (less its docstring), which
    tests/integration/test_tasks_cli.py trains on 2 ranks."""
    shown = next(
        block
        for block in fenced_blocks((REPO / "docs/tasks.md").read_text())
        if block.lines and block.lines[0][1] == "# my_experiments/tasks.py"
    )
    source = (REPO / "tests/integration/my_experiments/tasks.py").read_text()
    code = source.split('"""', 2)[2]  # after the module docstring
    assert [line for _, line in shown.lines[1:] if line.strip()] == [
        line for line in code.splitlines() if line.strip()
    ]


def test_the_architecture_page_names_every_module():
    """docs/architecture.md lists the package's files: a module added or renamed shows here."""
    page = (REPO / "docs/architecture.md").read_text()
    framework = REPO / "framework"
    modules = [*framework.glob("*.py"), *framework.glob("*/*.py")]
    missing = [
        str(module.relative_to(REPO))
        for module in sorted(modules)
        if module.name != "__init__.py" and module.name not in page
    ]
    # Packages one level deeper (components/models/, components/tasks/) are named as folders.
    missing += [
        str(package.relative_to(REPO))
        for package in sorted(framework.glob("*/*/__init__.py"))
        if f"{package.parent.name}/" not in page
    ]
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings."""
    anchors, seen = set(), {}
    for line in prose(page.read_text()).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_and_repository_path_exists(page):
    problems = []
    text = prose(page.read_text())
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"link to {target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file):
            problems.append(f"link to {target}: no such heading in {file.name}")
    # Files a page tells the reader to write (its YAML examples) need not exist.
    examples = {
        found.group(1)
        for block in fenced_blocks(page.read_text())
        if (found := example_file(block))
    }
    for span in INLINE_CODE.findall(text):
        path = span.split(":")[0].rstrip(".,")
        checkable = REPO_PATH.match(path) and not re.search(r"[<*{]", path)
        if checkable and path not in examples and not (REPO / path).exists():
            problems.append(f"`{span}`: no such path in the repository")
    assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(problems)


# --- every module, file and dotted name the text names exists --------------------------------
# A module of the framework named by its path (framework/app/composition.py, rank/build.py,
# local/launcher.py in the tree of docs/architecture.md), by its file name (build.py), or by its
# dotted name (framework.app.composition.OnceLoader).
MODULE_PATH = re.compile(
    r"(?<![\w./-])((?:framework/)?(?:app|launch|rank|components|storage|config|core|starter|"
    r"local|torchrun|slurm|models|tasks)/(?:\w+/)*\w+\.py)\b"
)
FILE_NAME = re.compile(r"(?<![\w./-])(\w+\.py)\b")
DOTTED_NAME = re.compile(r"(?<![\w.])(framework(?:\.[A-Za-z_]\w*)+)")
# Files of other projects that pages and comments name (Hydra's, a user's project).
OTHERS_FILES = {"utils.py", "target_policy.py", "config.py", "sitecustomize.py", "setup.py"}
SOURCES = sorted(
    path
    for folder in ("framework", "hydra_plugins", "benchmarks", "tests", "launchers")
    for path in (REPO / folder).rglob("*")
    if path.is_file() and "__pycache__" not in path.parts
)


def readable_text(path: Path) -> str:
    """What a reader reads: a page or a YAML file whole, a Python file's comments and strings
    (its docstrings among them), not its code."""
    if path.suffix != ".py":
        return path.read_text()
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return "\n".join(t.string for t in tokens if t.type in (tokenize.COMMENT, tokenize.STRING))


def top_level_names(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def dotted_name_exists(name: str) -> bool:
    """framework.a.b.C: the longest prefix that is a module of the repository, and C a name it
    binds (or a module inside it)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:cut])
        module = (
            base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        )
        if not module.is_file():
            continue
        rest = parts[cut:]
        return (
            not rest
            or rest[0].startswith("__")
            or rest[0] in top_level_names(module)
            or ((base / f"{rest[0]}.py").is_file())
        )
    return False


def named_but_missing(path: Path) -> list[str]:
    text = readable_text(path)
    framework_files = [p.relative_to(REPO).as_posix() for p in SOURCES if p.suffix == ".py"]
    file_names = {p.name for p in SOURCES}
    missing = [
        ref
        for ref in MODULE_PATH.findall(text)
        if not any(f == ref or f.endswith("/" + ref) for f in framework_files)
    ]
    missing += [
        ref for ref in FILE_NAME.findall(text) if ref not in file_names and ref not in OTHERS_FILES
    ]
    missing += [ref for ref in DOTTED_NAME.findall(text) if not dotted_name_exists(ref)]
    return missing


TEXTS = [
    *PAGES,
    *sorted((REPO / "conf").rglob("*.yaml")),
    *sorted((REPO / "experiments").glob("*.yaml")),
    *(p for p in SOURCES if p.suffix == ".py" and not p.is_relative_to(REPO / "tests")),
]


def test_no_page_comment_or_docstring_names_a_module_file_or_name_that_does_not_exist():
    """A module moved or renamed leaves no text behind that sends a reader to it."""
    stale = {
        str(path.relative_to(REPO)): missing
        for path in TEXTS
        if (missing := named_but_missing(path))
    }
    assert stale == {}


def test_the_readme_stays_a_front_door():
    """At most 3,000 words (as `wc -w` counts them): the rest has its page in docs/."""
    assert len((REPO / "README.md").read_text().split()) <= 3000
