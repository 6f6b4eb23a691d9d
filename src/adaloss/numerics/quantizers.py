"""Gradient quantizers: how a gradient is scaled before it is stored in FP8 (``precision.grad_scaling``).

Without a quantizer (recipe ``none``) a gradient is rounded to the gradient format as it is: the loss scaler's
global scale is the only scaling, and what falls below ``u_min`` underflows. The other recipes scale each
stored gradient into the format's range first, round, and multiply the rounded values back (*dequantize*),
so the value that flows on in the backward pass is the one a real FP8 kernel would have seen after reading
its FP8 operand and its scale, as Transformer Engine's and torchao's emulations do:

- ``none``: ``s = 1``, the loss scale only (the emulation before gradient quantizers);
- ``tensor_current`` (TE ``Float8CurrentScaling``): ``s = fp8_max / amax(x)`` of the tensor itself;
- ``tensor_delayed`` (TE ``DelayedScaling``): ``s = (fp8_max / amax) / 2^margin``, the amax taken from a
  history of the same tensor in earlier steps;
- ``mx_block`` (OCP Microscaling v1.0; Mishra et al. 2025): ``s = 2^-e`` per block of 32 elements, ``e``
  an E8M0 exponent (``floor``, ``ceil`` or ``rceil``).

Which gradients: every one the emulation stores in the gradient format (``EmulatedAutocast``'s rounding
nodes): the gradient of each stored activation (GEMM outputs and every other value autocast would keep in
FP16) and of each weight's per-step low-precision copy. Transformer Engine quantizes the gradient entering
each GEMM's backward and keeps the weight-gradient output in higher precision; the emulation has always
stored all of these in the gradient format, and the quantizers keep that scope, so ``none`` and the other
recipes differ only in scaling.

Every scale is the published formula rounded once to FP32: ``fp8_max / amax`` is one IEEE division (TE's
``__fdiv_rn``), never ``amax.reciprocal() * fp8_max``, which is what torch makes of ``float / tensor`` and
which misses the correctly rounded scale for about a quarter of amaxes.

The stored value is ``round(clamp(x * s, -fp8_max, fp8_max)) * s_inv``, ``s_inv = 1 / s`` rounded to FP32
(TE's ``scale_inv``): scaled values past the format's largest finite value saturate (TE's and the OCP
conversion's behaviour), and an element that is Inf or NaN stays as it is so the loss scalers still see the
overflow (also under ``none`` for E4M3, whose torch cast would turn Inf into 448). The recipe is data (the
frozen dataclasses below); :class:`GradQuantizer` is the one mechanism that applies any of them, and
:func:`quantize_grad` is the one call a backward node makes. Nothing here synchronizes host and device:
amaxes, scales and histories stay tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from adaloss.errors import ConfigError
from adaloss.numerics.formats import FloatFormat, round_to_format

__all__ = [
    "GlobalScaling",
    "CurrentScaling",
    "DelayedScaling",
    "MXBlockScaling",
    "RECIPES",
    "recipe_from_config",
    "GradQuantizer",
    "GradSite",
    "QuantStats",
    "quantize_grad",
    "reduce_amax",
]

#: The E8M0 scale's exponent range (OCP MX v1.0, section 5.4.1: 2^-127 .. 2^127; the code 0xFF is NaN).
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127
#: TE's stand-in for a scale that is infinite in FP32 (an amax so small that fp8_max / amax overflows).
FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class GlobalScaling:
    """Recipe ``none``: no per-tensor scale. Each gradient is rounded to the gradient format as it arrives,
    so the loss scaler's scale is the only one (the emulation before gradient quantizers). No fields."""

    name: str = "none"


