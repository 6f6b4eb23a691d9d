"""The CNN underflow table's outputs: the per-layer CSV of a model and regime, and the Markdown summary."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from adaloss.lab.reports.measurement import PRETTY, header_line, markdown_table
from adaloss.lab.underflow.settings import ADAPTIVE, MOMENTUM, SCALERS


def write_csv(path: Path, per_scaler: dict[str, dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(SCALERS)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["layer", *names, *(f"{a}_alpha" for a in ADAPTIVE)])
        for layer in per_scaler["none"]["rates"]:
            w.writerow(
                [layer]
                + [repr(per_scaler[s]["rates"][layer]) for s in names]
                + [repr(per_scaler[a]["alphas"].get(layer, float("nan"))) for a in ADAPTIVE]
            )


def pct(v: float) -> str:
    if not math.isfinite(v):
        return "n/a"
    if v == 0:
        return "0%"
    return f"{100 * v:.3g}%"


def render(info: dict[str, Any], settings: dict[str, Any], results: dict[str, Any]) -> str:
    lines = [
        f"### Per-layer activation-gradient underflow (one digits batch of {settings['batch']}, seed "
        f"{settings['seed']})",
        "",
        header_line(info),
        "",
        "Mean over layers of each layer's underflow rate (share of non-zero gradient elements flushed to "
        "zero when stored); the counts compare the scalers layer by layer. Adaptive: update_every=1, "
        "T_uf=1e-3, under the reference rule (the authors' code, their CIFAR bounds 128 / 4096) and the "
        "paper's (the text), each cell reference / paper. "
        "Train loss: FP32 loss of the measured weights on the measured batch. Alpha is the scale a layer's "
        "output gradient carries; it starts at alpha_{N+1} = 1 at the loss (the paper: 'normally we keep it "
        "as 1'), so a layer with alpha 1 is stored exactly as without scaling. A layer's rate counts only "
        "values non-zero before its own rounding: gradients already flushed upstream arrive as exact zeros "
        "and are not counted again.",
        "",
    ]
    rows = []
    for model, res in results.items():
        for regime, r in res["regimes"].items():
            c = r["compare"]
            n = c["layers"]
            both = list(ADAPTIVE)
            rows.append(
                [
                    PRETTY.get(model, model),
                    regime,
                    f"{r['fp32_loss']:.4f}",
                    n,
                    pct(c["mean"]["none"]),
                    pct(c["mean"]["fixed128"]),
                    " / ".join(pct(c["mean"][a]) for a in both),
                    " / ".join(f"{c[f'{a}_le_fixed']}" for a in both) + f" of {n}",
                    " / ".join(f"{c[f'{a}_lt_none']}" for a in both) + f" of {n}",
                    f"{c['none_positive']}/{n}",
                    " ; ".join(
                        " / ".join(f"{c[f'{a}_alpha_{k}']:g}" for k in ("min", "median", "max")) for a in both
                    ),
                ]
            )
    lines.append(
        markdown_table(
            [
                "Model",
                "Regime",
                "Train loss",
                "Layers",
                "Mean UF none",
                "Mean UF fixed 128",
                "Mean UF adaptive (ref / paper)",
                "Layers adaptive <= fixed",
                "Layers adaptive < none",
                "Layers none > 0",
                "Adaptive alpha min / median / max (ref ; paper)",
            ],
            rows,
            left=2,
        )
    )
    notes = []
    for model, res in results.items():
        tr = res.get("training")
        if tr:
            notes.append(
                f"{PRETTY.get(model, model)}: trained {tr['steps']} FP32 steps at lr {tr['lr']:g}, "
                f"momentum {MOMENTUM}, batch {settings['batch']} "
                f"(last-10 mean loss {tr['final_loss_mean10']:.4f}, "
                f"{tr['seconds']:.0f}s)"
            )
        for regime, r in res["regimes"].items():
            bad = [s for s, m in r["scalers"].items() if not m["grads_finite"]]
            if bad:
                notes.append(f"{model} {regime}: non-finite gradients (overflow) with {', '.join(bad)}")
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines)
