"""An independent port of the scale rule in the authors' released code, used as the oracle of
``tests/test_reference_rule.py``.

Written from a reading of kumasento/gradient-scaling (Chainer): ``ada_loss/chainer_impl/ada_loss_chainer.py``
(``get_fan_in``, ``get_loss_scale_by_approx_range``, ``bound_loss_scale_by_heuristics``, ``rescaling``) and
``ada_loss/core.py`` (``get_u_min``, ``get_loss_scale``, ``get_power_of_two_scale``). It follows what that
code computes step by step, in plain NumPy and float64, sharing nothing with ``adaloss``: no torch, no
import from the package. It was checked against the authors' own functions, run under Chainer 7.8.1 with
NumPy 1.23.5 in a throwaway environment (see the docstring of ``tests/test_reference_rule.py``).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

U_MIN_FP16 = 6.0e-8  # their get_u_min("float16"), not 2**-24
U_MAX_FP16 = 65504.0


def _erfinv(p: float) -> float:
    # erf(x) = 2 Phi(x sqrt 2) - 1, so erfinv(p) = Phi^-1((1 + p) / 2) / sqrt 2
    return NormalDist().inv_cdf((1.0 + p) / 2.0) / math.sqrt(2.0)


def fan_in(weight_shape: tuple[int, ...]) -> int:
    """Their ``get_fan_in``: a 2-D weight (linear, ``(out, in)``) gives ``out``; a 4-D one (conv,
    ``(out, in, kh, kw)``) gives ``out * kh * kw``."""
    if len(weight_shape) == 2:
        return int(weight_shape[0])
    return int(weight_shape[0] * weight_shape[2] * weight_shape[3])


def gemm_scale(
    g: np.ndarray,
    w: np.ndarray,
    alpha_in: float,
    scale_upper_bound: float | None,
    accum_upper_bound: float | None,
    t_uf: float = 1e-3,
    u_min: float = U_MIN_FP16,
    u_max: float = U_MAX_FP16,
) -> tuple[float, float]:
    """A GEMM layer's scale for incoming gradient ``g`` (already carrying ``alpha_in``) and weight ``w``.

    Returns ``(power-of-two scale, the value before rounding)``; the second lets a caller see when a result
    sits on a power-of-two boundary, where float32 and float64 arithmetic may round to different sides.
    """
    g64 = np.asarray(g, dtype=np.float64)
    w64 = np.asarray(w, dtype=np.float64)
    # the product distribution: variance plus squared mean of each factor, i.e. their second moments
    second = float(np.mean(g64 * g64)) * float(np.mean(w64 * w64))
    if second == 0.0:
        return 1.0, 1.0  # an all-zero gradient (or weight): no statistics, scale 1
    n = fan_in(w64.shape)
    sigma = math.sqrt(second) * math.sqrt(0.5 * n)  # "assuming the existence of ReLU"
    lower = u_min / (math.sqrt(2.0) * _erfinv(t_uf) * sigma)
    largest = float(np.max(np.abs(g64))) * float(np.max(np.abs(w64)))
    upper = (u_max / n) / largest
    raw = min(max(lower, 1.0), upper)  # the clamp at 1 comes before the overflow bound
    if accum_upper_bound is not None:
        raw = min(raw, accum_upper_bound / alpha_in)
    if scale_upper_bound is not None:
        raw = min(raw, scale_upper_bound)
    return 2.0 ** math.floor(math.log2(raw)), raw


def branch_scale(alphas: list[float], grads: list[np.ndarray], u_max: float = U_MAX_FP16) -> float | None:
    """The common scale of gradients meeting at a branch (their ``rescaling``): the largest incoming scale
    under which the largest unscaled magnitude stays below ``u_max``; failing that, the smallest incoming
    scale halved until it fits, halving at most once past 1/8. None where their code raises."""
    largest = max(
        float(np.max(np.abs(np.asarray(g, dtype=np.float64)))) / a for a, g in zip(alphas, grads, strict=True)
    )
    for candidate in sorted(alphas, reverse=True):
        if largest * candidate < u_max:
            return candidate
    t = min(alphas)
    while t >= 1.0 / 8.0:
        if largest * t < u_max:
            return t
        t /= 2.0
    return t if largest * t < u_max else None  # the first value below 1/8 is still checked, once
