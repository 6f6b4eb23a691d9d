"""The adaptive scaler's options, declared once: :class:`AdaptiveRecipe`.

Each option is a field of a frozen dataclass with its default and its check (one of the library's number
validators, :mod:`adaloss.scalers.base`). ``AdaptiveLossScaler`` builds one from its keyword arguments (or
takes one, ``AdaptiveLossScaler.from_recipe``), and the config schema (``adaloss.runner.schemas``) derives the
``scaler=adaptive`` node from these fields and checks each value with :meth:`AdaptiveRecipe.check`: the same
bounds and the same messages from the constructor and from the command line. Host-side only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from adaloss.adaptive.rules import REFERENCE_FP16_U_MIN, RULES, ScaleRule
from adaloss.errors import ConfigError
from adaloss.numerics.formats import FloatFormat, get_format
from adaloss.scalers.base import (
    OptionError,
    boolean,
    number_in_range,
    one_of,
    optional_bound,
    positive_int,
    positive_number,
)

__all__ = ["ROOTS", "AdaptiveRecipe"]

#: The values of ``root`` (``scaler.root``): how alpha_{N+1}, the scale of the loss gradient, is chosen.
ROOTS = ("fixed", "dynamic", "adaptive")
#: The per-layer bounds of the reference rule when ``"auto"`` (ada_loss/core.py:21-22).
_REFERENCE_BOUNDS = {"scale_upper_bound": 16.0, "accum_upper_bound": 1024.0}


def _option(default: Any, check: Callable[[Any, str], Any]) -> Any:
    """A recipe field: its default, and ``check(value, "scaler.<name>") -> parsed value`` (OptionError)."""
    return field(default=default, metadata={"check": check})


def _threshold(value: Any, where: str) -> float | None:
    """``u_min`` / ``u_max``: a finite number > 0, or None (the format's)."""
    if value is None:
        return None
    return number_in_range(
        value, where, 0.0, math.inf, "> 0 or null (the format's)", "6e-8", "a finite number"
    )


#: The order the options are checked in (the first bad one is reported).
_CHECK_ORDER = (
    "t_uf", "update_every", "growth_interval", "init_scale", "fmt", "rule", "allow_below_one", "u_min",
    "u_max", "product_betas", "root", "scale_upper_bound", "accum_upper_bound",
)  # fmt: skip


@dataclass(frozen=True)
class AdaptiveRecipe:
    """Every option of ``AdaptiveLossScaler`` but ``device`` and ``enabled``, with its default and bound
    (the scaler's docstring says what each does). Building one checks every value: a bad one is a
    ``ConfigError`` naming ``scaler.<option>``, what is wrong and an example (:class:`OptionError`); the
    fields then hold the parsed values (``rule`` and ``root`` lower-case, numbers as numbers)."""

    rule: str = _option("reference", lambda v, w: one_of(v, w, RULES))
    t_uf: float = _option(
        1e-3, lambda v, w: number_in_range(v, w, 0.0, 1.0, "between 0 and 1 (exclusive)", "1e-3")
    )
    update_every: int = _option(100, lambda v, w: positive_int(v, w, "100"))
    # a number, None (no bound) or "auto" (the rule's default: 16 and 1024 under reference, none under paper)
    scale_upper_bound: Any = _option(
        "auto", lambda v, w: optional_bound(v, w, "16", allow_zero=False, auto=True)
    )
    accum_upper_bound: Any = _option(
        "auto", lambda v, w: optional_bound(v, w, "1024", allow_zero=False, auto=True)
    )
    init_scale: float = _option(1.0, lambda v, w: positive_number(v, w, "1"))
    allow_below_one: bool = _option(False, lambda v, w: boolean(v, w))
    product_betas: bool = _option(True, lambda v, w: boolean(v, w))
    growth_interval: int = _option(2000, lambda v, w: positive_int(v, w, "2000"))
    u_min: float | None = _option(None, _threshold)
    u_max: float | None = _option(None, _threshold)
    root: str = _option("fixed", lambda v, w: one_of(v, w, ROOTS))
    fmt: Any = _option("fp16", lambda v, w: get_format(v if v is not None else "fp16"))

    def __post_init__(self) -> None:
        for name in _CHECK_ORDER:
            object.__setattr__(self, name, self.check(name, getattr(self, name)))
        self.check_together(self.rule, self.allow_below_one)
        u_min, u_max = self.thresholds()
        if not 0 < u_min < u_max:
            raise ConfigError(f"need 0 < scaler.u_min < scaler.u_max, got {u_min} and {u_max}")

    @classmethod
    def check(cls, name: str, value: Any) -> Any:
        """Option ``name``'s value parsed, or an :class:`OptionError` naming ``scaler.<name>``."""
        return cls.__dataclass_fields__[name].metadata["check"](value, f"scaler.{name}")

    @staticmethod
    def check_together(rule: str, allow_below_one: bool) -> None:
        """The options that bound each other (given parsed): ``allow_below_one`` only under ``paper``."""
        if allow_below_one and rule == "reference":
            raise OptionError(
                "scaler.allow_below_one",
                "=true applies to scaler.rule=paper only (under the reference rule beta falls below 1 "
                "through its overflow and accumulation bounds): add scaler.rule=paper, or set",
                "false",
            )

    def thresholds(self) -> tuple[float, float]:
        """``(u_min, u_max)``: as given, else the format's (under ``reference`` with FP16, the authors'
        6.0e-8 for ``u_min``)."""
        fmt: FloatFormat = self.fmt
        default_u_min = REFERENCE_FP16_U_MIN if self.rule == "reference" and fmt.name == "fp16" else fmt.u_min
        u_min = self.u_min if self.u_min is not None else default_u_min
        return u_min, self.u_max if self.u_max is not None else fmt.u_max

    def scale_rule(self) -> ScaleRule:
        """Algorithm 4's rule these options make (bounds ``"auto"`` resolved by ``rule``)."""

        def bound(name: str) -> float | None:
            value = getattr(self, name)
            if value == "auto":
                return _REFERENCE_BOUNDS[name] if self.rule == "reference" else None
            return value

        u_min, u_max = self.thresholds()
        return ScaleRule(
            self.rule,
            u_min,
            u_max,
            self.t_uf,
            self.allow_below_one,
            bound("scale_upper_bound"),
            bound("accum_upper_bound"),
        )
