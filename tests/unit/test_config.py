"""Every group option composes and builds; bad settings fail with the key and the fix."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
import yaml
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from framework.components.data import load_splits
from framework.components.optim import build_optimizer, scaled_lr
from framework.config import batch, schemas
from framework.config.registry import GROUP_BASES, read_option
from framework.config.resume_rules import must_match_in_eval, resumable_keys, training_settings
from framework.config.validation import node_range, validate
from framework.core.exits import ConfigError
from framework.core.signatures import signature_of
from tests.conftest import CONF_DIR, REPO, make_cfg


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_groups_have_the_promised_options():
    assert {"mlp", "cnn", "resnet18"} <= set(options("model"))
    assert {"digits", "synthetic", "cifar10"} <= set(options("data"))
    assert {"sgd", "adamw"} <= set(options("optimizer"))
    assert {"constant", "cosine", "step"} <= set(options("scheduler"))
    assert {"local", "torchrun"} <= set(options("launcher"))
    assert {"wandb", "none"} <= set(options("logger"))
    assert {"digits_cnn", "cifar10_resnet18"} <= set(options("experiment"))


def test_default_is_the_digits_cnn_experiment_on_two_ranks():
    cfg = make_cfg()
    assert cfg.model._target_.endswith("SmallCNN")
    assert cfg.data._target_.endswith("digits")
    assert cfg.launcher.nproc_per_node == 2
    assert cfg == make_cfg("experiment=digits_cnn")


# The image classifiers; ffn, vae and gpt read tables, reconstruct images and read tokens
# (each on its preset's data: tests/unit/test_tasks.py).
IMAGE_CLASSIFIERS = [name for name in options("model") if name not in ("ffn", "vae", "gpt")]


# ResNet-50's ImageNet stem downsamples 32x: it refuses digits' 8x8 (tests/unit/test_preflight.py).
ON_DIGITS = [name for name in IMAGE_CLASSIFIERS if name != "resnet50"]


@pytest.mark.parametrize(
    ("model", "data"),
    [(model, "digits") for model in ON_DIGITS] + [(m, "synthetic") for m in IMAGE_CLASSIFIERS],
)
def test_every_model_runs_on_every_embedded_dataset(model, data):
    cfg = (
        make_cfg(f"model={model}", f"data={data}", "data.train_size=8", "data.val_size=4")
        if data == "synthetic"
        else make_cfg(f"model={model}", f"data={data}")
    )
    splits = load_splits(cfg.data)
    inputs, _ = splits.train[0]
    assert inputs.shape == (cfg.data.in_channels, cfg.data.image_size, cfg.data.image_size)
    logits = instantiate(cfg.model)(inputs.unsqueeze(0).repeat(2, 1, 1, 1))
    assert logits.shape == (2, cfg.data.num_classes)


@pytest.mark.parametrize("optimizer", options("optimizer"))
@pytest.mark.parametrize("scheduler", options("scheduler"))
def test_every_optimizer_and_scheduler_builds_and_steps(optimizer, scheduler):
    cfg = make_cfg(f"optimizer={optimizer}", f"scheduler={scheduler}")
    param = torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer(cfg.optimizer, [param], lr=0.1)
    sched = instantiate(cfg.scheduler)(optimizer=opt, total_steps=10)
    for _ in range(10):
        param.grad = torch.ones(3)
        opt.step()
        sched.step()
    assert param.detach().lt(1).all()


def test_cosine_warmup_ramps_up_then_decays_to_min():
    cfg = make_cfg("scheduler=cosine", "scheduler.warmup_steps=5", "scheduler.min_lr_ratio=0.1")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    sched = instantiate(cfg.scheduler)(optimizer=opt, total_steps=25)
    lrs = []
    for _ in range(25):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] < lrs[4] < lrs[5] == pytest.approx(1.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("scaling", "expected"), [("none", 0.1), ("linear", 0.05), ("sqrt", 0.1 * math.sqrt(0.5))]
)
def test_lr_scaling_against_the_reference_global_batch(scaling, expected):
    cfg = make_cfg(
        "optimizer.lr=0.1", f"optimizer.lr_scaling={scaling}", "optimizer.reference_batch_size=256"
    )
    assert scaled_lr(cfg.optimizer, global_batch_size=128) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model=resnet99", "resnet18"),  # lists valid choices
        ("optimizer.lr=abc", "optimizer.lr"),
        ("trainer.not_a_key=1", "not_a_key"),
        ("optimizer.lr_scaling=cubic", "linear"),
        # Choices are enums: a wrong one fails at composition, listing the valid ones.
        ("dist.backend=mpi", "expected one of [auto, gloo, nccl]"),
        ("mode=predict", "expected one of [train, eval, estimate]"),
        ("eval.split=train", "expected one of [val, test]"),
        ("trainer.on_nonfinite=ignore", "expected one of [stop, skip]"),
        ("trainer.stop_signals=[SIGTERM,SIGKILL]", "SIGKILL"),
    ],
)
def test_composition_errors_name_the_key(override, expected):
    with pytest.raises(ConfigCompositionException) as error:
        make_cfg(*override.split())
    assert expected in str(error.value) + str(error.value.__cause__)


def test_oversubscribe_insists_on_more_ranks_than_the_machine_holds():
    # (one sample per rank and batch: the 1,438 training images hold a global batch of 1000)
    validate(
        make_cfg("launcher.nproc_per_node=1000", "launcher.oversubscribe=true", "data.batch_size=1")
    )


@pytest.mark.parametrize(
    ("nnodes", "expected"), [("2", (2, 2)), ("1:2", (1, 2)), ("2:4", (2, 4)), ("3:3", (3, 3))]
)
def test_launcher_nnodes_is_a_number_or_an_elastic_range(nnodes, expected):
    cfg = make_cfg(
        "launcher=torchrun",
        f"launcher.nnodes={nnodes}",
        "launcher.max_restarts=1",
        "launcher.rdzv_endpoint=node0:29500",
    )
    validate(cfg)
    assert node_range(cfg.launcher.nnodes) == expected


def test_nccl_where_no_gpu_is_visible_is_refused_before_torch(monkeypatch):
    """The rank refused it only after start-up; submitted to SLURM, the ranks run elsewhere."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, on any machine
    with pytest.raises(ConfigError, match="dist.backend=nccl needs CUDA devices and none is"):
        validate(make_cfg("dist.backend=nccl"))
    validate(make_cfg("dist.backend=nccl", "launcher=slurm"))


