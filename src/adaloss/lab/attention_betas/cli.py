"""The attention-betas lab's command line (``scripts/attention_betas.py``): FP32 training, then every
setting measured with the product betas off and on, printed as a table and written as per-layer CSVs."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
import torch.nn.functional as F

from adaloss.lab.attention_betas.measure import summarize, table_row, underflow, write_csv
from adaloss.lab.attention_betas.model import OUTPUT_LAYER, SIZES, TinyGPT, corpus, sample_batch
from adaloss.lab.reports.measurement import ROOT

#: ``--help``'s first line.
DESCRIPTION = "Do attention's products deserve a beta of their own? Per-layer underflow with and without."


def train(steps: int) -> tuple[dict[str, dict], torch.Tensor, torch.Tensor]:
    """The model's weights at initialization and after ``steps`` FP32 AdamW steps, the corpus, the loss."""
    torch.manual_seed(0)
    data = corpus()
    model = TinyGPT(**SIZES)
    regimes = {"init": copy.deepcopy(model.state_dict())}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        x, y = sample_batch(data, g)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    regimes["trained"] = copy.deepcopy(model.state_dict())
    return regimes, data, loss


def main(argv: list[str] | None = None, root: Path = ROOT) -> list[dict]:
    """Parse ``argv``, train, measure every setting; print the table, write the CSVs; returns the rows.
    ``root``: the checkout whose ``results/`` the default ``--out`` is in (the script's own)."""
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--steps", type=int, default=300, help="FP32 training steps for the trained regime")
    parser.add_argument("--out", default=str(root / "results" / "attention_betas"), help="CSV directory")
    args = parser.parse_args(argv)
    regimes, data, loss = train(args.steps)
    batch = sample_batch(data, torch.Generator().manual_seed(7))
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
                rows.append(summarize(regime, precision_name, rule, off, on))
                print(table_row(rows[-1], len([k for k in off if k != OUTPUT_LAYER])))
                write_csv(out / f"{regime}_{precision_name}_{rule}.csv", off, on)
    return rows
