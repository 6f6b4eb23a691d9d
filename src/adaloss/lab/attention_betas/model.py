"""The tiny GPT-style decoder the attention-betas lab measures (:class:`TinyGPT`), its sizes, and its data:
the bytes of a standard-library source file, sampled in batches of windows."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one fused QKV projection, causal scaled dot-product attention, a projection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = (
            nn.LayerNorm(dim),
            CausalSelfAttention(dim, heads),
            nn.LayerNorm(dim),
        )
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A GPT-style decoder small enough for CPU tests: token and position embeddings, pre-norm blocks, the
    output projection ``F.linear(h, wte.weight)`` tied to the token embedding (one parameter, an embedding
    lookup and a GEMM)."""

    def __init__(
        self, vocab: int = 32, block: int = 8, dim: int = 16, heads: int = 2, layers: int = 2
    ) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


SIZES = {"vocab": 256, "block": 32, "dim": 64, "heads": 4, "layers": 2}
BATCH = 16
OUTPUT_LAYER = "wte"  # the tied output projection: its gradient is the loss's, at alpha_{N+1} = 1


def corpus() -> torch.Tensor:
    """The bytes of the standard library's ``inspect.py``, as token ids 0-255."""
    text = (Path(os.__file__).parent / "inspect.py").read_bytes()
    return torch.tensor(list(text), dtype=torch.long)


def sample_batch(data: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``BATCH`` random windows of ``data`` (inputs, and targets one token on), drawn with ``g``."""
    starts = torch.randint(0, len(data) - SIZES["block"] - 1, (BATCH,), generator=g).tolist()
    x = torch.stack([data[i : i + SIZES["block"]] for i in starts])
    y = torch.stack([data[i + 1 : i + SIZES["block"] + 1] for i in starts])
    return x, y
