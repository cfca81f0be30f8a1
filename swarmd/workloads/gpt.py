"""The built-in model: a small decoder-only transformer (GPT-2 layout, pre-norm, no biases).

It is built as a flat list of layers (embedding, blocks, head), each taking and returning one
tensor, so a pipeline can cut it into contiguous stages without knowing anything about
transformers: `model.stages(n)` returns `n` modules whose composition is the full model.

The default size (about 2.3M parameters; a forward+backward of 8 x 128 tokens takes about
0.25 s on one CPU core) trains in minutes yet is large enough that loss curves separate real
optimisers from broken ones; byte-level tokens (vocabulary 256) mean no tokenizer has to be
downloaded or agreed on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BYTE_VOCAB = 256


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. `vocab_size` 256 means byte tokens; nanoGPT `.bin` data needs 50257 or so.

    `tie_weights` shares the token embedding with the output projection (fewer parameters,
    better small-model loss). Inside one process the stages keep sharing it; a pipeline that
    puts the first and last stage on different machines holds two copies that drift apart
    unless they are averaged, so such pipelines may prefer `tie_weights=False`.
    """

    vocab_size: int = BYTE_VOCAB
    n_layer: int = 5
    n_head: int = 6
    n_embd: int = 192
    block_size: int = 128
    dropout: float = 0.0
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "block_size"):
            _positive_int(name, getattr(self, name))
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, int | float) or not 0.0 <= d < 1.0:
            raise ValueError(f"GPTConfig.dropout must be a float in [0, 1), got {d!r}")
        if not isinstance(self.tie_weights, bool):
            raise ValueError(f"GPTConfig.tie_weights must be a bool, got {self.tie_weights!r}")


class Embedding(nn.Module):
    """Token + learned position embeddings: (B, T) int64 token ids -> (B, T, C) hidden."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.block_size = config.block_size
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2:
            raise ValueError(f"expected token ids of shape (batch, time), got {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        out: torch.Tensor = self.drop(self.wte(idx) + self.wpe(pos))
        return out


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        out: torch.Tensor = self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return out


class Block(nn.Module):
    """Pre-norm transformer block: (B, T, C) -> (B, T, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd, bias=False)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd, bias=False)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.fc_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.drop(self.fc_proj(F.gelu(self.fc(self.ln2(x)))))
        return out


class Head(nn.Module):
    """Final norm and projection to vocabulary logits: (B, T, C) -> (B, T, vocab)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, bias=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.ln_f(x))
        return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; a stage pipeline computes the loss with this after its
    last stage, exactly as `GPT.forward` does."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class GPT(nn.Module):
    """`forward(idx, targets=None) -> (logits, loss)`; loss is None without targets.

    Initialisation follows GPT-2 (normal 0.02, residual projections scaled by
    1/sqrt(2 * n_layer)) and draws from torch's global generator, or from a private one seeded
    with `seed`, so peers that agree on a seed start from the same weights without
    downloading them.
    """

    def __init__(self, config: GPTConfig | None = None, *, seed: int | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        # Layer constructors draw from the generator too, so a private seed covers them all.
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            self.embed = Embedding(config)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.head = Head(config)
            if config.tie_weights:
                self.head.lm_head.weight = self.embed.wte.weight
            self._init_weights()

    def _init_weights(self) -> None:
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # LayerNorm weights keep their ones
            std = resid_std if name.endswith("proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def layers(self) -> list[nn.Module]:
        """Embedding, each block, head: the units a pipeline may cut between."""
        return [self.embed, *self.blocks, self.head]

    def stages(self, n: int) -> list[nn.Sequential]:
        """Cut the layers into `n` contiguous stages of near-equal block counts.

        Stage 0 maps token ids to hidden states, the last stage maps hidden states to logits;
        `lm_loss` turns those into the loss. The stages share parameters with this model (no
        copies), so composing them reproduces `forward` exactly.
        """
        layers = self.layers()
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(layers) - 2:
            raise ValueError(
                f"number of stages must be an int in [1, n_layer={len(layers) - 2}], got {n!r}"
            )
        nblocks = len(layers) - 2
        bounds = [1 + (i * nblocks) // n for i in range(n + 1)]
        bounds[0], bounds[-1] = 0, len(layers)
        return [nn.Sequential(*layers[bounds[i] : bounds[i + 1]]) for i in range(n)]

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(x)
        loss = None if targets is None else lm_loss(logits, targets)
        return logits, loss

    def num_params(self) -> int:
        """Distinct parameters (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())
