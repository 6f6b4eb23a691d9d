"""The loss-scaler interface every scaler shares, and the bookkeeping they all need.

``LossScaler`` owns what does not depend on how the scale is chosen: the per-optimizer state machine
(READY -> UNSCALED -> STEPPED, reset by ``update()``), the Inf/NaN bookkeeping, skipping ``optimizer.step()``
on an overflow, the counters and the checkpoint format. A subclass decides only how the scale is chosen and
applied, through the hooks listed in the class docstring.

The loss scale is one 0-dim float32 device tensor, GradScaler's ``_scale``, created by the first ``scale()``
on the loss's device (before it, the scale is the host's ``_init_scale``, as in GradScaler); nothing keeps a
host copy of it. The scale rules (hysteresis, clamping) are plain Python on the host: ``step()`` reads the
Inf/NaN flag on the host anyway, and a rule reads the scale (one sync) only on the steps that change it (an
overflow, a growth); a new scale is written as a fresh tensor, without a sync.

Distributed data parallel: when ``torch.distributed`` is initialized with more than one rank, the found-inf
flag is all-reduced (MAX) before ``step()`` reads it (:func:`reduce_found_inf`), so every rank skips the same
steps and, since the scale is updated from that flag alone, every rank keeps the same scale. The cost is one
one-float collective per optimizer per iteration and no extra host sync.

Host-device synchronization, per method (on a GPU the host waits for the device at a sync; on the CPU there
is nothing to wait for): ``scale``, ``unscale_``, ``attach``, ``is_enabled``, the growth and backoff getters
and setters: none. ``step``: one, to read the Inf/NaN flag, as in ``GradScaler`` (also for an optimizer
that unscales in its own kernel, ``_step_supports_amp_scaling``, where GradScaler has none: the host
counts skipped steps and updates the scale from the flag). ``update``: none after
``step`` (the adaptive scaler: one more on each step that recomputed its scales, with ``update_every > 1``).
``get_scale``, ``state_dict``: one (the scale is read from the device, as in ``GradScaler``). Each method's
docstring says its own.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from adaloss.errors import ConfigError

__all__ = ["LossScaler", "OptState", "ScaleNotCalledError"]

_Outputs = TypeVar("_Outputs")


class OptState(Enum):
    """Where one optimizer is in the current iteration: nothing yet, grads unscaled, or stepped."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


class ScaleNotCalledError(AssertionError, RuntimeError):
    """``unscale_``, ``step`` or ``update`` was called on a scaler that has never scaled a loss.

    ``torch.amp.GradScaler`` raises an ``AssertionError`` in exactly this case (its scale tensor is created by
    the first ``scale()``), so code written for it that catches ``AssertionError`` keeps working; it is also a
    ``RuntimeError``, like the scalers' other call-order errors.
    """


@dataclass
class _OptimizerRecord:
    """What the scaler knows about one optimizer since the last ``update()``."""

    stage: OptState = OptState.READY
    found_inf: torch.Tensor | None = None  # 0-dim float32 on the grads' device; > 0 means Inf/NaN was seen
    found_inf_host: bool | None = None  # the same flag once read on the host (by step())


