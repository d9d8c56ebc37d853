"""Hydra's own node is closed as a class (framework/app/hydra_node.py,
framework/app/shipped_node.py): every key keeps what the framework ships except a short
positive list, whichever door a config uses (a file, an override, an interpolation, a sweep
parameter, the run mode), and the listed keys are judged resolved."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from framework.app.command_line import read_command_line
from framework.app.composition import OnceLoader, compose, search_path
from framework.app.hydra_node import check_hydra_node, settable
from framework.app.shipped_node import shipped_node
from framework.config.registry import register_configs
from framework.core.exits import ConfigError
from framework.train import check_sweep_job, checked

REFUSED = "Hydra's node keeps what the framework ships"
CANNOT = "cannot be set from a config file or the command line"


def write(root: Path, name: str, text: str) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def experiment(root: Path, body: str, name: str = "evil") -> list[str]:
    write(root, f"experiment/{name}.yaml", "# @package _global_\n" + body)
    return ["-cd", str(root), f"experiment={name}"]


def refusal(argv: list[str]) -> str:
    """What `train argv` refuses before Hydra starts (the command line, then the composed
    node), as one message."""
    with pytest.raises(ConfigError) as error:
        checked(argv)
    return str(error.value)


def named(message: str | None, path: str) -> bool:
    """The refusal names `path` itself (not only a key under it)."""
    return re.search(re.escape(path) + r"(?![\w.])", message or "") is not None


# --- the broken cases, one by one -----------------------------------------------------------
ENV_SET_OPEN = """hydra:
  job:
    env_set: {_target_: builtins.open, file: victim.txt, mode: w}
  callbacks:
    evil: ${hydra.job.env_set}
"""
ENV_SET_COPY = """hydra:
  job:
    env_set: {_target_: shutil.copyfile, src: evil.pth, dst: site-packages/evil.pth}
  callbacks:
    evil: ${hydra.job.env_set}
"""
LOG_FILE_CLIMBS = """hydra:
  job:
    env_set: {NAME: ../../../site-packages/evil.pth}
  job_logging:
    version: 1
    formatters: {code: {format: 'import os; os.system("touch pwned")'}}
    handlers:
      f:
        class: logging.FileHandler
        formatter: code
        filename: ${hydra.runtime.output_dir}/${hydra.job.env_set.NAME}
    root: {handlers: [f]}
