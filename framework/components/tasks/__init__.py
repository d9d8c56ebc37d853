"""Tasks: how a batch feeds the model, what the loss is, and which metrics evaluation reports.

A task is built from `task=<option>` by `_target_` like every component; a user's own task is a
subclass of `Task` in their own package (docs/tasks.md).

Two rules make every task exact under DDP and gradient accumulation:
- A loss is a *sum* over the items of a micro-batch (samples, pixels, tokens) with their count
  (`count()`). The runner divides by the count of the whole optimizer step over every rank and
  micro-batch, so 2 ranks x accumulation 2 give the gradient of one batch holding it all, even
  when micro-batches hold different numbers of tokens.
- Metrics are *sum states* (`states`, `evaluate()`), added up on the device and reduced across
  ranks in one all-reduce per evaluation; `compute()` turns the totals into metrics. A 2-rank
  evaluation then equals the 1-rank one whatever the split of the validation set.
"""

from framework.components.tasks.autoencoder import Autoencoder
from framework.components.tasks.base import (
    Task,
    TaskLoss,
    batch_shapes,
    first_batch,
    require_logits,
    state_sum,
)
from framework.components.tasks.classification import Classification
from framework.components.tasks.language_model import LanguageModel
from framework.components.tasks.regression import Regression

__all__ = [
    "Autoencoder",
    "Classification",
    "LanguageModel",
    "Regression",
    "Task",
    "TaskLoss",
    "batch_shapes",
    "first_batch",
    "require_logits",
    "state_sum",
]
