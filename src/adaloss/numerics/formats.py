"""Low-precision floating-point formats and rounding to them.

A :class:`FloatFormat` is described by its exponent and mantissa widths, which fixes everything loss scaling
cares about: ``u_min`` (the smallest positive subnormal: anything smaller in magnitude underflows to zero),
``u_max`` (the largest finite value: anything beyond rounds to infinity) and the spacing of representable
values in between.

:func:`round_to_format` maps a float32/float64 tensor to the nearest representable value of a format, with
IEEE semantics: round to nearest, ties to even; subnormals kept; magnitudes at or below half of ``u_min``
become (signed) zero, so for FP16 ``2**-25`` rounds to zero while ``2**-24`` survives; magnitudes that round
past ``u_max`` become infinite. The result keeps the input's dtype, which is what the CPU emulation of FP16
training needs: compute in FP32, but only ever store values the low-precision format could hold.

Cost: two casts for the formats torch has a dtype for (fp16, bf16, fp8), on every device. Formats without a
torch dtype use :func:`round_generic`, about ten element-wise passes. (A one-pass F16C kernel for FP16 on
the CPU saved 3.6% of an emulated ResNet-20 step and 6.7% of a tiny GPT step, measured on the project's
2-core AMD EPYC with one thread: below the 10% a native primitive must save to be kept, so it was removed.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from adaloss.errors import ConfigError

__all__ = ["FloatFormat", "FORMATS", "get_format", "round_to_format", "round_to_format_", "round_generic"]


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format with ``exponent_bits`` and ``mantissa_bits`` (fraction bits).

    ``ieee_specials`` says whether the top exponent is reserved for Inf/NaN (IEEE formats, bf16, fp8 e5m2):
    then overflow gives infinity. OCP fp8 e4m3 ("fn") has no infinity; torch's cast to it saturates at
    ``u_max`` (448), and :func:`round_generic` does the same.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    ieee_specials: bool = True
    max_finite_override: float | None = None
    dtype: torch.dtype | None = None

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def min_exponent(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def min_normal(self) -> float:
        return 2.0**self.min_exponent

    @property
    def u_min(self) -> float:
        """Smallest positive (subnormal) value: the paper's ``u_min`` (2**-24 for FP16)."""
        return 2.0 ** (self.min_exponent - self.mantissa_bits)

    @property
    def u_max(self) -> float:
        """Largest finite value: the paper's ``u_max`` (65504 for FP16)."""
        if self.max_finite_override is not None:
            return self.max_finite_override
        max_exp = 2**self.exponent_bits - 1 - self.bias - (1 if self.ieee_specials else 0)
        return (2.0 - 2.0**-self.mantissa_bits) * 2.0**max_exp

    def __str__(self) -> str:
        return self.name


FORMATS: dict[str, FloatFormat] = {
    "fp16": FloatFormat("fp16", 5, 10, dtype=torch.float16),
    "bf16": FloatFormat("bf16", 8, 7, dtype=torch.bfloat16),
    "fp8_e5m2": FloatFormat("fp8_e5m2", 5, 2, dtype=torch.float8_e5m2),
    "fp8_e4m3": FloatFormat(
        "fp8_e4m3", 4, 3, ieee_specials=False, max_finite_override=448.0, dtype=torch.float8_e4m3fn
    ),
}


def get_format(name: str | FloatFormat) -> FloatFormat:
    """Look a format up by name (``fp16``, ``bf16``, ``fp8_e5m2``, ``fp8_e4m3``)."""
    if isinstance(name, FloatFormat):
        return name
    try:
        return FORMATS[str(name)]
    except KeyError:
        raise ConfigError(f"unknown number format '{name}': choose one of {', '.join(FORMATS)}") from None


def round_to_format(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round ``x`` to the nearest value representable in ``fmt``; the result keeps ``x.dtype``.

    The cast when torch has the format (exact IEEE behaviour), else :func:`round_generic`. Always a new
    tensor. Does not synchronize host and device.
    """
    if fmt.dtype is not None and x.dtype in (torch.float32, torch.float64):
        return x.to(fmt.dtype).to(x.dtype)
    return round_generic(x, fmt)


def round_to_format_(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """In-place :func:`round_to_format`: ``x`` holds the rounded values afterwards; returns ``x``.

    Bumps ``x``'s version counter, so autograd notices the change. No host sync.
    """
    return x.copy_(round_to_format(x, fmt))


def round_generic(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round to ``fmt`` with plain tensor arithmetic (any exponent/mantissa width).

    The spacing of representable values around ``|x|`` is ``2**(e - mantissa_bits)``, where ``e`` is the
    binary exponent of ``|x|`` clamped below at the smallest normal exponent (which makes the subnormal
    range evenly spaced by ``u_min``). Dividing by the spacing, rounding half to even (``torch.round``) and
    multiplying back is exact in float64. Used for formats without a torch dtype and to cross-check the
    native casts in tests.
    """
    work = x.double()
    mag = work.abs()
    _, exp = torch.frexp(mag)  # mag = m * 2**exp with m in [0.5, 1)
    e = (exp - 1).clamp(min=fmt.min_exponent)
    spacing = torch.ldexp(torch.ones_like(work), (e - fmt.mantissa_bits))
    rounded = torch.round(work / spacing) * spacing
    # Rounding can carry into the next binade; the spacing there is coarser but the carried value
    # (a power of two) is representable, so nothing else changes.
    overflow_value = math.inf if fmt.ieee_specials else fmt.u_max  # e4m3fn saturates
    too_big = (rounded.abs() > fmt.u_max) | torch.isinf(work)
    rounded = torch.where(too_big, overflow_value * work.sign(), rounded)
    rounded = torch.where(torch.isnan(work), work, rounded)
    return rounded.to(x.dtype)
