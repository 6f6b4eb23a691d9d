"""The attention-betas lab's measurement: one adaptive step with telemetry, ``scaler.product_betas`` off or
on, and the summary of one setting (regime, gradient format, rule) with its per-layer CSV."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.nn.functional as F

from adaloss.lab.attention_betas.model import OUTPUT_LAYER, SIZES, TinyGPT


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


def _mean(rates: dict, keep: Callable[[str], bool], layers: list[str]) -> float:
    values = [rates[k] for k in layers if keep(k)]
    return sum(values) / len(values)


def summarize(regime: str, precision_name: str, rule: str, off: dict, on: dict) -> dict[str, Any]:
    """One setting's row: mean underflow off and on over all layers but the output, over attention's
    products and over the QKV projections; how many layers the product betas made better or worse."""
    layers = [k for k in off if k != OUTPUT_LAYER]
    return {
        "regime": regime,
        "gradients": precision_name,
        "rule": rule,
        "mean": (_mean(off, bool, layers), _mean(on, bool, layers)),
        "products": tuple(_mean(r, lambda k: k.endswith((".scores", ".values")), layers) for r in (off, on)),
        "c_attn": tuple(_mean(r, lambda k: k.endswith("c_attn"), layers) for r in (off, on)),
        "better": sum(on[k] < off[k] for k in layers),
        "worse": sum(on[k] > off[k] for k in layers),
    }


def table_row(summary: dict[str, Any], layers: int) -> str:
    """The printed Markdown row of one setting."""
    cells = [f"{a:.2%} -> {b:.2%}" for a, b in (summary["mean"], summary["products"], summary["c_attn"])]
    return (
        f"| {summary['regime']} | {summary['gradients']} | {summary['rule']} | {' | '.join(cells)} | "
        f"{summary['better']} / {summary['worse']} of {layers} |"
    )


def write_csv(path: Path, off: dict, on: dict) -> None:
    """Every layer's underflow rate with the product betas off and on."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["layer", "underflow_product_betas_off", "underflow_product_betas_on"])
        for k in off:
            writer.writerow([k, f"{off[k]:.6g}", f"{on[k]:.6g}"])
