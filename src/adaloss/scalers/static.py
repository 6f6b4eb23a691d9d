"""Scalers whose scale never changes: ``none`` (scale 1) and ``fixed`` (a constant chosen by the user)."""

from __future__ import annotations

from typing import Any

import torch

from adaloss.scalers.base import LossScaler, positive_number

__all__ = ["FixedLossScaler", "NoLossScaler"]


class NoLossScaler(LossScaler):
    """Plain mixed precision training: the loss is not scaled, but overflowing steps are still skipped.

    * ``scaler.scale(loss)`` multiplies by 1.0 (exact, so gradients are those of the unscaled loss).
    * ``scaler.step(optimizer)`` checks the gradients and skips ``optimizer.step()`` if any is Inf/NaN.
    * ``scaler.update()`` leaves the scale at 1.0.

    This is the paper's "None" column. Skipping rather than applying a non-finite step means a run that
    diverges in FP16 shows up as a growing ``skipped_steps`` count, not as NaN weights from which it cannot
    recover. The check costs one pass over the gradients and one host-device sync per step, like every scaler.

    Example::

        scaler = NoLossScaler()
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = criterion(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

    Its scale never changes, so it has no growth or backoff getters and setters (see ``LossScaler``).

    Args:
        device (str or torch.device, optional, default=None): As GradScaler's first argument (see
            ``LossScaler``): ``"cuda"`` without CUDA disables the scaler with a warning.
        enabled (bool, optional, default=True): If ``False``, every method is a passthrough and Inf/NaN steps
            are applied, as with no scaler at all.
    """

    name = "none"
    _number_keyword = "enabled"

    def __init__(self, device: str | torch.device | None = None, enabled: bool = True) -> None:
        super().__init__(device, init_scale=1.0, enabled=enabled)

    def _set_loss_scale(self, value: float) -> None:
        if value != 1.0:
            raise ValueError(
                f"scaler=none keeps the loss scale at 1.0, got {value!r}; use scaler=fixed to set one"
            )
        super()._set_loss_scale(value)


class FixedLossScaler(LossScaler):
    """Loss scaling by a constant ``S`` (Micikevicius et al., 2018): the paper's "Fixed" column.

    * ``scaler.scale(loss)`` multiplies the loss by ``S``.
    * ``scaler.step(optimizer)`` divides the gradients by ``S`` and calls ``optimizer.step()`` unless one of
      them is Inf/NaN, in which case the step is skipped and counted.
    * ``scaler.update()`` leaves ``S`` unchanged.

    ``S`` must be tuned per model: too small and gradients below FP16's smallest subnormal (2**-24) flush
    to zero; too large and they overflow past 65504, and every such step is skipped. A power of two unscales
    exactly; other values add one rounding per gradient element.

    Example::

        scaler = FixedLossScaler("cuda", scale=128)  # or FixedLossScaler(scale=128): any device
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = criterion(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

    Its scale never changes, so it has no growth or backoff getters and setters (see ``LossScaler``).

    Args:
        device (str or torch.device, optional, default=None): As GradScaler's first argument (see
            ``LossScaler``); the scale comes second and is best passed by keyword.
        scale (float, optional, default=128): The constant loss scale; a finite positive number (numeric
            strings from the command line are accepted).
        enabled (bool, optional, default=True): If ``False``, every method is a passthrough.

    Raises:
        ConfigError: if ``scale`` is not a finite positive number.
        TypeError: if the first positional argument is a number rather than a device.
    """

    name = "fixed"
    _number_keyword = "scale"

    def __init__(
        self, device: str | torch.device | None = None, scale: Any = 128.0, enabled: bool = True
    ) -> None:
        super().__init__(device, init_scale=positive_number(scale, "scaler.scale", "128"), enabled=enabled)
