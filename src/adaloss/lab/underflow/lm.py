"""The tiny GPT's underflow table: its scalers (the dynamic one backed off until the step goes through),
both gradient formats, and the table's rows, one per kind of layer (mean over the blocks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from adaloss.lab.reports.measurement import markdown_table
from adaloss.lab.underflow.measure import measure
from adaloss.lab.underflow.table import pct

SCALERS = ("none", "fixed", "dynamic", "adaptive")
PRECISIONS = ("fp16", "fp8_e5m2")
#: The kinds of layer the table has a row for: (label, the end of the layer's telemetry name).
KINDS: tuple[tuple[str, str], ...] = (
    ("attention QKV (`attn.c_attn`)", "attn.c_attn"),
    ("attention scores (`attn.scores`, dS)", "attn.scores"),
    ("attention values (`attn.values`)", "attn.values"),
    ("attention out-projection (`attn.c_proj`)", "attn.c_proj"),
    ("MLP fc (`mlp.c_fc`)", "mlp.c_fc"),
    ("MLP projection (`mlp.c_proj`)", "mlp.c_proj"),
    ("output head (`lm_head`, tied to `wte`)", "lm_head"),
)
PRODUCTS = ("attn.scores", "attn.values")
#: Halvings of the dynamic scale tried before giving up (2**16 down to 2**-24).
MAX_BACKOFFS = 40


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The language-model task's loss: cross-entropy over every position (``LanguageModelTask.loss``)."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _kind(layer: str, suffix: str) -> bool:
    return layer == suffix or layer.endswith("." + suffix)


def dynamic_step(model: torch.nn.Module, precision: str, cfg: dict[str, Any], x, y) -> dict[str, Any]:  # noqa: ANN001
    """GradScaler's rule on these weights: from ``cfg``'s initial scale, multiplied by its backoff factor
    while the step's gradients are not finite; the first step that goes through, with its ``scale``."""
    scale = float(cfg.get("init_scale") or 2.0**16)  # null in the config: GradScaler's start
    for _ in range(MAX_BACKOFFS):
        result = measure(model, precision, {**cfg, "init_scale": scale}, x, y, lm_loss)
        if result["grads_finite"]:
            return {**result, "scale": scale}
        scale *= float(cfg.get("backoff_factor", 0.5))
    raise RuntimeError(f"the dynamic scale overflows {precision} down to {scale:g}: the model diverged")


def measure_all(model: torch.nn.Module, configs: dict[str, dict[str, Any]], x, y) -> dict[str, Any]:  # noqa: ANN001
    """Every scaler in every precision on ``model``: ``{precision: {scaler: measure() + "scale"}}``."""
    out: dict[str, Any] = {}
    for precision in PRECISIONS:
        out[precision] = {}
        for name in SCALERS:
            if name == "dynamic":
                result = dynamic_step(model, precision, configs[name], x, y)
            else:
                result = measure(model, precision, configs[name], x, y, lm_loss)
                result["scale"] = float(configs[name].get("scale", 1.0))
            out[precision][name] = result
    return out


def _scale_cell(name: str, result: dict[str, Any]) -> str:
    if name == "adaptive":
        alphas = list(result["alphas"].values())
        return f"alpha {min(alphas):g}-{max(alphas):g}"
    return f"{result['scale']:g}"


def _rate_cell(result: dict[str, Any], suffix: str | None) -> str:
    rates = result["rates"]
    layers = [
        k for k in rates if (suffix is None and not _kind_of_product(k)) or (suffix and _kind(k, suffix))
    ]
    if not layers:
        return "—"
    cell = pct(sum(rates[k] for k in layers) / len(layers))
    return cell if result["grads_finite"] else f"{cell} (overflow)"


def _kind_of_product(layer: str) -> bool:
    return any(_kind(layer, p) for p in PRODUCTS)


def render(measured: dict[str, Any], fixed_scale: float) -> str:
    """The Markdown table: per regime and gradient format, one row per kind of layer (mean over the blocks),
    one for the mean over the GEMM layers, one for the loss scales."""
    headers = ["weights", "gradients", "layer", "none", f"fixed {fixed_scale:g}", "dynamic", "adaptive"]
    rows = []
    for regime, per_precision in measured.items():
        for precision, per_scaler in per_precision.items():
            for label, suffix in KINDS:
                rows.append([regime, precision, label, *(_rate_cell(per_scaler[s], suffix) for s in SCALERS)])
            rows.append(
                [
                    regime,
                    precision,
                    "mean over the GEMM layers",
                    *(_rate_cell(per_scaler[s], None) for s in SCALERS),
                ]
            )
            rows.append([regime, precision, "loss scale", *(_scale_cell(s, per_scaler[s]) for s in SCALERS)])
    return markdown_table(headers, rows, left=3)