@dataclass(frozen=True)
class CurrentScaling:
    """Recipe ``tensor_current`` (TE ``Float8CurrentScaling``): one scale per tensor from its own amax.

    ``amax = max(max|x|, amax_epsilon)``; ``s = fp8_max / amax``, one FP32 division rounded to nearest even
    (TE's ``__fdiv_rn(max_fp8, amax)``). Fallbacks (as TE's ``compute_scale_from_amax``): an amax of 0, Inf
    or NaN keeps ``s = 1``; an ``s`` that overflows FP32 becomes the largest FP32 value.
    With ``power_2_scale`` the scale is then rounded down to a power of two (``2^floor(log2 s)``, TE keeps the
    exponent bits of the FP32 scale), so scaling is exact and the largest element lands in ``(fp8_max/2,
    fp8_max]``.

    Args:
        power_2_scale (bool, default False): round the scale down to a power of two.
        amax_epsilon (float, default 0.0): a floor on the amax; a tensor of tinier values is scaled as if its
            amax were this (bounds the scale).
        reduce_amax (bool, default False): under data parallelism, the amax is the maximum over the ranks
            (one all-reduce per stored gradient, TE's amax reduction group), so every rank scales the same
            tensor alike; off, each rank scales with its own amax.
    """

    name: str = "tensor_current"
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    reduce_amax: bool = False


@dataclass(frozen=True)
class DelayedScaling:
    """Recipe ``tensor_delayed`` (TE ``DelayedScaling``): the scale of each stored gradient comes from the
    amaxes of the same tensor in earlier steps.

    Each gradient site keeps an amax history of ``history_len`` steps and a scale (1 at first). A step
    quantizes with the scale it has, then updates as TE's ``amax_and_scale_update`` does: the new amax goes
    into the window, ``amax = max(window)`` (``max``) or the new amax (``most_recent``), and ``s = (fp8_max /
    amax) / 2^margin``, computed as TE's kernel does: ``scaled_max = fp8_max * 2^-margin`` (exact), then one
    FP32 division ``scaled_max / amax`` rounded to nearest even, which is the formula rounded once (for
    margins up to 149); an ``s`` that overflows FP32 becomes the largest FP32 value (TE); an amax of 0, Inf
    or NaN keeps the previous scale. The window holds the last
    ``history_len`` amaxes, so a non-finite amax (an overflowing step) freezes the scale under ``max`` until
    it has left the window, as in TE. Values the stale scale pushes past ``fp8_max`` saturate. The state is
    part of the run (:meth:`GradQuantizer.state_dict`).

    A site is the n-th gradient-storing value of a forward pass (with its layer's name), so the same
    tensor of every training step shares one history; a model whose forward pass stores a different
    sequence of values from step to step would mix histories. Under data parallelism each rank keeps its
    own histories unless ``reduce_amax`` (TE's ``DelayedScaling.reduce_amax``): then each step's amax is
    the maximum over the ranks before it enters the history, so every rank holds the same history and scale.

    Args:
        margin (int, default 0): head-room in powers of two: the scale is divided by ``2^margin``.
        history_len (int, default 1024): the amax window, in steps.
        amax_compute (str, default "max"): ``max`` (the largest amax in the window) or ``most_recent``.
        reduce_amax (bool, default False): all-reduce (max) each step's amax over the ranks under data
            parallelism (see :class:`CurrentScaling`).
    """

    name: str = "tensor_delayed"
    margin: int = 0
    history_len: int = 1024
    amax_compute: str = "max"
    reduce_amax: bool = False


