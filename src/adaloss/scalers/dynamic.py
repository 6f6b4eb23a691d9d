"""Dynamic loss scaling by backoff: the scale halves on overflow and doubles after a run of clean steps."""

from __future__ import annotations

import math
from typing import Any

import torch

from adaloss.errors import ConfigError
from adaloss.scalers.base import (
    LossScaler,
    number_in_range,
    optional_bound,
    positive_int,
    positive_number,
    to_float32,
)

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler(LossScaler):
    """Dynamic loss scaling (NVIDIA's backoff procedure; Kuchaiev et al., 2018): the paper's "Dynamic" column.

    * ``scaler.scale(loss)`` multiplies the loss by the current scale.
    * ``scaler.step(optimizer)`` unscales the gradients and skips ``optimizer.step()`` if any is Inf/NaN.
    * ``scaler.update()`` backs the scale off after an overflow and grows it after ``growth_interval`` clean
      iterations in a row.

    With the defaults it reproduces ``torch.amp.GradScaler`` step for step (same scales, same skipped steps)
    as long as the scale stays at or above ``min_scale``.

    Example::

        scaler = DynamicLossScaler("cuda", init_scale=2.0**16, growth_interval=2000)  # GradScaler's call
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            with precision.autocast():
                loss = criterion(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # skipped if a gradient overflowed
            scaler.update()  # back off or grow the scale

    The largest scale that does not overflow is the best one: it lifts the most small gradients out of FP16's
    underflow range. The scaler searches for it by trial:

    * An iteration with an Inf/NaN gradient skips its update and resets the clean-iteration count. With
      ``hysteresis`` h = 1 the scale is multiplied by ``backoff_factor`` (never below ``min_scale``).
      With h > 1 (DeepSpeed's ``hysteresis``, Megatron's ``hysteresis``) the first h - 1 overflows only use up
      tolerance and leave the scale alone; once the tolerance is spent, every overflow backs off. The
      tolerance is refilled to h - 1 when the scale grows, or, with ``consecutive_hysteresis=True``, after
      any clean iteration (so only h consecutive overflows back off).
    * After ``growth_interval`` clean iterations in a row the scale is multiplied by ``growth_factor``
      (never above ``max_scale``; a growth that would overflow float32 is dropped, as in GradScaler) and the
      count restarts.

    The update runs on the host from the Inf/NaN flag ``step()`` has already read, so it adds no sync.

    The first six parameters are ``torch.amp.GradScaler``'s, in its order (positional calls mean the same);
    the bounds and hysteresis are keyword-only. ``get_growth_factor``/``set_growth_factor``,
    ``get_backoff_factor``/``set_backoff_factor`` and ``get_growth_interval``/``set_growth_interval`` read
    and change the rule between iterations, as in GradScaler (host floats, no sync). One difference: a
    growth interval lowered below the current count of clean iterations grows the scale at the next clean
    iteration; GradScaler compares for equality and then never grows until the next overflow.

    Args:
        device (str or torch.device, optional, default=None): As GradScaler's first argument (see
            ``LossScaler``); GradScaler's default is ``"cuda"``.
        init_scale (float, optional, default=2.**16): Initial scale factor.
        growth_factor (float, optional, default=2.0): Factor (> 1) applied to the scale after
            ``growth_interval`` consecutive clean iterations.
        backoff_factor (float, optional, default=0.5): Factor (between 0 and 1) applied to the scale after an
            overflow that exhausts the hysteresis.
        growth_interval (int, optional, default=2000): Number of consecutive clean iterations before the scale
            grows.
        enabled (bool, optional, default=True): If ``False``, every method is a passthrough.
        min_scale (float or None, optional, default=1.0): Floor for backoff. Below 1 the scale no longer
            fights overflow of the scaled loss; it only answers NaNs the model makes on its own, and shrinking
            further adds underflow and, at 0, turns NaN steps into silent zero-gradient steps. ``None`` or
            ``0`` gives GradScaler's unbounded backoff.
        max_scale (float or None, optional, default=None): Cap for growth, e.g. ``2.**24``; ``None``: no cap.
        hysteresis (int, optional, default=1): Number of overflows that trigger a backoff; 1 backs off on
            every overflow, as GradScaler does.
        consecutive_hysteresis (bool, optional, default=False): Refill the hysteresis after every clean
            iteration rather than only when the scale grows (DeepSpeed's option of the same name).

    Raises:
        ConfigError: for an argument outside its range, naming it and an example value (the setters too).
        TypeError: if the first positional argument is a number rather than a device.
    """

    name = "dynamic"

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: Any = 2.0**16,
        growth_factor: Any = 2.0,
        backoff_factor: Any = 0.5,
        growth_interval: Any = 2000,
        enabled: bool = True,
        *,
        min_scale: Any = 1.0,
        max_scale: Any = None,
        hysteresis: Any = 1,
        consecutive_hysteresis: bool = False,
    ) -> None:
        init = positive_number(init_scale, "scaler.init_scale", "65536")
        self.set_growth_factor(growth_factor)
        self.set_backoff_factor(backoff_factor)
        self.set_growth_interval(growth_interval)
        self._min_scale = optional_bound(min_scale, "scaler.min_scale", "1", allow_zero=True) or 0.0
        self._max_scale = optional_bound(max_scale, "scaler.max_scale", "16777216", allow_zero=False)
        self._hysteresis = positive_int(hysteresis, "scaler.hysteresis", "2")
        self._consecutive_hysteresis = bool(consecutive_hysteresis)
        if self._max_scale is not None and self._max_scale < self._min_scale:
            raise ConfigError(
                f"scaler.max_scale ({self._max_scale:g}) is below scaler.min_scale ({self._min_scale:g}); "
                "raise max_scale or lower min_scale"
            )
        if not self._min_scale <= init <= (self._max_scale if self._max_scale is not None else math.inf):
            raise ConfigError(
                f"scaler.init_scale ({init:g}) lies outside [min_scale, max_scale] = "
                f"[{self._min_scale:g}, {self._max_scale if self._max_scale is not None else math.inf:g}]; "
                "choose an init_scale inside it"
            )
        super().__init__(device, init_scale=init, enabled=enabled)
        self._growth_tracker = 0  # clean iterations in a row since the last overflow or growth
        self._hysteresis_tracker = self._hysteresis  # overflows left before the next one backs off (1: now)

    def get_growth_factor(self) -> float:
        """The factor the scale grows by after ``growth_interval`` clean iterations. No sync."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (a number > 1), effective at the next growth. No sync."""
        self._growth_factor = number_in_range(new_factor, "scaler.growth_factor", 1.0, math.inf, "> 1", "2")

    def get_backoff_factor(self) -> float:
        """The factor the scale backs off by after an overflow. No sync."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (strictly between 0 and 1), effective at the next backoff. No sync."""
        self._backoff_factor = number_in_range(
            new_factor, "scaler.backoff_factor", 0.0, 1.0, "between 0 and 1 (exclusive)", "0.5"
        )

    def get_growth_interval(self) -> int:
        """How many consecutive clean iterations grow the scale. No sync."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (a positive integer). The clean iterations already counted still count:
        if they reach the new interval, the next clean iteration grows the scale. No sync."""
        self._growth_interval = positive_int(new_interval, "scaler.growth_interval", "2000")

    @property
    def growth_tracker(self) -> int:
        """Consecutive clean iterations counted towards the next growth."""
        return self._growth_tracker

    @property
    def hysteresis_tracker(self) -> int:
        """DeepSpeed's ``cur_hysteresis``: an overflow that finds it at 1 backs off; else it is tolerated."""
        return self._hysteresis_tracker

    def _update_scale(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            if self._hysteresis_tracker > 1:
                self._hysteresis_tracker -= 1  # tolerated: the step was skipped, the scale stays
            else:
                backed_off = to_float32(self._loss_scale * self._backoff_factor)
                self._set_loss_scale(max(backed_off, self._min_scale))
            return
        if self._consecutive_hysteresis:
            self._hysteresis_tracker = self._hysteresis
        self._growth_tracker += 1
        if self._growth_tracker >= self._growth_interval:  # >=: the interval may have been lowered
            self._growth_tracker = 0
            self._hysteresis_tracker = self._hysteresis
            grown = to_float32(self._loss_scale * self._growth_factor)
            if self._max_scale is not None:
                grown = min(grown, self._max_scale)
            if math.isfinite(grown):
                self._set_loss_scale(grown)

    def _extra_state(self) -> dict[str, Any]:
        return {"growth_tracker": self._growth_tracker, "hysteresis_tracker": self._hysteresis_tracker}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])

    def __repr__(self) -> str:
        if not self._enabled:
            return "DynamicLossScaler(enabled=False)"
        return (
            f"DynamicLossScaler(scale={self._loss_scale:g}, growth_tracker={self._growth_tracker}, "
            f"hysteresis_tracker={self._hysteresis_tracker})"
        )
