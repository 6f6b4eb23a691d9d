"""Loss scalers: ``none``, ``fixed``, ``dynamic`` and the paper's layer-wise ``adaptive``.

All share ``LossScaler``'s interface (``torch.amp.GradScaler``'s method names); ``build_scaler`` makes one
from the ``scaler`` config group. ``AdaptiveLossScaler`` is exported here too, imported on first use: its
module pulls in the torch.fx rewrite, which the other scalers do not need.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from adaloss.errors import ConfigError
from adaloss.scalers.base import (
    LossScaler,
    OptState,
    ScaleNotCalledError,
    number_in_range,
    positive_int,
    positive_number,
)
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


#: The values ``scaler.name`` accepts, in the order of the paper's tables.
SCALER_NAMES = ("none", "fixed", "dynamic", "adaptive")

# The config fields each scaler reads; anything else is a typo and is refused rather than ignored.
# ``rule`` and ``consecutive_hysteresis`` are optional (the YAML need not carry them); a null ``init_scale``
# is the rule's start.
_FIELDS: dict[str, tuple[str, ...]] = {
    "none": ("name",),
    "fixed": ("name", "scale"),
    "dynamic": (
        "name",
        "rule",
        "init_scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "min_scale",
        "max_scale",
        "hysteresis",
        "consecutive_hysteresis",
    ),
}


def build_scaler(cfg: Mapping[str, Any], fmt: FloatFormat | None = None) -> LossScaler:
    """Build the loss scaler named by ``cfg["name"]`` from the ``scaler`` config group.

    Missing fields take the class defaults (``fixed``: scale 128; ``dynamic``: ``rule`` torch, GradScaler's
    2**16, x2, x0.5, every 2000 steps, plus ``min_scale`` 1, no ``max_scale``, ``hysteresis`` 1). Numbers may
    be strings, as they arrive from the command line. ``fmt`` is the training format (``None`` for FP32);
    only ``adaptive`` uses it, to know the underflow threshold ``u_min`` it scales against.

    Raises:
        ConfigError: for an unknown name, an unknown field, or a value out of range.
    """
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"scaler must be a config group with a name, got {cfg!r}; e.g. scaler=dynamic")
    raw_name = cfg.get("name")
    name = str(raw_name).strip().lower() if raw_name is not None else ""
    if name not in SCALER_NAMES:
        raise ConfigError(f"unknown scaler {raw_name!r}; choose scaler= one of {', '.join(SCALER_NAMES)}")
    if name == "adaptive":
        return _build_adaptive(cfg, fmt)

    unknown = sorted(str(key) for key in cfg if key not in _FIELDS[name])
    if unknown:
        known = ", ".join(_FIELDS[name][1:]) or "none"
        raise ConfigError(f"scaler={name} has no field(s) {', '.join(unknown)}; its fields are: {known}")
    options = {key: cfg[key] for key in _FIELDS[name][1:] if key in cfg}
    if name == "none":
        return NoLossScaler()
    if name == "fixed":
        return FixedLossScaler(**options)
    return DynamicLossScaler(**options)


def _build_adaptive(cfg: Mapping[str, Any], fmt: FloatFormat | None) -> LossScaler:
    # The command-line fields first, with messages that give an example value (the class checks them too).
    if cfg.get("t_uf") is not None:
        number_in_range(cfg["t_uf"], "scaler.t_uf", 0.0, 1.0, "between 0 and 1 (exclusive)", "1e-3")
    if cfg.get("update_every") is not None:
        positive_int(cfg["update_every"], "scaler.update_every", "100")
    if cfg.get("growth_interval") is not None:
        positive_int(cfg["growth_interval"], "scaler.growth_interval", "2000")
    if cfg.get("init_scale") is not None:
        positive_number(cfg["init_scale"], "scaler.init_scale", "1")
    # Imported lazily: the adaptive scaler pulls in torch.fx machinery the other scalers do not need.
    from adaloss.scalers.adaptive import AdaptiveLossScaler

    return AdaptiveLossScaler.from_config(cfg, fmt)
