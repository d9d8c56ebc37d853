"""What the shipped models, data, tasks, schedules and torch's optimizers need of their
settings' values and of each other, checked before torch loads. Torch would refuse each of
these only inside a rank, after start-up, with a traceback: a layer of width -4 ("negative
dimension"), heads that do not divide the width (a reshape on the first batch), a StepLR of
step_size 0 (a modulo by zero at the first step), a VAE's tuple of outputs given to a task that
reads one tensor; or train on, to nonsense: a classifier on token sequences, ResNet-50's
ImageNet stem on 8x8 images.

Each rule is registered by the callable an option names (validation.CHECKS), so a user's option
naming the same class is checked alike; a user's own model gets its constructor's error as one
line (framework/rank/build.py).
"""

from __future__ import annotations

from collections.abc import Callable

from omegaconf import DictConfig, ListConfig

from framework.config.registry import read_option, shipped_choice, shipped_options
from framework.core.exits import ConfigError
from framework.core.signatures import signature_of

Check = Callable[[DictConfig, DictConfig], None]  # (the group's node, the whole config)
MODELS = "framework.components.models"
TASKS = "framework.components.tasks."
DATA = "framework.components.data."
AUTOENCODER = f"{TASKS}Autoencoder"
LANGUAGE_MODEL = f"{TASKS}LanguageModel"
TEXT = f"{DATA}text"
ASCII_TOKENS = 128  # data=text's vocabulary: one token per ASCII character
# The data's shape (schemas.DataConfig), which the models read by interpolation.
SHAPE_KEYS = ("in_channels", "image_size", "num_classes", "num_features", "num_outputs")


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _at_least_one(group: str, node: DictConfig, keys: tuple[str, ...]) -> None:
    """Sizes: each key (or each item of a list of sizes) is at least 1. A null is left to the
    type check, which names where it came from."""
    for key in keys:
        value = node.get(key)
        sizes = list(value) if isinstance(value, ListConfig) else [value]
        require(
            all(size is None or size >= 1 for size in sizes),
            f"{group}.{key}={_shown(value)} must be >= 1"
            + (" (each size)" if isinstance(value, ListConfig) else ""),
        )


def _shown(value: object) -> str:
    return str(list(value)) if isinstance(value, ListConfig) else str(value)


def _dropout(group: str, node: DictConfig) -> None:
    require(0 <= node.dropout < 1, f"{group}.dropout={node.dropout} must be in [0, 1)")


def sizes(group: str, *keys: str) -> Check:
    """A rule: the option's `keys` are sizes (>= 1)."""

    def check(node: DictConfig, cfg: DictConfig) -> None:
        _at_least_one(group, node, keys)

    return check


def every(*checks: Check) -> Check:
    """A rule: each of `checks`, in order."""

    def check(node: DictConfig, cfg: DictConfig) -> None:
        for one in checks:
            one(node, cfg)

    return check


def _fits_data(model: DictConfig, cfg: DictConfig) -> None:
    """A shipped model's input shape is the data's, and its classes cover the data's labels
    (each defaults to the data's by interpolation; an override that differs fails in the rank
    on the first batch, or trains on part of the image)."""
    for key, fits, need in (
        ("in_channels", lambda mine, data: mine == data, "be"),
        ("image_size", lambda mine, data: mine == data, "be"),
        ("num_classes", lambda mine, data: mine >= data, "be at least"),
    ):
        mine, given = model.get(key), cfg.data.get(key)
        if mine is None or given is None or fits(mine, given):
            continue
        raise ConfigError(  # (the option's name read from the YAML files only here)
            f"model.{key}={mine} does not fit data={shipped_choice('data', cfg.data)}, whose "
            f"data.{key} is {given}: it must {need} {given}; leave model.{key}=${{data.{key}}} "
            "(the default)"
        )


def _check_described_shape(data: DictConfig, cfg: DictConfig) -> None:
    """A shipped data option's shape keys that its callable does not take (digits: 1 channel,
    8x8 pixels, 10 classes) describe what it gives, for the models to read: a different value
    changes no image, and builds a model for other data."""
    option, facts = _shipped_option("data", str(data._target_))
    signature = signature_of(str(data._target_))
    parameters = signature.parameters if signature is not None else {}
    for key in SHAPE_KEYS:
        if key in facts and key not in parameters:
            require(
                data.get(key) == facts[key],
                f"data.{key}={data.get(key)}: data={option} gives "
                f"{key} {facts[key]}; the key describes the data for the model and changes "
                f"nothing in it: leave data.{key} at {facts[key]}",
            )


def _shipped_option(group: str, target: str) -> tuple[str, dict[str, object]]:
    """The name and YAML values of the shipped option of `group` that names `target`."""
    for name, path in shipped_options(group).items():
        values = read_option(path)
        if values.get("_target_") == target:
            return name, values
    return target, {}


def _check_feedforward(model: DictConfig, cfg: DictConfig) -> None:
    _at_least_one("model", model, ("in_features", "out_features", "hidden_sizes"))
    _dropout("model", model)


def _check_gpt(model: DictConfig, cfg: DictConfig) -> None:
    _at_least_one("model", model, ("vocab_size", "block_size", "layers", "heads", "width"))
    require(
        model.width % model.heads == 0,
        f"model.heads={model.heads} does not divide model.width={model.width}: each head takes "
        f"width/heads channels; pick heads among {_divisors(model.width)}, or change the width",
    )
    _dropout("model", model)
    for key, what in (("vocab_size", "token ids up to"), ("block_size", "positions up to")):
        given = cfg.data.get(key)
        require(
            given is None or model[key] >= given,
            f"model.{key}={model[key]} is smaller than data.{key}={given}: {what} {given} have "
            f"no embedding; leave model.{key}=${{data.{key}}} (the default)",
        )


