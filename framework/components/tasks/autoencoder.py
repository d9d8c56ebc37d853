"""task=autoencoder: reconstruct the inputs; with `vae`, a variational autoencoder (ELBO)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from annotated_types import Ge
from torch import nn

from framework.components.tasks.base import (
    Count,
    Task,
    TaskLoss,
    batch_shapes,
    mean,
    pick,
    state_sum,
)
from framework.core.exits import ConfigError


class Autoencoder(Task):
    """`model(inputs)` returns the reconstruction, or with vae=true (reconstruction, mu, logvar)
    (a tuple, or a mapping with those keys). Batches are inputs, (inputs, ...) or
    {"inputs", ...}. Per sample: reconstruction = summed squared error (`mse`) or Bernoulli
    negative log-likelihood of logits against inputs in [0, 1] (`bce`); kl = KL(q(z|x) || N(0, I));
    elbo = -(reconstruction + kl), in nats per sample with `bce`."""

    name = "autoencoder"
    reads = "inputs to reconstruct (a tensor, or the first element / 'inputs' of a batch)"
    fix = "pick a data option with inputs to reconstruct"
    model_methods = ("decode",)  # samples.png: draws from the prior, decoded
    # Its metrics follow task.vae: written here, the command checks an objective before torch.
    metrics_by_setting = {
        "vae": {
            True: {"elbo": "max", "reconstruction": "min", "kl": "min"},
            False: {"reconstruction": "min"},
        }
    }

    def __init__(
        self,
        vae: bool,
        reconstruction: Literal["mse", "bce"],
        kl_weight: Annotated[float, Ge(0)],
    ) -> None:
        self.vae, self.reconstruction, self.kl_weight = vae, reconstruction, kl_weight
        self.logits_loss = "task.reconstruction=bce" if reconstruction == "bce" else None
        self.metrics = dict(self.metrics_by_setting["vae"][vae])
        if vae:
            self.states = ("reconstruction", "kl", "count")
            self.train_sums = ("reconstruction", "kl")
        else:
            self.states = ("reconstruction", "count")

    def _outputs(self, model: nn.Module, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = model(inputs)
        if not self.vae:
            return (out,)
        if isinstance(out, Mapping):
            return out["reconstruction"], out["mu"], out["logvar"]
        return tuple(out)

    def _terms(
        self, model: nn.Module, batch: Any, add: Callable[[torch.Tensor], torch.Tensor] = torch.sum
    ) -> dict[str, torch.Tensor]:
        """Each term added up over the batch by `add` (evaluation's: in float64)."""
        inputs = pick(batch, 0, "inputs")
        outputs = self._outputs(model, inputs)
        reconstructed = outputs[0].float()
        if self.reconstruction == "bce":
            error = F.binary_cross_entropy_with_logits(
                reconstructed, inputs.float(), reduction="none"
            )
        else:
            error = F.mse_loss(reconstructed, inputs.float(), reduction="none")
        terms = {"reconstruction": add(error)}
        if self.vae:
            mu, logvar = outputs[1].float(), outputs[2].float()
            terms["kl"] = add(-0.5 * (1 + logvar - mu.square() - logvar.exp()))
        return terms

    def count(self, batch: Any) -> Count:
        return pick(batch, 0, "inputs").shape[0]

    def loss(self, model: nn.Module, batch: Any) -> TaskLoss:
        terms = self._terms(model, batch)
        total = (
            terms["reconstruction"] + self.kl_weight * terms["kl"]
            if self.vae
            else terms["reconstruction"]
        )
        return TaskLoss.sum(total, sums={key: value.detach() for key, value in terms.items()})

    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        inputs = pick(batch, 0, "inputs")
        count = torch.tensor(inputs.shape[0], device=inputs.device)
        return {**self._terms(model, batch, add=state_sum), "count": count}

    def compute(self, totals: dict[str, float]) -> dict[str, float]:
        metrics = {"reconstruction": mean(totals["reconstruction"], totals["count"])}
        if self.vae:
            metrics["kl"] = mean(totals["kl"], totals["count"])
            metrics["elbo"] = -(metrics["reconstruction"] + metrics["kl"])
        return metrics

    def check(self, model: nn.Module, batch: Any) -> None:
        try:
            inputs = pick(batch, 0, "inputs")
            outputs = self._outputs(model, inputs)
        except Exception as error:  # noqa: BLE001
            raise self.failed_on(batch, error, model) from None
        if self.vae and len(outputs) != 3:
            raise ConfigError(
                f"task=autoencoder with task.vae=true needs the model to return "
                f"(reconstruction, mu, logvar), it returns {len(outputs)} value(s): use a VAE "
                "model (model=vae) or task.vae=false"
            )
        if not isinstance(outputs[0], torch.Tensor) or outputs[0].shape != inputs.shape:
            raise ConfigError(
                f"task=autoencoder: the model returns {batch_shapes(outputs[0])} for inputs "
                f"{batch_shapes(inputs)}: the reconstruction must have its inputs' shape"
                + (
                    ""
                    if self.vae
                    else " (a VAE's (reconstruction, mu, logvar) needs task.vae=true)"
                )
            )
        if self.reconstruction == "bce" and (inputs.min() < 0 or inputs.max() > 1):
            raise ConfigError(
                "task.reconstruction=bce needs inputs in [0, 1] (pixel intensities): scale the "
                "data to [0, 1] (data.normalize=false for digits) or use task.reconstruction=mse"
            )
        super().check(model, batch)

    @torch.no_grad()
    def artifacts(
        self, model: nn.Module, val_batch: Any, decode: Callable | None = None
    ) -> dict[str, torch.Tensor | str]:
        """reconstructions.png (inputs above, reconstructions below) and, for a model with
        decode() and latent_dim, samples.png (decoded draws from the prior)."""
        inputs = pick(val_batch, 0, "inputs")[:16]
        if inputs.dim() != 4:
            return {}
        shown = self._as_image(self._outputs(model, inputs)[0])
        images = {"reconstructions.png": torch.cat([self._as_image(inputs, raw=True), shown])}
        if hasattr(model, "decode") and hasattr(model, "latent_dim"):
            generator = torch.Generator(device=inputs.device).manual_seed(0)
            z = torch.randn(32, model.latent_dim, generator=generator, device=inputs.device)
            images["samples.png"] = self._as_image(model.decode(z))
        return images

    def _as_image(self, images: torch.Tensor, raw: bool = False) -> torch.Tensor:
        images = images.float()
        if self.reconstruction == "bce":
            return images if raw else images.sigmoid()
        low, high = images.amin(), images.amax()
        return (images - low) / (high - low).clamp_min(1e-8)
