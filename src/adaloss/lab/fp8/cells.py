"""The lab's cells and tasks: the overrides every run gets, the two tasks (:data:`MODELS`), the formats,
scalers and quantizers crossed, and the settings digest that makes two runs comparable."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

#: Overrides every run gets: the CPU, no logger or bar, no checkpoints, a diverged run recorded (not raised),
#: telemetry on the first and the last step only.
COMMON = [
    "device=cpu",
    "logger=none",
    "trainer.progress_bar=false",
    "trainer.checkpoint_every=null",
    "trainer.on_divergence=record",
    "telemetry.every=100000",
]


@dataclass(frozen=True)
class Model:
    """One task of the lab: its overrides (full and ``--smoke``), its metric and that metric's direction."""

    label: str
    metric: str
    unit: str
    higher_is_better: bool
    overrides: tuple[str, ...]
    smoke: tuple[str, ...]


MODELS = {
    "gpt": Model(
        "tiny GPT, pystdlib",
        "val_loss",
        "validation loss",
        False,
        # 40 of the 400-step recipe (the cosine schedule squeezed to fit), batch 16, 128 validation windows;
        # adaptive betas every 10 steps
        ("model=gpt", "dataset=pystdlib", "trainer.max_steps=40", "trainer.eval_every=40")
        + ("trainer.batch_size=16", "dataset.val_windows=128", "adaptive_recipe.update_every=10"),
        ("model=gpt", "dataset=pystdlib", "trainer.max_steps=2", "trainer.eval_every=2", "model.n_layer=1")
        + ("trainer.batch_size=4", "dataset.val_windows=8", "adaptive_recipe.update_every=1"),
    ),
    "resnet20": Model(
        "ResNet-20, digits",
        "test_accuracy",
        "test accuracy (%)",
        True,
        # 16x16 images, batch 32, 60 of the 200-step recipe (lr steps squeezed); adaptive every 3 (digits')
        ("model=resnet20", "dataset=digits", "dataset.image_size=16", "trainer.batch_size=32")
        + ("trainer.max_steps=60", "trainer.eval_every=60"),
        ("model=resnet20", "dataset=digits", "dataset.image_size=8", "trainer.batch_size=4")
        + ("trainer.max_steps=2", "trainer.eval_every=2", "adaptive_recipe.update_every=1"),
    ),
}
FORMATS = {"fp8_e5m2": "E5M2", "fp8_e4m3": "E4M3"}
SCALERS = ("none", "dynamic", "adaptive")
#: Quantizer label -> ``precision.grad_scaling``.
QUANTIZERS = {
    "global": "none",
    "tensor_current": "tensor_current",
    "tensor_delayed": "tensor_delayed",
    "mx_block_ceil": "{name:mx_block,rounding:ceil}",
}
#: The cells ``--smoke`` runs (every code path: both baselines, a quantizer with state, MX, every scaler).
SMOKE_CELLS = (
    "fp32",
    "bf16",
    "E4M3/none/global",
    "E4M3/adaptive/mx_block_ceil",
    "E5M2/dynamic/tensor_delayed",
)


@dataclass(frozen=True)
class Cell:
    """One column of the lab: ``name`` (``fp32``, ``bf16`` or ``<format>/<scaler>/<quantizer>``)."""

    name: str
    overrides: tuple[str, ...]
    fmt: str = ""
    scaler: str = ""
    quantizer: str = ""


def all_cells() -> list[Cell]:
    """FP32, BF16, then format x scaler x quantizer."""
    cells = [Cell("fp32", ("precision=fp32", "scaler=none")), Cell("bf16", ("precision=bf16", "scaler=none"))]
    for precision, fmt in FORMATS.items():
        for scaler in SCALERS:
            for label, recipe in QUANTIZERS.items():
                overrides = (f"precision={precision}", f"scaler={scaler}", f"precision.grad_scaling={recipe}")
                cells.append(Cell(f"{fmt}/{scaler}/{label}", overrides, fmt, scaler, label))
    return cells


def settings_digest(model: str, smoke: bool) -> str:
    """What makes two runs of a cell comparable: the overrides every run of ``model`` gets."""
    spec = MODELS[model]
    text = json.dumps([*COMMON, *(spec.smoke if smoke else spec.overrides)])
    return hashlib.sha256(text.encode()).hexdigest()[:12]
