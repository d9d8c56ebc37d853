"""framework/security.py as pure functions: the `_target_` allowlist, the command-line checks,
secret detection and redaction, and the redacted records written for Hydra."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from framework.app.command_line import hide_secrets, read_command_line
from framework.app.hydra_node import hydra_target_problem
from framework.app.hydra_records import redact_multirun_master, write_hydra_record
from framework.config.redaction import (
    REDACTED,
    SecretFilter,
    is_secret_name,
    redact,
    redacted_container,
    secret_values,
)
from framework.config.registry import register_configs, shipped_targets
from framework.config.validation import validate
from framework.core.allowlist import (
    check_targets,
    matches_prefix,
    target_problem,
    trusted_prefixes,
)
from framework.core.exits import ConfigError
from framework.train import checked
from tests.conftest import CONF_DIR, REPO, make_cfg

SECRET = "PLANTED-SECRET-123"
FIX = "one of your own modules listed in allowed_targets in a config file"


# --- the allowlist --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "prefixes", "expected"),
    [
        ("torch.optim.SGD", ["torch"], True),
        ("torch", ["torch"], True),
        ("torchevil.x", ["torch"], False),
        ("torchvision.models.resnet18", ["torch"], False),
        ("tests.integration.byo_components.TinyNet", ["tests.integration"], True),
        ("tests.integrationevil.x", ["tests.integration"], False),
    ],
)
def test_prefixes_match_on_module_boundaries(name, prefixes, expected):
    assert matches_prefix(name, prefixes) is expected


SHIPPED_TARGETS = shipped_targets()


@pytest.mark.parametrize(
    "target",
    [
        "torch.optim.SGD",
        "torch.optim.lr_scheduler.CosineAnnealingLR",
        "torch.nn.Linear",
        "torch.nn.init.kaiming_normal_",
        "torch.utils.data.TensorDataset",
        "torchvision.models.resnet18",
        "torchvision.transforms.Compose",
        "framework.components.models.SmallCNN",
        "framework.components.data.digits",
        "framework.components.data.PadSequences",
    ],
)
def test_the_families_allow_the_usual_targets(target):
    assert target_problem(target, shipped=SHIPPED_TARGETS) is None


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("builtins.open", "outside the allowed families"),
        ("shutil.copy", "outside the allowed families"),
        ("os.system", "outside the allowed families"),
        ("subprocess.run", "outside the allowed families"),
        ("importlib.import_module", "outside the allowed families"),
        ("torchevil.nn.Linear", "outside the allowed families"),
        # A path through an imported module, or through a family's submodule.
        ("torch.os.system", "outside the allowed families"),
        ("torchvision.datasets.mnist.shutil.copy", "outside the allowed families"),
        ("torch.nn.functional.torch.load", "outside the allowed families"),
        ("torch.nn.modules.linear.Linear", "outside the allowed families"),
        # Inside torch, but they run code, load pickles or write files.
        ("torch.hub.load", "outside the allowed families"),
        ("torch.load", "outside the allowed families"),
        ("torch.fx.graph_module._exec_with_source", "private"),
        ("torch.utils.cpp_extension.load_inline", "outside the allowed families"),
        ("torchvision.datasets.CIFAR10", "outside the allowed families"),
        ("torchvision.models.ResNet18_Weights", "outside the allowed families"),
        ("torchvision.models.get_model", "never allowed"),
        # A public name of a family that is really something private or a module.
        ("torch.utils.data.IterDataPipe", "resolves to torch.utils.data.datapipes"),
        ("torchvision.models.resnet", "not a class or function"),
        # Our own package beyond the shipped options: what a run builds itself.
        ("framework.components.loggers.JsonlSink", "outside the allowed families"),
        ("framework.storage.run_dir.RunDir", "outside the allowed families"),
        ("framework.components.loggers.os.system", "outside the allowed families"),
    ],
)
def test_dangerous_targets_are_refused_with_the_reason(target, expected):
    problem = target_problem(target, shipped=SHIPPED_TARGETS)
    assert problem is not None and expected in problem


def test_a_trusted_prefix_allows_only_what_resolves_inside_it():
    trusted = ["tests.integration"]
    assert target_problem("tests.integration.byo_components.TinyNet", trusted) is None
    problem = target_problem("tests.integration.byo_components.torch.load", trusted)
    assert problem is not None and "resolves to torch.serialization.load" in problem
    assert "private" in target_problem("tests.integration._hidden.x", trusted)


def test_pretrained_weights_are_refused_by_argument():
    cfg = make_cfg("+model.backbone={_target_:torchvision.models.resnet18,weights:IMAGENET1K_V1}")
    with pytest.raises(ConfigError, match=r"model.backbone.weights=IMAGENET1K_V1 is not allowed"):
        check_targets(cfg, SHIPPED_TARGETS)


@pytest.mark.parametrize("argument", ["pretrained", "pretrained_backbone"])
def test_torchvisions_older_pretrained_flag_is_refused_too(argument):
    cfg = make_cfg(f"+model.backbone={{_target_:torchvision.models.resnet18,{argument}:true}}")
    with pytest.raises(ConfigError, match=rf"model.backbone.{argument}=True is not allowed"):
        check_targets(cfg, SHIPPED_TARGETS)
    check_targets(
        make_cfg("+model.backbone={_target_:torchvision.models.resnet18,pretrained:false}"),
        SHIPPED_TARGETS,
    )


@pytest.mark.parametrize(
    "target",
    ["torchvision.transforms.v2.RandomCrop", "torchvision.transforms.v2.Normalize"],
)
def test_a_documented_family_name_defined_in_its_private_module_is_allowed(target):
    assert target_problem(target, shipped=SHIPPED_TARGETS) is None
    assert target_problem(target, shipped=SHIPPED_TARGETS, by_import=True) is None


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("os", "is refused"),  # the standard library
        ("torch", "is refused"),  # an installed package
        ("hydra", "is refused"),
        ("framework", "is refused"),  # beyond the shipped targets
        ("not a module", "is invalid"),
        ("tests._private", "is invalid"),
    ],
)
def test_allowed_targets_trusts_only_your_own_code(entry, expected):
    with pytest.raises(ConfigError, match=f"allowed_targets entry '{entry}' {expected}"):
        trusted_prefixes({"allowed_targets": [entry]})


@pytest.mark.parametrize("entry", ["benchmarks", "tests", "tests.integration", "launchers"])
def test_allowed_targets_never_trusts_this_repositorys_own_packages(entry, monkeypatch):
    monkeypatch.delenv("FRAMEWORK_TRUSTED_PACKAGES", raising=False)
    with pytest.raises(ConfigError, match=f"allowed_targets entry '{entry}' is refused"):
        trusted_prefixes({"allowed_targets": [entry]})


@pytest.mark.parametrize("sweep", [[], ["-m"]], ids=["run", "sweep"])
def test_allowed_targets_that_cannot_be_resolved_is_one_refusal(tmp_path, monkeypatch, sweep):
    monkeypatch.delenv("NO_SUCH_TARGETS", raising=False)
    write_yaml(
        tmp_path / "experiment" / "mine.yaml",
        "# @package _global_\nallowed_targets: ${oc.env:NO_SUCH_TARGETS}\n",
    )
    with pytest.raises(ConfigError, match="allowed_targets cannot be resolved"):
        checked([*sweep, "-cd", str(tmp_path), "experiment=mine"])


def test_benchmarks_cannot_be_trusted_to_start_a_subprocess(tmp_path, monkeypatch):
    monkeypatch.delenv("FRAMEWORK_TRUSTED_PACKAGES", raising=False)
    write_yaml(
        tmp_path / "experiment" / "bench.yaml",
        "# @package _global_\nallowed_targets: [benchmarks]\nmodel:\n  sh:\n"
        "    _target_: benchmarks.comm.sh\n",
    )
    with pytest.raises(ConfigError, match="allowed_targets entry 'benchmarks' is refused"):
        checked(["-cd", str(tmp_path), "experiment=bench"])


def test_the_environment_may_trust_this_checkouts_tests(monkeypatch):
    monkeypatch.setenv("FRAMEWORK_TRUSTED_PACKAGES", "tests")
    assert trusted_prefixes({"allowed_targets": ["tests.integration"]}) == ("tests.integration",)
    with pytest.raises(ConfigError, match="'benchmarks' is refused"):
        trusted_prefixes({"allowed_targets": ["benchmarks"]})


def test_check_targets_names_the_key_the_target_and_the_fix():
    cfg = make_cfg("+model.evil={_target_:builtins.open,file:marker,mode:w}")
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    message = str(error.value)
    assert "model.evil._target_=builtins.open is not allowed" in message
    assert FIX in message and "\n" not in message


def test_a_target_reached_through_an_interpolation_is_checked_resolved():
    cfg = make_cfg("+data.name=shutil.copy", "+model.evil._target_=${data.name}")
    with pytest.raises(ConfigError, match=r"model.evil._target_=shutil.copy"):
        check_targets(cfg, SHIPPED_TARGETS)


def test_allowed_targets_from_a_config_adds_a_prefix():
    byo = REPO / "tests" / "integration" / "byo"
    cfg = make_cfg(f"hydra.searchpath=[file://{byo}]", "model=my_net", "data=my_data")
    assert list(cfg.allowed_targets) == ["tests.integration"]
    validate(cfg)
    without = OmegaConf.merge(cfg, {"allowed_targets": []})
    with pytest.raises(ConfigError, match=r"model._target_=tests.integration.byo_components"):
        check_targets(without, SHIPPED_TARGETS)


def test_an_invalid_allowed_targets_entry_is_refused():
    with pytest.raises(ConfigError, match="allowed_targets entry"):
        check_targets(OmegaConf.create({"allowed_targets": ["not a module"]}))


def test_an_allowed_targets_entry_that_is_not_importable_says_so():
    """Not "list your own project's modules": it is one, but train runs where it is not
    importable (another folder, the project not installed)."""
    with pytest.raises(ConfigError) as error:
        trusted_prefixes({"allowed_targets": ["no_such_project.models"]})
    assert str(error.value) == (
        "allowed_targets entry 'no_such_project.models': no_such_project is not importable from "
        "here: run train in your project's folder, or install the project there (uv sync)"
    )


def test_a_module_of_ones_own_named_as_a_target_gets_its_one_callable(tmp_path, monkeypatch):
    (tmp_path / "own_nets").mkdir()
    (tmp_path / "own_nets" / "__init__.py").write_text("")
    (tmp_path / "own_nets" / "sine.py").write_text("import torch\n\nclass SineNet:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = OmegaConf.create(
        {"allowed_targets": ["own_nets"], "model": {"_target_": "own_nets.sine"}}
    )
    with pytest.raises(ConfigError) as error:
        check_targets(cfg, SHIPPED_TARGETS)
    assert str(error.value) == (
        "model._target_=own_nets.sine is a module, not a class or function: "
        "did you mean own_nets.sine.SineNet?"
    )


def options(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml"))


SHIPPED = [
    *(
        f"{group}={name}"
        for group in (
            "model",
            "data",
            "optimizer",
            "scheduler",
            "logger",
            "launcher",
            "precision",
            "comm",
            "strategy",
            "init",
        )
        for name in options(CONF_DIR / group)
    ),
    *(f"experiment={name}" for name in options(REPO / "experiments")),
]


@pytest.mark.parametrize("override", SHIPPED)
def test_every_shipped_option_and_experiment_passes_the_allowlist(override):
    check_targets(make_cfg(override), SHIPPED_TARGETS)


# --- the command line -----------------------------------------------------------------------
REFUSED = [
    (["+hydra.callbacks.evil._target_=shutil.copy"], "hydra.callbacks.evil._target_=shutil.copy"),
    (["+hydra.callbacks.evil={_target_:builtins.open,file:x}"], "_target_=builtins.open"),
    (
        [
            "-m",
            "+hydra.callbacks.e._target_=choice(framework.app.run_dir_callback.RunDirCallback,os.system)",
        ],
        "Sweeping over Hydra's configuration is not supported",  # Hydra's own refusal
    ),
    (["hydra.launcher._target_=subprocess.Popen"], "_target_=subprocess.Popen"),
    (["hydra.sweeper._target_=importlib.import_module"], "_target_=importlib.import_module"),
    (
        ["+hydra.hydra_logging.handlers.evil={\\(\\):shutil.copy,src:a,dst:b}"],
        "evil.()=shutil.copy",
    ),
    (["+hydra.job_logging.handlers.evil={class:shutil.copy}"], "evil.class=shutil.copy"),
    (["+hydra.callbacks.evil._target_=hydra.core.utils.os.system"], "is not allowed here"),
    (["+hydra.callbacks.evil._target_=hydra.utils.instantiate"], "is not allowed here"),
    (
        ["+hydra.callbacks.evil._target_=torch.fx.graph_module._exec_with_source"],
        "is not allowed here",
    ),
    (["+hydra.callbacks.evil=${model}"], "_target_=framework.components.models.SmallCNN is not"),
    # (OmegaConf cannot merge a mapping into the basic sweeper's null params: one line)
    (
        ["hydra.sweeper.params={+hydra.callbacks.e._target_:shutil.copy}"],
        "the overrides do not compose at hydra.sweeper.params",
    ),
    (
        ["+hydra.sweeper.params.x=1", "+hydra.sweeper.params.allowed_targets=[os]"],
        "allowed_targets cannot be set on the command line",
    ),
    (["allowed_targets=[builtins]"], "allowed_targets cannot be set on the command line"),
    (["+allowed_targets=[os]"], "allowed_targets cannot be set on the command line"),
    (
        ["~hydra.callbacks.run_dir"],
        "hydra.callbacks, hydra.callbacks.run_dir._target_ cannot be set",
    ),
    (
        ["hydra.callbacks.run_dir._target_=hydra.experimental.callback.Callback"],
        "hydra.callbacks.run_dir._target_=hydra.experimental.callback.Callback is not allowed",
    ),
    (["hydra.output_subdir=.hydra"], "hydra.output_subdir cannot be set"),
    (["+hydra.job.env_set.LD_PRELOAD=/tmp/x.so"], "LD_PRELOAD cannot be set"),
    (["--experimental-rerun", "config.pickle"], "loads a pickle"),
]


@pytest.mark.parametrize(("argv", "expected"), REFUSED, ids=lambda v: str(v))
def test_the_command_line_cannot_reach_code_through_hydras_node(argv, expected):
    """Refused before Hydra starts: as it is typed where it acts as the config is composed
    (allowed_targets, a config folder), else on the composed node, before Hydra uses it."""
    with pytest.raises(ConfigError) as error:
        checked(argv, {})
    assert expected in str(error.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "hydra/launcher=submitit_slurm", "optimizer.lr=0.1,0.05"],
        ["model=resnet18", "+model.x._target_=torchvision.models.resnet18"],  # app: checked later
        ["+hydra.callbacks.log._target_=hydra.experimental.callbacks.LogJobReturnCallback"],
        ["hydra.output_subdir=null", "hydra.callbacks.run_dir.output_subdir=record"],
        ["+hydra.job.env_set.CUDA_VISIBLE_DEVICES=0", "hydra.run.dir=/tmp/x"],
        ["--cfg", "job", "trainer.max_steps=3"],
        ["not a valid override ((("],  # refused as it is composed, in Hydra's words
    ],
)
def test_ordinary_command_lines_pass(argv):
    read_command_line(argv, {})


# --- Hydra's node, composed from the config files ---------------------------------------------
def write_yaml(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


HYDRA_NODE_GADGETS = [
    ("callbacks:\n    evil:\n      _target_: shutil.copy", "hydra.callbacks.evil._target_"),
    (
        "callbacks:\n    evil:\n      _target_: torch.fx.graph_module._exec_with_source",
        "hydra.callbacks.evil._target_",
    ),
    ("callbacks:\n    evil:\n      _target_: ${oc.env:X}", "an interpolation cannot name"),
    (
        "hydra_logging:\n    handlers:\n      evil:\n        (): shutil.copy",
        "hydra.hydra_logging.handlers.evil.()",
    ),
    (
        "hydra_logging:\n    handlers:\n      console:\n        stream: ext://antigravity.x",
        "would import a module",
    ),
    (
        "hydra_logging:\n    handlers:\n      f:\n        class: logging.FileHandler\n"
        "        filename: /root/.bashrc",
        "a log file must lie in the run dir",
    ),
]


def test_the_optuna_sweepers_function_is_checked(tmp_path):
    write_yaml(
        tmp_path / "experiment" / "evil.yaml",
        "# @package _global_\nhydra:\n  sweeper:\n    custom_search_space: os.system\n",
    )
    argv = ["-cd", str(tmp_path), "hydra/sweeper=optuna", "experiment=evil"]
    with pytest.raises(ConfigError, match="custom_search_space=os.system is not allowed"):
        checked(argv)


@pytest.mark.parametrize(("node", "expected"), HYDRA_NODE_GADGETS, ids=lambda v: str(v)[:40])
def test_an_experiment_file_cannot_name_code_in_hydras_node(tmp_path, node, expected):
    write_yaml(tmp_path / "experiment" / "evil.yaml", f"# @package _global_\nhydra:\n  {node}\n")
    with pytest.raises(ConfigError, match=re.escape(expected)):
        checked(["-cd", str(tmp_path), "experiment=evil"])


def test_a_swept_experiment_is_checked_job_by_job(tmp_path):
    write_yaml(
        tmp_path / "experiment" / "fine.yaml", "# @package _global_\ntrainer:\n  max_steps: 2\n"
    )
    write_yaml(
        tmp_path / "experiment" / "evil.yaml",
        "# @package _global_\nhydra:\n  job_logging:\n    handlers:\n      e:\n"
        "        (): shutil.copy\n",
    )
    with pytest.raises(ConfigError, match=r"hydra.job_logging.handlers.e.\(\)=shutil.copy"):
        checked(["-cd", str(tmp_path), "-m", "experiment=fine,evil"])


def test_sweeper_params_in_a_file_are_checked_as_jobs(tmp_path):
    write_yaml(
        tmp_path / "extra" / "evil.yaml",
        "# @package _global_\nhydra:\n  job_logging:\n    handlers:\n      e:\n"
        "        class: subprocess.Popen\n",
    )
    write_yaml(
        tmp_path / "experiment" / "sweep.yaml",
        "# @package _global_\nhydra:\n  sweeper:\n    params:\n      +extra: none,evil\n",
    )
    write_yaml(tmp_path / "extra" / "none.yaml", "# @package _global_\n{}\n")
    with pytest.raises(ConfigError, match="class=subprocess.Popen"):
        checked(["-cd", str(tmp_path), "-m", "experiment=sweep"])


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["launcher=slurm"],
        ["hydra/launcher=submitit_local"],
        ["-m", "optimizer.lr=0.1,0.05", "experiment=digits_cnn"],
        ["hydra/sweeper=optuna"],
        ["hydra/job_logging=default"],
    ],
)
def test_shipped_hydra_nodes_pass(argv):
    checked(argv)


def test_your_own_callback_passes_once_its_module_is_trusted(tmp_path):
    write_yaml(
        tmp_path / "experiment" / "mine.yaml",
        "# @package _global_\nallowed_targets: [tests]\nhydra:\n  callbacks:\n    mine:\n"
        "      _target_: hydra.experimental.callbacks.LogJobReturnCallback\n",
    )
    checked(["-cd", str(tmp_path), "experiment=mine"])
    assert hydra_target_problem("tests.faults.FaultyMLP", ["tests"]) is None
    assert "is not allowed here" in str(hydra_target_problem("tests.faults.FaultyMLP", []))


def test_secret_overrides_move_to_the_environment_and_still_resolve(monkeypatch):
    environ = {"WANDB_API_KEY": "PLANTED-SECRET-456"}
    overrides = [
        "+data.api_token=" + SECRET,
        "optimizer.lr=0.1",
        "+logger.note=PLANTED-SECRET-456",
        "+data.password=a1234567,b1234567",
    ]
    hidden = hide_secrets(overrides, environ)
    assert hidden[0] == "+data.api_token=${oc.env:FRAMEWORK_SECRET_DATA_API_TOKEN}"
    assert hidden[2] == "+logger.note=${oc.env:FRAMEWORK_SECRET_LOGGER_NOTE}"  # a known value
    assert hidden[1] == overrides[1]
    # A swept secret: each value its own variable (Hydra's "Launching" lines, a job's name and
    # the sweep summary show the references).
    assert hidden[3] == (
        "+data.password=${oc.env:FRAMEWORK_SECRET_DATA_PASSWORD_0},"
        "${oc.env:FRAMEWORK_SECRET_DATA_PASSWORD_1}"
    )
    assert environ["FRAMEWORK_SECRET_DATA_PASSWORD_1"] == "b1234567"
    assert environ["FRAMEWORK_SECRET_DATA_API_TOKEN"] == SECRET
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert make_cfg(hidden[0]).data.api_token == SECRET


def test_group_selections_keep_their_option_name():
    environ: dict[str, str] = {}
    argv = ["db/credentials=prod", "+api_token=abcdefgh"]
    assert hide_secrets(argv, environ) == [
        "db/credentials=prod",
        "+api_token=${oc.env:FRAMEWORK_SECRET_API_TOKEN}",
    ]
    assert environ == {"FRAMEWORK_SECRET_API_TOKEN": "abcdefgh"}


# --- secrets --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    [
        "api_key",
        "WANDB_API_KEY",
        "data.api_token",
        "password",
        "db_passwd",
        "apiKey",
        "accessToken",
        "client_secret",
        "HF_TOKEN",
        "AWS_SECRET_ACCESS_KEY",
        "credentials.user",
    ],
)
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "max_tokens",
        "tokenizer",
        "keep",
        "monkey",
        "keys",
        "PWD",
        "batch_size",
        "hydra.job.config.override_dirname.exclude_keys",
        "num_passes",
        "KEYBOARD",
    ],
)
def test_names_that_are_not_secret(name):
    assert not is_secret_name(name)


def test_secret_values_come_from_config_keys_and_environment_and_skip_short_ones():
    cfg = OmegaConf.create(
        {
            "data": {"api_token": SECRET, "max_tokens": 123456789},
            "db": {"password": "abc"},
            "auth": {"token": "${data.api_token}"},
        }
    )
    environ = {
        "WANDB_API_KEY": "PLANTED-SECRET-456",
        "HOME": "/root/home-dir",
        "SSL_KEY_FILE": "/etc/ssl/key.pem",
        "REDIS_KEY_PREFIX": "myapp-",
        "GH_TOKEN": "x",
    }
    assert secret_values(cfg, environ) == {SECRET, "PLANTED-SECRET-456"}


def test_redact_replaces_secret_keys_whole_and_secret_values_anywhere():
    value = {
        "data": {"api_token": "short-ok", "root": f"/data/{SECRET}/x", "n": 3},
        "flags": [f"--key={SECRET}", True],
        "use_token": True,
        "password": None,
    }
    assert redact(value, {SECRET}) == {
        "data": {"api_token": REDACTED, "root": f"/data/{REDACTED}/x", "n": 3},
        "flags": [f"--key={REDACTED}", True],
        "use_token": True,
        "password": None,
    }
    assert redact("abcdef-longer abcdef", {"abcdef", "abcdef-longer"}) == f"{REDACTED} {REDACTED}"


def test_redacted_container_is_what_config_yaml_and_wandb_get(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "PLANTED-SECRET-456")
    cfg = make_cfg(f"+data.api_token={SECRET}", "+logger.note=PLANTED-SECRET-456-suffix")
    container = redacted_container(cfg)
    assert container["data"]["api_token"] == REDACTED
    assert container["logger"]["note"] == f"{REDACTED}-suffix"
    assert container["optimizer"]["lr_scaling"] == "none"  # enums as strings, as before


def test_the_log_filter_redacts_messages_and_tracebacks(monkeypatch):
    monkeypatch.setenv("MY_SERVICE_TOKEN", SECRET)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(SecretFilter())
    logger = logging.getLogger("test_security")
    logger.addHandler(handler)
    try:
        logger.warning("connecting with %s", SECRET)
        try:
            raise RuntimeError(f"bad token {SECRET}")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert SECRET not in text
    assert f"connecting with {REDACTED}" in text and f"bad token {REDACTED}" in text


# --- Hydra's records ------------------------------------------------------------------------
def compose_with_hydra(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def test_hydras_config_leaves_the_record_to_the_callback():
    cfg = compose_with_hydra()
    assert cfg.hydra.output_subdir is None
    assert cfg.hydra.callbacks.run_dir.output_subdir == ".hydra"


def test_the_hydra_record_is_written_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "PLANTED-SECRET-456")
    cfg = compose_with_hydra(f"+data.api_token={SECRET}", "+hydra.job.env_set.MY_TOKEN=abcdefgh")
    write_hydra_record(cfg, tmp_path / ".hydra")
    files = sorted(p.name for p in (tmp_path / ".hydra").iterdir())
    assert files == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    for path in (tmp_path / ".hydra").iterdir():
        text = path.read_text()
        assert SECRET not in text and "abcdefgh" not in text, path.name
    assert OmegaConf.load(tmp_path / ".hydra" / "config.yaml").data.api_token == REDACTED
    overrides = OmegaConf.load(tmp_path / ".hydra" / "overrides.yaml")
    assert f"+data.api_token={REDACTED}" in overrides
    assert OmegaConf.load(tmp_path / ".hydra" / "hydra.yaml").hydra.job.env_set.MY_TOKEN == REDACTED


def test_the_multirun_master_is_redacted_in_place_but_keeps_the_overrides():
    cfg = compose_with_hydra(f"+data.api_token={SECRET}", "+hydra.job.env_set.MY_TOKEN=abcdefgh")
    overrides = list(cfg.hydra.overrides.task)
    redact_multirun_master(cfg)
    assert cfg.data.api_token == REDACTED and cfg.hydra.job.env_set.MY_TOKEN == REDACTED
    assert list(cfg.hydra.overrides.task) == overrides  # the jobs are composed from these


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("https://bob:hunter2@example.com/x", f"https://bob:{REDACTED}@example.com/x"),
        ("sqlite+pysql://u:p@db:5432", f"sqlite+pysql://u:{REDACTED}@db:5432"),
        (
            "mirror https://:tok3n@h and s3://k:v@b",
            f"mirror https://:{REDACTED}@h and s3://k:{REDACTED}@b",
        ),
        ("https://example.com/a:b@c", "https://example.com/a:b@c"),  # no credentials
        ("user@example.com", "user@example.com"),
    ],
)
def test_url_passwords_are_redacted_under_any_key(text, expected):
    assert redact({"data": {"mirror": text}}, set()) == {"data": {"mirror": expected}}


def test_a_url_password_on_the_command_line_moves_to_the_environment():
    environ: dict[str, str] = {}
    argv = hide_secrets(["+data.mirror=https://bob:hunter22@example.com"], environ)
    assert argv == ["+data.mirror=${oc.env:FRAMEWORK_SECRET_DATA_MIRROR}"]
    assert environ == {"FRAMEWORK_SECRET_DATA_MIRROR": "https://bob:hunter22@example.com"}
