"""The lab's tables: the Markdown of ``fp8_lab.md`` (per model, the main table and the scaler contrasts)
and the CSVs (``fp8_lab.csv``, ``fp8_lab_layers.csv``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from adaloss.lab.fp8.cells import MODELS
from adaloss.lab.reports.measurement import header_line


def _num(x: float, digits: int) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _pct(x: float) -> str:
    return "—" if not math.isfinite(x) else f"{100 * x:.2f}"


def _gap(row: dict[str, Any], digits: int) -> str:
    if row["cell"] == "fp32":
        return "(baseline)"
    if not math.isfinite(row["gap"]):
        return "—"
    mark = "" if row["separated"] else " ~"
    return f"{row['gap']:+.{digits}f} ± {_num(row['gap_ci'], digits)}{mark}"


def main_table(summary: list[dict[str, Any]], model: str) -> str:
    """The Markdown table of one model: metric, gap to FP32 (95% CI), divergences, per-layer rates."""
    spec, digits = MODELS[model], 3 if model == "gpt" else 2
    lines = [
        f"| cell | seeds | {spec.unit} | gap to FP32, 95% CI | diverged | skipped steps "
        "| underflow: mean / worst layer (%) | saturation: mean / worst layer (%) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in (r for r in summary if r["model"] == model):
        worst_uf = f" ({row['underflow_max_layer']})" if row["underflow_max_layer"] else ""
        worst_sat = f" ({row['saturation_max_layer']})" if row["saturation_max"] > 0 else ""
        lines.append(
            f"| {row['cell']} | {row['seeds']} | {_num(row['mean'], digits)} ± {_num(row['sd'], digits)} "
            f"| {_gap(row, digits)} | {row['diverged']} | {_num(row['skipped_steps'], 1)} "
            f"| {_pct(row['underflow_mean'])} / {_pct(row['underflow_max'])}{worst_uf} "
            f"| {_pct(row['saturation_mean'])} / {_pct(row['saturation_max'])}{worst_sat} |"
        )
    return "\n".join(lines)


def effects_table(effects: list[dict[str, Any]], model: str) -> str:
    """Scaler contrasts under each quantizer, one row per format and quantizer."""
    digits = 3 if model == "gpt" else 2
    contrasts = ("dynamic - none", "adaptive - none", "adaptive - dynamic")
    lines = [
        f"| format | quantizer | {' | '.join(contrasts)} |",
        "| --- | --- | --- | --- | --- |",
    ]
    keys = dict.fromkeys((e["format"], e["quantizer"]) for e in effects if e["model"] == model)
    for fmt, quantizer in keys:
        cells = []
        for contrast in contrasts:
            found = [
                e
                for e in effects
                if (e["model"], e["format"], e["quantizer"], e["contrast"])
                == (model, fmt, quantizer, contrast)
            ]
            e = found[0] if found else None
            text = "—" if e is None else f"{e['diff']:+.{digits}f} ± {_num(e['ci'], digits)}"
            cells.append(text + ("" if e is None or e["separated"] else " ~"))
        lines.append(f"| {fmt} | {quantizer} | {' | '.join(cells)} |")
    return "\n".join(lines)


def report_markdown(summary: list[dict], effects: list[dict], models: list[str], info: dict) -> str:
    """The whole ``fp8_lab.md``: settings, then per model the main table and the scaler contrasts."""
    parts = [
        f"{header_line(info['machine'])}",
        "",
        "Gap to FP32: the cell's final metric minus FP32's with the same seed, mean over the seeds and the "
        "half-width of the two-sided 95% t-interval (t(0.975, n-1) s / sqrt(n)); `~` marks an interval that "
        "contains 0 (the table cannot tell the cell from FP32). Underflow and saturation: the share of each "
        "layer's activation-gradient elements flushed to zero / clamped at the format's largest value on the "
        "last training step, averaged over the seeds; mean over the layers and the worst layer, over the "
        "layers every FP8 cell measures (adaptive runs also measure the attention products they scale: those "
        "are in fp8_lab_layers.csv).",
    ]
    for model in models:
        spec = MODELS[model]
        better = "higher" if spec.higher_is_better else "lower"
        parts += [
            "",
            f"### {spec.label}: {spec.unit}, {better} is better",
            "",
            f"Run settings: `{' '.join(info['settings'][model])}`.",
            "",
            main_table(summary, model),
            "",
            f"Loss scalers under each quantizer ({spec.unit}, paired by seed, 95% CI; `~`: contains 0):",
            "",
            effects_table(effects, model),
        ]
    return "\n".join(parts) + "\n"


def write_csv(path: Path, summary: list[dict[str, Any]]) -> None:
    """One line per (model, cell): the table's numbers (per-layer rates in ``fp8_lab_layers.csv``)."""
    import csv

    keys = [k for k in summary[0] if not k.endswith("_by_layer")] if summary else []
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(summary)
    with open(path.with_name(path.stem + "_layers.csv"), "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "cell", "layer", "underflow_rate", "saturation_rate"])
        for row in summary:
            for layer, rate in row["underflow_by_layer"].items():
                writer.writerow(
                    [row["model"], row["cell"], layer, rate, row["saturation_by_layer"].get(layer)]
                )