"""
EXT_IMPORT = """hydra:
  job:
    env_set: {STREAM: ext://antigravity.geohash}
  hydra_logging:
    handlers:
      console:
        stream: ${hydra.job.env_set.STREAM}
"""


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (ENV_SET_OPEN, "hydra.job.env_set._target_"),
        (ENV_SET_COPY, "hydra.job.env_set._target_"),
        (LOG_FILE_CLIMBS, "hydra.job.env_set.NAME"),
        (EXT_IMPORT, "hydra.hydra_logging.handlers.console.stream"),
    ],
    ids=["open-through-env_set", "copyfile-through-env_set", "log-file-climbs", "ext"],
)
def test_an_interpolation_into_hydras_node_is_judged_resolved(tmp_path, body, expected):
    message = refusal(experiment(tmp_path, body))
    assert named(message, expected) and CANNOT in message and "\n" not in message


def test_a_callback_reached_through_an_interpolation_is_judged_by_what_it_resolves_to(tmp_path):
    body = "data:\n  evil: {_target_: builtins.open, file: victim.txt, mode: w}\n"
    body += "hydra:\n  callbacks:\n    evil: ${data.evil}\n"
    # (`train` refuses data.evil first, as an app key: the node's own check, alone, here)
    message = refusal_or_none(experiment(tmp_path, body))
    assert message and "hydra.callbacks.evil._target_=builtins.open is not allowed here" in message


def test_hydra_mode_multirun_on_the_command_line_checks_every_swept_experiment(tmp_path):
    write(tmp_path, "experiment/fine.yaml", "# @package _global_\ntrainer:\n  max_steps: 2\n")
    experiment(tmp_path, "hydra:\n  callbacks:\n    evil:\n      _target_: builtins.open\n")
    argv = ["-cd", str(tmp_path), "hydra.mode=MULTIRUN", "experiment=fine,evil"]
    assert "hydra.callbacks.evil._target_=builtins.open" in refusal(argv)


def test_a_mode_set_in_a_file_is_the_mode_checked(tmp_path):
    write(tmp_path, "experiment/fine.yaml", "# @package _global_\ntrainer:\n  max_steps: 2\n")
    body = "hydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      +extra: fine,evil\n"
    write(tmp_path, "extra/fine.yaml", "# @package _global_\n{}\n")
    write(
        tmp_path,
        "extra/evil.yaml",
        "# @package _global_\nhydra:\n  job_logging:\n    root:\n      level: DEBUG\n",
    )
    message = refusal(experiment(tmp_path, body))
    assert named(message, "hydra.job_logging.root") and CANNOT in message


@pytest.mark.parametrize("sweep", [[], ["-m"]], ids=["run", "sweep"])
def test_a_mode_that_cannot_be_read_is_unset_as_hydra_reads_it(tmp_path, monkeypatch, sweep):
    """Hydra takes a hydra.mode it cannot read for unset, and the run's composition sets it:
    the config is checked (and runs) as a plain run or sweep."""
    monkeypatch.delenv("NO_SUCH_MODE", raising=False)
    argv = experiment(tmp_path, "hydra:\n  mode: ${oc.env:NO_SUCH_MODE}\n", "mine")
    checked([*sweep, *argv])


def test_a_hydra_group_left_missing_in_a_sweep_is_named(tmp_path):
    """Hydra composes a sweep's master config without it, so its node lacks the group's keys:
    the refusal names the group to pick, not the keys."""
    body = "defaults:\n  - override /hydra/launcher: ???\n"
    message = refusal(["-m", *experiment(tmp_path, body)])
    assert (
        message == "hydra/launcher is left ??? by a config file: pick one, hydra/launcher=<option>"
    )


def test_sweeper_params_cannot_add_logging_handlers(tmp_path):
    body = (
        "hydra:\n  sweeper:\n    params:\n      +hydra.job_logging.handlers.f: "
        "'{class:logging.FileHandler,filename:/tmp/x.pth}'\n"
    )
    assert "hydra.job_logging.handlers.f cannot be set" in refusal(experiment(tmp_path, body))


@pytest.mark.parametrize(
    "variable", ["TORCH_HOME", "WANDB_DIR", "MLFLOW_TRACKING_URI", "LD_PRELOAD", "PYTHONPATH"]
)
def test_env_set_may_not_move_files_or_load_code(tmp_path, variable):
    line = f"+hydra.job.env_set.{variable}=sqlite:////elsewhere/x.db"
    assert f"hydra.job.env_set.{variable} cannot be set" in refusal([line])
    body = f"hydra:\n  job:\n    env_set:\n      {variable}: /home/colleague/cache\n"
    assert f"hydra.job.env_set.{variable} cannot be set" in refusal(experiment(tmp_path, body))


def test_env_set_of_a_harmless_variable_passes():
    checked(["+hydra.job.env_set.OMP_NUM_THREADS=1"])


@pytest.mark.parametrize("subdir", ["../../mine", "/tmp/mine", "..", "a/../../b"])
def test_the_records_folder_stays_in_the_run_dir(subdir):
    argv = [f"hydra.callbacks.run_dir.output_subdir={subdir}"]
    assert "must be a folder name inside the run dir" in refusal(argv)


@pytest.mark.parametrize("subdir", ["..", "../other", "/tmp/x"])
def test_a_sweep_jobs_dir_stays_in_the_sweep_dir(subdir):
    assert "must name a folder inside hydra.sweep.dir" in refusal([f"hydra.sweep.subdir={subdir}"])


def test_a_searchpath_entry_may_not_import_a_package():
    assert "pkg:// would import" in refusal(["hydra.searchpath=[pkg://antigravity]"])


def test_launcher_setup_lines_and_file_options_are_refused():
    assert "hydra.launcher.setup cannot be set" in refusal(
        ["launcher=slurm", "hydra.launcher.setup=[touch pwned]"]
    )
    output = ["launcher=slurm", "+hydra.launcher.additional_parameters.output=/root/.bashrc"]
    assert "additional_parameters.output cannot be set" in refusal(output)


def test_a_user_option_of_a_hydra_group_is_refused(tmp_path):
    write(tmp_path, "hydra/job_logging/mine.yaml", "version: 1\nroot: {level: DEBUG}\n")
    argv = ["-cd", str(tmp_path), "hydra/job_logging=mine"]
    assert "hydra/job_logging=mine is not an option that Hydra" in refusal(argv)


def test_a_config_file_cannot_write_hydras_record_of_the_overrides(tmp_path):
    body = "hydra:\n  overrides:\n    task: ['+hydra.callbacks.e._target_=builtins.open']\n"
    assert "hydra.overrides cannot be set" in refusal(experiment(tmp_path, body))


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["hydra.run.dir=outputs/x", "+hydra.job.env_set.OMP_NUM_THREADS=1"],
        ["-m", "optimizer.lr=0.1,0.05", "hydra.sweep.dir=multirun/x", "hydra.sweep.subdir=j"],
        ["launcher=slurm", "+hydra.launcher.additional_parameters.mail-type=END"],
        ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=0"],
        ["hydra/job_logging=default"],
        ["hydra.callbacks.run_dir.output_subdir=record"],
        ["+hydra.callbacks.log._target_=hydra.experimental.callbacks.LogJobReturnCallback"],
        ["experiment=char_gpt"],
    ],
)
def test_the_settable_keys_and_shipped_options_pass(argv):
    checked(argv)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        # (a pruning sweep with n_jobs=0 printed "Launching 0 jobs" without end)
        (["hydra/sweeper=optuna_prune", "hydra.sweeper.n_jobs=0"], "n_jobs=0: give a number >= 1"),
        (["hydra/sweeper=optuna", "hydra.sweeper.n_trials=-1"], "n_trials=-1: give a number >="),
        (["hydra.sweeper.max_batch_size=0"], "max_batch_size=0: give a number >= 1"),
        (["hydra/sweeper=optuna", "hydra.sweeper.max_failure_rate=2"], "from 0 to 1"),
    ],
    ids=["no jobs at once", "no trials", "batches of none", "a rate over 1"],
)
def test_a_sweepers_count_outside_its_range_is_refused(argv, said):
    assert said in refusal(["-m", *argv, "optimizer.lr=0.1,0.05"])


@pytest.mark.parametrize(
    "setting",
    [
        "hydra.sweeper.n_trials=${hydra:job.num}",  # (a traceback from Hydra's sweeper, exit 1)
        "hydra.sweeper.median.n_startup_trials=${hydra:runtime.cwd}",
    ],
)
def test_hydras_values_do_not_resolve_where_hydra_makes_the_sweeper(setting):
    """Hydra makes it once, before any job: a job's values are not there yet."""
    sweeper = ["hydra/sweeper=optuna_prune", "hydra.sweeper.direction=maximize"]
    said = refusal(["-m", *sweeper, "optimizer.lr=0.1,0.05", "trainer.eval_every=1", setting])
    assert said.startswith(setting.split("=")[0]) and "cannot be resolved before the run" in said


def test_a_run_dir_from_a_file_with_an_interpolation_passes(tmp_path):
    body = "hydra:\n  run:\n    dir: outputs/${optimizer.lr}/${now:%H}\n"
    checked(experiment(tmp_path, body, "mine"))


@pytest.fixture
def compositions(monkeypatch) -> list[tuple]:
    """The compositions made from here on (Hydra's load_configuration calls)."""
    composed = []
    compose = ConfigLoaderImpl.load_configuration

    def counted(self, *args, **kwargs):
        composed.append(args)
        return compose(self, *args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counted)
    return composed


def test_a_bad_node_in_a_file_is_refused_after_one_composition(tmp_path, compositions):
    """A refused node costs one composition (0.2 s): the shipped node it is compared with is the
    one every run with the same shipped options shares."""
    checked(experiment(tmp_path / "fine", "optimizer:\n  lr: 0.5\n", "fine"))
    compositions.clear()
    message = refusal(experiment(tmp_path / "evil", "hydra:\n  job:\n    chdir: true\n"))
    assert "hydra.job.chdir" in message and len(compositions) == 1


def test_a_mistake_in_the_apps_keys_is_refused_after_one_composition(compositions):
    """The run's composition is validated before its node is compared with the shipped one: a
    typo is refused before the shipped node is composed."""
    message = refusal(["data.standardise=true"])
    assert message.startswith("data.standardise is not a setting of") and len(compositions) == 1


def test_a_composition_hydra_refuses_is_refused_with_hydras_message_before_hydra_starts(
    monkeypatch, compositions
):
    """The composition the check makes is Hydra's own: its error, in Hydra's words, needs no
    start of Hydra and no second composition. HYDRA_FULL_ERROR=1 leaves it to Hydra, which then
    shows its traceback."""
    message = refusal(["data.batch_size=abc"])
    assert message == (
        "Error merging override data.batch_size=abc: "
        "Value 'abc' of type 'str' could not be converted to Integer"
    )
    assert len(compositions) == 1
    sweep = refusal(["-m", "data.batch_size=abc"])  # a sweep: at its master composition
    assert sweep == message and len(compositions) == 2
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigCompositionException):
        checked(["data.batch_size=abc"])


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "optimizer=sgd,adamw", "optimizer.lr=0.1"],
        ["-m", "optimizer.lr=0.1,0.05", "data.split_seed=${hydra:job.num}"],  # set in the job
        ["-m", "data.batch_size=32,24", "trainer.global_batch_size=64"],  # 24's job fails alone
    ],
)
def test_a_sweep_whose_keys_every_job_takes_passes_its_check(argv):
    checked(argv)


