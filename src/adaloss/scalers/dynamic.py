"""Dynamic loss scaling by backoff: shrink the scale on overflow, grow it while the gradients stay finite.

Two rules (``rule``): ``"torch"``, ``torch.amp.GradScaler``'s (halve on overflow, double after a run of clean
steps), and ``"chainer"``, Chainer's ``Optimizer.update_loss_scale`` (the rule behind the authors' "Dynamic"
columns: double until the first overflow, then grow by ``2 ** (1 / interval)`` after every clean step).
"""

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

__all__ = ["CHAINER_MAX_SCALE", "DYNAMIC_RULES", "DynamicLossScaler", "backed_off", "grown"]

#: The values of ``rule`` (``scaler.rule``).
DYNAMIC_RULES = ("torch", "chainer")
#: Chainer's ceiling on a dynamic loss scale: ``Optimizer._loss_scale_max`` in chainer/chainer
#: ``chainer/optimizer.py`` (the largest finite FP16 value), applied in ``Optimizer.update_loss_scale``.
CHAINER_MAX_SCALE = 65504.0
#: GradScaler's default ``init_scale``; under ``rule="chainer"`` it means "not chosen" (Chainer starts at 1).
_GRAD_SCALER_INIT = 2.0**16


class DynamicLossScaler(LossScaler):
    """Dynamic loss scaling (NVIDIA's backoff procedure; Kuchaiev et al., 2018): the paper's "Dynamic" column.

    * ``scaler.scale(loss)`` multiplies the loss by the current scale.
    * ``scaler.step(optimizer)`` unscales the gradients and skips ``optimizer.step()`` if any is Inf/NaN.
    * ``scaler.update()`` backs the scale off after an overflow and grows it while the gradients stay finite,
      by one of two rules (``rule``).

    With the defaults (``rule="torch"``) it reproduces ``torch.amp.GradScaler`` step for step (same scales,
    same skipped steps, same parameters) as long as the scale stays at or above ``min_scale``.

    Example::

        scaler = DynamicLossScaler("cuda", init_scale=2.0**16, growth_interval=2000)  # GradScaler's call
        # scaler = DynamicLossScaler("cuda", rule="chainer", growth_interval=10)  # the authors' "Dynamic"
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            with precision.autocast():
                loss = criterion(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # skipped if a gradient overflowed
            scaler.update()  # back off or grow the scale

    The largest scale that does not overflow is the best one: it lifts the most small gradients out of FP16's
    underflow range. Both rules search for it by trial; an iteration with an Inf/NaN gradient always skips its
    update (the parameters and the optimizer state stay as they were).

    ``rule="torch"`` (GradScaler's; the default):

    * An overflow resets the clean-iteration count. With ``hysteresis`` h = 1 the scale is multiplied by
      ``backoff_factor`` (never below ``min_scale``). With h > 1 (DeepSpeed's and Megatron's ``hysteresis``)
      the first h - 1 overflows only use up tolerance and leave the scale alone, whether or not clean
      iterations lie between them; once the tolerance is spent, every overflow backs off. The tolerance is
      refilled (to h - 1 tolerated overflows) when the scale grows, or, with ``consecutive_hysteresis=True``,
      after any clean iteration, so that only h overflows in a row back off.
    * After ``growth_interval`` clean iterations in a row the scale is multiplied by ``growth_factor``
      (never above ``max_scale``; a growth that would overflow float32 is dropped, as in GradScaler) and the
      count restarts.

    ``rule="chainer"`` (Chainer's dynamic loss scaling, chainer/chainer ``chainer/optimizer.py``:
    ``Optimizer.loss_scaling`` sets it up, ``Optimizer.update_loss_scale`` applies it after every update):

    * The scale starts at 1 and is multiplied by ``growth_factor`` (2) after every clean iteration until the
      first overflow of the run.
    * An overflow multiplies it by ``backoff_factor`` (0.5). From the first overflow on, each clean
      iteration multiplies it by ``growth_factor ** (1 / growth_interval)`` (``2 ** (1 / interval)``), so
      the scales are no longer powers of two, and it takes ``growth_interval`` clean iterations to double.
    * After every update the scale is clamped to ``[min_scale, max_scale]``, by default ``[1, 65504]``
      (Chainer's ``Optimizer._loss_scale_max``, FP16's largest value).
    * Arithmetic: Chainer keeps the scale as a Python float (float64) and computes the rule in float64; so
      does this scaler, on the host, and what it applies (``get_scale()``, the device copy ``scale()``
      multiplies by, the reciprocal that unscales) is that value rounded to float32: what Chainer's
      ``backward(loss_scale=...)`` and ``grad /= loss_scale`` apply to float32 gradients, where NumPy and
      CuPy convert the Python scalar to the array's dtype. The float64 value and the phase (whether an
      overflow has happened yet) are checkpointed, so a resumed run continues Chainer's sequence exactly.
    * No hysteresis: ``hysteresis`` must be 1. Chainer keeps no growth count, so ``growth_tracker`` stays 0.

    The update runs on the host from the Inf/NaN flag ``step()`` has already read; under the torch rule it
    reads the scale (one sync) only on a step that changes it (a backoff, a growth), and the chainer rule
    computes from its float64 value, so it adds no sync. The scale itself is one device tensor
    (``LossScaler``), written afresh on a change.

    Compared with DeepSpeed's ``DynamicLossScaler`` (deepspeed/runtime/fp16/loss_scaler.py), whose
    ``scale_window``, ``delayed_shift``, ``consecutive_hysteresis`` and ``min_scale`` are our
    ``growth_interval``, ``hysteresis``, ``consecutive_hysteresis`` and ``min_scale``:

    * Growth: DeepSpeed grows when the iterations since the last overflow are a multiple of
      ``scale_window``, which is after W clean iterations the first time and every W after that: the same
      iterations as here (``tests/test_scalers.py`` runs a port of its rule beside ours).
    * At the floor: when an overflow that would back off finds the scale already at ``min_scale``,
      DeepSpeed raises (``raise_error_at_min_scale=True``, its default) and the run ends; this scaler keeps
      the scale at ``min_scale`` and skips the step, and the trainer's divergence guard
      (``trainer.max_consecutive_overflows``) decides when a run has failed.
    * DeepSpeed has no ceiling and no float32 check on growth; ``max_scale`` and the dropped float32
      overflow are ours (the latter GradScaler's).

    The first six parameters are ``torch.amp.GradScaler``'s, in its order (positional calls mean the same);
    the rule, bounds and hysteresis are keyword-only. ``get_growth_factor``/``set_growth_factor``,
    ``get_backoff_factor``/``set_backoff_factor`` and ``get_growth_interval``/``set_growth_interval`` read
    and change the rule between iterations, as in GradScaler (host floats, no sync). Differences from
    GradScaler under ``rule="torch"``: a growth interval lowered below the current count of clean
    iterations grows the scale at the next clean iteration (GradScaler compares for equality and then never
    grows until the next overflow); and ``min_scale`` defaults to 1 (``None`` gives GradScaler's unbounded
    backoff). ``state_dict()`` holds GradScaler's entries (``scale``, ``growth_factor``, ``backoff_factor``,
    ``growth_interval``, ``_growth_tracker``) beside its own, and ``load_state_dict`` takes GradScaler's
    state dicts too, so checkpoints move both ways. As GradScaler's does, ``load_state_dict`` restores the
    growth factor, backoff factor and growth interval from the state, so on resume the checkpoint's values
    win over the constructor's (call the setters after loading to change them); a state saved before these
    entries existed keeps the constructor's. The rule is checked, not restored: a checkpoint of the other
    rule is refused.

    Args:
        device (str or torch.device, optional, default=None): As GradScaler's first argument (see
            ``LossScaler``); GradScaler's default is ``"cuda"``.
        init_scale (float, optional, default=2.**16): Initial scale factor (``rule="torch"``). The chainer
            rule always starts at 1, as Chainer does: leave it at its default (or ``None`` or 1) there.
        growth_factor (float, optional, default=2.0): Factor (> 1) applied to the scale after
            ``growth_interval`` consecutive clean iterations (torch); after each clean iteration before the
            first overflow, and its ``growth_interval``-th root after each one later (chainer).
        backoff_factor (float, optional, default=0.5): Factor (between 0 and 1) applied to the scale after an
            overflow that exhausts the hysteresis.
        growth_interval (int, optional, default=2000): Number of consecutive clean iterations before the scale
            grows (torch); Chainer's ``interval``, the clean iterations that double the scale after the first
            overflow (chainer; Chainer's default is 1000, the authors' scripts use 10).
        enabled (bool, optional, default=True): If ``False``, every method is a passthrough.
        rule (str, optional, default="torch"): ``"torch"`` or ``"chainer"``, as described above.
        min_scale (float or None, optional, default=1.0): Floor for backoff. Below 1 the scale no longer
            fights overflow of the scaled loss; it only answers NaNs the model makes on its own, and shrinking
            further adds underflow and, at 0, turns NaN steps into silent zero-gradient steps. ``None`` or
            ``0`` gives GradScaler's unbounded backoff (torch only: the chainer rule needs a positive floor).
        max_scale (float or None, optional, default=None): Cap for growth, e.g. ``2.**24``; ``None``: no cap
            (torch), Chainer's 65504 (chainer).
        hysteresis (int, optional, default=1): Number of overflows that trigger a backoff; 1 backs off on
            every overflow, as GradScaler does. h > 1 tolerates h - 1 overflows (see above).
        consecutive_hysteresis (bool, optional, default=False): Refill the hysteresis after every clean
            iteration rather than only when the scale grows (DeepSpeed's option of the same name).

    Raises:
        ConfigError: for an argument outside its range, naming it and an example value (the setters too).
        TypeError: if the first positional argument is a number rather than a device.
    """

    name = "dynamic"
    _accepts_grad_scaler_state = True

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: Any = _GRAD_SCALER_INIT,
        growth_factor: Any = 2.0,
        backoff_factor: Any = 0.5,
        growth_interval: Any = 2000,
        enabled: bool = True,
        *,
        rule: Any = "torch",
        min_scale: Any = 1.0,
        max_scale: Any = None,
        hysteresis: Any = 1,
        consecutive_hysteresis: bool = False,
    ) -> None:
        self._rule = _rule_name(rule)
        chainer = self._rule == "chainer"
        init = _initial_scale(init_scale, chainer)
        self.set_growth_factor(growth_factor)
        self.set_backoff_factor(backoff_factor)
        self.set_growth_interval(growth_interval)
        self._min_scale = optional_bound(min_scale, "scaler.min_scale", "1", allow_zero=True) or 0.0
        self._max_scale = optional_bound(max_scale, "scaler.max_scale", "16777216", allow_zero=False)
        self._hysteresis = positive_int(hysteresis, "scaler.hysteresis", "2")
        self._consecutive_hysteresis = bool(consecutive_hysteresis)
        if chainer:
            self._check_chainer_options()
            if self._max_scale is None:
                self._max_scale = CHAINER_MAX_SCALE
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
        self._exact_scale = float(init)  # the rule's own value (chainer: float64, as Chainer's)
        super().__init__(device, init_scale=init, enabled=enabled)
        self._growth_tracker = 0  # clean iterations in a row since the last overflow or growth
        self._hysteresis_tracker = self._hysteresis  # overflows left before the next one backs off (1: now)
        self._overflowed = False  # chainer: Chainer's ``_loss_scaling_isnan_ever``, the phase of the rule

    def _check_chainer_options(self) -> None:
        """The options Chainer's rule has no counterpart for: refused rather than silently ignored."""
        if self._hysteresis != 1 or self._consecutive_hysteresis:
            raise ConfigError(
                "scaler.rule=chainer backs off on every overflow and has no hysteresis; "
                "set scaler.hysteresis=1 and scaler.consecutive_hysteresis=false"
            )
        if self._min_scale <= 0.0:
            raise ConfigError(
                "scaler.rule=chainer needs a positive scaler.min_scale (Chainer clamps at 1): a scale of 0 "
                "could never grow again; e.g. scaler.min_scale=1"
            )

    @property
    def rule(self) -> str:
        """The scale rule: ``"torch"`` (GradScaler's) or ``"chainer"`` (Chainer's ``update_loss_scale``)."""
        return self._rule

    def get_growth_factor(self) -> float:
        """The factor the scale grows by (see ``rule``). No sync."""
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
        """How many consecutive clean iterations grow the scale (chainer: double it). No sync."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (a positive integer). The clean iterations already counted still count:
        if they reach the new interval, the next clean iteration grows the scale. No sync."""
        self._growth_interval = positive_int(new_interval, "scaler.growth_interval", "2000")

    @property
    def growth_tracker(self) -> int:
        """Consecutive clean iterations counted towards the next growth (always 0 under the chainer rule)."""
        return self._growth_tracker

    @property
    def hysteresis_tracker(self) -> int:
        """DeepSpeed's ``cur_hysteresis``: an overflow that finds it at 1 backs off; else it is tolerated."""
        return self._hysteresis_tracker

    @property
    def has_overflowed(self) -> bool:
        """Whether an overflow has been seen since the start (Chainer's ``_loss_scaling_isnan_ever``): the
        chainer rule grows by ``growth_factor`` before and by its ``growth_interval``-th root after."""
        return self._overflowed

    def _update_scale(self, found_inf: bool) -> None:
        if found_inf:
            self._overflowed = True
        if self._rule == "chainer":
            self._update_chainer(found_inf)
        else:
            self._update_torch(found_inf)

    def _update_torch(self, found_inf: bool) -> None:
        """GradScaler's rule (``torch._amp_update_scale_``), with hysteresis and the bounds."""
        if found_inf:
            self._growth_tracker = 0
            if self._hysteresis_tracker > 1:
                self._hysteresis_tracker -= 1  # tolerated: the step was skipped, the scale stays
            else:
                self._set_loss_scale(backed_off(self._current_scale(), self._backoff_factor, self._min_scale))
            return
        if self._consecutive_hysteresis:
            self._hysteresis_tracker = self._hysteresis
        self._growth_tracker += 1
        if self._growth_tracker >= self._growth_interval:  # >=: the interval may have been lowered
            self._growth_tracker = 0
            self._hysteresis_tracker = self._hysteresis
            self._set_loss_scale(grown(self._current_scale(), self._growth_factor, self._max_scale))

    def _update_chainer(self, found_inf: bool) -> None:
        """Chainer's rule, in its float64 arithmetic (chainer/optimizer.py, ``Optimizer.update_loss_scale``;
        the multiplier ``2 ** (1 / interval)`` is computed as ``Optimizer.loss_scaling`` does)."""
        if found_inf:
            multiplier = self._backoff_factor
        elif self._overflowed:
            multiplier = math.pow(self._growth_factor, 1.0 / self._growth_interval)
        else:
            multiplier = self._growth_factor
        assert self._max_scale is not None  # the chainer rule always has a ceiling (65504 by default)
        self._set_loss_scale(max(self._min_scale, min(self._max_scale, self._exact_scale * multiplier)))

    def _set_loss_scale(self, value: float) -> None:
        """Keep the rule's exact value (float64) beside the applied float32 scale."""
        self._exact_scale = float(value)
        super()._set_loss_scale(value)

    def _extra_state(self) -> dict[str, Any]:
        return {
            # torch.amp.GradScaler's entries, under its names (its load_state_dict reads exactly these)
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._growth_tracker,
            # ours
            "rule": self._rule,
            "exact_scale": self._exact_scale,
            "has_overflowed": self._overflowed,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        saved_rule = state.get("rule", "torch")  # GradScaler's and our older states: the torch rule
        if saved_rule != self._rule:
            raise ConfigError(
                f"the checkpoint holds state of scaler.rule={saved_rule} but this run uses "
                f"scaler.rule={self._rule}; resume with scaler.rule={saved_rule} or start a fresh run"
            )
        # the growth tracker: GradScaler's name, or the one our checkpoints used before they carried it
        key = (
            "_growth_tracker"
            if "_growth_tracker" in state or "growth_tracker" not in state
            else "growth_tracker"
        )
        self._growth_tracker = int(state[key])
        # hyperparameters: restored when present, as GradScaler's load_state_dict does (older states: kept)
        for setter, entry in (
            (self.set_growth_factor, "growth_factor"),
            (self.set_backoff_factor, "backoff_factor"),
            (self.set_growth_interval, "growth_interval"),
        ):
            if entry in state:
                setter(state[entry])
        self._hysteresis_tracker = int(state.get("hysteresis_tracker", self._hysteresis))
        self._overflowed = bool(state.get("has_overflowed", False))
        if "exact_scale" in state:  # the float64 value the float32 "scale" was rounded from
            self._set_loss_scale(float(state["exact_scale"]))

    def __repr__(self) -> str:
        if not self._enabled:
            return "DynamicLossScaler(enabled=False)"
        tail = (
            f"has_overflowed={self._overflowed}"
            if self._rule == "chainer"
            else f"growth_tracker={self._growth_tracker}, hysteresis_tracker={self._hysteresis_tracker}"
        )
        return f"DynamicLossScaler(rule={self._rule}, scale={self._current_scale():g}, {tail})"


def backed_off(scale: float, factor: float, min_scale: float) -> float:
    """GradScaler's backoff: ``scale * factor`` in float32, never below ``min_scale``. Shared by
    ``DynamicLossScaler(rule="torch")`` and ``AdaptiveLossScaler(root="dynamic")``."""
    return max(to_float32(scale * factor), min_scale)


def grown(scale: float, factor: float, max_scale: float | None) -> float:
    """GradScaler's growth: ``scale * factor`` in float32, never above ``max_scale`` (None: no cap); a
    growth that would overflow float32 is dropped (``scale`` comes back), as in GradScaler. Shared by
    ``DynamicLossScaler(rule="torch")`` and ``AdaptiveLossScaler(root="dynamic")``."""
    value = to_float32(scale * factor)
    if max_scale is not None:
        value = min(value, max_scale)
    return value if math.isfinite(value) else scale


def _rule_name(rule: Any) -> str:
    """Parse ``rule``; ConfigError for anything but one of :data:`DYNAMIC_RULES`."""
    name = str(rule).strip().lower() if isinstance(rule, str) else None
    if name not in DYNAMIC_RULES:
        raise ConfigError(
            f"scaler.rule must be one of {', '.join(DYNAMIC_RULES)} for scaler=dynamic, got {rule!r}; "
            "e.g. scaler.rule=chainer"
        )
    return name


def _initial_scale(init_scale: Any, chainer: bool) -> float:
    """The start scale: ``init_scale`` (torch; ``None``: GradScaler's 2**16), or 1 (chainer), where the only
    values accepted are those that do not contradict it: ``None``, the default 2**16 and 1."""
    if not chainer:
        return (
            _GRAD_SCALER_INIT
            if init_scale is None
            else positive_number(init_scale, "scaler.init_scale", "65536")
        )
    if init_scale is not None and positive_number(init_scale, "scaler.init_scale", "1") not in (
        1.0,
        _GRAD_SCALER_INIT,
    ):
        raise ConfigError(
            f"scaler.rule=chainer starts at scale 1, as Chainer's loss_scaling does, got scaler.init_scale="
            f"{init_scale!r}; leave scaler.init_scale out (null) or use scaler.rule=torch"
        )
    return 1.0