@dataclass(frozen=True)
class MXBlockScaling:
    """Recipe ``mx_block`` (OCP Microscaling v1.0, MXFP8): one power-of-two scale per block of 32 elements.

    Blocks run along one dimension of the gradient: the channel dimension (1) for a convolution's output
    and for other 4-D and 5-D tensors (NCHW/NCDHW activations), the last dimension otherwise (a linear
    layer's output features, a weight's input features). For a layer's output gradient that is the dimension
    the dgrad GEMM reduces over (it computes the input gradient, the one that flows on), as MX requires of
    a GEMM operand. A dimension whose size is not a multiple of 32 ends in a shorter block: it is padded
    with zeros, which change no block's amax, and the padding is dropped after dequantization.

    The block's scale is ``X = 2^e`` (E8M0) with, for ``amax = max|x|`` over the block and ``fp8_max`` the
    element format's largest value (``emax_elem = floor(log2 fp8_max)``: 8 for E4M3, 15 for E5M2):

    - ``floor`` (OCP MX v1.0, section 6.3): ``e = floor(log2 amax) - emax_elem``. ``amax / X`` may reach
      ``2^(emax_elem+1)`` and then saturates at ``fp8_max``.
    - ``ceil`` (Mishra et al. 2025, "Recipes for Pre-training LLMs with MXFP8"): ``e = ceil(log2(amax /
      fp8_max))``, the smallest exponent with ``amax / X <= fp8_max``: nothing saturates.
    - ``rceil``: ``amax / fp8_max`` computed in FP32 and converted to E8M0 rounding toward +infinity (the
      hardware conversion). For FP32 gradients and ``fp8_max = 1.75 * 2^k`` (both FP8 formats) this gives
      ``ceil``'s exponent for every amax; it exists so that a run names the conversion it means.

    ``e`` is clamped to E8M0's ``[-127, 127]`` (an all-zero block gets ``2^-127`` and stays zero); a block
    whose amax is Inf or NaN gets the NaN scale, so its elements dequantize to NaN. Each element is then
    ``round(clamp(x / X)) * X``, exact in FP32 because ``X`` is a power of two.

    Args:
        rounding (str, default "floor"): ``floor``, ``ceil`` or ``rceil``.
        block_size (int, default 32): elements per scale (32 in MX v1.0).
    """

    name: str = "mx_block"
    rounding: str = "floor"
    block_size: int = 32


Recipe = GlobalScaling | CurrentScaling | DelayedScaling | MXBlockScaling
RECIPES: dict[str, type] = {
    "none": GlobalScaling,
    "tensor_current": CurrentScaling,
    "tensor_delayed": DelayedScaling,
    "mx_block": MXBlockScaling,
}
#: The allowed values of the string fields.
_CHOICES = {"amax_compute": ("max", "most_recent"), "rounding": ("floor", "ceil", "rceil")}


def recipe_from_config(value: Any) -> Recipe:
    """The recipe named by ``precision.grad_scaling``: a name (``mx_block``) or a mapping with ``name`` and
    the recipe's fields (``{name: mx_block, rounding: ceil}``). A bad value is a one-line ConfigError."""
    options = dict(value) if isinstance(value, Mapping) else {"name": value}
    name = str(options.pop("name", None))
    if name not in RECIPES:
        raise ConfigError(
            f"unknown precision.grad_scaling '{name}': choose one of {', '.join(RECIPES)} "
            "(or {name: <recipe>, <field>: <value>})"
        )
    cls = RECIPES[name]
    known = {f.name: f for f in fields(cls) if f.name != "name"}
    unknown = sorted(str(k) for k in options if k not in known)
    if unknown:
        raise ConfigError(
            f"precision.grad_scaling={name} has no field(s) {', '.join(unknown)}; its fields are: "
            f"{', '.join(known) or 'none'}"
        )
    checked = {key: _check_field(name, key, known[key].default, v) for key, v in options.items()}
    return cls(**checked)


