"""`framework-new <folder>`: what it writes, and the folders it refuses without writing anything.
That the written project passes its own test: tests/integration/test_packaging.py."""

from __future__ import annotations

import pytest

from framework.core.exits import ExitCode
from framework.starter.create import main, sources_table
from tests.conftest import REPO


def new(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exit_:
        code = int(exit_.code)
    out, err = capsys.readouterr()
    return code, out, err


def test_a_new_project_is_the_skeleton_named_after_its_folder(capsys, tmp_path):
    code, out, err = new(capsys, str(tmp_path / "sine-lab"))
    assert code == 0, err
    project = tmp_path / "sine-lab"
    files = sorted(p.relative_to(project).as_posix() for p in project.rglob("*") if p.is_file())
    assert files == [
        ".gitignore",
        "README.md",
        "conf/data/sine_lab.yaml",
        "conf/data/sine_lab_stream.yaml",
        "conf/experiment/sine_lab.yaml",
        "conf/experiment/sine_lab_stream.yaml",
        "conf/model/sine_lab.yaml",
        "conf/task/sine_lab.yaml",
        "pyproject.toml",
        "src/sine_lab/__init__.py",
        "src/sine_lab/data.py",
        "src/sine_lab/model.py",
        "src/sine_lab/stream.py",
        "src/sine_lab/task.py",
        "tests/test_sine_lab.py",
    ]
    texts = {name: (project / name).read_text() for name in files}
    assert not [name for name, text in texts.items() if "__project__" in text]
    assert 'name = "sine-lab"' in texts["pyproject.toml"]
    # This framework runs from the clone: the project depends on the clone's folder.
    assert f'framework = {{ path = "{REPO.as_posix()}" }}' in texts["pyproject.toml"]
    assert "allowed_targets: [sine_lab]" in texts["conf/experiment/sine_lab.yaml"]
    assert "_target_: sine_lab.data.noisy_sine" in texts["conf/data/sine_lab.yaml"]
    assert f"cd {project}" in out and "uv run pytest" in out


@pytest.mark.parametrize(
    ("folder", "message"),
    [
        ("exists", "already exists: give a new folder (nothing is overwritten)"),
        ("missing/parent", "is not a folder: create it first"),
        ("1st", "does not make a Python package name"),
        ("class", "does not make a Python package name"),
        ("torch", "torch is already an importable module here"),
        ("digits", "digits names the project's options as shipped ones (data=digits)"),
        ("text", "text names the project's options as shipped ones (data=text, data=text_stream)"),
    ],
)
def test_a_wrong_or_existing_folder_is_refused_and_nothing_is_written(
    capsys, tmp_path, folder, message
):
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "mine.txt").write_text("keep")
    before = sorted(tmp_path.rglob("*"))
    code, out, err = new(capsys, str(tmp_path / folder))
    assert code == ExitCode.CONFIG_REJECTED
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err
    assert sorted(tmp_path.rglob("*")) == before
    assert (tmp_path / "exists" / "mine.txt").read_text() == "keep"


def test_a_folder_inside_the_clone_is_refused(capsys):
    code, _, err = new(capsys, str(REPO / "my_project"))
    assert code == ExitCode.CONFIG_REJECTED
    assert f"is inside the framework's clone {REPO}: create it outside" in err
    assert not (REPO / "my_project").exists()


@pytest.mark.parametrize(
    ("source", "table"),
    [
        ("/src/framework", 'framework = { path = "/src/framework" }'),
        (
            "git+https://example.org/framework.git@abc123",
            'framework = { git = "https://example.org/framework.git", rev = "abc123" }',
        ),
        ("https://example.org/framework.git", 'git = "https://example.org/framework.git" }'),
    ],
)
def test_the_framework_source_is_written_as_uv_add_writes_it(source, table):
    assert table in sources_table(source)
    assert sources_table(None) == ""  # from a package index: by name alone
