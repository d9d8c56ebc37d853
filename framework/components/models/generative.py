"""Models for the non-classification presets: a feed-forward net for tables, a VAE for small
images, and a nanoGPT-style character transformer."""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from annotated_types import Ge, Interval
from torch import nn

Size = Annotated[int, Ge(1)]  # a count of features, units, tokens, blocks or heads
Dropout = Annotated[float, Interval(ge=0, lt=1)]
# The MLP's GELU: exact (erf), or tanh-approximated as GPT-2 was trained with ("gelu_new").
Activation = Literal["gelu", "gelu_tanh"]


class FeedForward(nn.Module):
    """Linear-GELU blocks from `in_features` to `out_features` (tabular regression or
    classification). No dropout by default: exact DDP parity."""

    def __init__(
        self,
        in_features: Size,
        out_features: Size,
        hidden_sizes: list[Size],
        dropout: Dropout,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.GELU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = hidden
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class VAE(nn.Module):
    """A variational autoencoder for small images: MLP encoder to (mu, logvar) of a
    `latent_dim` Gaussian, MLP decoder to one logit per pixel. forward() returns
    (reconstruction logits shaped like the input, mu, logvar). With `sample=False` the latent is
    mu itself (no noise): deterministic, used by exact-parity tests."""

    def __init__(
        self,
        in_channels: Size,
        image_size: Size,
        latent_dim: Size,
        hidden_size: Size,
        sample: bool,
    ) -> None:
        super().__init__()
        self.shape = (in_channels, image_size, image_size)
        pixels = in_channels * image_size * image_size
        self.latent_dim, self.sample = latent_dim, sample
        self.encoder = nn.Sequential(
            nn.Flatten(),
            nn.Linear(pixels, hidden_size),
            nn.GELU(),
            nn.Linear(hidden_size, hidden_size),
            nn.GELU(),
        )
        self.to_mu = nn.Linear(hidden_size, latent_dim)
        self.to_logvar = nn.Linear(hidden_size, latent_dim)
        self.decoder = nn.Sequential(
            nn.Linear(latent_dim, hidden_size),
            nn.GELU(),
            nn.Linear(hidden_size, hidden_size),
            nn.GELU(),
            nn.Linear(hidden_size, pixels),
        )

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z).view(-1, *self.shape)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.encoder(x)
        mu, logvar = self.to_mu(hidden), self.to_logvar(hidden)
        z = mu
        if self.sample and self.training:  # the reparameterisation trick
            z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return self.decode(z), mu, logvar


class TransformerBlock(nn.Module):
    """Pre-norm causal self-attention, then an MLP, each on a residual path."""

    def __init__(
        self, width: int, heads: int, dropout: float, activation: Activation = "gelu"
    ) -> None:
        super().__init__()
        if width % heads:  # each head takes width / heads channels
            divisors = [n for n in range(1, min(width, 64) + 1) if width % n == 0]
            raise ValueError(
                f"heads={heads} does not divide width={width}: pick heads among "
                f"{', '.join(map(str, divisors))}, or change the width"
            )
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width),
            nn.GELU(approximate="tanh" if activation == "gelu_tanh" else "none"),
            nn.Linear(4 * width, width),
            nn.Dropout(dropout),
        )
        self.heads, self.dropout = heads, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, time, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A decoder-only transformer (nanoGPT's shape: pre-norm blocks, causal self-attention,
    learned positions, tied input/output embeddings). forward(tokens [B, T]) -> logits
    [B, T, vocab_size]."""

    def __init__(
        self,
        vocab_size: Size,
        block_size: Size,
        layers: Size,
        heads: Size,
        width: Size,
        dropout: Dropout,
        activation: Activation,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(block_size, width)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(width, heads, dropout, activation) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.tokens.weight
        self.apply(self._init)
        for name, parameter in self.named_parameters():  # GPT-2's scaled residual projections
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.tokens(tokens) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
