"""The lab's figures: ``fp8_gap.png`` (each cell's gap to FP32 with its CI) and ``fp8_layers.png``
(per-layer underflow and saturation of every FP8 cell)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from adaloss.lab.fp8.cells import MODELS, QUANTIZERS


def plot(summary: list[dict[str, Any]], models: list[str], out: Path) -> list[Path]:
    """``fp8_gap.png`` (each cell's gap to FP32 with its CI) and ``fp8_layers.png`` (per-layer underflow
    and saturation of every FP8 cell)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(
        zip(["", *QUANTIZERS], ["black", "tab:gray", "tab:blue", "tab:green", "tab:red"], strict=True)
    )
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 9), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = [r for r in summary if r["model"] == model and r["cell"] != "fp32"]
        for y, row in enumerate(rows):
            ci = row["gap_ci"] if math.isfinite(row["gap_ci"]) else 0.0
            ax.errorbar(row["gap"], y, xerr=ci, fmt="o", color=colors[row["quantizer"]], capsize=3)
        ax.axvline(0.0, color="black", lw=0.8)
        for label, color in colors.items():
            ax.plot([], [], "o", color=color, label=label or "BF16")
        ax.legend(fontsize=8, loc="best")
        ax.set_yticks(range(len(rows)), [r["cell"] for r in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"{MODELS[model].unit} minus FP32's (same seed), 95% CI")
        ax.set_title(MODELS[model].label)
    fig.tight_layout()
    paths = [out / "fp8_gap.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(2, len(models), figsize=(7 * len(models), 12), squeeze=False)
    for col, model in enumerate(models):
        rows = [r for r in summary if r["model"] == model and r["underflow_by_layer"]]
        layers = list(rows[0]["underflow_by_layer"]) if rows else []
        for ax, key, name in zip(
            axes[:, col], ("underflow", "saturation"), ("underflow", "saturation"), strict=True
        ):
            grid = [[100 * r[f"{key}_by_layer"].get(layer, math.nan) for layer in layers] for r in rows]
            image = ax.imshow(grid or [[math.nan]], aspect="auto", cmap="viridis")
            ax.set_yticks(range(len(rows)), [r["cell"] for r in rows], fontsize=7)
            ax.set_xticks(range(len(layers)), layers, rotation=90, fontsize=6)
            ax.set_title(f"{MODELS[model].label}: {name} rate per layer (%), last step")
            fig.colorbar(image, ax=ax)
    fig.tight_layout()
    paths.append(out / "fp8_layers.png")
    fig.savefig(paths[1], dpi=90)
    plt.close(fig)
    return paths
