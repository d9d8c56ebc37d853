"""task=language_model: next-token prediction, exact per token however tokens are spread."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from annotated_types import Ge, Gt
from torch import nn

from framework.components.tasks.base import Count, Task, TaskLoss, mean, pick, state_sum
from framework.core.exits import ConfigError


class LanguageModel(Task):
    """Cross-entropy of `model(inputs)` ([B, T, V] logits for [B, T] token ids) against
    `targets` ([B, T], the next tokens; `ignore_index` marks padding). Batches are
    (inputs, targets) or {"inputs", "targets"}. The loss is per token over the whole optimizer
    step, so padded or variable-length micro-batches weigh each token once."""

    name = "language_model"
    metrics = {"loss": "min", "perplexity": "min", "bits_per_char": "min"}
    states = ("loss", "tokens")
    reads = "(inputs, targets) of token ids, [batch, time] each"
    logits_loss = "cross-entropy"
    logits_dim = -1
    fix = "pick a text data option (data=text), or task=classification for labelled inputs"

    def __init__(
        self,
        ignore_index: int,
        chars_per_token: Annotated[float, Gt(0)],
        sample_tokens: Annotated[int, Ge(0)],
    ) -> None:
        self.ignore_index = ignore_index
        self.chars_per_token = chars_per_token
        self.sample_tokens = sample_tokens

    def _loss_sum(self, model: nn.Module, batch: Any, reduction: str = "sum") -> torch.Tensor:
        logits, targets = model(pick(batch, 0, "inputs")), pick(batch, 1, "targets")
        return F.cross_entropy(
            logits.float().flatten(0, -2),
            targets.flatten(),
            reduction=reduction,
            ignore_index=self.ignore_index,
        )

    def count(self, batch: Any) -> Count:
        return (pick(batch, 1, "targets") != self.ignore_index).sum()

    def loss(self, model: nn.Module, batch: Any) -> TaskLoss:
        return TaskLoss.sum(self._loss_sum(model, batch))

    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        losses = self._loss_sum(model, batch, reduction="none")  # per token, padding 0
        return {"loss": state_sum(losses), "tokens": self.count(batch)}

    def compute(self, totals: dict[str, float]) -> dict[str, float]:
        loss = mean(totals["loss"], totals["tokens"])  # nats per token
        return {
            "loss": loss,
            "perplexity": math.exp(min(loss, 700.0)),
            "bits_per_char": loss / math.log(2) / self.chars_per_token,
        }

    def check(self, model: nn.Module, batch: Any) -> None:
        try:
            inputs, targets = pick(batch, 0, "inputs"), pick(batch, 1, "targets")
        except Exception as error:  # noqa: BLE001
            raise self.misfit(batch, f"{type(error).__name__}: {error}") from None
        tokens = (inputs, targets)
        if any(
            not isinstance(t, torch.Tensor) or t.is_floating_point() or t.dim() != 2 for t in tokens
        ):
            raise self.misfit(batch, "inputs and targets must be integer token ids [batch, time]")
        try:
            outputs = model(inputs)
        except Exception as error:  # noqa: BLE001 (any failure on a real batch is a misfit)
            raise self.failed_on(batch, error, model) from None
        logits = self.one_tensor(outputs, "logits [batch, time, vocabulary]")
        if logits.dim() != 3 or logits.shape[:2] != targets.shape:
            raise ConfigError(
                f"task=language_model: the model returns {list(logits.shape)} for tokens "
                f"{list(inputs.shape)}; it must return logits [batch, time, vocabulary]"
            )
        super().check(model, batch)

    @torch.no_grad()
    def artifacts(
        self, model: nn.Module, val_batch: Any, decode: Callable | None = None
    ) -> dict[str, torch.Tensor | str]:
        """samples.txt: what the model writes after the start of a validation sequence."""
        if decode is None or self.sample_tokens <= 0:
            return {}
        prompt = pick(val_batch, 0, "inputs")[:1]
        generator = torch.Generator(device=prompt.device).manual_seed(0)
        tokens = prompt
        context = getattr(model, "block_size", prompt.shape[1])
        for _ in range(self.sample_tokens):
            logits = model(tokens[:, -context:])[:, -1].float()
            next_token = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, next_token], dim=1)
        text = (
            f"--- prompt (the start of a validation sequence)\n{decode(prompt[0].tolist())}\n"
            f"--- the model's continuation ({self.sample_tokens} tokens, sampled)\n"
            f"{decode(tokens[0, prompt.shape[1] :].tolist())}\n"
        )
        return {"samples.txt": text}
