"""Loss scalers: ``none``, ``fixed``, ``dynamic`` and the paper's layer-wise ``adaptive``.

All share ``LossScaler``'s interface (``torch.amp.GradScaler``'s method names). ``AdaptiveLossScaler`` is
exported here too, imported on first use: its module pulls in the torch.fx rewrite, which the other scalers
do not need. The runner makes one from the ``scaler`` config group with
:func:`adaloss.runner.utils.targets.build_scaler`.
"""

from __future__ import annotations

from typing import Any

from adaloss.scalers.base import LossScaler, OptState, ScaleNotCalledError
from adaloss.scalers.dynamic import DynamicLossScaler
from adaloss.scalers.static import FixedLossScaler, NoLossScaler

__all__ = [
    "SCALER_NAMES",
    "AdaptiveLossScaler",
    "DynamicLossScaler",
    "FixedLossScaler",
    "LossScaler",
    "NoLossScaler",
    "OptState",
    "ScaleNotCalledError",
]


def __getattr__(name: str) -> Any:
    """``AdaptiveLossScaler``, imported from its module on first access (PEP 562)."""
    if name == "AdaptiveLossScaler":
        from adaloss.scalers.adaptive import AdaptiveLossScaler

        return AdaptiveLossScaler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


#: The bundled scalers' names, in the order of the paper's tables.
SCALER_NAMES = ("none", "fixed", "dynamic", "adaptive")