def test_a_key_one_jobs_option_does_not_take_refuses_the_sweep_before_its_first_job():
    """Every job is composed and its keys, types and bounds checked before the sweep starts:
    a sweep would otherwise half-run (AdamW takes no momentum)."""
    message = refusal(["-m", "optimizer=sgd,adamw", "optimizer.momentum=0.8"])
    assert message.startswith("optimizer.momentum is not a setting of torch.optim.AdamW")
    assert refusal(["-m", "optimizer.lr=0.1,-1"]) == "optimizer.lr=-1.0 must be > 0"


def test_a_key_of_a_group_left_unpicked_is_refused_naming_the_group(tmp_path):
    """The first composition skips a group left `???`, so the key is not there: the run's
    composition names the group to pick, instead of advising to append the key."""
    shipped = (Path(__file__).parents[2] / "conf" / "config.yaml").read_text()
    write(tmp_path, "mine.yaml", re.sub(r"(?m)^  - model: .*$", "  - model: ???", shipped))
    message = refusal(["-cd", str(tmp_path), "-cn", "mine", "model.width=16"])
    assert message.startswith("You must specify 'model', e.g, model=<OPTION>")


def test_a_file_that_is_not_yaml_is_refused_naming_the_file_and_line(tmp_path):
    message = refusal(experiment(tmp_path, "trainer: {max_steps: [1\n", "broken"))
    assert message == (
        f"{tmp_path}/experiment/broken.yaml, line 3 is not valid YAML: "
        "expected ',' or ']', but got '<stream end>'"
    )


