"""A decoder-only transformer in the shape of nanoGPT's ``model.py``: the language model of ``model=gpt``.

``wte`` (token embedding) + ``wpe`` (position embedding) -> ``h.<i>`` blocks -> ``ln_f`` -> ``lm_head``, where
each :class:`Block` is pre-norm: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``. The output head shares its
weight with the token embedding (``lm_head.weight is wte.weight``), so one parameter feeds two GEMMs: the
embedding lookup at the input and the logits at the output. The model returns logits ``[B, T, vocab]``; the
loss is the task's (:class:`adaloss.runner.engine.tasks.LanguageModelTask`).

Written for the adaptive scaler's torch.fx rewrite, which sees only modules and traceable ops:

* attention is one fused ``c_attn`` ``nn.Linear`` (Q, K and V in one GEMM), ``split`` and
  ``F.scaled_dot_product_attention(is_causal=True)``, then the ``c_proj`` ``nn.Linear``; every weight GEMM
  is an ``nn.Linear`` module (no ``nn.MultiheadAttention``, whose packed projections are not modules);
* no ``assert`` or ``if`` on tensor sizes in ``forward`` (fx traces sizes as proxies); a sequence longer than
  ``block_size`` fails inside the position-embedding lookup instead;
* dropout only as ``nn.Dropout`` modules, which follow ``train()``/``eval()`` after tracing (a
  ``dropout_p`` argument to the attention call would be frozen at trace time).

Weight init as GPT-2: normal(0, 0.02) for linear and embedding weights, zero biases, and the residual
projections (``attn.c_proj``, ``mlp.c_proj``) at 0.02 / sqrt(2 * n_layer). Cost of a forward pass: about
``2 * n_params * tokens`` multiply-adds for the GEMMs plus ``2 * n_layer * T^2 * n_embd`` for attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from adaloss.errors import ConfigError

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP"]


@dataclass(frozen=True)
class GPTConfig:
    """The sizes of a :class:`GPT`. Defaults: GPT-2 small (124M parameters at vocab 50304)."""

    vocab_size: int = 50304  # tokens in the vocabulary (GPT-2's 50257 padded to a multiple of 64)
    block_size: int = 1024  # the longest sequence: rows of the position embedding
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block; n_embd must be a multiple of it
    n_embd: int = 768  # width of the residual stream
    dropout: float = 0.0  # on the embeddings, after attention and after the MLP (0: none, as for pretraining)
    bias: bool = True  # biases in the linear layers and layer norms (GPT-2 has them)
    tie_weights: bool = True  # the output head reuses the token embedding's weight (GPT-2, nanoGPT)

    def __post_init__(self) -> None:
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{key} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"model.n_embd={self.n_embd} must be a multiple of model.n_head={self.n_head} (each head "
                "gets n_embd / n_head channels); e.g. "
                f"model.n_embd={self.n_head * max(1, self.n_embd // self.n_head)}"
            )
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, int | float)
            or not 0 <= self.dropout < 1
        ):
            raise ConfigError(f"model.dropout must be a number in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention: one fused QKV projection, PyTorch's fused attention, an output projection.

    ``causal=False`` lets every token attend to every other (the encoder blocks of
    :mod:`adaloss.runner.models.vit`). Shapes: ``[B, T, C] -> [B, T, C]``; inside, ``q, k, v`` are ``[B,
    n_head, T, C / n_head]``.
    """

    def __init__(
        self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True, causal: bool = True
    ):
        super().__init__()
        self.n_head = n_head
        self.causal = causal
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # Q, K and V in one GEMM
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # softmax(q k^T / sqrt(d)) v
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """``c_fc`` (width x4) -> GELU -> ``c_proj``: the position-wise feed-forward layer."""

    def __init__(self, n_embd: int, dropout: float = 0.0, bias: bool = True, hidden: int | None = None):
        super().__init__()
        hidden = hidden or 4 * n_embd
        self.c_fc = nn.Linear(n_embd, hidden, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(hidden, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        dropout: float = 0.0,
        bias: bool = True,
        causal: bool = True,
        mlp_hidden: int | None = None,
    ):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias, causal)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias, mlp_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The language model: token ids ``[B, T]`` (``T <= block_size``) -> next-token logits ``[B, T, vocab]``.

    Arguments are the fields of :class:`GPTConfig` (``self.config`` keeps them). ``vocab_size`` and
    ``block_size`` come from the dataset when the config does not set them (see
    :func:`adaloss.runner.models.build_model`). Parameter count (tied weights counted once):
    ``vocab * C + block_size * C + n_layer * (12 C^2 + 13 C) + 2 C`` with biases, ``C = n_embd``.
    """

    def __init__(
        self,
        vocab_size: int = GPTConfig.vocab_size,
        block_size: int = GPTConfig.block_size,
        n_layer: int = GPTConfig.n_layer,
        n_head: int = GPTConfig.n_head,
        n_embd: int = GPTConfig.n_embd,
        dropout: float = GPTConfig.dropout,
        bias: bool = GPTConfig.bias,
        tie_weights: bool = GPTConfig.tie_weights,
    ) -> None:
        super().__init__()
        self.config = c = GPTConfig(
            vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias, tie_weights
        )
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.h = nn.ModuleList(Block(c.n_embd, c.n_head, c.dropout, c.bias) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.apply(_gpt2_init)
        if c.tie_weights:
            self.lm_head.weight = self.wte.weight  # one parameter, two GEMMs (the lookup is one-hot x W)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # residual projections: keep the stream's variance in check
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(t, dtype=torch.long, device=idx.device)  # [T]
        x = self.drop(self.wte(idx) + self.wpe(pos))  # [B, T, C] + [T, C]
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # [B, T, vocab]

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters, the tied head counted once; ``non_embedding`` leaves out the position embedding (as
        nanoGPT reports it: the token embedding is the head too, so it stays)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n


def _gpt2_init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
