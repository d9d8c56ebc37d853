"""Old runs stay usable after the code changes: a key a checkpoint lacks is no change when its
value is the one it takes unset (the callable's default, the framework's, a shipped option's)."""

from __future__ import annotations

import json
import textwrap

import pytest

from framework.app.command_line import argument_mistake, read_command_line
from framework.config.redaction import redacted_container
from framework.config.resume_rules import changed_settings, default_value, training_settings
from framework.storage.checkpoint import settings_differences, settings_hash
from tests.conftest import make_cfg

OWN_TASK = """
from framework.components.tasks import Classification


class MyTask(Classification):
    def __init__(self, label_smoothing: float, ignore_index: int | None,
                 float64_states: bool = False, scale: float = 2.5) -> None:
        super().__init__(label_smoothing=label_smoothing, ignore_index=ignore_index)
"""


@pytest.fixture
def own_task(tmp_path, monkeypatch):
    (tmp_path / "own_task_module.py").write_text(textwrap.dedent(OWN_TASK))
    monkeypatch.syspath_prepend(str(tmp_path))
    return json.dumps("own_task_module.MyTask")


def settings_now(*overrides: str) -> dict[str, str]:
    return training_settings(redacted_container(make_cfg(*overrides)))


def checkpoint_of(settings: dict[str, str]) -> dict:
    return {"config": settings, "config_hash": settings_hash(settings)}


def test_a_key_added_with_its_callables_default_is_no_change(own_task):
    saved = {"task._target_": own_task, "task.label_smoothing": "0.0"}
    now = {**saved, "task.float64_states": "false", "task.scale": "2.5"}
    assert changed_settings(saved, now) == []
    assert settings_differences(checkpoint_of(saved), now, changed_settings) == []
    # ... and a key removed again that held the default, too
    assert changed_settings(now, saved) == []


def test_a_key_added_with_another_value_than_the_default_is_a_change(own_task):
    saved = {"task._target_": own_task, "task.label_smoothing": "0.0"}
    now = {**saved, "task.float64_states": "true"}
    assert changed_settings(saved, now) == ["task.float64_states"]
    [line] = settings_differences(checkpoint_of(saved), now, changed_settings)
    assert line == "task.float64_states: (absent) in the checkpoint, true now"


def test_a_framework_key_a_checkpoint_lacks_takes_the_schemas_default():
    now = settings_now()
    assert now["trainer.grad_accum"] == "1"
    saved = {key: value for key, value in now.items() if key != "trainer.grad_accum"}
    assert changed_settings(saved, now) == []
    assert changed_settings(saved, {**now, "trainer.grad_accum": "2"}) == ["trainer.grad_accum"]


def test_a_shipped_options_value_is_its_default():
    settings = settings_now()
    # Shipped callables have no defaults of their own: the option's YAML holds the value.
    assert default_value("task.label_smoothing", settings) == "0.0"
    assert default_value("model.width", settings) == settings["model.width"]
    assert default_value("task.no_such_key", settings) is None


def test_a_resume_takes_the_runs_settings_but_not_how_its_ranks_started(tmp_path):
    """A node joining another node's job names the same run dir: it must not take that node's
    launcher (rdzv_host=true would make it host a second store), dist or hydra settings."""
    record = tmp_path / ".hydra" / "overrides.yaml"
    record.parent.mkdir()
    record.write_text(
        "- launcher=torchrun\n- launcher.rdzv_host=true\n- dist.timeout_s=10\n"
        "- hydra.job.chdir=false\n- optimizer.lr=0.05\n"
    )
    command = read_command_line([f"hydra.run.dir={tmp_path}"], {})
    assert command.record == record and command.adopted == ("optimizer.lr=0.05",)
    assert command.overrides == ["optimizer.lr=0.05", f"hydra.run.dir={tmp_path}"]


def test_the_runs_overrides_go_before_this_commands_overrides_and_after_its_flags(tmp_path):
    """argparse takes the overrides as one run: adopted ones put before a flag (`-cd conf`)
    would make the command one Hydra refuses."""
    record = tmp_path / ".hydra" / "overrides.yaml"
    record.parent.mkdir()
    record.write_text("- optimizer.lr=0.05\n")
    argv = ["-cd", "conf", "--config-name", "config", f"hydra.run.dir={tmp_path}"]
    command = read_command_line(argv, {})
    assert command.adopted == ("optimizer.lr=0.05",)
    assert command.argv == [*argv[:4], "optimizer.lr=0.05", f"hydra.run.dir={tmp_path}"]
    assert argument_mistake(command.argv) is None
