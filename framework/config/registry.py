"""The one place where the config is made known to Hydra: every group option's typed schema (in
its ConfigStore, as schema/<group>/<option>, which the YAML files in conf/ extend) and the
resolvers the YAML files use. framework/train.py calls `register_configs()` before Hydra
composes anything; so do tests and benchmarks that compose a config themselves.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from framework.config import schemas as s
from framework.config.resolvers import register_resolvers

# group -> option -> schema. A YAML option of the group starts with
# `defaults: [/schema/<group>/<option>@_here_]`; `base` is the schema a user's own option extends.
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


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore and register the resolvers (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=s.Config)
    for group, options in SCHEMAS.items():
        for name, schema in options.items():
            store.store(group=f"schema/{group}", name=name, node=schema)
    register_resolvers()
