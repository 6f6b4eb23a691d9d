"""The lab's statistics: each cell's gap to FP32 paired by seed with its 95% t-interval, the per-layer
underflow and saturation rates, and the loss scalers' contrasts under each quantizer."""

from __future__ import annotations

import math
import statistics
from typing import Any

from adaloss.lab.fp8.cells import FORMATS, QUANTIZERS, Cell


def t_interval(values: list[float]) -> tuple[float, float, int]:
    """``(mean, half-width of the two-sided 95% t-interval, n)``: ``t(0.975, n-1) * s / sqrt(n)`` with ``s``
    the sample standard deviation; the half-width is NaN below two values, everything NaN for none."""
    from scipy.stats import t

    n = len(values)
    if n == 0:
        return math.nan, math.nan, 0
    mean = statistics.fmean(values)
    if n < 2:
        return mean, math.nan, 1
    return mean, float(t.ppf(0.975, n - 1)) * statistics.stdev(values) / math.sqrt(n), n


def paired_differences(rows: list[dict], cell: str, baseline: str) -> list[float]:
    """``value(cell) - value(baseline)`` for each seed where both runs finished with a finite value."""
    base = {r["seed"]: r["value"] for r in rows if r["cell"] == baseline and r["value"] is not None}
    return [
        r["value"] - base[r["seed"]]
        for r in sorted(rows, key=lambda r: r["seed"])
        if r["cell"] == cell and r["value"] is not None and r["seed"] in base
    ]


def per_layer(rows: list[dict], key: str) -> dict[str, float]:
    """Each layer's ``key`` rate (last training step) averaged over the runs that report it."""
    sums: dict[str, list[float]] = {}
    for row in rows:
        for layer, rate in (row.get(key) or {}).items():
            if rate is not None and math.isfinite(rate):
                sums.setdefault(layer, []).append(rate)
    return {layer: statistics.fmean(v) for layer, v in sums.items()}


def common_layers(rows: list[dict], model: str) -> set[str]:
    """The layers every FP8 run of ``model`` reports. The adaptive scaler's runs also measure the attention
    products it scales (``attn.scores``, ``attn.values``: ``scaler.product_betas``), which the other
    scalers' runs do not, so only the common layers make the cells' mean and worst layer comparable."""
    sets = [set(r["underflow_rate"]) for r in rows if r["model"] == model and "/" in r["cell"]]
    return set.intersection(*sets) if sets else set()


def summarize(rows: list[dict], model: str, cell: Cell, layers: set[str] | None = None) -> dict[str, Any]:
    """One row of the main table: the metric over seeds, its gap to FP32 with the CI, the per-layer rates
    (the table's mean and worst layer over ``layers``, default all; every layer in the ``*_by_layer``)."""
    mine = [r for r in rows if r["model"] == model and r["cell"] == cell.name]
    values = [r["value"] for r in mine if r["value"] is not None]
    gap, half, n = t_interval(paired_differences([r for r in rows if r["model"] == model], cell.name, "fp32"))
    fp8 = bool(cell.fmt)  # FP32's and BF16's underflow is of another format: not shown beside FP8's
    by_layer = {k: per_layer(mine, k) if fp8 else {} for k in ("underflow_rate", "saturation_rate")}
    underflow, saturation = (
        {n: v for n, v in by_layer[k].items() if layers is None or n in layers}
        for k in ("underflow_rate", "saturation_rate")
    )
    return {
        "model": model,
        "cell": cell.name,
        "format": cell.fmt or cell.name,
        "scaler": cell.scaler,
        "quantizer": cell.quantizer,
        "seeds": len(mine),
        "diverged": sum(r["diverged"] for r in mine),
        "mean": statistics.fmean(values) if values else math.nan,
        "sd": statistics.stdev(values) if len(values) > 1 else math.nan,
        "gap": gap if cell.name != "fp32" else 0.0,
        "gap_ci": half if cell.name != "fp32" else 0.0,
        "pairs": n,
        "separated": cell.name != "fp32" and math.isfinite(half) and abs(gap) > half,
        "skipped_steps": statistics.fmean(r["skipped_steps"] for r in mine) if mine else math.nan,
        "underflow_mean": statistics.fmean(underflow.values()) if underflow else math.nan,
        "underflow_max": max(underflow.values(), default=math.nan),
        "underflow_max_layer": max(underflow, key=underflow.get, default=""),
        "saturation_mean": statistics.fmean(saturation.values()) if saturation else math.nan,
        "saturation_max": max(saturation.values(), default=math.nan),
        "saturation_max_layer": max(saturation, key=saturation.get, default=""),
        "underflow_by_layer": by_layer["underflow_rate"],
        "saturation_by_layer": by_layer["saturation_rate"],
    }


def scaler_effects(rows: list[dict], model: str) -> list[dict[str, Any]]:
    """Per format and quantizer: dynamic - none, adaptive - none, adaptive - dynamic, paired by seed."""
    mine = [r for r in rows if r["model"] == model]
    out = []
    for fmt in FORMATS.values():
        for quantizer in QUANTIZERS:
            for a, b in (("dynamic", "none"), ("adaptive", "none"), ("adaptive", "dynamic")):
                cell_a, cell_b = f"{fmt}/{a}/{quantizer}", f"{fmt}/{b}/{quantizer}"
                diff, half, n = t_interval(paired_differences(mine, cell_a, cell_b))
                if n == 0:
                    continue
                separated = math.isfinite(half) and abs(diff) > half
                out.append(
                    {"model": model, "format": fmt, "quantizer": quantizer, "contrast": f"{a} - {b}"}
                    | {"diff": diff, "ci": half, "pairs": n, "separated": separated}
                )
    return out