class LossScaler:
    """Base class of the loss scalers: scale the loss, unscale and check the grads, skip overflowing steps.

    * ``scaler.scale(loss)`` multiplies the loss by the current loss scale, so the backward pass produces
      scaled gradients that stay above FP16's underflow threshold.
    * ``scaler.step(optimizer)`` divides the gradients by the scale, checks them for Inf/NaN, and calls
      ``optimizer.step()`` only if they are all finite; an overflowing step is skipped and counted.
    * ``scaler.update()`` lets the scaler adjust its scale from the outcome of the iteration.

    Example::

        scaler = build_scaler(cfg.scaler, fmt)
        model = scaler.attach(model)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            with precision.autocast():
                loss = criterion(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)  # optional: only needed to inspect or clip the true gradients
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(optimizer)  # skips optimizer.step() if a gradient is Inf/NaN
            scaler.update()
            if not scaler.last_step_skipped:
                lr_schedule.step()  # a skipped step must not advance the schedule

    The method names and their semantics are those of ``torch.amp.GradScaler``, so a reader who knows it can
    read this loop: a leading ``device`` argument (``DynamicLossScaler("cuda", init_scale=2.0**16)``),
    ``unscale_``/``step``/``update`` before any ``scale()`` raise (:class:`ScaleNotCalledError`, an
    ``AssertionError`` as in GradScaler), ``is_enabled()``, and the growth and backoff getters and setters
    where the scaler has a growth or backoff rule:

    ========================  ==================  ==================  ======================================
    scaler                    ``growth_factor``   ``backoff_factor``  ``growth_interval``
    ========================  ==================  ==================  ======================================
    ``DynamicLossScaler``     get and set         get and set         get and set
    ``AdaptiveLossScaler``    get (2.0, fixed)    get (0.5, fixed)    get and set (``alpha_{N+1}``'s regrowth)
    ``FixedLossScaler``       none                none                none
    ``NoLossScaler``          none                none                none
    ========================  ==================  ==================  ======================================

    The scale of ``fixed`` and ``none`` never changes, so they have none of the six methods (an
    ``AttributeError``, as for any missing method; ``hasattr(scaler, "set_growth_factor")`` tells which kind
    a scaler is). Differences from GradScaler: every enabled scaler, ``none`` included, skips and counts a
    step with Inf/NaN gradients, so a diverging FP16 run shows up as skipped steps rather than NaN weights;
    and ``device`` defaults to ``None`` (GradScaler's default
    is ``"cuda"``), so the same code runs on a machine without a GPU.

    Extending: a subclass supplies

    * ``_scale_holder() -> Tensor | None`` and ``_store_scale(value)``: where the one scale tensor lives
      (default: ``self._scale``, GradScaler's; the adaptive scaler keeps it in its scale buffers);
    * ``_unscale_grads_(optimizer) -> Tensor``: divide the optimizer's grads in place and return a 0-dim
      float32 found-inf flag, without a host sync (default: divide every grad by the scalar scale);
    * ``_update_scale(found_inf: bool) -> None``: adjust the scale after an iteration (default: keep it);
    * ``_extra_state() -> dict`` and ``_load_extra_state(state) -> None``: its own checkpoint entries;
    * ``attach(model) -> nn.Module``: the module to train (default: ``model`` unchanged);
    * ``loss_scale_metric()``: what the logger records (default: ``get_scale()``).

    Args:
        device (str or torch.device, optional, default=None): The device type the scaler is used with,
            GradScaler's first argument (``"cuda"``, ``"cpu"``, ...; ``"cuda:1"`` counts as ``"cuda"``).
            What it does, as in GradScaler: ``"cuda"`` on a machine without CUDA disables the scaler with a
            warning, and ``update(new_scale=tensor)`` requires a tensor of this device type. The scale
            itself goes to whatever device the loss is on, so ``None`` (any device) works everywhere.
        init_scale (float, optional, default=1.0): The loss scale before any update.
        enabled (bool, optional, default=True): If ``False``, every method is a no-op passthrough:
            ``scale`` returns its argument, ``step`` just calls ``optimizer.step()``, ``update`` does nothing
            and nothing is counted. The training loop keeps one shape for every configuration.
    """

    #: The key under which the training checkpoint stores ``state_dict()``.
    state_dict_key: ClassVar[str] = "scaler"
    #: The ``scaler.name`` config value that builds this class; stored in the checkpoint to catch mix-ups.
    name: ClassVar[str] = "base"
    #: The argument a number given in ``device``'s place most likely meant (for the error message).
    _number_keyword: ClassVar[str] = "init_scale"
    #: Whether ``load_state_dict`` takes ``torch.amp.GradScaler``'s state dicts (the scalers with its rule).
    _accepts_grad_scaler_state: ClassVar[bool] = False

    def __init__(
        self, device: str | torch.device | None = None, init_scale: float = 1.0, enabled: bool = True
    ) -> None:
        self._device = device_type(device, type(self).__name__, self._number_keyword)
        self._enabled = bool(enabled)
        if self._enabled and self._device == "cuda" and torch.cuda.amp.common.amp_definitely_not_available():
            warnings.warn(
                f"{type(self).__name__} is enabled for device 'cuda', but CUDA is not available. Disabling.",
                stacklevel=3,
            )
            self._enabled = False
        self._has_scaled = False  # GradScaler's "_scale is None": no scale() call yet
        # GradScaler's names: the scale before the first scale() creates it on the device; then the scale
        self._init_scale = to_float32(init_scale)
        self._scale: torch.Tensor | None = None
        self._last_device: torch.device | None = None
        self._per_optimizer: defaultdict[int, _OptimizerRecord] = defaultdict(_OptimizerRecord)
        self._skipped_steps = 0
        self._overflow_count = 0
        self._last_step_skipped = False

    # ------------------------------------------------------------------ counters and properties

    @property
    def skipped_steps(self) -> int:
        """How many ``step()`` calls skipped ``optimizer.step()`` because a gradient was Inf/NaN."""
        return self._skipped_steps

    @property
    def overflow_count(self) -> int:
        """How many iterations (``update()`` calls) had an Inf/NaN gradient in any optimizer."""
        return self._overflow_count

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest ``step()`` was skipped; if so the trainer must not advance the LR schedule."""
        return self._last_step_skipped

    def is_enabled(self) -> bool:
        """Whether this scaler does anything (``enabled=False``, or ``device="cuda"`` without CUDA, makes
        every method a passthrough). No host-device sync."""
        return self._enabled

    # ------------------------------------------------------------------ the training-loop API

    def attach(self, model: nn.Module, *example_inputs: Any, **example_kwargs: Any) -> nn.Module:
        """Return the module to train. Scalers that act inside the backward pass return a transformed module.

        The base scalers act on the loss and the gradients only, so they return ``model`` unchanged (the
        example inputs, with which the adaptive scaler captures a model fx cannot trace, go unused). No
        host-device sync.
        """
        return model

    def scale(self, outputs: _Outputs) -> _Outputs:
        """Multiply a tensor, or a (nested) list or tuple of tensors, by the current loss scale.

        Returns the scaled outputs, or ``outputs`` itself when the scaler is disabled. The scale is a 0-dim
        device tensor, so this does not synchronize host and device.

        Args:
            outputs (Tensor or list/tuple of Tensors): Typically the loss; call ``.backward()`` on the result.

        Raises:
            TypeError: for anything else. A deliberate difference: GradScaler also takes any other iterable
                and returns a lazy ``map`` over it, which a caller can consume only once; lists and tuples
                keep their type here, and a generator is refused rather than silently turned into a map.
        """
        if not self._enabled:
            return outputs
        self._has_scaled = True
        return self._scale_nested(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients in place by the loss scale and record whether any is Inf/NaN.

        Optional: ``step()`` unscales if this was not called. Call it to inspect or clip the true gradients
        between the backward pass and ``step()``. It must be called at most once per optimizer per iteration,
        after all of that optimizer's gradients have been accumulated.

        .. note::
            Does not synchronize host and device: the Inf/NaN flag stays on the device until ``step()``.

        .. note::
            Under ``torch.distributed`` (initialized, world size > 1) the flag is all-reduced (MAX) over the
            default process group here, so every rank skips the same steps and updates its scale alike:
            one collective of one float per optimizer per iteration, issued on the device tensor (no host
            sync of its own; with gloo on the CPU it blocks until every rank has unscaled). Every rank must
            therefore call ``unscale_``/``step`` for the same optimizers in the same order.

        Raises:
            ScaleNotCalledError: if no ``scale()`` call has been made yet (as GradScaler).
            RuntimeError: if called twice for ``optimizer`` before ``update()``, or after ``step()``.
        """
        if not self._enabled:
            return
        self._check_scaled("unscale_")
        record = self._per_optimizer[id(optimizer)]
        if record.stage is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if record.stage is OptState.STEPPED:
            raise RuntimeError(
                "unscale_() was called after step() on this optimizer; call update() to finish the iteration "
                "before unscaling the next one's gradients."
            )
        record.found_inf = reduce_found_inf(self._unscale_grads_(optimizer))
        record.stage = OptState.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale the gradients (unless ``unscale_`` did) and call ``optimizer.step()`` if all are finite.

        If any gradient of ``optimizer`` is Inf/NaN the update is skipped, so neither the parameters nor the
        optimizer state (momentum, Adam moments, step count) change; ``skipped_steps`` grows by one and
        ``last_step_skipped`` becomes ``True``. ``*args`` and ``**kwargs`` go to ``optimizer.step()``.

        Returns the result of ``optimizer.step()``, or ``None`` if the step was skipped.

        .. note::
            Synchronizes host and device once, to read the Inf/NaN flag (as ``GradScaler.step`` does).
            Under ``torch.distributed`` that flag has already been all-reduced across ranks (see
            ``unscale_``), so a step is skipped on every rank or on none.

        .. note::
            Optimizers that unscale and skip inside their own kernel declare ``_step_supports_amp_scaling =
            True`` (torch's ``fused=True`` Adam, AdamW, SGD). As GradScaler does, a scaler whose scale is one
            number (``none``, ``fixed``, ``dynamic``) then hands them ``optimizer.grad_scale`` (the scale,
            times any ``grad_scale`` the caller set; ``None`` after ``unscale_``) and ``optimizer.found_inf``
            and always calls ``optimizer.step()``, which divides and skips by itself; the grads are checked
            but not unscaled first. The sync to read the flag (for ``skipped_steps``) comes after that call.
            The adaptive scaler's per-layer scales are not one number: it drives such optimizers like any
            other (correct, but unfused). GradScaler's deprecated ``grad_scaler=`` keyword is refused.

        .. note::
            Closures are not supported.

        Raises:
            ScaleNotCalledError: if no ``scale()`` call has been made yet: GradScaler raises an
                ``AssertionError`` then, and so does this (the class is both).
            RuntimeError: for a closure, a second ``step()`` on ``optimizer`` before ``update()``, or an
                optimizer whose ``step`` takes GradScaler's deprecated ``grad_scaler`` keyword.
        """
        if not self._enabled:
            self._last_step_skipped = False
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError("step() does not support closures while loss scaling is enabled.")
        self._check_scaled("step")
        record = self._per_optimizer[id(optimizer)]
        if record.stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called on this optimizer since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False) and self._scale_is_one_number():
            return self._step_in_kernel(optimizer, record, args, kwargs)
        if record.stage is OptState.READY:
            self.unscale_(optimizer)
        assert record.found_inf is not None
        found_inf = bool(record.found_inf.item() != 0.0)  # the one host-device sync of the iteration
        self._record_step(record, found_inf)
        if found_inf:
            return None
        return optimizer.step(*args, **kwargs)

    def _step_in_kernel(
        self, optimizer: torch.optim.Optimizer, record: _OptimizerRecord, args: tuple, kwargs: dict
    ) -> Any:
        """``step()`` for an optimizer with ``_step_supports_amp_scaling``: GradScaler's protocol
        (torch/amp/grad_scaler.py, ``GradScaler.step``). One host-device sync, after ``optimizer.step()``."""
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step takes a grad_scaler= keyword, GradScaler's deprecated "
                "protocol, which the adaloss scalers do not drive; use an optimizer that reads "
                "optimizer.grad_scale and optimizer.found_inf (e.g. torch.optim.Adam(fused=True))"
            )
        if record.stage is OptState.READY:
            # check without unscaling (GradScaler's _check_inf_per_device): the kernel divides by grad_scale
            groups = self._grads_by_device_and_dtype(optimizer, allow_fp16=True)
            record.found_inf = reduce_found_inf(self._unscale_grad_groups_(groups, 1.0))
            scale = self._scale_tensor(record.found_inf.device)
            optimizer.grad_scale = scale * getattr(optimizer, "grad_scale", 1)  # type: ignore[attr-defined]
        else:  # unscale_() already divided the grads; a grad_scale the caller set stays as it is
            optimizer.grad_scale = getattr(optimizer, "grad_scale", None)  # type: ignore[attr-defined]
        assert record.found_inf is not None
        optimizer.found_inf = record.found_inf  # type: ignore[attr-defined]
        try:
            result = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        self._record_step(record, bool(record.found_inf.item() != 0.0))  # the iteration's one sync
        return result

    def _record_step(self, record: _OptimizerRecord, found_inf: bool) -> None:
        """Book one ``step()``: the host flag, the stage, ``last_step_skipped`` and ``skipped_steps``."""
        record.found_inf_host = found_inf
        record.stage = OptState.STEPPED
        self._last_step_skipped = found_inf
        if found_inf:
            self._skipped_steps += 1

    def _scale_is_one_number(self) -> bool:
        """Whether the gradients carry one scale (this class's ``_scale_tensor`` and ``_unscale_grads_``), so
        that an optimizer can unscale them in its kernel by ``grad_scale``."""
        cls = type(self)
        return (
            cls._scale_tensor is LossScaler._scale_tensor
            and cls._unscale_grads_ is LossScaler._unscale_grads_
        )

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Adjust the loss scale from this iteration's outcome and start the next iteration.

        Call once per iteration, after ``step()`` for every optimizer. If any optimizer saw an Inf/NaN
        gradient, the iteration counts in ``overflow_count``. With ``new_scale`` the scale is set to that
        value instead of being adjusted by the scaler's rule (growth and hysteresis counters stay put).

        .. note::
            Does not synchronize when ``step()`` was called for every optimizer (it reuses the flag
            ``step()`` read); an optimizer that was only unscaled costs one sync, and so does a tensor
            ``new_scale``.

        Raises:
            ScaleNotCalledError: if no ``scale()`` call has been made yet (as GradScaler).
            RuntimeError: if neither ``step()`` nor ``unscale_()`` was called since the last ``update()`` and
                no ``new_scale`` is given.
            ValueError: for a ``new_scale`` that is not a finite positive number, or a tensor with more than
                one element, with ``requires_grad``, or on another device type than the scaler's ``device``.
        """
        if not self._enabled:
            return
        self._check_scaled("update")
        records = list(self._per_optimizer.values())
        if not records and new_scale is None:
            raise RuntimeError(
                "update() was called before any step() or unscale_() since the last update(); "
                "call scaler.step(optimizer) first."
            )
        found_inf = any(self._record_found_inf(record) for record in records)
        if found_inf:
            self._overflow_count += 1
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                self._check_new_scale_tensor(new_scale)
            value = float(new_scale.item()) if isinstance(new_scale, torch.Tensor) else float(new_scale)
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"update(new_scale=...) needs a finite positive scale, got {value!r}")
            self._set_loss_scale(value)
        else:
            self._update_scale(found_inf)
        self._per_optimizer = defaultdict(_OptimizerRecord)

    def get_scale(self) -> float:
        """Return the current loss scale as a Python float (1.0 when disabled; ``init_scale`` before the first
        ``scale()``, as GradScaler).

        .. note::
            Synchronizes host and device once (the scale lives on the device), as ``GradScaler.get_scale``.
        """
        return self._current_scale() if self._enabled else 1.0

    def loss_scale_metric(self) -> float | dict[str, float]:
        """What the logger records as the loss scale: here the scalar scale (one sync, as ``get_scale``)."""
        return self.get_scale()

    def state_dict(self) -> dict[str, Any]:
        """Return the scaler's state for the checkpoint (``{}`` when disabled, as GradScaler).

        Holds ``name``, ``scale``, the counters ``skipped_steps``, ``overflow_count``, ``last_step_skipped``
        and the subclass's ``_extra_state()`` (``DynamicLossScaler``: GradScaler's ``growth_factor``,
        ``backoff_factor``, ``growth_interval`` and ``_growth_tracker`` too, so that
        ``torch.amp.GradScaler().load_state_dict`` takes it). Call after ``update()``. One sync, to read the
        scale (the adaptive scaler reads it with every per-layer scale, in the same one host read).
        """
        if not self._enabled:
            return {}
        extra = self._extra_state()
        scale = extra.pop("scale", None)  # a subclass that read the scale with its own state
        return {
            "name": self.name,
            "scale": self._current_scale() if scale is None else scale,
            "skipped_steps": self._skipped_steps,
            "overflow_count": self._overflow_count,
            "last_step_skipped": self._last_step_skipped,
            **extra,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state returned by ``state_dict()`` (a no-op when disabled).

        ``DynamicLossScaler`` also takes ``torch.amp.GradScaler().state_dict()`` (recognized by its
        ``_growth_tracker`` entry and no ``name``): the scale, growth and backoff factors, growth interval
        and growth tracker are restored as GradScaler restores them, and the counters start at 0. No sync.

        Raises:
            ConfigError: if the state was saved by a different scaler (e.g. ``dynamic`` into ``fixed``, or a
                GradScaler state into a scaler without its rule).
            RuntimeError: if the state is empty (saved by a disabled scaler) or lacks an entry.
        """
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("the scaler state is empty, probably saved by a scaler with enabled=False.")
        from_grad_scaler = "name" not in state_dict and "_growth_tracker" in state_dict
        saved_name = "dynamic" if from_grad_scaler else state_dict.get("name", self.name)
        if saved_name != self.name or (from_grad_scaler and not self._accepts_grad_scaler_state):
            what = "torch.amp.GradScaler (a dynamic scale)" if from_grad_scaler else f"scaler={saved_name}"
            raise ConfigError(
                f"the checkpoint holds state of {what} but this run uses scaler={self.name}; "
                f"resume with scaler={saved_name} or start a fresh run"
            )
        try:
            self._set_loss_scale(float(state_dict["scale"]))
            counters = {"skipped_steps": 0, "overflow_count": 0, "last_step_skipped": False}
            if not from_grad_scaler:  # ours always carry them: a missing one is a damaged state
                counters = {key: state_dict[key] for key in counters}
            self._skipped_steps = int(counters["skipped_steps"])
            self._overflow_count = int(counters["overflow_count"])
            self._last_step_skipped = bool(counters["last_step_skipped"])
            self._load_extra_state(state_dict)
        except KeyError as missing:
            raise RuntimeError(f"the scaler state has no entry {missing}; was it saved by adaloss?") from None

    # ------------------------------------------------------------------ hooks for subclasses

    def _scale_holder(self) -> torch.Tensor | None:
        """The one 0-dim float32 device tensor holding the scale; None before the first ``scale()`` (then
        the scale is ``_init_scale``). Host-side, no sync."""
        return self._scale

    def _store_scale(self, value: float) -> None:
        """Write a new scale into the holder (which exists). A fresh tensor (not ``fill_``): an autograd
        graph may still hold the old one. No sync."""
        assert self._scale is not None
        self._scale = torch.full((), value, dtype=torch.float32, device=self._scale.device)

    def _current_scale(self) -> float:
        """The scale as a Python float: one host read of the holder (a sync), none before it exists."""
        held = self._scale_holder()
        return self._init_scale if held is None else float(held.item())

    def _scale_tensor(self, device: torch.device) -> torch.Tensor:
        """The 0-dim float32 scale on ``device`` that ``scale()`` multiplies by. No host-device sync.

        The holder itself, created on the first call on ``device`` (GradScaler's lazy init); a copy of it on
        another device, or when the holder is kept elsewhere and written in place (the adaptive scaler's
        buffers: autograd refuses a saved tensor that changed since).
        """
        held = self._scale_holder()
        if held is None:
            held = self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._last_device = device
        return held if held.device == device and held is self._scale else held.to(device, copy=True)

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Divide every gradient of ``optimizer`` in place by the scale; return the found-inf flag.

        The flag is a 0-dim float32 tensor on the grads' device, > 0 if any gradient held Inf/NaN. No
        host-device sync: ``torch._amp_foreach_non_finite_check_and_unscale_`` checks and scales in one pass
        per device/dtype group. The reciprocal is taken in float64 and rounded once, as GradScaler does.
        """
        scale = self._scale_holder()
        if scale is None:  # no scale() yet (a copy that was never used): made where scale() would make it
            scale = self._scale_tensor(torch.device(self._fallback_device()))
        inv_scale = scale.double().reciprocal().float()
        return self._unscale_grad_groups_(self._grads_by_device_and_dtype(optimizer), inv_scale)

    def _update_scale(self, found_inf: bool) -> None:
        """Adjust the scale after an iteration; ``found_inf`` says whether any gradient was Inf/NaN.

        Called by ``update()`` once per iteration. The default keeps the scale constant.
        """

    def _extra_state(self) -> dict[str, Any]:
        """Checkpoint entries beyond the base ones (scale and counters). Keys must not clash with them."""
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what ``_extra_state()`` saved; ``state`` is the whole state dict."""

    # ------------------------------------------------------------------ helpers for subclasses

    def _set_loss_scale(self, value: float) -> None:
        """Set the scale (rounded to float32): into the holder, or ``_init_scale`` before it exists. No
        sync."""
        value = to_float32(value)
        if self._scale_holder() is None:
            self._init_scale = value
        else:
            self._store_scale(value)

    def _grads_by_device_and_dtype(
        self, optimizer: torch.optim.Optimizer, allow_fp16: bool = False
    ) -> dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]:
        """Group the optimizer's gradients (dense grads, or the values of sparse ones) by device and dtype.

        FP16 gradients are refused unless ``allow_fp16``: unscaling in FP16 would flush to zero the very small
        values loss scaling exists to keep. Keep FP32 master parameters (autocast does) instead.
        """
        groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.dtype == torch.float16 and not allow_fp16:
                    raise ValueError(
                        "refusing to unscale FP16 gradients: keep FP32 parameters (FP16 only inside autocast)"
                    )
                if grad.is_sparse:
                    if grad.dtype == torch.float16:
                        # Duplicate indices are summed by coalesce(); the sum may overflow, so check it.
                        grad = param.grad = grad.coalesce()
                    grad = grad._values()
                groups[grad.device][grad.dtype].append(grad)
        return groups

    def _unscale_grad_groups_(
        self,
        groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]],
        inv_scale: float | torch.Tensor,
    ) -> torch.Tensor:
        """Multiply each group by ``inv_scale`` in place and return one combined found-inf flag (no sync).

        The flag lives on the first group's device (other devices' flags are copied there asynchronously), or
        on the device of the last ``scale()`` call (CPU if none) when there are no gradients.
        """
        flags: list[torch.Tensor] = []
        with torch.no_grad():
            for device, by_dtype in groups.items():
                found_inf = torch.zeros((), dtype=torch.float32, device=device)
                if isinstance(inv_scale, torch.Tensor):
                    inv = inv_scale.to(device)
                else:
                    inv = torch.full((), inv_scale, dtype=torch.float32, device=device)
                for grads in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
                flags.append(found_inf)
        if not flags:
            return torch.zeros((), dtype=torch.float32, device=self._fallback_device())
        combined = flags[0]
        for flag in flags[1:]:
            combined = combined + flag.to(combined.device, non_blocking=True)
        return combined

    # ------------------------------------------------------------------ internals

    def _check_scaled(self, method: str) -> None:
        """GradScaler's condition for ``unscale_``/``step``/``update``: some loss was scaled before."""
        if not self._has_scaled:
            raise ScaleNotCalledError(
                f"{type(self).__name__}.{method}() was called before any scaler.scale(loss): the gradients "
                "were not made with this scaler's scale. Call scaler.scale(loss).backward() first "
                "(torch.amp.GradScaler raises here too)."
            )

    def _check_new_scale_tensor(self, new_scale: torch.Tensor) -> None:
        """GradScaler's rules for a tensor ``update(new_scale=...)``: one element, no grad, the scaler's
        device type (when it was given one)."""
        if new_scale.numel() != 1 or new_scale.requires_grad:
            raise ValueError(
                "update(new_scale=...) takes a float or a 1-element tensor with requires_grad=False, got a "
                f"tensor of shape {tuple(new_scale.shape)} (requires_grad={new_scale.requires_grad})"
            )
        if self._device is not None and new_scale.device.type != self._device:
            raise ValueError(
                f"update(new_scale=...) got a tensor on '{new_scale.device.type}' but this scaler was made "
                f"for device '{self._device}'; pass a float or a tensor on '{self._device}'"
            )

    def _scale_nested(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value * self._scale_tensor(value.device)
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
            return type(value)(*(self._scale_nested(v) for v in value))
        if isinstance(value, (list, tuple)):
            return type(value)(self._scale_nested(v) for v in value)
        raise TypeError(
            f"scale() takes a Tensor or a (nested) list/tuple of Tensors, got {type(value).__name__}"
        )

    def _fallback_device(self) -> torch.device | str:
        """Where a found-inf flag lives when no gradient says: the last ``scale()``'s device, else the
        scaler's ``device``, else the CPU."""
        return self._last_device or self._device or "cpu"

    @staticmethod
    def _record_found_inf(record: _OptimizerRecord) -> bool:
        if record.found_inf_host is not None:
            return record.found_inf_host
        if record.found_inf is None:
            return False
        return bool(record.found_inf.item() != 0.0)  # only for an optimizer unscaled but never stepped

    def __repr__(self) -> str:
        state = f"scale={self._current_scale():g}" if self._enabled else "enabled=False"
        return f"{type(self).__name__}({state})"


# ---------------------------------------------------------------------- shared helpers


def distributed_world_size() -> int:
    """The default process group's world size, or 1 when ``torch.distributed`` is absent or uninitialized."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def device_type(device: Any, owner: str = "LossScaler", keyword: str = "init_scale") -> str | None:
    """The device type of GradScaler's leading ``device`` argument: ``"cuda"`` for ``"cuda"``, ``"cuda:1"``
    or ``torch.device("cuda", 1)``; ``None`` stays ``None`` (any device).

    Raises:
        TypeError: for anything but a string or ``torch.device``, a number in particular: the first
            positional argument is the device, as in GradScaler, not a scale.
        ValueError: for a string that names no device type.
    """
    if device is None:
        return None
    if isinstance(device, torch.device):
        return device.type
    if not isinstance(device, str):
        raise TypeError(
            f"{owner}'s first argument is the device, as in torch.amp.GradScaler('cuda', ...): a string such "
            f"as 'cuda' or 'cpu', or a torch.device, got {device!r}; pass it by keyword: "
            f"{owner}(..., {keyword}={device!r})"
        )
    try:
        return torch.device(device).type
    except (RuntimeError, ValueError):
        raise ValueError(
            f"{owner} got device {device!r}, which names no device type; use e.g. 'cuda' or 'cpu'"
        ) from None


def reduce_found_inf(found_inf: torch.Tensor) -> torch.Tensor:
    """All-reduce (MAX) a 0-dim found-inf flag over the default process group; identity on one process.

    Called on the device tensor before anyone reads it, so it adds no host sync: with NCCL the collective
    is queued on the device; with gloo (CPU tensors) it returns once every rank has contributed. Cost: one
    collective of one float. A rank that found no Inf/NaN still learns of another rank's, so all ranks skip
    the same steps and keep identical scales.
    """
    if distributed_world_size() > 1:
        torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX)
    return found_inf


def to_float32(value: float) -> float:
    """Round a Python float to the nearest float32, so the host scale equals its device copy exactly."""
    return float(torch.tensor(float(value), dtype=torch.float32))


class OptionError(ConfigError):
    """A bad option value: ``field`` (``scaler.t_uf``), what is wrong (``problem``) and an example of a good
    value; the message is ``<field> <problem>; e.g. <field>=<example>``. The config schema reports it under
    its own key (``adaloss.runner.schemas``)."""

    def __init__(self, field: str, problem: str, example: Any) -> None:
        sep = "" if problem.startswith(("=", ":")) else " "
        super().__init__(f"{field}{sep}{problem}; e.g. {field}={example}")
        self.field, self.problem, self.example = field, problem, example


# The library's option validators (every scaler's and the adaptive recipe's): each parses a value from a
# constructor or from config (numbers may arrive as strings from the CLI) or raises an OptionError.


def positive_number(value: Any, field: str, example: str) -> float:
    """A finite, strictly positive number that fits in float32."""
    number = _parse_float(value)
    if number is None or not math.isfinite(number) or number <= 0.0:
        raise OptionError(field, f"must be a positive number, got {value!r}", example)
    if not math.isfinite(to_float32(number)):
        raise OptionError(field, f"must fit in float32 (at most 3.4e38), got {value!r}", example)
    return number


def number_in_range(
    value: Any, field: str, low: float, high: float, bounds: str, example: str, what: str = "a number"
) -> float:
    """A number strictly between ``low`` and ``high`` (``bounds`` in words)."""
    number = _parse_float(value)
    if number is None or not (low < number < high):
        raise OptionError(field, f"must be {what} {bounds}, got {value!r}", example)
    return number


def positive_int(value: Any, field: str, example: str) -> int:
    """A positive integer (``"3"`` and ``3.0`` are accepted, ``2.5`` is not)."""
    number = _parse_float(value)
    if number is None or not number.is_integer() or number < 1:
        raise OptionError(field, f"must be a positive integer, got {value!r}", example)
    return int(number)


def optional_bound(value: Any, field: str, example: str, allow_zero: bool, auto: bool = False) -> Any:
    """An optional scale bound: ``None`` means unbounded; otherwise a finite number > 0 (or >= 0); with
    ``auto``, the string ``"auto"`` too (the rule's default), returned as ``"auto"``."""
    if value is None:
        return None
    if auto and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    number = _parse_float(value)
    low_ok = number is not None and (number >= 0.0 if allow_zero else number > 0.0)
    if number is None or not math.isfinite(number) or not low_ok:
        kind = "a number >= 0" if allow_zero else "a positive number"
        tail = ", null (no bound) or auto" if auto else " or null"
        raise OptionError(field, f"must be {kind}{tail}, got {value!r}", example)
    return number


def boolean(value: Any, field: str) -> bool:
    """``True`` or ``False`` (not 1, not ``"yes"``)."""
    if not isinstance(value, bool):
        raise OptionError(field, f"must be true or false, got {value!r}", "true")
    return value


def one_of(value: Any, field: str, choices: tuple[str, ...]) -> str:
    """One of ``choices``, case and surrounding blanks ignored; returned as the choice."""
    name = value.strip().lower() if isinstance(value, str) else None
    if name not in choices:
        raise OptionError(field, f"must be one of {', '.join(choices)}, got {value!r}", choices[0])
    return name


def _parse_float(value: Any) -> float | None:
    """``float(value)`` for numbers and numeric strings; ``None`` for anything else (booleans included)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float, str)):
        try:
            return float(value)
        except (ValueError, OverflowError):
            return None
    return None
