"""FP4 block formats: NVFP4 and MXFP4, with stochastic rounding and the 16x16 random Hadamard transform.

Elements are E2M1 (OCP MX v1.0, section 5.3.3): sign, 2 exponent bits, 1 mantissa bit, the magnitudes
``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` (codes 0..7), no Inf and no NaN. :func:`round_e2m1` rounds to nearest,
ties to even (or stochastically), saturates at 6 and keeps the sign of zero.

A matrix is quantized along its last dimension (a GEMM's reduction dimension) in blocks, each with a scale:

- ``nvfp4`` (NVIDIA, "Pretraining Large Language Models with NVFP4", 2025, appendix; Transformer Engine's
  ``NVFP4BlockScaling``): blocks of 16 (16x16 tiles for weights), two scales. Per tensor, the FP32 encode
  scale ``s_enc = 6 * 448 / amax`` (one division, correctly rounded, :func:`nvfp4_global_scale`); per block,
  the decode scale ``amax_b / 6 * s_enc`` (each operation rounded once to FP32, in that order) stored in E4M3
  with round-to-nearest-even (subnormals kept, a zero scale possible), the block's encode scale
  ``1 / (e4m3_scale * s_dec)`` with ``s_dec = 1 / s_enc``, each element ``e2m1(x * enc_b)`` (the product
  rounded to FP32 first) and dequantized as ``(q * e4m3_scale) * s_dec``.
- ``mxfp4`` (OCP MX v1.0): blocks of 32, one E8M0 scale ``2^e``: ``floor`` (the spec, section 6.3: ``e =
  floor(log2 amax) - 2``, values up to ``8 * 2^e`` saturate at 6) or ``rceil`` (``amax / 6`` in FP32 rounded
  up to a power of two: nothing saturates), clamped to ``[-127, 127]``; ``e2m1(x * 2^-e) * 2^e`` (exact).

Zero, Inf and NaN, as the hardware recipes do them, with one deviation kept from the FP8 quantizers:

- an all-zero block has scale 0 (NVFP4) or ``2^-127`` (MXFP4) and stays zero; an all-zero tensor has
  ``s_enc = 1`` (TE: an amax of 0 keeps 1);
- NVFP4: a tensor amax of Inf or NaN gives ``s_enc = 1`` (TE's fallback), an ``s_enc`` past FP32's range
  becomes FP32's largest value; a block's decode scale past 448 (or NaN) is 448 (TE's ``fminf``); a zero E4M3
  scale gives the encode scale FP32's largest value (``1/0`` clamped as TE does), so the block stores zeros;
- MXFP4: a block whose amax is Inf or NaN has the NaN scale (E8M0 code 0xFF), so its finite elements
  dequantize to NaN (the spec's rule);
- deviation: the Inf or NaN element itself dequantizes to NaN (E2M1 cannot hold it; hardware saturates Inf
  to 6), so that the loss scalers still see the overflow, as the FP8 quantizers keep Inf for E4M3 (NaN
  rather than Inf: ``x * 0`` added to the result marks it with two fast passes, where ``torch.where`` costs
  as much as the whole quantization on the CPU).

A last dimension that is not a multiple of the block (or rows not a multiple of 16 for 16x16 tiles) is
padded with zeros, which change no amax, and cropped after. Stochastic rounding draws one uniform number per
element from a seeded ``torch.Generator`` (:class:`FP4Gemm` keeps it; its state goes into checkpoints): a
value between neighbours ``lo < x < hi`` becomes ``hi`` with probability ``(x - lo) / (hi - lo)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from adaloss.numerics.quantizers import FLOAT32_MAX, divide_once, mx_exponents

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "FP4_RECIPES",
    "FP4Blocks",
    "round_e2m1",
    "e2m1_codes",
    "nvfp4_global_scale",
    "nvfp4_block_scales",
    "quantize_fp4",
    "hadamard_transform",
    "random_hadamard",
]

E2M1_MAX = 6.0
#: The E2M1 magnitudes, indexed by their 3-bit code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
#: Elements per block and the block's scale format.
FP4_RECIPES = {"nvfp4": 16, "mxfp4": 32}
MX_ROUNDINGS = ("floor", "rceil")


def round_e2m1(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (float32) rounded to E2M1: nearest-even without ``generator``, else stochastically with it;
    magnitudes past 6 saturate (Inf too), NaN stays NaN, the sign of zero is kept.

    The grid spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]: half the power of two at or below
    ``clamp(|x|, 1, 4)``, read off its exponent bits (exact, and without ``where``, which is slow on the
    CPU). ``|x| / spacing`` rounded to an integer (half to even: the integer's parity is the mantissa bit's)
    times the spacing is the rounded magnitude, exactly.
    """
    mag = x.abs().clamp_(max=E2M1_MAX)
    exponent = mag.clamp(1.0, 4.0).view(torch.int32) & 0x7F800000
    spacing = (exponent - (1 << 23)).view(torch.float32)  # 2^(e - 1): 0.5, 1 or 2
    inverse = (0x7F000000 - (exponent - (1 << 23))).view(torch.float32)  # 1 / spacing, exactly
    units = mag.mul_(inverse)
    if generator is None:
        units = units.round_()
    else:
        low = torch.floor(units)
        draw = torch.rand(units.shape, generator=generator, device=units.device, dtype=units.dtype)
        units = low.add_(draw.lt_(units.sub_(low)))
    return torch.copysign(units.mul_(spacing), x)


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes (uint8: sign bit 3, magnitude code in bits 0..2) of E2M1 values ``q``."""
    grid = torch.tensor(E2M1_VALUES, dtype=q.dtype, device=q.device)
    magnitude = torch.searchsorted(grid, q.abs().contiguous())
    return (torch.signbit(q).to(torch.uint8) << 3) | magnitude.to(torch.uint8)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The NVFP4 per-tensor encode scale ``6 * 448 / amax`` (float32, one division correctly rounded);
    FP32's largest value where it overflows; 1 for an amax of 0, Inf or NaN (TE's fallbacks)."""
    amax = amax.float()
    scale = divide_once(E2M1_MAX * E4M3_MAX, amax)
    scale = torch.where(torch.isinf(scale), FLOAT32_MAX, scale)
    return torch.where((amax == 0) | ~torch.isfinite(amax), torch.ones_like(scale), scale)