def _check_field(recipe: str, key: str, default: Any, value: Any) -> Any:
    where = f"precision.grad_scaling {recipe}.{key}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(default, str):
        if str(value) not in _CHOICES[key]:
            raise ConfigError(f"{where} must be one of {', '.join(_CHOICES[key])}, got {value!r}")
        return str(value)
    if isinstance(default, int):
        low = {"margin": 0, "history_len": 1, "block_size": 1}[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{where} must be an integer >= {low}, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < math.inf:
        raise ConfigError(f"{where} must be a finite number >= 0, got {value!r}")
    return float(value)


# ----------------------------------------------------------------------------------------- the formulas


def divide_once(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` rounded once to float32 (IEEE division, round to nearest even), as TE's
    ``__fdiv_rn(max_fp8, amax)``. ``python_float / tensor`` would not be: torch evaluates it as
    ``denominator.reciprocal() * numerator``, two roundings, which miss the correctly rounded quotient for
    about a quarter of float32 amaxes. The numerator is filled on the denominator's device (no host-to-device
    copy); ``denominator`` is a float32 tensor of any shape."""
    return torch.full_like(denominator, numerator) / denominator


def current_scale(amax: torch.Tensor, fp8_max: float, recipe: CurrentScaling) -> torch.Tensor:
    """``fp8_max / max(amax, amax_epsilon)``, one correctly rounded float32 division, with TE's fallbacks and
    optional power-of-two floor (see :class:`CurrentScaling`). ``amax`` is a float32 tensor of any shape; no
    host sync."""
    amax = amax.float()
    if recipe.amax_epsilon > 0.0:
        amax = torch.where(amax < recipe.amax_epsilon, torch.full_like(amax, recipe.amax_epsilon), amax)
    scale = divide_once(fp8_max, amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLOAT32_MAX), scale)
    keep = (amax == 0) | ~torch.isfinite(amax)
    scale = torch.where(keep, torch.ones_like(scale), scale)
    if recipe.power_2_scale:
        scale = _pow2_floor(scale)
    return scale


def _pow2_floor(x: torch.Tensor) -> torch.Tensor:
    """``2^floor(log2 x)`` for positive finite ``x``: the FP32 value with its mantissa bits cleared."""
    _, exp = torch.frexp(x)  # x = m * 2^exp, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), exp - 1)


def delayed_update(
    history: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, fp8_max: float, recipe: DelayedScaling
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of TE's delayed-scaling update for one tensor: put ``amax`` in the window, choose the amax,
    compute the next scale; returns ``(history, scale)`` (new tensors).

    The layout is TE's: ``history[0]`` is the slot of the step being recorded, ``history[1:]`` the
    ``history_len - 1`` steps before it, oldest first. After the scale is computed the window rolls by one
    (``history[i] <- history[i+1]``, the recorded amax moves to the end, the oldest one drops out) and slot 0
    is cleared for the next step.
    """
    current = torch.cat([amax.float().reshape(1), history[1:]])
    chosen = current.max() if recipe.amax_compute == "max" else current[0]
    # TE's kernel: scaled_max = fp8_max * 2^-margin (exact), then one division scaled_max / amax
    new_scale = divide_once(math.ldexp(fp8_max, -recipe.margin), chosen)
    new_scale = torch.where(torch.isinf(new_scale), torch.full_like(new_scale, FLOAT32_MAX), new_scale)
    keep = (chosen == 0) | ~torch.isfinite(chosen)
    new_scale = torch.where(keep, scale, new_scale)
    if current.numel() == 1:
        return torch.zeros_like(current), new_scale
    # rolled by one with slot 0 cleared: [0, h2, ..., h_(len-1), h0] (h1, the oldest, leaves the window)
    rolled = torch.cat([torch.zeros_like(current[:1]), current[2:], current[:1]])
    return rolled, new_scale


def mx_exponents(amax: torch.Tensor, fp8_max: float, rounding: str) -> torch.Tensor:
    """The E8M0 exponent ``e`` of each block's scale ``2^e`` (float32 tensor; NaN where the amax is not
    finite), by the rule of :class:`MXBlockScaling`. Exact: integer exponent arithmetic, no ``log2``."""
    amax = amax.float()
    mant, exp = torch.frexp(amax)  # amax = mant * 2^exp, mant in [0.5, 1); frexp(0) = (0, 0)
    max_mant, max_exp = math.frexp(fp8_max)
    if rounding == "floor":
        e = (exp - 1) - (max_exp - 1)  # floor(log2 amax) - emax_elem
    elif rounding == "ceil":
        # amax / fp8_max = (mant / max_mant) * 2^(exp - max_exp), and mant / max_mant is in (0.5, 2): its
        # log2 is in (-1, 0] exactly when mant <= max_mant, else in (0, 1)
        e = exp - max_exp + (mant > max_mant).to(exp.dtype)
    else:  # rceil: the FP32 quotient (one rounding: on CUDA ``amax / float`` is ``amax * (1 / float)``),
        # rounded up to a power of two
        q_mant, q_exp = torch.frexp(amax / amax.new_full((), fp8_max))
        e = q_exp - (q_mant == 0.5).to(q_exp.dtype)
        e = torch.where(q_mant == 0, torch.full_like(e, E8M0_MIN_EXP), e)
    e = torch.where(amax == 0, torch.full_like(e, E8M0_MIN_EXP), e)
    e = e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP).float()
    return torch.where(torch.isfinite(amax), e, torch.full_like(e, math.nan))


def reduce_amax(amax: torch.Tensor) -> torch.Tensor:
    """The maximum of ``amax`` over the ranks of the default process group (a new tensor; ``amax`` itself
    outside data parallelism). A NaN amax counts as Inf, so a rank's non-finite amax reaches every rank
    whatever the backend does with NaN in a max, and the recipes' fallbacks treat both alike. Every rank
    must quantize the same sequence of gradients (the same model): each call is one collective."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return amax
    reduced = torch.where(torch.isnan(amax), math.inf, amax)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return reduced


# --------------------------------------------------------------------------------------- the mechanism


@dataclass
class QuantStats:
    """What one quantization did, for telemetry (tensors: no host sync): ``saturated`` (finite elements
    whose scaled magnitude exceeded ``fp8_max``), ``scale_min`` / ``scale_max`` (over the tensor's scale or
    its blocks with a non-zero finite amax; None when no block had one)."""

    saturated: torch.Tensor
    scale_min: torch.Tensor | None
    scale_max: torch.Tensor | None


@dataclass(frozen=True)
class GradSite:
    """One place a gradient is stored: the quantizer, the key of its state (delayed scaling) and the
    dimension blocks run along (MX). Made by ``EmulatedAutocast.grad_site`` in the forward pass."""

    quantizer: GradQuantizer
    key: str
    dim: int


class GradQuantizer:
    """Applies a recipe to gradients; holds the per-site state of ``tensor_delayed``.

    Example::

        quantizer = GradQuantizer(DelayedScaling(history_len=16), get_format("fp8_e4m3"))
        site = GradSite(quantizer, key="fc1", dim=-1)
        stored = quantize_grad(grad, quantizer.fmt, site)      # dequantized: flows on in the backward
        checkpoint["grad_quantizer"] = quantizer.state_dict()

    Args:
        recipe: one of :data:`RECIPES`' dataclasses.
        fmt (FloatFormat): the gradient format (its ``u_max`` is ``fp8_max``).
    """

    def __init__(self, recipe: Recipe, fmt: FloatFormat) -> None:
        self.recipe = recipe
        self.fmt = fmt
        self._delayed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def scales(self) -> bool:
        """Whether the recipe scales at all (``none`` does not)."""
        return not isinstance(self.recipe, GlobalScaling)

    def quantize(
        self, x: torch.Tensor, key: str, dim: int, stats: bool = False
    ) -> tuple[torch.Tensor, QuantStats | None]:
        """``x`` scaled, rounded to the format (saturating) and unscaled; with ``stats``, what that did.
        Updates the delayed state of ``key``. No host sync."""
        recipe, fp8_max = self.recipe, self.fmt.u_max
        if isinstance(recipe, MXBlockScaling):
            return self._quantize_blocks(x, dim, stats)
        if isinstance(recipe, GlobalScaling):  # plain rounding: overflow gives the format's Inf (or its max)
            one = torch.ones((), dtype=torch.float32, device=x.device)
            saturated = (torch.isfinite(x) & (x.abs() > fp8_max)).sum() if stats else None
            return _round_keeping_non_finite(x, self.fmt), (
                QuantStats(saturated, one, one) if stats else None
            )
        else:
            amax = x.detach().abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
            if recipe.reduce_amax:
                amax = reduce_amax(amax)
            if isinstance(recipe, CurrentScaling):
                scale = current_scale(amax, fp8_max, recipe)
            else:
                scale = self._delayed_scale(key, amax, x.device)
        out, saturated = self._saturating_round(x, scale, stats)
        return out, (QuantStats(saturated, scale, scale) if stats else None)

    def _delayed_scale(self, key: str, amax: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The scale ``key`` has now; records ``amax`` and moves to the next scale (TE's update)."""
        recipe = self.recipe
        state = self._delayed.get(key)
        if state is None:
            history = torch.zeros(recipe.history_len, dtype=torch.float32, device=device)
            state = (history, torch.ones((), dtype=torch.float32, device=device))
        history, scale = state
        self._delayed[key] = delayed_update(history, scale, amax, self.fmt.u_max, recipe)
        return scale

    def _saturating_round(
        self, x: torch.Tensor, scale: torch.Tensor, stats: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``round(clamp(x * scale)) / scale`` (non-finite elements kept) and the count of saturated ones."""
        fp8_max = self.fmt.u_max
        scaled = x * scale.to(x.dtype)
        finite = torch.isfinite(scaled)
        saturated = (finite & (scaled.abs() > fp8_max)).sum() if stats else None
        rounded = round_to_format(scaled.clamp(-fp8_max, fp8_max), self.fmt)
        # dequantized with TE's scale_inv = 1 / scale (one rounding), not a division by the scale
        out = torch.where(finite, rounded * torch.reciprocal(scale).to(x.dtype), scaled)
        return out, saturated

    def _quantize_blocks(
        self, x: torch.Tensor, dim: int, stats: bool
    ) -> tuple[torch.Tensor, QuantStats | None]:
        """MX: blocks of ``block_size`` along ``dim`` (a shorter last block), one E8M0 scale each.

        When ``dim``'s size ``n`` is a multiple of the block size or at most one block, ``x`` is viewed as
        ``(before, n / block, block, after)`` and blocks are reduced in place along axis 2, without moving
        ``dim`` or copying; other sizes take the zero-padded path (:meth:`_quantize_padded_blocks`)."""
        size = self.recipe.block_size
        shape = x.shape
        dim = dim % x.dim() if x.dim() else 0
        n = shape[dim] if x.dim() else 1
        if n % size and n > size:
            return self._quantize_padded_blocks(x, dim, stats)
        block = min(n, size) if n else size
        before, after = math.prod(shape[:dim]), math.prod(shape[dim + 1 :])
        blocks = x.reshape(before, n // block, block, after)
        out, quant_stats = self._round_blocks(blocks, 2, stats)
        return out.reshape(shape), quant_stats

    def _quantize_padded_blocks(
        self, x: torch.Tensor, dim: int, stats: bool
    ) -> tuple[torch.Tensor, QuantStats | None]:
        """MX along ``dim`` of a size that is neither a multiple of the block size nor one block: ``dim``
        moved last and zero-padded to a multiple (zeros change no block's amax), the padding dropped after."""
        size = self.recipe.block_size
        moved = x.movedim(dim, -1)
        n = moved.shape[-1]
        padded = torch.nn.functional.pad(moved, (0, -n % size))
        blocks = padded.reshape(*padded.shape[:-1], padded.shape[-1] // size, size)
        out, quant_stats = self._round_blocks(blocks, -1, stats)
        return out.reshape(padded.shape)[..., :n].movedim(-1, dim), quant_stats

    def _round_blocks(
        self, blocks: torch.Tensor, axis: int, stats: bool
    ) -> tuple[torch.Tensor, QuantStats | None]:
        """Each block (the elements along ``axis``) scaled by its ``2^-e``, rounded (saturating) and
        unscaled: ``round(clamp(x * 2^-e)) * 2^e``. The scaled values are finite or NaN (a block with an Inf
        or NaN has the NaN scale; a finite amax times ``2^-e <= 2^127`` stays finite), so clamping and
        rounding in place keep NaN where the general path keeps it."""
        fp8_max = self.fmt.u_max
        amax = blocks.detach().abs().amax(dim=axis, keepdim=True).float()
        e = mx_exponents(amax, fp8_max, self.recipe.rounding)
        scale = torch.exp2(-e)  # the multiplier 1 / X; NaN for a non-finite block
        if blocks.dtype != torch.float32:  # 2^127 may overflow a narrower dtype: the general path
            out, saturated = self._saturating_round(blocks, scale, stats)
            return out, self._block_stats(amax, scale, saturated) if stats else None
        scaled = blocks * scale
        saturated = (scaled.abs() > fp8_max).sum() if stats else None  # NaN compares False
        if self.fmt.ieee_specials:  # E4M3's rounding saturates by itself (round_to_format): no clamp
            scaled.clamp_(-fp8_max, fp8_max)
        out = round_to_format(scaled, self.fmt)
        out = out.mul_(1.0 / scale)
        return out, self._block_stats(amax, scale, saturated) if stats else None

    @staticmethod
    def _block_stats(amax: torch.Tensor, scale: torch.Tensor, saturated: torch.Tensor) -> QuantStats:
        """The scale range over the blocks with a non-zero finite amax."""
        valid = torch.isfinite(amax) & (amax > 0)
        scale_min = torch.where(valid, scale, math.inf).amin()
        scale_max = torch.where(valid, scale, -math.inf).amax()
        return QuantStats(saturated, scale_min, scale_max)

    def state_dict(self) -> dict[str, Any]:
        """The recipe's fields and, for ``tensor_delayed``, each site's amax history and scale (tensors)."""
        return {
            "recipe": {f.name: getattr(self.recipe, f.name) for f in fields(self.recipe)},
            "sites": {k: {"amax_history": h, "scale": s} for k, (h, s) in self._delayed.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s sites; a checkpoint of another recipe is a ConfigError (the delayed
        state would silently mean something else)."""
        saved = recipe_from_config(state.get("recipe", {"name": "none"}))
        if saved != self.recipe:
            raise ConfigError(
                f"the checkpoint's gradient quantizer is {saved}, this run's is {self.recipe}: resume "
                "with the same precision.grad_scaling"
            )
        self._delayed = {
            str(k): (v["amax_history"].float().clone(), v["scale"].float().clone())
            for k, v in state.get("sites", {}).items()
        }


def quantize_grad(
    grad: torch.Tensor, fmt: FloatFormat, site: GradSite | None = None, probe: Any = None
) -> torch.Tensor:
    """Store ``grad`` in ``fmt``: through ``site``'s quantizer when there is one, else plain rounding (the
    global loss scale only). Returns the stored (dequantized) value, which flows on in the backward pass.

    ``probe`` (an :class:`adaloss.numerics.emulation.Probe`, telemetry steps only) records underflow,
    saturation, the scale range and the SQNR of the stored value against ``grad``. The one call a backward
    node makes where it stores a gradient. No host sync.
    """
    if site is None or not site.quantizer.scales:
        rounded = _round_keeping_non_finite(grad, fmt)
        if probe is not None:
            probe.record(grad, rounded)
        return rounded
    out, stats = site.quantizer.quantize(grad, site.key, site.dim, stats=probe is not None)
    if probe is not None:
        probe.record(grad, out, stats)
    return out


def _round_keeping_non_finite(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """:func:`round_to_format`, except that for a format without Inf (E4M3) Inf and NaN elements stay as
    they are instead of becoming ``u_max`` (torch's E4M3 cast saturates even Inf), so an overflow still
    reaches the loss scaler. Formats with Inf (E5M2) are rounded as they are: one pass."""
    rounded = round_to_format(x, fmt)
    return rounded if fmt.ieee_specials else torch.where(torch.isfinite(x), rounded, x)
