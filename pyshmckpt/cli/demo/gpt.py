"""A small GPT-style language model built in code, and deterministic synthetic batches.

Used by ``pyshmckpt demo``: token and position embeddings, pre-norm transformer blocks (causal
self-attention written out with matmuls, so every kernel is deterministic, and a GELU MLP), a
final LayerNorm and an LM head tied to the token embedding. No dropout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError

ACTIVE_TOKENS = 256  # token ids the synthetic batches use (see batch())


@dataclass(frozen=True)
class GPTConfig:
    """Size of a GPT: vocabulary, context length, width, depth and attention heads."""

    vocab: int
    seq_len: int
    width: int
    layers: int
    heads: int

    def __post_init__(self) -> None:
        for name in ("vocab", "seq_len", "width", "layers", "heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, not {value!r}")
        if self.width % self.heads:
            raise ConfigError(f"width {self.width} is not divisible by heads {self.heads}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees itself and earlier positions only."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        head_dim = width // self.heads
        q, k, v = (
            t.view(batch, time, self.heads, head_dim).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        future = torch.ones(time, time, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        y = (weights @ v).transpose(1, 2).reshape(batch, time, width)
        return self.proj(y)


class MLP(nn.Module):
    """The position-wise feed-forward layer: width -> 4 * width -> width with GELU."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """A pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer: ``forward(tokens)`` gives logits (batch, time, vocab)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.width)
        self.pos = nn.Embedding(config.seq_len, config.width)
        self.blocks = nn.ModuleList(Block(config.width, config.heads) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one tensor under two names
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        time = tokens.shape[1]
        if time > self.config.seq_len:
            raise ConfigError(f"{time} tokens exceed the context length {self.config.seq_len}")
        positions = torch.arange(time, device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of predicting `targets` (the next token at each position)."""
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def parameter_count(model: nn.Module) -> int:
    """Number of distinct parameter elements (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


def batch(
    step: int,
    batch_size: int,
    seq_len: int,
    vocab: int,
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) token batch of training step `step`, the same in every run.

    Tokens come from a CPU ``torch.Generator`` seeded by (`seed`, `step`), so they do not depend
    on the device or on anything drawn before. Each sequence counts up from a random start with a
    random stride, modulo the first ACTIVE_TOKENS ids (or the whole vocabulary, if smaller): a
    pattern a model learns quickly, so the loss goes down within a few steps, while the rest of a
    large vocabulary still makes the model's (and the optimizer's) state large. Targets are the
    inputs shifted by one position. Both have shape (batch_size, seq_len) and dtype int64.
    """
    active = min(vocab, ACTIVE_TOKENS)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, active, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 8, (batch_size, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq_len + 1)) % active
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


__all__ = ["GPT", "GPTConfig", "batch", "parameter_count"]
