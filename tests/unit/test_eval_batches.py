"""trainer.eval_batches: a validation capped at the first batches of each rank's shard."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from framework.components.data import eval_loader
from framework.components.models import SmallCNN
from framework.components.precision import Precision
from framework.components.tasks import Classification, first_batch
from framework.config.registry import option_values
from framework.config.validation import validate
from framework.core.exits import ConfigError
from framework.core.launch_context import DistEnv
from framework.rank.evaluation import evaluate
from tests.conftest import make_cfg

LOADER = {"eval_batch_size": 7, "num_workers": 0, "pin_memory": False, "persistent_workers": False}


def metrics_over(dataset, max_batches=None) -> dict[str, float]:
    torch.manual_seed(0)
    model = SmallCNN(**option_values("model", "cnn", in_channels=1, num_classes=10)).eval()
    task = Classification(**option_values("task", "classification"))
    with torch.no_grad():
        task.check(model, first_batch(dataset, 7))
    loader = eval_loader(dataset, LOADER, DistEnv(), torch.device("cpu"))
    cpu = torch.device("cpu")
    return evaluate(task, model, loader, Precision(cpu), lambda b: b, max_batches=max_batches)


def test_a_capped_validation_sees_only_the_first_batches():
    generator = torch.Generator().manual_seed(1)
    images, labels = torch.randn(50, 1, 8, 8, generator=generator), torch.arange(50) % 10
    whole = TensorDataset(images, labels)
    first_two = TensorDataset(images[:14], labels[:14])
    capped = metrics_over(whole, max_batches=2)
    assert capped == pytest.approx(metrics_over(first_two), rel=1e-12)
    assert metrics_over(whole) != pytest.approx(capped)
    assert metrics_over(whole, max_batches=100) == metrics_over(whole)  # more than there are


def test_eval_batches_is_off_by_default_and_a_positive_count():
    assert make_cfg().trainer.eval_batches is None
    validate(make_cfg("trainer.eval_batches=3"))
    with pytest.raises(ConfigError, match=r"trainer.eval_batches=0 must be >= 1"):
        validate(make_cfg("trainer.eval_batches=0"))
