"""The scale rules of adaptive loss scaling: Algorithm 4 (a GEMM layer's beta) and Algorithm 5 (branches).

A reader holding the paper finds here, by name:

* **Algorithm 4**, ``GetGEMMLossScale``, with the post-processing of section 3.2.3: :func:`gemm_loss_scale`
  (device tensors, no host sync) and its two parts, :func:`weight_factors` (the weight's statistics) and
  :meth:`ScaleRule.beta` (the gradient's statistics, the bounds, the power-of-two rounding).
* **Algorithm 5**, ``GetBranchLossScale``: :func:`branch_loss_scale` (device) and
  :func:`branch_loss_scale_host` (floats).

Algorithm 3, the backward pass that carries ``<alpha, delta>`` and applies these scales, is
:class:`adaloss.adaptive.ops.ScaledGEMM` (GEMM layers) and :class:`adaloss.adaptive.ops.Rescale` (branches).

Two rules (:class:`ScaleRule`, ``scaler.rule``):

``reference``
    What the authors' released code computes (kumasento/gradient-scaling, ``ada_loss/chainer_impl/
    ada_loss_chainer.py``, ``get_loss_scale_by_approx_range`` and ``bound_loss_scale_by_heuristics``;
    ``ada_loss/core.py``, ``get_loss_scale``), which produced the paper's tables. With ``F`` the layer's
    backward fan-in (:func:`backward_fan_in`): the product's spread is ``sigma_p * sqrt(F / 2)`` (an input
    gradient element sums ``F`` products), the overflow bound is ``(u_max / F) / (max|W| max|delta|)``,
    and ``beta = min(max(lower, 1), upper)``, so beta falls below 1 when the overflow bound asks for it;
    then ``beta <= scale_upper_bound`` and ``beta <= accum_upper_bound / alpha_in`` (the accumulated scale
    stays under ``accum_upper_bound``), then rounded down to a power of two. FP16's ``u_min`` is their
    ``6.0e-8`` (``get_u_min``). At a branch, when no incoming alpha fits under ``u_max``, the common alpha
    is the smallest one halved until it does (``rescaling``; the authors stop with an error below 1/8,
    this keeps halving).
``paper``
    The text as written: ``lower = u_min / (sigma_p sqrt(2) erfinv(T_uf))``, the overflow bound
    ``u_max / (max|W| max|delta|)`` replacing it when smaller, then ``beta >= 1`` (unless
    ``allow_below_one``) and rounded down to a power of two; the optional bounds apply as in ``reference``.
    At a branch with no fitting alpha, the smallest incoming alpha (the step then overflows and is skipped).

How the arithmetic is arranged, for speed and for bitwise agreement between the paths that compute it (torch
ops on any device; the native C kernel of :mod:`adaloss.numerics.native` on host floats; the fused C++ nodes
of :mod:`adaloss.numerics.fused`): with ``ms(x) = ||x||^2 / n`` the second moment,
``sigma_p^2 = ms(W) ms(delta)`` (the paper's ``(sigma_w^2 + mu_w^2)(sigma_g^2 + mu_g^2)``), so

    lower = A / ||W|| * sqrt(n_g) / ||delta||,   A = u_min sqrt(n_w) / (sqrt(2) erfinv(T_uf) c_F)
    upper = B / max|W| / max|delta|,             B = u_max / F_u

with ``c_F = sqrt(F / 2)`` and ``F_u = F`` under ``reference``, both 1 under ``paper``. ``A`` and ``B`` depend
only on the layer (:meth:`ScaleRule.layer_constants`), so they are computed once and moved to the device
when the scaler is armed, never during a backward pass; the weight's part, ``[A / ||W||, B / max|W|,
B / max|W|]`` (:func:`weight_factors`), is computed once per recompute pass for all layers together; the
gradient's part, ``[||delta||, |min delta|, |max delta|]``, comes from one pass over the gradient.
Every step after that is one float32 operation, the same in every path (see ``beta_from`` in
``numerics/_fast.c``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "RULES",
    "ScaleRule",
    "backward_fan_in",
    "branch_loss_scale",
    "branch_loss_scale_host",
    "gemm_loss_scale",
    "weight_factors",
]

#: The values of ``scaler.rule``.
RULES = ("reference", "paper")

#: ``u_min`` for FP16 in the authors' code (``AdaLoss.get_u_min``), slightly above 2**-24 = 5.96e-8.
REFERENCE_FP16_U_MIN = 6.0e-8


@functools.lru_cache(maxsize=32)
def _erfinv_factor(t_uf: float) -> float:
    """``sqrt(2) * erfinv(T_uf)``: the half-normal quantile of Algorithm 4, in double."""
    return math.sqrt(2.0) * float(torch.erfinv(torch.tensor(t_uf, dtype=torch.float64)))


def backward_fan_in(kind: str, weight_shape: Sequence[int], groups: int = 1) -> int:
    """``F``: how many products an input-gradient element of the layer sums (its fan-in going backwards).

    * ``linear``, weight ``(out, in)``, any number of leading input dimensions: ``out`` (each element of
      ``delta @ W`` sums over the outputs). The authors' ``get_fan_in`` gives ``W.shape[0]`` as well.
    * ``conv``, weight ``(out, in / groups, *kernel)``: ``(out / groups) * prod(kernel)``; an input channel
      only feeds the ``out / groups`` output channels of its group. For ``groups = 1`` this is the authors'
      ``W.shape[0] * kh * kw``; their code, written for ungrouped convolutions, would give ``out *
      prod(kernel)`` for grouped and depthwise ones too (none of the paper's models has one).
    * ``conv_transpose``, weight ``(in, out / groups, *kernel)``: its input gradient is a convolution over
      ``out / groups`` channels: ``weight.shape[1] * prod(kernel)``.

    Strides are ignored, as in the authors' code: with stride ``s`` an interior element sums about
    ``F / s**d`` products, so ``F`` is an upper bound (the overflow bound stays safe).
    """
    if kind == "linear":
        return int(weight_shape[0])
    kernel = math.prod(int(k) for k in weight_shape[2:])
    if kind == "conv":
        return int(weight_shape[0]) // int(groups) * kernel
    if kind == "conv_transpose":
        return int(weight_shape[1]) * kernel
    raise ValueError(f"unknown layer kind {kind!r}")


@dataclass(frozen=True)
class ScaleRule:
    """Which rule computes a layer's beta (module docstring), and its parameters.

    ``scale_upper_bound`` / ``accum_upper_bound``: caps on beta and on ``alpha_in * beta`` (None: no cap).
    ``allow_below_one`` applies to the ``paper`` rule only (the ``reference`` rule lets beta fall below 1
    through its overflow and accumulation bounds alone).
    """

    name: str
    u_min: float
    u_max: float
    t_uf: float
    allow_below_one: bool = False
    scale_upper_bound: float | None = None
    accum_upper_bound: float | None = None

    def __post_init__(self) -> None:
        if self.name not in RULES:
            raise ValueError(f"unknown scale rule {self.name!r}; choose one of {', '.join(RULES)}")

    @property
    def reference(self) -> bool:
        return self.name == "reference"

    @property
    def flags(self) -> int:
        """The rule as the native kernels take it: bit 0 ``allow_below_one``, bit 1 ``reference``."""
        return int(self.allow_below_one and not self.reference) | (2 if self.reference else 0)

    def layer_constants(self, n_w: int, fan_in: int) -> tuple[float, float]:
        """``(A, B)`` of the module docstring for a layer with ``n_w`` weights and backward fan-in ``F``,
        in double (the float32 rounding happens once, where they are stored)."""
        a = self.u_min * math.sqrt(n_w) / _erfinv_factor(self.t_uf)
        if not self.reference:
            return a, self.u_max
        return a / math.sqrt(0.5 * fan_in), self.u_max / fan_in

    def cap(self, alpha_in: float) -> float:
        """The bound on beta from ``scale_upper_bound`` and ``accum_upper_bound / alpha_in`` (inf: none)."""
        cap = math.inf if self.scale_upper_bound is None else float(self.scale_upper_bound)
        if self.accum_upper_bound is not None:
            cap = min(cap, self.accum_upper_bound / alpha_in)
        return cap

    def beta(
        self,
        factors: torch.Tensor,
        stats: torch.Tensor,
        sqrt_n_g: float,
        alpha_in: torch.Tensor | float = 1.0,
    ) -> torch.Tensor:
        """Algorithm 4's beta from the weight's factors and the gradient's statistics (3-vectors, same
        dtype and device), bounded and rounded down to a power of two (section 3.2.3). A 0-dim tensor; no
        host sync. ``alpha_in``: the scale the layer's gradient carries (for ``accum_upper_bound``).

        A zero, infinite or NaN result (an all-zero gradient or weight, an Inf/NaN gradient) gives 1.
        Cost: about ten scalar ops on the device.
        """
        q = factors / stats  # [A/||W|| / ||delta||, B/max|W| / |min delta|, B/max|W| / |max delta|]
        lower = q[0] * sqrt_n_g
        upper = torch.minimum(q[1], q[2])
        if self.reference:
            beta = torch.minimum(lower.clamp(min=1.0), upper)
        else:
            beta = torch.minimum(lower, upper)
            if not self.allow_below_one:
                beta = beta.clamp(min=1.0)
        if isinstance(alpha_in, torch.Tensor) and self.accum_upper_bound is not None:
            cap = (self.accum_upper_bound / alpha_in.to(beta.dtype)).reshape(())
            if self.scale_upper_bound is not None:
                cap = cap.clamp(max=float(self.scale_upper_bound))
            beta = torch.minimum(beta, cap)
        else:
            cap = self.cap(float(alpha_in) if not isinstance(alpha_in, torch.Tensor) else 1.0)
            if cap < math.inf:
                beta = beta.clamp(max=cap)
        beta = floor_pow2(beta)  # NaN becomes +inf here, subnormals 0
        return torch.where((beta > 0) & (beta < math.inf), beta, torch.ones_like(beta))


_POW2_MASK = {torch.float32: (torch.int32, 0x7F800000), torch.float64: (torch.int64, 0x7FF0000000000000)}


def floor_pow2(x: torch.Tensor) -> torch.Tensor:
    """Round positive values down to a power of two (section 3.2.3), so that ``(alpha x) / alpha == x``.

    For float32/float64 this clears the mantissa bits (one op, exact: ``exp2(floor(log2(x)))`` can round up
    for values a few ulps below a power of two); infinities stay infinite, NaN becomes infinity and
    subnormals become 0, which the caller maps to its fallback. Other dtypes use ``exp2(floor(log2(x)))``.
    """
    mask = _POW2_MASK.get(x.dtype)
    if mask is None:
        return torch.exp2(torch.floor(torch.log2(x)))
    int_dtype, bits = mask
    return torch.bitwise_and(x.contiguous().view(int_dtype), bits).view(x.dtype).reshape(x.shape)


def _floor_pow2_host(x: float) -> float:
    """:func:`floor_pow2` of a positive finite double; 0 for 0."""
    if not (x > 0 and math.isfinite(x)):
        return 0.0 if x == 0 else x
    mantissa, exponent = math.frexp(x)
    return math.ldexp(0.5, exponent)


def weight_factors(weights: list[torch.Tensor], constants: torch.Tensor) -> list[torch.Tensor]:
    """The weight's part of Algorithm 4 for several GEMM layers: per layer the 3-vector
    ``[A / ||W||, B / max|W|, B / max|W|]`` (``B`` twice: it is divided by ``|min delta|`` and
    ``|max delta|``). ``constants`` is a ``[len(weights), 2]`` tensor of ``(A, B)`` on the weights' device
    (:meth:`ScaleRule.layer_constants`), in the weights' dtype (float32 for low-precision weights, which
    are reduced in float32). Two ``_foreach_norm`` calls and three vector ops; no host sync, no host-to-
    device copy. (For float32 CPU weights :func:`adaloss.numerics.native.weight_factors` computes the same
    in one native call.)
    """
    w0 = weights[0]
    red = None if w0.dtype in (torch.float32, torch.float64) else torch.float32
    if len(weights) == 1:
        norms = torch.linalg.vector_norm(w0, dtype=red).reshape(1)
        lo, hi = torch.aminmax(w0)
        maxs = torch.maximum(-lo, hi).to(norms.dtype).reshape(1)
    else:
        norms = torch.stack(torch._foreach_norm(weights, 2, dtype=red))
        maxs = torch.stack(torch._foreach_norm(weights, math.inf, dtype=red))
    upper = constants[:, 1] / maxs
    return list(torch.stack([constants[:, 0] / norms, upper, upper], dim=1).unbind(0))


def grad_stats(delta: torch.Tensor) -> torch.Tensor:
    """``[||delta||, |min delta|, |max delta|]`` (float32 for low-precision gradients): the gradient's part
    of Algorithm 4, in two torch reductions. No host sync."""
    red = None if delta.dtype in (torch.float32, torch.float64) else torch.float32
    norm = torch.linalg.vector_norm(delta, dtype=red)
    lo, hi = torch.aminmax(delta)
    return torch.stack([norm, lo.to(norm.dtype), hi.to(norm.dtype)]).abs_()


def gemm_loss_scale(
    weight: torch.Tensor,
    delta: torch.Tensor,
    rule: ScaleRule,
    fan_in: int | None = None,
    alpha_in: torch.Tensor | float = 1.0,
    factors: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
) -> torch.Tensor:
    """Algorithm 4 (``GetGEMMLossScale``) with section 3.2.3's post-processing: the beta of one layer.

    ``delta`` is the incoming gradient (already scaled by ``alpha_in``); ``fan_in`` defaults to
    ``weight.shape[0]`` (a linear layer). ``factors`` and ``stats`` may come precomputed (see
    :func:`weight_factors` and :func:`grad_stats`). No host sync; builds the layer's two constants with
    one host-to-device copy unless ``factors`` is given (the scaler's backward pass always gives it).
    """
    if factors is None:
        f = backward_fan_in("linear", weight.shape) if fan_in is None else fan_in
        dtype = torch.float32 if weight.dtype not in (torch.float32, torch.float64) else weight.dtype
        consts = torch.tensor([rule.layer_constants(weight.numel(), f)], dtype=dtype, device=weight.device)
        factors = weight_factors([weight], consts)[0]
    if stats is None:
        stats = grad_stats(delta)
    return rule.beta(factors, stats.to(factors.dtype), math.sqrt(delta.numel()), alpha_in)


# ----------------------------------------------------------------------------------------- Algorithm 5


def branch_loss_scale(
    alphas: torch.Tensor, max_abs: torch.Tensor, u_max: float, rule: str = "paper"
) -> torch.Tensor:
    """Algorithm 5 (``GetBranchLossScale``): the common alpha for gradients ``delta_k`` (scaled by
    ``alphas[k]``, largest magnitude ``max_abs[k]``) meeting at a branch.

    Candidates are the incoming alphas in descending order; the first (largest) under which every rescaled
    gradient ``(alpha / alphas[k]) * delta_k`` stays below ``u_max`` wins. If none does: under ``paper`` the
    smallest alpha (the step then overflows and is skipped); under ``reference`` the smallest alpha halved
    until the rescaled gradients fit (the smallest if they never do: an Inf/NaN gradient). Vectorized; no
    host sync.
    """
    ratio = alphas[:, None] / alphas[None, :]  # [candidate, input]
    ok = (ratio * max_abs[None, :] < u_max).all(dim=1)
    best = torch.where(ok, alphas, torch.zeros_like(alphas)).amax()
    smallest = alphas.amin()
    if rule != "reference":
        return torch.where(ok.any(), best, smallest)
    m = (max_abs / alphas).amax()  # the largest unscaled gradient: exact, the alphas are powers of two
    t = floor_pow2((u_max / m).reshape(1)).reshape(())
    t = torch.where(t * m >= u_max, t * 0.5, t)  # strictly below u_max
    t = torch.minimum(t, smallest * 0.5)
    t = torch.where(torch.isfinite(m) & (t > 0), t, smallest)
    return torch.where(ok.any(), best, t)


def branch_loss_scale_host(
    alphas: list[float], maxima: list[float], u_max: float, rule: str = "paper"
) -> float:
    """:func:`branch_loss_scale` on host floats, with the same result: the alphas are powers of two, so every
    ``(alpha / alphas[k]) * maxima[k]`` is exact in float32 and in double alike (up to float32 overflow,
    which fails the ``< u_max`` test either way), and NaN maxima fail it too."""
    ok = [c for c in alphas if all((c / a) * m < u_max for a, m in zip(alphas, maxima, strict=True))]
    if ok:
        return max(ok)
    smallest = min(alphas)
    if rule != "reference":
        return smallest
    quotients = [mx / a for a, mx in zip(alphas, maxima, strict=True)]
    if not all(math.isfinite(q) for q in quotients):  # an Inf/NaN gradient: nothing fits
        return smallest
    m = max(quotients)
    t = _floor_pow2_host(u_max / m)
    if t * m >= u_max:
        t *= 0.5
    t = min(t, smallest * 0.5)
    return t if t > 0 else smallest