def test_a_keyword_that_kwargs_take_and_no_schema_names_is_let_through():
    """torchvision's resnet18(**kwargs) takes zero_init_residual without naming it."""
    validate(make_cfg("model._target_=torchvision.models.resnet18", "+model.zero_init_residual=1"))


ELASTIC_1_3 = (
    "launcher=torchrun",
    "launcher.nnodes=1:3",
    "launcher.nproc_per_node=1",
    "launcher.max_restarts=1",
    "launcher.rdzv_endpoint=node0:29500",
)


def test_the_accumulation_follows_the_number_of_ranks_to_keep_the_global_batch():
    cfg = make_cfg(*ELASTIC_1_3, "data.batch_size=16", "trainer.global_batch_size=96")
    validate(cfg)  # 96 = 16 x 1 x 6 = 16 x 2 x 3 = 16 x 3 x 2
    assert [batch.grad_accum(cfg.trainer, 16, ranks) for ranks in (1, 2, 3)] == [6, 3, 2]
    with pytest.raises(ConfigError, match="16 x 4 ranks .* a multiple of 64"):
        batch.grad_accum(cfg.trainer, 16, 4)  # (a world size the range rules out)
    unset = make_cfg("trainer.grad_accum=3")
    assert batch.grad_accum(unset.trainer, 16, 4) == 3  # null: the global batch follows


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # Bounds declared beside each key: a schema field's, or a callable's annotation.
        (["launcher.nproc_per_node=0"], "launcher.nproc_per_node=0 must be >= 1"),
        (["trainer.grad_accum=0"], "trainer.grad_accum=0 must be >= 1"),
        (["trainer.ema_decay=1.5"], "trainer.ema_decay=1.5 must be in (0, 1)"),
        (["data.eval_batch_size=0"], "data.eval_batch_size=0 must be >= 1"),
        (["trainer.seed=-1"], "trainer.seed=-1 must be in [0, 4294967296)"),
        (["trainer.seed=4294967296"], "trainer.seed=4294967296 must be in"),
        (["trainer.peak_tflops=0"], "trainer.peak_tflops=0.0 must be > 0"),
        (["dist.ddp.bucket_cap_mb=-5"], "dist.ddp.bucket_cap_mb=-5.0 must be > 0"),
        (["optimizer.reference_batch_size=0"], "optimizer.reference_batch_size=0 must be >= 1"),
        (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay=-0.1 must be >= 0"),
        (["+optimizer.lr_multipliers={head.*:0}"], "optimizer.lr_multipliers={'head.*': 0.0}"),
        (["launcher=torchrun", "launcher.monitor_interval_s=0"], "monitor_interval_s=0.0 must"),
        (["logger=mlflow", "logger.mlflow.experiment="], "logger.mlflow.experiment= must be at"),
        (["data=synthetic", "data.image_size=0"], "data.image_size=0 must be >= 1"),
        # (a bound declared by an alias another module of the package defines: data.Size)
        (["experiment=char_gpt", "data=text_stream", "data.val_files=0"], "data.val_files=0 must"),
        (["data=synthetic", "data.train_size=0"], "data.train_size=0 must be >= 1"),
        (["data.val_fraction=0"], "data.val_fraction=0 must be in (0, 1)"),
        (["data.test_fraction=-0.1"], "data.test_fraction=-0.1 must be in [0, 1)"),
        (["experiment=char_gpt", "data.stride=0"], "data.stride=0 must be >= 1"),
        (["experiment=char_gpt", "task.sample_tokens=-5"], "task.sample_tokens=-5 must be >= 0"),
        (["experiment=char_gpt", "task.chars_per_token=0"], "chars_per_token=0 must be > 0"),
        (["model=mlp", "model.hidden_sizes=[8,0]"], "model.hidden_sizes=[8, 0] must be >= 1"),
        (["precision=amp", "precision.backoff_factor=1"], "backoff_factor=1 must be in (0, 1)"),
        (["comm=powersgd", "comm.rank=0"], "comm.rank=0 must be >= 1"),
        # The facts between keys, one table (framework/config/validation.py's RULES).
        (
            ["launcher.nproc_per_node=1000"],
            "launcher.nproc_per_node=1000 with data.num_workers=0 is 1000 processes",
        ),
        (["launcher=torchrun", "launcher.nproc_per_node=1000"], "launcher.oversubscribe=true"),
        (["trainer.max_steps=null", "trainer.max_epochs=null"], "trainer.max_steps"),
        # launcher.nnodes: N, or MIN:MAX for an elastic job, which restarts after a lost node.
        (["launcher=torchrun", "launcher.nnodes=2:1"], "launcher.nnodes=2:1 is not a number"),
        (["launcher=torchrun", "launcher.nnodes=0:2"], "1 <= MIN <= MAX"),
        (["launcher=torchrun", "launcher.nnodes=a:b"], "launcher.nnodes=a:b is not a number"),
        (["launcher=torchrun", "launcher.nnodes=0"], "give N >= 1"),
        (["launcher=torchrun", "launcher.nnodes=1:2"], "set launcher.max_restarts>=1"),
        # A port picked at random on one node: no other node could join (it waited in silence).
        (["launcher=torchrun", "launcher.nnodes=2"], "port 0 picks a free port on one node"),
        # A test split the training run never held out (its settings are the run's).
        (
            ["mode=eval", "checkpoint.resume=/x/last.pt", "eval.split=test"],
            "the run was trained with data.test_fraction=0",
        ),
        # An autoencoder's metrics follow task.vae; an objective is checked before torch too.
        (["experiment=digits_vae", "objective=val/accuracy"], "choose one of val/elbo"),
        # Gradients sharded by FSDP: DDP's comm hooks and amp's GradScaler cannot run.
        (["strategy=fsdp", "comm=powersgd"], "comm=powersgd is a DDP comm hook"),
        (["strategy=fsdp", "comm=fp16"], "use comm=allreduce with strategy=fsdp"),
        (["strategy=fsdp", "precision=amp"], "GradScaler needs whole gradients on every rank"),
        # Only a sharded checkpoint is written in the background (rank 0's file is not).
        (["checkpoint.async_save=true"], "add checkpoint.format=sharded"),
        (["strategy=fsdp", "checkpoint.format=file", "checkpoint.async_save=true"], "async_save"),
        (["checkpoint.resume=/"], "checkpoint.resume=/ is no checkpoint"),
        # The accumulation is derived from trainer.global_batch_size: a whole number of
        # per-rank batches x ranks at every size the job can take, an elastic range's included.
        (["trainer.global_batch_size=64", "trainer.grad_accum=2"], "derived from the global"),
        (["data.batch_size=24", "trainer.global_batch_size=64"], "batch_size=24 x 2 ranks"),
        ([*ELASTIC_1_3, "data.batch_size=16", "trainer.global_batch_size=64"], "16 x 3 ranks"),
        # A special case: a classifier on data=text's 128-token windows of 128 tokens.
        (["model=gpt", "data=text"], "only task=language_model reads, not task=classification"),
        # Every key of a component's node is something its callable (or the framework) takes.
        (["+model.hiden=3"], "model.hiden is not a setting of framework.components.models"),
        (["+optimizer.momentun=0.5"], "did you mean optimizer.momentum?"),
        (["+data.batch_sise=8"], "did you mean data.batch_size?"),
        # The shipped data options take no **kwargs: a key near none is refused too.
        (["+data.standardise=true"], "data.standardise is not a setting of"),
        (["logger=csv", "+logger.csv.filname=x"], "did you mean logger.csv.filename?"),
        # A setting with a fixed set of values is a Literal in its callable's signature.
        (["task=autoencoder", "task.reconstruction=l1"], "not one of 'mse', 'bce'"),
        (["comm=powersgd", "comm.compress=fp8"], "not one of 'fp16', 'bf16'"),
        (["logger=wandb", "logger.wandb.mode=cloud"], "not one of 'auto', 'online', 'offline'"),
        (["optimizer.momentum=abc"], "optimizer.momentum='abc' is not of type float"),
        (
            ["optimizer=adamw", "optimizer.betas=[0.9]"],
            "optimizer.betas=[0.9] is not of type tuple[",
        ),
        # The framework gives these when it builds the option; a value here would be ignored.
        (["+scheduler.total_steps=5"], "scheduler.total_steps is given by the framework"),
        (["+optimizer.params=5"], "optimizer.params is given by the framework"),
        (["precision=bf16", "+precision.device=cuda"], "precision.device is given by"),
    ],
)
def test_cross_field_errors_name_the_setting(overrides, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        validate(make_cfg(*overrides))


# --- an option is two places: its YAML file and its callable --------------------------------
OPTION_GROUPS = ("task", "model", "data", "optimizer", "scheduler", "precision", "comm", "strategy")


def shipped_options() -> list[tuple[str, str]]:
    return [(group, name) for group in OPTION_GROUPS for name in options(group)]


def option_node(group: str, name: str) -> DictConfig:
    return make_cfg(f"{group}={name}", *OVERRIDES_FOR.get((group, name), ()))[group]


OVERRIDES_FOR = {("data", "cifar10"): ["data.root=/nonexistent"]}


@pytest.mark.parametrize(
    ("group", "name"), shipped_options(), ids=[f"{g}/{n}" for g, n in shipped_options()]
)
def test_a_shipped_option_shows_its_values_each_a_parameter_of_its_callable(group, name):
    """What a user sees in conf/<group>/<name>.yaml is what runs: `_target_` and every value
    of the option's own, each a keyword its callable names (not one swallowed by **kwargs)."""
    content = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{name}.yaml"))
    assert content.pop("defaults") == [f"/schema/{group}/base@_here_", "_self_"]
    target = content.pop("_target_")
    signature = signature_of(target)
    assert signature is not None, f"{target}'s signature is not readable from its source"
    base = {field.name for field in dataclasses.fields(GROUP_BASES[group])}
    own = set(content) - base
    assert own <= set(signature.parameters), (
        f"{target} does not name {own - set(signature.parameters)}"
    )


def test_the_checks_read_each_shipped_file_as_pyyamls_own_parser_does():
    """The checks read every shipped option with libyaml (faster); what they read must be what
    the pure-Python safe loader reads."""
    files = sorted(CONF_DIR.glob("*/*.yaml"))
    assert len(files) > 30
    for path in files:
        assert read_option(path) == (yaml.safe_load(path.read_text()) or {}), path


def our_options() -> list[tuple[str, str]]:
    """The shipped options whose callable is ours (not torch's optimizers)."""
    return [
        (group, name)
        for group, name in shipped_options()
        if OmegaConf.load(CONF_DIR / group / f"{name}.yaml")._target_.startswith("framework.")
    ]


OUR_OPTIONS = our_options()


@pytest.mark.parametrize(("group", "name"), OUR_OPTIONS, ids=[f"{g}/{n}" for g, n in OUR_OPTIONS])
def test_our_callables_hold_no_second_default_for_what_their_option_sets(group, name):
    """Each default once: in the option's YAML. Our own callable takes the value it is given."""
    node = option_node(group, name)
    signature = signature_of(node._target_)
    doubled = [
        key
        for key in node
        if key in signature.parameters and not signature.parameters[key].required
    ]
    assert not doubled, f"{node._target_} has its own default for {doubled}"


def test_the_root_config_only_picks_options():
    content = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))
    assert sorted(content) == ["defaults", "hydra"]


