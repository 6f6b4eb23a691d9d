"""Underflow per expert of a tiny mixture-of-experts LM in emulated FP16, with and without adaptive scaling.

Usage: ``.venv/bin/python scripts/moe_underflow.py [--steps 200] [--batches 4]``

The LM: byte tokens of the standard library's ``inspect.py``, 2 pre-norm blocks of width 64 with causal
attention (4 heads) and a mixture-of-experts feed-forward (top-2 of 4 experts, each 64 -> 128 -> 64, plus
a shared expert), the experts' weights two ``(4, in, out)`` parameters multiplied by ``torch._grouped_mm``
over the tokens sorted by expert: each a scaling point with one beta for its 4 experts. Measured at
initialization and after ``--steps`` FP32 AdamW steps: the gradient arriving at each grouped GEMM's output
in emulated FP16, split by expert (its rows), share of its non-zero elements that FP16 flushes to zero:
plain FP16 (loss scale 1) against the adaptive scaler (paper rule, ``update_every=1``). Means over
``--batches`` batches, with the smallest and largest. About a minute on one CPU core.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from _env import require_project_python  # noqa: E402 - standard library only; scripts/ is on sys.path

require_project_python()  # a shell without .venv activated: one error: line naming the fix

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from adaloss.lab.attention_betas.model import CausalSelfAttention, corpus, sample_batch  # noqa: E402

DIM, HIDDEN, EXPERTS, TOP_K, LAYERS, VOCAB = 64, 128, 4, 2, 2, 256


class Experts(nn.Module):
    """Top-k routed experts through two grouped GEMMs and a shared expert (DeepSeek-V3's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.up = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) / DIM**0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / HIDDEN**0.5)
        self.shared = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        x = x.reshape(b * t, c)
        top, idx = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
        order = idx.reshape(-1).argsort(stable=True)
        offs = torch.cumsum(torch.bincount(idx.reshape(-1), minlength=EXPERTS), 0).to(torch.int32)
        h = F.gelu(torch._grouped_mm(x[order // TOP_K], self.up, offs=offs))
        y = torch._grouped_mm(h, self.down, offs=offs) * top.reshape(-1)[order].unsqueeze(-1)
        routed = torch.zeros_like(y).index_copy(0, order, y).reshape(b * t, TOP_K, c).sum(1)
        return (routed + self.shared(x)).reshape(b, t, c)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(DIM), CausalSelfAttention(DIM, 4)
        self.ln_2, self.moe = nn.LayerNorm(DIM), Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.moe(self.ln_2(x))


class MoELM(nn.Module):
    def __init__(self, block: int = 32) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(block, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _grouped_grads(model: nn.Module, batch: tuple, adaptive: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One emulated FP16 step: ``(gradient at the output, offs)`` of each grouped GEMM, in forward order."""
    from adaloss.adaptive.transform import FunctionalGEMM
    from adaloss.precision import Precision
    from adaloss.scalers.adaptive import AdaptiveLossScaler
    from adaloss.telemetry import UnderflowMonitor

    precision, seen = Precision("fp16", "cpu"), []
    grouped = torch._grouped_mm

    def keep(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        slot = len(seen)
        seen.append(None)
        out.register_hook(lambda g: seen.__setitem__(slot, (g.detach().clone(), offs)))
        return out

    if adaptive:
        scaler = AdaptiveLossScaler(update_every=1, rule="paper", fmt=precision.grad_format)
        model = scaler.attach(model)
        for module in model.modules():
            if isinstance(module, FunctionalGEMM) and module.spec["kind"] == "grouped":
                module.register_forward_hook(lambda m, args, out: keep(out, args[4]))
    else:
        torch._grouped_mm = lambda a, b, offs: keep(grouped(a, b, offs=offs), offs)
    try:
        with precision.autocast(monitor=UnderflowMonitor(every=1, fmt="fp16")):
            x, y = batch
            loss = F.cross_entropy(precision.prepare(model)(x).flatten(0, 1), y.flatten())
        (scaler.scale(loss) if adaptive else loss).backward()
    finally:
        torch._grouped_mm = grouped
    return seen


def per_expert(grad: torch.Tensor, offs: torch.Tensor) -> list[float]:
    """Per expert (row block): the share of non-zero elements FP16 flushes to zero."""
    from adaloss.numerics.formats import FORMATS, round_to_format

    lost = (grad != 0) & (round_to_format(grad, FORMATS["fp16"]) == 0)
    rates, start = [], 0
    for end in offs.tolist():
        nonzero = int((grad[start:end] != 0).sum())
        rates.append(float(lost[start:end].sum()) / nonzero if nonzero else float("nan"))
        start = end
    return rates


def train(model: nn.Module, data: torch.Tensor, steps: int) -> None:
    optimizer, g = torch.optim.AdamW(model.parameters(), lr=3e-3), torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = sample_batch(data, g)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"FP32 training: {steps} steps, final loss {loss.item():.3f}")


def measure(model: nn.Module, data: torch.Tensor, batches: int) -> dict[tuple, list[tuple[float, float]]]:
    """``{(grouped GEMM, expert): [(plain, adaptive) per batch]}``."""
    names = [f"blocks.{b}.moe.{p}" for b in range(LAYERS) for p in ("up", "down")]
    out: dict[tuple, list] = {}
    g = torch.Generator().manual_seed(7)
    for _ in range(batches):
        batch = sample_batch(data, g)
        runs = [_grouped_grads(copy.deepcopy(model), batch, adaptive) for adaptive in (False, True)]
        for name, plain, scaled in zip(names, *runs, strict=True):
            for e, pair in enumerate(zip(per_expert(*plain), per_expert(*scaled), strict=True)):
                out.setdefault((name, e), []).append(pair)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    data, model = corpus(), MoELM()
    print("| regime | grouped GEMM | expert | FP16 underflow, plain | adaptive |")
    print("|:--|:--|--:|--:|--:|")
    for regime in ("init", "trained"):
        if regime == "trained":
            train(model, data, args.steps)
        for (name, e), pairs in measure(model, data, args.batches).items():
            cells = []
            for values in zip(*pairs, strict=True):
                mean = sum(values) / len(values)
                cells.append(f"{mean:.2%} ({min(values):.2%}-{max(values):.2%})")
            print(f"| {regime} | {name} | {e} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
