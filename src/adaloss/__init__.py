"""adaloss: loss scaling for FP16 training, measured side by side.

The package reproduces "Adaptive Loss Scaling for Mixed Precision Training" (Zhao et al.) and compares its
layer-wise scaler with no scaling, a fixed scale and dynamic backoff. See ``docs/architecture.md``.

The four scalers are importable from here (``from adaloss import AdaptiveLossScaler``), as from
``adaloss.scalers``. They are looked up on first access, so ``import adaloss`` alone does not import torch.

This package is the library layer's face (``docs/architecture.md``, "Layers"): importing it, the scalers, the
adaptive core, numerics, precision or telemetry needs torch and the standard library only. The runner (the
engine, configs and their schemas, logging) needs the ``runner`` extra; it stores the config schemas in
Hydra's ConfigStore itself (``adaloss.runner.schemas.register``, called by ``train.py`` and
``compose_train``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: Names re-exported from ``adaloss.scalers`` on first access (PEP 562).
_SCALER_EXPORTS = (
    "AdaptiveLossScaler",
    "DynamicLossScaler",
    "FixedLossScaler",
    "LossScaler",
    "NoLossScaler",
)

__all__ = ["__version__", *_SCALER_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _SCALER_EXPORTS:
        return getattr(importlib.import_module("adaloss.scalers"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