def test_sgd_weight_decay_is_the_documented_default():
    """The value conf/optimizer/sgd.yaml carried, once a second default next to the schema's."""
    assert make_cfg("optimizer=sgd").optimizer.weight_decay == 5e-4
    assert make_cfg("optimizer=adamw").optimizer.weight_decay == 0.01


# --- what a resume may change and an evaluation must match: schema field metadata -------------
def test_resumable_settings_come_from_the_schema_metadata():
    keys = resumable_keys()
    # Whole sections, single trainer keys, and data options' loader keys (any data option).
    for key in ("checkpoint", "logger", "launcher", "trainer.max_steps", "data.num_workers"):
        assert key in keys
    for key in ("trainer.grad_accum", "trainer.seed", "optimizer.lr", "data.batch_size"):
        assert key not in keys


def test_training_settings_leave_out_what_a_resume_may_change():
    record = OmegaConf.to_container(make_cfg(), resolve=True)
    settings = training_settings(record)
    assert "optimizer.lr" in settings and "data.batch_size" in settings
    assert "trainer.max_epochs" not in settings and "data.num_workers" not in settings
    assert not any(key.startswith(("launcher.", "checkpoint.", "logger")) for key in settings)


def test_a_users_data_schema_inherits_what_an_evaluation_may_change():
    @dataclasses.dataclass
    class MyData(schemas.DataConfig):
        val_fraction: float = 0.2

    assert MyData.__dataclass_fields__["num_workers"].metadata[schemas.RESUMABLE]
    assert must_match_in_eval("data.val_fraction")  # which examples: must match
    for loader_key in ("data.batch_size", "data.eval_batch_size", "data.root", "data.shuffle"):
        assert not must_match_in_eval(loader_key)
    assert must_match_in_eval("model.width") and must_match_in_eval("task.label_smoothing")
    assert not must_match_in_eval("optimizer.lr")  # an evaluation trains nothing


