"""Do attention's products deserve a beta of their own? Per-layer underflow with and without.

Usage: ``.venv/bin/python scripts/attention_betas.py [--steps 300] [--out results/attention_betas]``

A tiny GPT-style decoder (:class:`TinyGPT`: causal ``F.scaled_dot_product_attention``, one fused QKV
``nn.Linear``, the token embedding tied to the output projection) is trained in FP32 on the bytes of a
standard-library source file (read at run time, nothing downloaded). At initialization and after that
training, one step of the adaptive scaler (``update_every=1``) in emulated FP16 and in FP8 e5m2
gradients, under both rules, measures every GEMM's and every attention product's activation-gradient
underflow (telemetry) with ``scaler.product_betas`` off (alpha passes through attention) and on (attention
gets a beta of its own: Algorithm 4 with the other operand in the weight's place). Prints one row per
setting; writes the per-layer rates as CSV under ``--out``. About a minute on one CPU core.
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


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


def _corpus() -> torch.Tensor:
    text = (Path(os.__file__).parent / "inspect.py").read_bytes()
    return torch.tensor(list(text), dtype=torch.long)


def _batch(data: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - SIZES["block"] - 1, (BATCH,), generator=g).tolist()
    x = torch.stack([data[i : i + SIZES["block"]] for i in starts])
    y = torch.stack([data[i + 1 : i + SIZES["block"] + 1] for i in starts])
    return x, y


def underflow(weights: dict, precision_name: str, rule: str, product_betas: bool, batch: tuple) -> dict:
    """One adaptive step with telemetry: ``{layer: activation-gradient underflow rate}``."""
    from adaloss.precision import Precision
    from adaloss.scalers.adaptive import AdaptiveLossScaler
    from adaloss.telemetry import UnderflowMonitor

    model = TinyGPT(**SIZES)
    model.load_state_dict(weights)
    precision = Precision(precision_name, "cpu")
    scaler = AdaptiveLossScaler(
        update_every=1, rule=rule, fmt=precision.grad_format, product_betas=product_betas
    )
    attached = precision.prepare(scaler.attach(model))
    monitor = UnderflowMonitor(every=1, fmt=precision.telemetry_format)
    x, y = batch
    with precision.autocast(monitor=monitor):
        loss = F.cross_entropy(attached(x).flatten(0, 1), y.flatten())
    scaler.scale(loss).backward()
    return monitor.underflow_rates()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="FP32 training steps for the trained regime")
    parser.add_argument("--out", default=str(ROOT / "results" / "attention_betas"), help="CSV directory")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    data = _corpus()
    model = TinyGPT(**SIZES)
    regimes = {"init": copy.deepcopy(model.state_dict())}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    loss = torch.tensor(float("nan"))
    for _ in range(args.steps):
        x, y = _batch(data, g)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    regimes["trained"] = copy.deepcopy(model.state_dict())
    batch = _batch(data, torch.Generator().manual_seed(7))
    print(f"FP32 training: {args.steps} steps, final loss {loss.item():.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    print(
        "| regime | gradients | rule | mean UF (all but output), off -> on | attention products | c_attn "
        "(qkv output) | layers better / worse |"
    )
    print("|:--|:--|:--|--:|--:|--:|--:|")
    for regime, weights in regimes.items():
        for precision_name in ("fp16", "fp8_e5m2"):
            for rule in ("reference", "paper"):
                off, on = (underflow(weights, precision_name, rule, b, batch) for b in (False, True))
                layers = [k for k in off if k != OUTPUT_LAYER]

                def mean(rates: dict, keep, layers=layers) -> float:
                    values = [rates[k] for k in layers if keep(k)]
                    return sum(values) / len(values)

                summary = {
                    "regime": regime,
                    "gradients": precision_name,
                    "rule": rule,
                    "mean": (mean(off, bool), mean(on, bool)),
                    "products": tuple(
                        mean(r, lambda k: k.endswith((".scores", ".values"))) for r in (off, on)
                    ),
                    "c_attn": tuple(mean(r, lambda k: k.endswith("c_attn")) for r in (off, on)),
                    "better": sum(on[k] < off[k] for k in layers),
                    "worse": sum(on[k] > off[k] for k in layers),
                }
                rows.append(summary)
                cells = [
                    f"{a:.2%} -> {b:.2%}"
                    for a, b in (summary["mean"], summary["products"], summary["c_attn"])
                ]
                print(
                    f"| {regime} | {precision_name} | {rule} | {' | '.join(cells)} | "
                    f"{summary['better']} / {summary['worse']} of {len(layers)} |"
                )
                with open(out / f"{regime}_{precision_name}_{rule}.csv", "w", newline="") as f:
                    writer = csv.writer(f)
                    writer.writerow(["layer", "underflow_product_betas_off", "underflow_product_betas_on"])
                    for k in off:
                        writer.writerow([k, f"{off[k]:.6g}", f"{on[k]:.6g}"])
    return rows


if __name__ == "__main__":
    main()
