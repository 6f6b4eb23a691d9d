"""The lab's FP4 cells (issue 37): BF16, FP8 E4M3 ``tensor_current``, MXFP8 (E4M3 ``mx_block``), NVFP4 and
MXFP4, crossed with rounding (nearest, stochastic), the Hadamard transform (on, off) and the loss scalers
(none, dynamic, adaptive), on the tiny GPT and ResNet-20; gaps to BF16 paired by seed with 95% t-intervals.

The FP8 cells store gradients only in FP8 (FP16 weights and activations, the FP8 lab's view); the FP4 cells
run every FP4 layer's three GEMMs with FP4 operands (:mod:`adaloss.numerics.fp4_gemm`): the GPT's linear
layers, ResNet-20's convolutions (as GEMMs over their im2col columns). Every block is FP4 (``keep_first=0``,
``keep_last=0``): on a 4-block GPT, keeping an edge block would keep half of it. The default ``keep``
patterns keep the GPT's head and embeddings and ResNet-20's ``fc`` head in BF16; ResNet-20's stem conv
(``conv1``, outside every block and matching no pattern) is FP4, so all 19 of its convolutions are.

The runs reuse the FP8 lab's machinery (:func:`adaloss.lab.fp8.runs.run_all`: resumable runs files, one
line per finished run); :func:`fp4_table` is a model's table, each cell's gap to BF16 with its interval, and
:func:`fp4_report` the tables of every model with runs.
"""

from __future__ import annotations

import math
import statistics

from adaloss.lab.fp8.cells import MODELS, Cell
from adaloss.lab.fp8.stats import paired_differences, t_interval

__all__ = ["FP4_MODELS", "FP4_SMOKE_CELLS", "fp4_cells", "fp4_report", "fp4_table"]

FP4_MODELS = ("gpt", "resnet20")
SCALERS = ("none", "dynamic", "adaptive")
#: Every transformer block in FP4 (module docstring).
_FP4_LAYERS = ("precision.keep_first=0", "precision.keep_last=0")
#: The cells ``--smoke`` runs: the baseline, an FP8 cell, each FP4 format with and without SR and Hadamard.
FP4_SMOKE_CELLS = ("bf16", "FP8/adaptive", "NVFP4/adaptive/nearest/plain", "MXFP4/dynamic/sr/rht")


def fp4_cells() -> list[Cell]:
    """BF16, then FP8 and MXFP8 per scaler, then NVFP4 and MXFP4 per scaler x rounding x Hadamard."""
    cells = [Cell("bf16", ("precision=bf16", "scaler=none"))]
    for scaler in SCALERS:
        for label, recipe in (("FP8", "tensor_current"), ("MXFP8", "{name:mx_block,rounding:ceil}")):
            overrides = ("precision=fp8_e4m3", f"scaler={scaler}", f"precision.grad_scaling={recipe}")
            cells.append(Cell(f"{label}/{scaler}", overrides, label, scaler))
    for fmt in ("NVFP4", "MXFP4"):
        for scaler in SCALERS:
            for rounding, sr in (("nearest", "false"), ("sr", "true")):
                for transform, rht in (("plain", "false"), ("rht", "true")):
                    overrides = (f"precision={fmt.lower()}", f"scaler={scaler}", *_FP4_LAYERS)
                    overrides += (f"precision.stochastic_rounding={sr}", f"precision.hadamard={rht}")
                    name = f"{fmt}/{scaler}/{rounding}/{transform}"
                    cells.append(Cell(name, overrides, fmt, scaler, f"{rounding}/{transform}"))
    return cells


def fp4_table(rows: list[dict], model: str, cells: list[Cell]) -> str:
    """The markdown table: each cell's metric over seeds and its gap to BF16 paired by seed with the 95%
    t-interval (``separated``: the interval excludes 0), the FP4 layers' mean ``fp4_grad_to_noise``."""
    mine = [r for r in rows if r["model"] == model]
    lines = [
        "| Cell | Runs | Mean | Gap to BF16 | 95% CI | Separated | Grad-to-noise (FP4 layers) |",
        "|:-----|-----:|-----:|------------:|-------:|:---------:|---------------------------:|",
    ]
    for cell in cells:
        values = [r["value"] for r in mine if r["cell"] == cell.name and r["value"] is not None]
        if not values:
            continue
        gap, half, _ = t_interval(paired_differences(mine, cell.name, "bf16"))
        ratios = [
            v for r in mine if r["cell"] == cell.name for v in (r.get("fp4_grad_to_noise") or {}).values()
        ]
        ratio = statistics.fmean(ratios) if ratios else math.nan
        baseline = cell.name == "bf16"
        separated = "yes" if not baseline and math.isfinite(half) and abs(gap) > half else "no"
        interval = "n/a" if not math.isfinite(half) else f"±{half:.4f}"
        lines.append(
            f"| {cell.name} | {len(values)} | {statistics.fmean(values):.4f} | "
            f"{'(baseline)' if baseline else f'{gap:+.4f}'} | {'' if baseline else interval} | "
            f"{'' if baseline else separated} | {'' if math.isnan(ratio) else f'{ratio:.1f}'} |"
        )
    return "\n".join(lines)


def fp4_report(rows: dict[str, list[dict]], cells: list[Cell]) -> str:
    """One section per model with runs (``rows``: each model's runs), its heading naming the task and the
    metric, then :func:`fp4_table`."""
    sections = []
    for model, mine in rows.items():
        if mine:
            spec = MODELS[model]
            better = "higher" if spec.higher_is_better else "lower"
            heading = f"## {spec.label}: {spec.unit}, {better} is better"
            sections.append(f"{heading}\n\n{fp4_table(mine, model, cells)}")
    return "\n\n".join(sections)
