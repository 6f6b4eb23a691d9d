"""The scale rules of adaptive loss scaling: Algorithm 4 (a GEMM layer's beta) and Algorithm 5 (branches).

A reader holding the paper finds here, by name:

* **Algorithm 4**, ``GetGEMMLossScale``, with the post-processing of section 3.2.3: :func:`gemm_loss_scale`
  (device tensors, no host sync), in three steps each written once: :func:`statistics` (a tensor's
  ``||x||`` and ``max|x|``), :func:`gemm_bounds` (the underflow and overflow bounds from the weight's and
  the gradient's statistics) and :meth:`ScaleRule.beta` (the bounds and caps combined by the rule and
  rounded down to a power of two). A GEMM layer calls :func:`gemm_loss_scale`; an activation-by-activation
  product (:func:`adaloss.adaptive.algorithm3.product_beta`) calls the three steps with the other operand in
  the weight's place; the root scale (``AdaptiveLossScaler.root_target``) calls the last two with the loss
  gradient's counted quantile as its lower bound.
* **Algorithm 5**, ``GetBranchLossScale``: :func:`branch_loss_scale`.

Each is written once, in torch ops, and runs on every device (the CPU emulation included); nothing here
synchronizes host and device.

Algorithm 3, the backward pass that carries ``<alpha, delta>`` and applies these scales, is
:mod:`adaloss.adaptive.algorithm3`; Algorithm 5 at a branch point, :mod:`adaloss.adaptive.algorithm5`.

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

How the arithmetic is arranged, for few kernels per point: with ``ms(x) = ||x||^2 / n`` the second moment,
``sigma_p^2 = ms(W) ms(delta)`` (the paper's ``(sigma_w^2 + mu_w^2)(sigma_g^2 + mu_g^2)``), so

    lower = A / ||W|| * sqrt(n_g) / ||delta||,   A = u_min sqrt(n_w) / (sqrt(2) erfinv(T_uf) c_F)
    upper = B / max|W| / max|delta|,             B = u_max / F_u

with ``c_F = sqrt(F / 2)`` and ``F_u = F`` under ``reference``, both 1 under ``paper``. ``A`` and ``B`` depend
only on the layer (:meth:`ScaleRule.layer_constants`), so they are computed once, when the transform makes
the layer's point, as Python floats: constants of a traced graph, filled into device tensors where they
are used (no host-to-device copy). The statistics are two reductions per tensor (:func:`statistics`);
every step after that is one float32 (float64 for float64 weights) operation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "RULES",
    "ScaleRule",
    "Statistics",
    "backward_fan_in",
    "branch_loss_scale",
    "gemm_bounds",
    "gemm_loss_scale",
    "max_magnitude",
    "statistics",
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


#: "No bound" for ``scale_upper_bound`` / ``accum_upper_bound``: 2**64, above any scale FP16 data can take
#: (a non-zero FP16 value is at least 2**-24 and at most 65504 < 2**16, so a beta above 2**40 overflows every
#: one of them). Finite, so that the arithmetic below needs no special case for "none".
NO_BOUND = 2.0**64


@dataclass(frozen=True)
class ScaleRule:
    """Which rule computes a layer's beta (module docstring), and its parameters.

    ``scale_upper_bound`` / ``accum_upper_bound``: caps on beta and on ``alpha_in * beta`` (None: no cap,
    i.e. :data:`NO_BOUND`). ``allow_below_one`` applies to the ``paper`` rule only (the ``reference`` rule
    lets beta fall below 1 through its overflow and accumulation bounds alone).

    How the steps are arranged (:meth:`beta`): from the lower (underflow) bound and the upper (overflow)
    bound of :func:`gemm_bounds`, ``q = |[lower, upper, scale cap, accumulation cap / alpha_in]|``, an
    infinite or NaN ``q`` read as 1 (an all-zero gradient or weight has no statistics: scale 1, as in the
    authors' code; a NaN gradient: 1), and then

    * ``reference``: ``beta = min(max(q0, 1), q1, q2, q3)``;
    * ``paper``: ``beta = min(max(min(q0, q1), 1), q2, q3)`` (no ``max(., 1)`` with ``allow_below_one``);

    rounded down to a power of two (a subnormal result becomes 0: only an infinite gradient, whose step is
    skipped, gives one).
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
        # the quantile once, as a float: layer_constants also runs in backward passes (traced, compiled)
        object.__setattr__(self, "_quantile", _erfinv_factor(self.t_uf))

    @property
    def reference(self) -> bool:
        return self.name == "reference"

    @property
    def caps(self) -> tuple[float, float]:
        """``(scale cap, accumulation cap)``: the two bounds, :data:`NO_BOUND` where there is none."""
        scale = NO_BOUND if self.scale_upper_bound is None else float(self.scale_upper_bound)
        accum = NO_BOUND if self.accum_upper_bound is None else float(self.accum_upper_bound)
        return scale, accum

    def layer_constants(self, n_w: int, fan_in: int) -> tuple[float, float]:
        """``(A, B)`` of the module docstring for a layer with ``n_w`` weights and backward fan-in ``F``,
        in double (the float32 rounding happens once, where they are stored)."""
        a = self.u_min * math.sqrt(n_w) / self._quantile
        if not self.reference:
            return a, self.u_max
        return a / math.sqrt(0.5 * fan_in), self.u_max / fan_in

    @staticmethod
    def lower_constant(a: float, n_g: int) -> float:
        """``A sqrt(n_g)``: the lower bound's constant for a gradient of ``n_g`` elements, in double."""
        return a * math.sqrt(n_g)

    def beta(
        self,
        lower: torch.Tensor,
        upper: torch.Tensor,
        alpha_in: torch.Tensor | float = 1.0,
        caps: tuple[float, float] | None = None,
    ) -> torch.Tensor:
        """Algorithm 4's last step (section 3.2.3): beta from the underflow bound ``lower`` and the overflow
        bound ``upper`` (0-dim tensors of one dtype and device, :func:`gemm_bounds`), combined by the rule,
        capped by ``caps`` (``(scale cap, accumulation cap)``, default :attr:`caps`; the accumulation cap
        bounds ``alpha_in * beta``) and rounded down to a power of two. A 0-dim tensor; no host sync."""
        scale_cap, accum_cap = self.caps if caps is None else caps
        alpha = alpha_in if isinstance(alpha_in, torch.Tensor) else torch.full_like(lower, alpha_in)
        accum = lower.new_full((), accum_cap) / alpha.reshape(()).to(lower.dtype)
        q = torch.stack([lower, upper, lower.new_full((), scale_cap), accum])
        q = torch.nan_to_num(q.abs_(), nan=1.0, posinf=1.0)
        if self.reference:
            beta = torch.maximum(q, _low_like(q)).amin()
        else:
            beta = q[:2].amin()
            if not self.allow_below_one:
                beta = beta.clamp(min=1.0)
            beta = torch.minimum(beta, q[2:].amin())
        return floor_pow2(beta)


@functools.lru_cache(maxsize=8)
def _low(dtype: torch.dtype, device: str) -> torch.Tensor:
    """``[1, 0, 0, 0]``: the reference rule's ``max(q0, 1)`` as one elementwise maximum. Made once per
    device and dtype, by a fill on the device (no host-to-device copy)."""
    return _make_low(dtype, torch.device(device))


def _make_low(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    low = torch.zeros(4, dtype=dtype, device=device)
    low[:1].fill_(1.0)
    return low


def _low_like(q: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():  # a constant of the traced graph; the cache is for eager calls
        return _make_low(q.dtype, q.device)
    return _low(q.dtype, str(q.device))


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
    if not x.is_contiguous():
        x = x.contiguous()
    return torch.bitwise_and(x.view(int_dtype), bits).view(x.dtype)


def max_magnitude(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` as a 0-dim tensor (float32 for half-precision tensors, else ``x``'s dtype); NaN if ``x``
    holds one, 0 if it is empty. No host sync.

    One ``aminmax`` reduction for a contiguous tensor, ``amax`` and ``amin`` otherwise. On the CPU both
    alternatives take slow paths: ``linalg.vector_norm(x, inf)`` always (1.4 ms against 60 us for 524,288
    floats on one core, ``shared/notes/device-path-on-cpu.md``), and ``aminmax`` on a channels-last
    tensor such as a convolution's gradient (5.3 ms against 70 us for ``amax`` and ``amin``, interleaved
    medians on the project's 2-core AMD EPYC); on CUDA each is one kernel per reduction."""
    dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    if x.numel() == 0:
        return torch.zeros((), dtype=dtype, device=x.device)
    if x.is_contiguous():
        low, high = torch.aminmax(x)
    else:
        low, high = x.amin(), x.amax()
    return torch.maximum(high, low.neg()).to(dtype)


@dataclass(frozen=True)
class Statistics:
    """What Algorithm 4 reads of a tensor: ``norm = ||x||`` and ``peak = max|x|``, 0-dim device tensors in
    the statistics dtype (float32 for half-precision tensors, else the tensor's). Of a weight, the paper's
    ``sigma_w^2 + mu_w^2 = norm^2 / n`` and the overflow bound's ``max|W|``; of a gradient, likewise."""

    norm: torch.Tensor
    peak: torch.Tensor


def statistics(x: torch.Tensor, reduce_fn: Any = None) -> Statistics:
    """``||x||`` and ``max|x|`` of ``x``: two reductions; no host sync. ``reduce_fn(mean_square, peak)``,
    when given (``torch.distributed``: the gradients and activations differ between ranks), combines the
    second moment and the peak over the ranks first."""
    red = None if x.dtype in (torch.float32, torch.float64) else torch.float32
    norm = torch.linalg.vector_norm(x, dtype=red)
    peak = max_magnitude(x).to(norm.dtype)
    if reduce_fn is not None:
        n = x.numel()
        mean_square, peak = reduce_fn(norm.square() / n, peak)
        norm, peak = torch.sqrt(mean_square * n).reshape(()), peak.reshape(())
    return Statistics(norm, peak)


def gemm_bounds(
    weight: Statistics, grad: Statistics, lower_constant: float, upper_constant: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 4's two bounds on beta (module docstring): the underflow bound ``lower = A' / ||W|| /
    ||delta||`` (``A' = A sqrt(n_g)``, :meth:`ScaleRule.lower_constant`: at most ``T_uf`` of the products
    ``W delta`` fall below ``u_min``) and the overflow bound ``upper = B / max|W| / max|delta|`` (no
    product passes ``u_max``). The constants are filled into device tensors (no host-to-device copy), in
    the weight statistics' dtype; a few 0-dim ops; no host sync."""
    lower = torch.full_like(weight.norm, lower_constant) / weight.norm / grad.norm
    upper = torch.full_like(weight.peak, upper_constant) / weight.peak / grad.peak
    return lower, upper


def gemm_loss_scale(
    weight: torch.Tensor,
    delta: torch.Tensor,
    rule: ScaleRule,
    fan_in: int | None = None,
    alpha_in: torch.Tensor | float = 1.0,
    constants: tuple[float, float] | None = None,
    reduce_fn: Any = None,
) -> torch.Tensor:
    """Algorithm 4 (``GetGEMMLossScale``) with section 3.2.3's post-processing: the beta of one layer.

    ``delta`` is the incoming gradient (already scaled by ``alpha_in``); ``fan_in`` defaults to
    ``weight.shape[0]`` (a linear layer). ``constants``: the layer's ``(A, B)``
    (:meth:`ScaleRule.layer_constants`), when known (the scaler's points hold them; then ``fan_in`` is
    not read). ``reduce_fn``: the gradient's statistics over the ranks (:func:`statistics`). The
    statistics (:func:`statistics`), the bounds (:func:`gemm_bounds`), beta (:meth:`ScaleRule.beta`).
    No host sync, no host-to-device copy.
    """
    if constants is None:
        constants = rule.layer_constants(
            weight.numel(), backward_fan_in("linear", weight.shape) if fan_in is None else fan_in
        )
    a, b = constants
    w = statistics(weight)
    g = statistics(delta, reduce_fn)
    g = Statistics(g.norm.to(w.norm.dtype), g.peak.to(w.norm.dtype))
    lower, upper = gemm_bounds(w, g, rule.lower_constant(a, delta.numel()), b)
    return rule.beta(lower, upper, alpha_in)


# ----------------------------------------------------------------------------------------- Algorithm 5


def branch_loss_scale(
    alphas: torch.Tensor, max_abs: torch.Tensor, u_max: float, rule: str = "paper"
) -> torch.Tensor:
    """Algorithm 5 (``GetBranchLossScale``): the common alpha for gradients ``delta_k`` (scaled by
    ``alphas[k]``, largest magnitude ``max_abs[k]``) meeting at a branch.

    Candidates are the incoming alphas in descending order; the first (largest) under which every rescaled
    gradient ``(alpha / alphas[k]) * delta_k`` stays below ``u_max`` wins. If none does: under ``paper`` the
    smallest alpha (the step then overflows and is skipped); under ``reference`` the smallest alpha halved
    until the rescaled gradients fit (the smallest if they never do: an Inf/NaN gradient).

    With ``M = max_k(max_abs[k] / alphas[k])``, the largest unscaled magnitude (exact: the alphas are powers
    of two), a candidate ``c`` fits when ``c * M < u_max``, also exact. Vectorized: no host sync; 9 kernels
    (``reference``: 15).
    """
    m = (max_abs / alphas).amax()
    best = torch.where(alphas * m < u_max, alphas, 0.0).amax()  # 0 if no candidate fits
    smallest = alphas.amin()
    if rule == "reference":
        # the largest power of two t with t * M < u_max (below the smallest alpha, which did not fit)
        t = floor_pow2(u_max / m)
        t = torch.where(t * m >= u_max, t * 0.5, t)
        fallback = torch.where(m < math.inf, t, smallest)
    else:
        fallback = smallest
    return torch.where(best > 0, best, fallback)