# --- a preset's values for one option do not forbid choosing another --------------------------
@pytest.mark.parametrize("scheduler", ["constant", "step", "cosine"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_presets_values_for_its_own_options_do_not_forbid_choosing_others(optimizer, scheduler):
    """char_gpt sets cosine's warmup_steps and AdamW's betas: with another scheduler or
    optimizer those are left out, with its own they are kept."""
    cfg = make_cfg("experiment=char_gpt", f"scheduler={scheduler}", f"optimizer={optimizer}")
    validate(cfg)
    assert ("warmup_steps" in cfg.scheduler) == (scheduler in ("cosine",))
    if scheduler == "cosine":
        assert cfg.scheduler.warmup_steps == 50  # the preset's, not the option's 0
    assert ("betas" in cfg.optimizer) == (optimizer == "adamw")
    if optimizer == "adamw":
        assert list(cfg.optimizer.betas) == [0.9, 0.99]  # the preset's
    assert cfg.optimizer.lr == 3.0e-3  # a key every optimizer has stays the preset's


def test_cifar10_resnet18_keeps_its_warmup_for_its_own_scheduler_only():
    own = make_cfg("experiment=cifar10_resnet18", "data.root=/nonexistent")
    assert own.scheduler.warmup_steps == 200
    other = make_cfg("experiment=cifar10_resnet18", "data.root=/nonexistent", "scheduler=step")
    assert "warmup_steps" not in other.scheduler


def test_the_table_of_rules_in_the_docs_is_the_table_the_code_checks():
    """docs/configuration.md lists the facts between keys, one row per rule of RULES, in its
    order: a rule added, renamed or removed without its row fails here."""
    from framework.config.validation import RULES

    page = (REPO / "docs" / "configuration.md").read_text()
    section = page.split("## Bad input")[1].split("\n## ")[0]
    documented = re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)
    assert documented == [rule.__name__ for rule in RULES]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["init.path=model.safetensors"], "init.path is not a setting of "),
        (["optimizer=adamw", "optimizer.nesterov=true"], "; optimizer=sgd takes it"),
    ],
)
def test_a_key_of_another_option_of_the_group_names_that_option(overrides, expected):
    with pytest.raises(ConfigError) as refused:
        validate(make_cfg(*overrides))
    assert expected in str(refused.value)
    if overrides[0].startswith("init."):
        assert str(refused.value).endswith("; init=file takes it")
