"""The one place where the config is made known to Hydra: every group option's typed schema (in
its ConfigStore, as schema/<group>/<option>, which the YAML files in conf/ extend) and the
resolvers the YAML files use. framework/train.py calls `register_configs()` before Hydra
composes anything; so do tests and benchmarks that compose a config themselves.
"""

from __future__ import annotations

import dataclasses

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from framework.config import schemas as s
from framework.config.resolvers import register_resolvers

# group -> option -> schema. A YAML option of the group starts with
# `defaults: [/schema/<group>/<option>@_here_]`; `base` is the schema a user's own option extends.
# A base is stored open: the user's option adds keys of its own, typed and checked against its
# `_target_`'s signature (framework/config/option_keys.py), while the framework's keys stay typed.
SCHEMAS: dict[str, dict[str, type]] = {
    "task": {
        "base": s.TaskConfig,
        "classification": s.ClassificationConfig,
        "regression": s.RegressionConfig,
        "language_model": s.LanguageModelConfig,
        "autoencoder": s.AutoencoderConfig,
    },
    "model": {
        "base": s.ModelConfig,
        "mlp": s.MLPConfig,
        "cnn": s.CNNConfig,
        "resnet18": s.ResNet18Config,
        "resnet50": s.ResNet50Config,
        "ffn": s.FeedForwardConfig,
        "vae": s.VAEModelConfig,
        "gpt": s.GPTConfig,
    },
    "data": {
        "base": s.DataConfig,
        "digits": s.DigitsConfig,
        "diabetes": s.DiabetesConfig,
        "text": s.TextConfig,
        "synthetic": s.SyntheticConfig,
        "cifar10": s.Cifar10Config,
    },
    "optimizer": {"sgd": s.SGDConfig, "adamw": s.AdamWConfig},
    "scheduler": {
        "constant": s.ConstantSchedulerConfig,
        "cosine": s.CosineSchedulerConfig,
        "step": s.StepSchedulerConfig,
    },
    "precision": {"fp32": s.PrecisionConfig, "bf16": s.BF16Config, "amp": s.AmpConfig},
    "comm": {
        "allreduce": s.CommConfig,
        "fp16": s.FP16CommConfig,
        "bf16": s.BF16CommConfig,
        "powersgd": s.PowerSGDConfig,
    },
    "strategy": {"ddp": s.StrategyConfig, "fsdp": s.FSDPConfig},
    "launcher": {
        "local": s.LocalLauncherConfig,
        "torchrun": s.TorchrunLauncherConfig,
        "slurm": s.SlurmLauncherConfig,
        "slurm_local": s.SlurmLocalLauncherConfig,
    },
    "logger": {
        "base": s.LoggerConfig,
        "wandb": s.WandbLoggerConfig,
        "tensorboard": s.TensorBoardLoggerConfig,
        "csv": s.CsvLoggerConfig,
        "mlflow": s.MLflowLoggerConfig,
    },
}


# Building blocks a config may name besides the options' own targets.
BUILDING_BLOCKS = ("framework.components.data.PadSequences",)


def shipped_targets() -> frozenset[str]:
    """Every framework callable a config may name: the `_target_` of each shipped option."""
    targets = {
        field.default
        for options in SCHEMAS.values()
        for schema in options.values()
        for field in dataclasses.fields(schema)
        if field.name == "_target_" and isinstance(field.default, str)
    }
    return frozenset({*targets, *BUILDING_BLOCKS} - {MISSING})


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore and register the resolvers (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=s.Config)
    for group, options in SCHEMAS.items():
        for name, schema in options.items():
            node = open_schema(schema) if name == "base" else schema
            store.store(group=f"schema/{group}", name=name, node=node)
    register_resolvers()


def open_schema(schema: type) -> DictConfig:
    """`schema`'s fields, typed, in a node that also takes keys the schema does not name."""
    node = OmegaConf.structured(schema)
    OmegaConf.set_struct(node, False)
    return node