def nvfp4_block_scales(
    amax_b: torch.Tensor, s_enc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(wanted, scale, s_dec, enc_b)`` of NVFP4 blocks with amaxes ``amax_b`` under ``s_enc``: the FP32
    decode scale ``amax_b / 6 * s_enc`` (two roundings, as written), the E4M3 value stored for it
    (nearest-even of ``min(wanted, 448)``, NaN counting as past 448), ``s_dec = 1 / s_enc`` and the block
    encode scale ``1 / (scale * s_dec)`` (at most FP32's largest value)."""
    decode = amax_b.float() / torch.full_like(amax_b, E2M1_MAX, dtype=torch.float32)
    wanted = decode * s_enc
    capped = torch.nan_to_num(wanted, nan=E4M3_MAX, posinf=E4M3_MAX).clamp(max=E4M3_MAX)
    scale = capped.to(torch.float8_e4m3fn).float()
    s_dec = torch.reciprocal(s_enc)
    enc_b = torch.reciprocal(scale * s_dec).clamp(max=FLOAT32_MAX)
    return wanted, scale, s_dec, enc_b


@dataclass
class FP4Blocks:
    """One matrix in FP4: ``values`` (the E2M1 elements, float32, zero-padded blocked shape ``(rows_p,
    cols_p)``), ``scales`` (per block, float32 holding the E4M3 or E8M0 value, ``(rows_p / tile, cols_p /
    block)``), ``global_scale`` (NVFP4's ``s_enc``; None for MXFP4), ``dequantized`` (the input's shape)
    and, when asked for, ``stats`` (:func:`block_stats`)."""

    values: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None
    dequantized: torch.Tensor
    stats: dict[str, torch.Tensor] | None = None


def _blocked(x: torch.Tensor, block: int, tile: int) -> torch.Tensor:
    """``x`` (2-D) zero-padded to multiples of ``(tile, block)`` and viewed as ``(R/tile, tile, C/block,
    block)``."""
    rows, cols = x.shape
    padded = (
        x
        if cols % block == 0 and rows % tile == 0
        else torch.nn.functional.pad(x, (0, -cols % block, 0, -rows % tile))
    )
    return padded.reshape(padded.shape[0] // tile, tile, padded.shape[1] // block, block)


def quantize_fp4(
    x: torch.Tensor,
    recipe: str = "nvfp4",
    rounding: str = "floor",
    tile: int = 1,
    generator: torch.Generator | None = None,
    stats: bool = False,
) -> FP4Blocks:
    """Quantize the 2-D float32 ``x`` along its last dimension by ``recipe`` (module docstring): blocks of
    ``FP4_RECIPES[recipe]`` elements shared by ``tile`` rows (16 for NVFP4 weights), ``rounding`` the MXFP4
    exponent rule, ``generator`` for stochastic rounding. No host sync."""
    if x.dim() != 2:
        raise ValueError(f"error: quantize_fp4 takes a 2-D matrix, got shape {tuple(x.shape)}: reshape it")
    blocks = _blocked(x.float(), FP4_RECIPES[recipe], tile)
    amax_b = blocks.abs().amax(dim=(1, 3), keepdim=True)
    if recipe == "nvfp4":
        s_enc = nvfp4_global_scale(amax_b.amax() if x.numel() else x.new_zeros((), dtype=torch.float32))
        wanted, scale, s_dec, multiplier = nvfp4_block_scales(amax_b, s_enc)
        scaled = blocks * multiplier
        values = round_e2m1(scaled, generator)
        deq = values * scale * s_dec
    else:
        s_enc = wanted = None
        e = mx_exponents(amax_b, E2M1_MAX, rounding)
        scale, multiplier = torch.exp2(e), torch.exp2(-e)
        scaled = blocks * multiplier
        values = round_e2m1(scaled, generator)
        deq = values * scale
    deq = deq.add_(blocks * 0.0)  # Inf and NaN elements become NaN (x * 0), the rest keep their signed value
    rows, cols = x.shape
    padded_rows = deq.shape[0] * tile
    out = deq.reshape(padded_rows, -1)[:rows, :cols]
    info = block_stats(amax_b, scale, scaled, wanted) if stats else None
    return FP4Blocks(values.reshape(padded_rows, -1), scale.reshape(scale.shape[0], -1), s_enc, out, info)


def block_stats(
    amax_b: torch.Tensor, scale: torch.Tensor, scaled: torch.Tensor, wanted: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Per-block telemetry (0-dim tensors, no host sync) from the blocks' amaxes, stored scales, scaled
    elements (before E2M1 rounding) and (NVFP4) wanted FP32 decode scales.

    ``blocks``: those with a non-zero finite amax; ``clamped``: among them, NVFP4 a decode scale cut at 448
    or rounded to a zero E4M3 scale, MXFP4 an exponent at E8M0's limits; ``subnormal``: NVFP4 an E4M3 scale
    below 2^-6; ``log2_min`` / ``log2_max``: the range of the blocks' ``log2`` stored scales (their spread);
    ``saturated``: finite elements of blocks with a non-zero scale whose scaled magnitude passed 6 (NVFP4's
    E4M3 scale rounded down, MXFP4's ``floor``)."""
    valid = (amax_b > 0) & torch.isfinite(amax_b)
    if wanted is not None:
        clamped = valid & ((wanted > E4M3_MAX) | (scale == 0))
        subnormal = valid & (scale > 0) & (scale < E4M3_MIN_NORMAL)
    else:
        exponent = torch.log2(scale)
        clamped = valid & ((exponent <= -127) | (exponent >= 127))
        subnormal = torch.zeros_like(valid)
    log2 = torch.log2(torch.where(valid & (scale > 0), scale, math.nan))
    return {
        "blocks": valid.sum(),
        "clamped": clamped.sum(),
        "subnormal": subnormal.sum(),
        "log2_min": torch.where(torch.isnan(log2), math.inf, log2).amin(),
        "log2_max": torch.where(torch.isnan(log2), -math.inf, log2).amax(),
        "saturated": (valid & (scale > 0) & torch.isfinite(scaled) & (scaled.abs() > E2M1_MAX)).sum(),
    }


def random_hadamard(size: int = 16, seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``size x size`` random Hadamard matrix ``H D / sqrt(size)`` (float32): ``H`` Sylvester's Hadamard
    matrix, ``D`` the diagonal of a fixed random sign vector drawn from ``seed``. Orthogonal, exactly in
    float32 for ``size`` a power of 4 (entries ``+-2^-k``)."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"error: the Hadamard size must be a power of two, got {size}: use 16")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (size,), generator=gen, dtype=torch.float64) * 2 - 1
    return (h * signs / math.sqrt(size)).float().to(device)


def hadamard_transform(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``x`` (2-D) transformed along its last dimension in blocks of ``matrix``'s size (zero-padded to a
    multiple of it): each block ``v`` becomes ``matrix @ v``. The result keeps the padding: both operands of
    the wgrad GEMM are padded alike, and ``(T a) . (T b) = a . b`` block by block."""
    size = matrix.shape[0]
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x, (0, -cols % size))
    return (padded.reshape(rows, -1, size) @ matrix.t()).reshape(rows, -1)