def _divisors(width: int) -> str:
    return ", ".join(str(n) for n in range(1, min(width, 64) + 1) if width % n == 0)


def _check_vae(model: DictConfig, cfg: DictConfig) -> None:
    _at_least_one("model", model, ("in_channels", "image_size", "latent_dim", "hidden_size"))
    task = cfg.task
    reads_it = task._target_ == AUTOENCODER and task.vae
    require(
        reads_it or not str(task._target_).startswith(TASKS),
        "model=vae returns (reconstruction, mu, logvar), which only task=autoencoder with "
        "task.vae=true reads: add task=autoencoder task.vae=true (experiment=digits_vae has both)",
    )


def _check_resnet50(model: DictConfig, cfg: DictConfig) -> None:
    _at_least_one("model", model, ("in_channels", "num_classes"))
    pixels = cfg.data.get("image_size")
    require(
        pixels is None or pixels >= 32,
        f"model=resnet50 has ImageNet's stem, which downsamples 32x, and data.image_size={pixels} "
        "leaves nothing to pool: use model=resnet18 (a 32x32 stem) or images of 32 pixels or "
        "more (data=synthetic data.image_size=224)",
    )


def _check_text(data: DictConfig, cfg: DictConfig) -> None:
    """Token sequences: only the language model reads them (a classifier would take the time
    axis for classes, and train)."""
    task = str(cfg.task._target_)
    require(
        task == LANGUAGE_MODEL or not task.startswith(TASKS),
        f"data=text gives token sequences, which only task=language_model reads, not "
        f"task={shipped_choice('task', cfg.task)}: add task=language_model model=gpt "
        "(experiment=char_gpt has them)",
    )
    require(
        data.vocab_size >= ASCII_TOKENS,
        f"data.vocab_size={data.vocab_size}: data=text is one token per ASCII character, ids "
        f"up to {ASCII_TOKENS - 1}: leave it at {ASCII_TOKENS}",
    )


def _check_language_model(task: DictConfig, cfg: DictConfig) -> None:
    data = str(cfg.data._target_)
    require(
        data == TEXT or not data.startswith(DATA),
        f"task=language_model reads token sequences, which data={data.removeprefix(DATA)} does "
        "not give: add data=text model=gpt (experiment=char_gpt has them)",
    )
    require(task.sample_tokens >= 0, f"task.sample_tokens={task.sample_tokens} must be >= 0")
    require(task.chars_per_token > 0, f"task.chars_per_token={task.chars_per_token} must be > 0")


def _check_sgd(optimizer: DictConfig, cfg: DictConfig) -> None:
    momentum, dampening = optimizer.get("momentum", 0), optimizer.get("dampening", 0)
    require(momentum >= 0, f"optimizer.momentum={momentum} must be >= 0")
    require(
        not optimizer.get("nesterov", False) or (momentum > 0 and dampening == 0),
        f"optimizer.nesterov=true needs optimizer.momentum > 0 and no dampening (momentum="
        f"{momentum}, dampening={dampening})",
    )


def _check_adam(optimizer: DictConfig, cfg: DictConfig) -> None:
    betas = list(optimizer.get("betas", (0.9, 0.999)))
    require(
        all(0 <= beta < 1 for beta in betas),
        f"optimizer.betas={betas}: each must be in [0, 1) (0.9, 0.999 are usual)",
    )
    eps = optimizer.get("eps", 1e-8)
    require(eps >= 0, f"optimizer.eps={eps} must be >= 0")


def _check_step_schedule(scheduler: DictConfig, cfg: DictConfig) -> None:
    _at_least_one("scheduler", scheduler, ("step_size",))
    require(scheduler.gamma > 0, f"scheduler.gamma={scheduler.gamma} must be > 0")


def _check_cosine_schedule(scheduler: DictConfig, cfg: DictConfig) -> None:
    require(
        scheduler.warmup_steps >= 0,
        f"scheduler.warmup_steps={scheduler.warmup_steps} must be >= 0",
    )
    require(
        0 <= scheduler.min_lr_ratio <= 1,
        f"scheduler.min_lr_ratio={scheduler.min_lr_ratio} must be in [0, 1] (of the base lr)",
    )


VALUE_RULES: dict[str | type, Check] = {
    f"{MODELS}.SmallCNN": every(sizes("model", "in_channels", "num_classes", "width"), _fits_data),
    f"{MODELS}.MLP": every(
        sizes("model", "in_channels", "image_size", "num_classes", "hidden_sizes"), _fits_data
    ),
    f"{MODELS}.resnet18_cifar": every(sizes("model", "in_channels", "num_classes"), _fits_data),
    f"{MODELS}.resnet50": every(_check_resnet50, _fits_data),
    f"{MODELS}.FeedForward": _check_feedforward,
    f"{MODELS}.GPT": _check_gpt,
    f"{MODELS}.VAE": every(_check_vae, _fits_data),
    f"{DATA}synthetic": sizes("data", "in_channels", "image_size", "num_classes"),
    f"{DATA}digits": _check_described_shape,
    f"{DATA}cifar10": _check_described_shape,
    f"{DATA}diabetes": _check_described_shape,
    TEXT: _check_text,
    LANGUAGE_MODEL: _check_language_model,
    "torch.optim.SGD": _check_sgd,
    "torch.optim.Adam": _check_adam,
    "torch.optim.AdamW": _check_adam,
    "framework.components.schedulers.step": _check_step_schedule,
    "framework.components.schedulers.cosine_with_warmup": _check_cosine_schedule,
}
