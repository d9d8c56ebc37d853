"""`framework-new <folder>`: writes a runnable project of one's own into a new folder outside the
clone. The project depends on this framework (from where this one was installed: the clone's
path, a git URL, a wheel; or `--framework`), keeps its own conf/ beside its package, and passes
its own test right after creation (`cd <folder> && uv run pytest`).

A target that exists, whose parent does not, that lies inside the clone, or whose name is not a
Python package name (or shadows a module or a shipped option) is refused: nothing is written.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import keyword
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

from framework.core.config_dir import CONF_DIR
from framework.core.exits import ExitCode

SKELETON = Path(__file__).resolve().parent / "skeleton"
PLACEHOLDER = "__project__"  # the package name, in the skeleton's paths and texts
RENAMES = {"pyproject.toml.in": "pyproject.toml", "gitignore.in": ".gitignore"}


class Refused(Exception):
    """The target cannot be created: one line saying why and what to do."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="framework-new",
        description="Write a runnable project (own model, data, task, configs, test) that "
        "depends on this framework, into a new folder.",
    )
    parser.add_argument("folder", type=Path, help="the new project's folder (must not exist)")
    parser.add_argument(
        "--framework",
        metavar="SOURCE",
        help="where the project gets the framework: a local path or a git URL "
        "(default: where this one was installed from)",
    )
    args = parser.parse_args(argv)
    try:
        target, package = check_target(args.folder)
        source = args.framework or installed_source()
        create(target, package, source)
    except Refused as refusal:
        print(f"error: {refusal}", file=sys.stderr)
        raise SystemExit(ExitCode.CONFIG_REJECTED) from None
    print(next_steps(target, package))


def check_target(folder: Path) -> tuple[Path, str]:
    """(the absolute folder, the package name), or Refused."""
    target = folder.expanduser().absolute()
    package = target.name.replace("-", "_")
    if target.exists() or target.is_symlink():
        raise Refused(f"{target} already exists: give a new folder (nothing is overwritten)")
    if not target.parent.is_dir():
        raise Refused(f"{target.parent} is not a folder: create it first, or pick another place")
    clone = clone_root()
    if clone is not None and target.resolve().is_relative_to(clone):
        raise Refused(f"{target} is inside the framework's clone {clone}: create it outside")
    if not package.isidentifier() or keyword.iskeyword(package):
        raise Refused(
            f"{target.name!r} does not make a Python package name: use letters, digits, _ or - "
            "(not first: a digit)"
        )
    if importlib.util.find_spec(package) is not None:
        raise Refused(f"{package} is already an importable module here: pick another name")
    if shipped := shipped_names(package):
        raise Refused(
            f"{package} names the project's options as shipped ones ({', '.join(shipped)}), "
            "which would hide the project's own: pick another name"
        )
    return target, package


def shipped_names(package: str) -> list[str]:
    """The project's options (the skeleton's conf/, named after `package`) that a shipped option
    has the name of: `group=name` each."""
    options = (
        path.relative_to(SKELETON / "conf").with_suffix("").as_posix().replace(PLACEHOLDER, package)
        for path in (SKELETON / "conf").rglob("*.yaml")
    )
    return sorted(
        option.replace("/", "=", 1) for option in options if (CONF_DIR / f"{option}.yaml").is_file()
    )


def clone_root() -> Path | None:
    """The repository this framework runs from, when it runs from a clone."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "conf").is_dir() else None


def installed_source() -> str | None:
    """Where this framework was installed from (its PEP 610 direct_url.json): a local folder or
    wheel, or a git URL with its commit. None: from a package index, by name."""
    try:
        record = importlib.metadata.distribution("framework").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        record = None
    if not record:
        return None
    origin = json.loads(record)
    url = origin["url"]
    if "vcs_info" in origin:
        return f"git+{url}@{origin['vcs_info']['commit_id']}"
    parsed = urlparse(url)
    return unquote(parsed.path) if parsed.scheme == "file" else url


def sources_table(source: str | None) -> str:
    """pyproject.toml's [tool.uv.sources] for the framework, as `uv add <source>` writes it."""
    if source is None:
        return ""
    if source.startswith("git+") or source.endswith(".git"):
        url, _, rev = source.removeprefix("git+").partition("@")
        entry = f'git = "{url}"' + (f', rev = "{rev}"' if rev else "")
    elif "://" in source:
        entry = f'url = "{source}"'
    else:
        entry = f'path = "{Path(source).expanduser().absolute().as_posix()}"'
    return f"\n[tool.uv.sources]\nframework = {{ {entry} }}\n"


def create(target: Path, package: str, source: str | None) -> None:
    """Copy the skeleton into `target` (created here, so never one that existed), naming the
    package `package`."""
    target.mkdir()
    for template in sorted(SKELETON.rglob("*")):
        if template.is_dir() or "__pycache__" in template.parts:
            continue
        relative = template.relative_to(SKELETON).as_posix().replace(PLACEHOLDER, package)
        relative = RENAMES.get(relative, relative)
        text = template.read_text().replace(PLACEHOLDER, package)
        text = text.replace("__distribution__", target.name)
        if relative == "pyproject.toml":
            text += sources_table(source)
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def next_steps(target: Path, package: str) -> str:
    return (
        f"created {target}: src/{package}/ (model.py, data.py, task.py, stream.py), conf/ (data, "
        f"model, task and experiment={package}; a streamed data={package}_stream and "
        f"experiment={package}_stream), tests/\n"
        f"  cd {target}\n"
        "  uv run pytest                       # trains 2 steps on 2 ranks\n"
        f"  uv run train experiment={package}   # the whole experiment"
    )


if __name__ == "__main__":
    main()