# --- the class: every key of the shipped node, through every door ----------------------------
# The shipped node of each family of Hydra's options (launchers, sweepers, logging).
CONTEXTS = ([], ["launcher=slurm"], ["hydra/sweeper=optuna"], ["hydra/job_logging=default"])
SKIPPED = (
    "hydra.overrides",
    "hydra.runtime",
    "hydra.job.override_dirname",
    "hydra.job.config_name",
)


def shipped_leaves() -> list[tuple[list[str], str, Any]]:
    """(options picked, path, shipped value) of every leaf of the shipped node that is not
    settable, once each, with the first options that bring it in."""
    register_configs()
    found: dict[str, tuple[list[str], Any]] = {}

    def walk(value: Any, path: str, context: list[str], cfg: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(item, f"{path}.{key}", context, cfg)
        elif not path.startswith(SKIPPED) and not settable(path):
            # (an interpolation's value where it resolves: a sample of the key's type)
            sample = OmegaConf.select(cfg, path, throw_on_resolution_failure=False)
            typed = value if sample is None or isinstance(value, dict | list) else sample
            found.setdefault(path, (context, typed))

    for context in CONTEXTS:
        command = read_command_line(context, {})
        loader = OnceLoader(search_path(command.args), lambda cfg, overrides: None)
        cfg = compose(command, loader).cfg
        walk(shipped_node(dict(cfg.hydra.runtime.choices)), "hydra", context, cfg)
    return [(context, path, value) for path, (context, value) in found.items()]


LEAVES = shipped_leaves()
# Values of the type Hydra's schema gives these keys (another type: Hydra refuses it itself).
TYPED = {
    "hydra.job.chdir": True,
    "hydra.job.num": 7,
    "hydra.job.env_copy": ["PATH"],  # (Hydra copies each named variable: it must exist)
    "hydra.output_subdir": "record",
    "hydra.launcher.setup": ["touch pwned"],
    "hydra.sweeper.storage": "sqlite:///elsewhere.db",
    "hydra.sweeper.search_space": {"x": "y"},
    # (shipped as an interpolation of a launcher value that is null: the schema's type is int)
    "hydra.launcher.cpus_per_task": 3,
    "hydra.launcher.mem_gb": 5,
    "hydra.launcher.cpus_per_gpu": 2,
    "hydra.launcher.gpus_per_task": 2,
}


def changed(value: Any) -> Any:
    """Another value of the same type, so Hydra's own schema does not refuse it first."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, list):
        return [*value, "x"]
    if isinstance(value, dict):
        return {"x": "y"}
    if value in ("RUN", "MULTIRUN"):
        return "MULTIRUN"
    return (
        f"{value}x" if isinstance(value, str) and "${" not in value and "\n" not in value else "x"
    )


def override_text(value: Any) -> str:
    """`value` in Hydra's override grammar (strings quoted: `???`, `,` and `=` are grammar)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(override_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(value)


def nested(path: str, value: Any) -> dict[str, Any]:
    """`a.b.c`, value: {a: {b: {c: value}}}."""
    node: Any = value
    for key in reversed(path.split(".")):
        node = {key: node}
    return node


def merged(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.merge(*nodes))  # type: ignore[return-value]


def global_experiment(root: Path, node: dict[str, Any], name: str = "evil") -> list[str]:
    return experiment(root, OmegaConf.to_yaml(node), name)


def doors(root: Path, context: list[str], values: dict[str, Any]) -> dict[str, list[str]]:
    """The command lines that set each path of Hydra's node in `values` to its value, all in
    one command per door."""
    gadgets = {f"gadget{index}": value for index, value in enumerate(values.values())}
    pointing = [nested(path, f"${{data.gadget{i}}}") for i, path in enumerate(values)]
    sweep = nested("hydra.sweeper.params", {p: override_text(v) for p, v in values.items()})
    return {
        "a config file": [
            *global_experiment(root / "file", merged([nested(p, v) for p, v in values.items()])),
            *context,
        ],
        "an override": [*context, *(f"{p}={override_text(v)}" for p, v in values.items())],
        "an interpolation": [  # (data's node takes keys of a user's loader)
            *global_experiment(root / "interpolation", merged([{"data": gadgets}, *pointing])),
            *context,
        ],
        "a sweep parameter": ["-m", *global_experiment(root / "sweep", sweep, "sweep"), *context],
    }


def refusal_or_none(argv: list[str]) -> str | None:
    """The one-line refusal of `train argv`'s Hydra node (the command line, then the composed
    node: the node's own check, alone), or None if it passes."""
    try:
        command = read_command_line(argv, {})
        composition = compose(command, OnceLoader(search_path(command.args), check_sweep_job))
        check_hydra_node(composition.cfg, composition.overrides)
    except ConfigError as error:
        return str(error)
    return None


# Overrides Hydra refuses itself where another key is set beside them (an override cannot add
# `x` to hydra.env's struct; optuna's search space cannot be read): each on its own command.
ALONE_AS_OVERRIDES = ("hydra.env", "hydra.sweeper.search_space")


@pytest.mark.slow
@pytest.mark.parametrize("context", CONTEXTS, ids=lambda context: " ".join(context) or "shipped")
def test_every_other_key_of_hydras_node_is_refused_through_every_door(tmp_path, context):
    """Each door is refused by the framework, naming every key set through it (a refusal by
    Hydra's own parser or schema instead would prove nothing about the door): one command per
    door sets all of this context's keys, and its one line names each."""
    values = {path: TYPED.get(path, changed(value)) for c, path, value in LEAVES if c == context}
    together = {path: value for path, value in values.items() if path not in ALONE_AS_OVERRIDES}
    overrides = [together] + [{path: values[path]} for path in values.keys() - together.keys()]
    found = {
        door: refusal_or_none(argv)
        for door, argv in doors(tmp_path, context, values).items()
        if door != "an override"
    }
    found["an override"] = " | ".join(
        refusal_or_none(doors(tmp_path, context, some)["an override"]) or "" for some in overrides
    )
    missed = {door: [p for p in values if not named(message, p)] for door, message in found.items()}
    assert missed == dict.fromkeys(found, []), found


def test_the_generator_covers_the_code_nodes():
    paths = [path for _, path, _ in LEAVES]
    for prefix in ("hydra.job_logging", "hydra.hydra_logging", "hydra.launcher", "hydra.sweeper"):
        assert any(path.startswith(prefix) for path in paths), prefix
    assert "hydra.callbacks.run_dir._target_" in paths
    assert "hydra.job.env_set" not in paths and re.search("env_copy", " ".join(paths))


def test_cfg_job_is_printed_from_the_composition_the_checks_made(cli, compositions, tmp_path):
    """`train --cfg job` prints the composition its checks made, the same bytes as Hydra's own
    --cfg (here by `-p _global_`, the whole config), which gets that composition too."""
    printed, made = {}, {}
    for way in ("hydras", "ours", "hydras", "ours"):  # the second of each: nothing left to cache
        compositions.clear()
        package = ["-p", "_global_"] if way == "hydras" else []
        printed[way] = cli("--cfg", "job", *package, "launcher.nproc_per_node=1", cwd=tmp_path)
        made[way] = len(compositions)
    assert printed["ours"].returncode == printed["hydras"].returncode == 0
    assert printed["ours"].stdout == printed["hydras"].stdout
    assert "launcher:" in printed["ours"].stdout
    assert made["ours"] == 1, made
