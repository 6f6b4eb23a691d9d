"""Loss scalers: ``none``, ``fixed``, ``dynamic`` and the paper's layer-wise ``adaptive``.

All share ``LossScaler``'s interface (``torch.amp.GradScaler``'s method names); ``build_scaler`` makes one
from the ``scaler`` config group. ``AdaptiveLossScaler`` is exported here too, imported on first use: its
module pulls in the torch.fx rewrite, which the other scalers do not need.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from adaloss.errors import ConfigError
from adaloss.scalers.base import LossScaler, OptState, ScaleNotCalledError
from adaloss.scalers.dynamic import DynamicLossScaler
from adaloss.scalers.static import FixedLossScaler, NoLossScaler

if TYPE_CHECKING:
    from adaloss.numerics import FloatFormat

__all__ = [
    "SCALER_NAMES",
    "AdaptiveLossScaler",
    "DynamicLossScaler",
    "FixedLossScaler",
    "LossScaler",
    "NoLossScaler",
    "OptState",
    "ScaleNotCalledError",
    "build_scaler",
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


def build_scaler(cfg: Mapping[str, Any], fmt: FloatFormat | None = None) -> LossScaler:
    """The loss scaler of a ``scaler`` config: ``hydra.utils.instantiate`` on its ``_target_``, with ``fmt``
    (the training gradient format; ``None`` for FP32) if the class takes it (the adaptive scaler scales
    against its smallest subnormal).

    ``cfg``: the composed ``scaler`` node (typed by its schema, :mod:`adaloss.schemas`), or a plain
    mapping: ``{"name": "fixed", "scale": 8}`` takes the schema of that name, ``{"_target_": ...}`` is the
    class's own. Raises ``ConfigError`` for an unknown name or key, a wrong type or a value out of range.
    """
    from adaloss.schemas import typed
    from adaloss.utils.targets import build_target

    node = typed("scaler", cfg)
    scaler = build_target(
        "scaler", node, example="scaler=custom scaler._target_=my_pkg.MyScaler", fill={"fmt": fmt}
    )
    if not isinstance(scaler, LossScaler):
        raise ConfigError(
            f"scaler._target_={node.get('_target_')} made a {type(scaler).__name__}, not a LossScaler: "
            "subclass adaloss.scalers.LossScaler (torch.amp.GradScaler's interface)"
        )
    return scaler
