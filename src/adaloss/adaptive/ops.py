"""The numerical core of adaptive loss scaling (Zhao et al., section 3): Algorithms 3, 4, 5 as autograd ops.

Backpropagation carries the pair ``<alpha, delta>``: ``delta`` is the gradient already multiplied by the
accumulated scale ``alpha`` (Algorithm 3). Autograd only passes gradients, so the alphas travel beside them in
an :class:`AdaptiveState`: one 0-dim device tensor per *slot*. Slot 0 holds the initial scale
``alpha_{N+1}`` applied to the loss; every GEMM point and every branch point writes the alpha of the gradient
it emits into its own slot, and reads the alpha of the gradient it receives from the slot of whichever point
emitted it (that wiring is static and comes from :mod:`adaloss.adaptive.transform`). Element-wise ops sit
between points and pass alpha through unchanged (section 3.2.2), so they need no code at all.

* :class:`ScaledGEMM` (conv, linear): receives ``delta_j`` scaled by ``alpha_j``; computes the local scale
  ``beta`` from the statistics of its weight and ``delta_j`` (:func:`gemm_loss_scale`, Algorithm 4); computes
  the input gradient with the weight scaled by ``beta`` (the paper's "scale W_i before computing the input
  gradient", which equals ``Backprop(beta * delta_j)``) and emits ``alpha_j * beta``; computes the weight
  gradient from ``delta_j`` and divides it by ``alpha_j`` in FP32 so the master weights receive true
  gradients.
* :class:`Rescale` (branches, Algorithm 5): all gradients flowing into one tensor arrive together; they are
  brought to one common alpha (:func:`branch_loss_scale`) before autograd sums them.

Nothing here synchronizes host and device: the statistics, betas and alphas stay on the device as tensors.
On update steps the scaler copies all betas and branch factors to the host once (one sync per
``update_every`` steps); on the other steps the ops use those host copies, which lets them skip
multiplications by exactly 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from adaloss.numerics.emulation import active_emulation, is_low_precision, mark_low_precision, suspended
from adaloss.numerics.formats import round_to_format

__all__ = [
    "AdaptiveState",
    "GemmPoint",
    "BranchPoint",
    "gemm_loss_scale",
    "branch_loss_scale",
    "ScaledGEMM",
    "Rescale",
]


def _erfinv(p: float) -> float:
    return float(torch.erfinv(torch.tensor(p, dtype=torch.float64)))


def _floor_pow2(x: torch.Tensor) -> torch.Tensor:
    """Round positive values down to a power of two (section 3.2.3), so that (alpha*x)/alpha == x exactly."""
    return torch.exp2(torch.floor(torch.log2(x)))


def _max_abs(x: torch.Tensor) -> torch.Tensor:
    """max|x| in one pass without a temporary (aminmax; ``vector_norm(ord=inf)`` is several times slower)."""
    lo, hi = torch.aminmax(x)
    return torch.maximum(-lo, hi)


def gemm_loss_scale(
    weight: torch.Tensor,
    delta: torch.Tensor,
    u_min: float,
    u_max: float,
    t_uf: float,
    allow_below_one: bool = False,
    reduce_fn: Any = None,
) -> torch.Tensor:
    """Algorithm 4 plus the post-processing of section 3.2.3: the local scale ``beta`` of one GEMM layer.

    With ``w ~ N(mu_w, sigma_w^2)`` and ``g ~ N(mu_g, sigma_g^2)`` the product ``p = w*g`` has
    ``sigma_p^2 = (sigma_w^2 + mu_w^2)(sigma_g^2 + mu_g^2)``, and each factor is just a second moment
    (``sigma^2 + mu^2 = E[x^2]``), so one pass over each tensor gives it. The lower bound that keeps
    ``P(|beta*p| <= u_min)`` under ``t_uf`` is ``u_min / (sigma_p * sqrt(2) * erfinv(t_uf))``; the overflow
    bound ``u_max / (max|W| * max|delta|)`` replaces it when smaller. The result is rounded down to a power of
    two, kept at 1 or above unless ``allow_below_one``, and falls back to 1 when the gradient is all zeros.

    Cost: two single-pass reductions over ``delta`` (second moment, max) and two over ``weight``. No host
    sync.
    ``reduce_fn(second_moment, max_abs)`` may all-reduce the delta statistics across ranks.
    """
    # vector_norm reduces in one pass without a temporary (square() or abs() would allocate one).
    w = weight if weight.dtype in (torch.float32, torch.float64) else weight.float()
    g = delta if delta.dtype in (torch.float32, torch.float64) else delta.float()
    ms_w = torch.linalg.vector_norm(w).square() / w.numel()
    ms_g = torch.linalg.vector_norm(g).square() / g.numel()
    max_w = _max_abs(w)
    max_g = _max_abs(g)
    if reduce_fn is not None:
        ms_g, max_g = reduce_fn(ms_g, max_g)
    sigma_p = torch.sqrt(ms_w * ms_g)
    lower = u_min / (sigma_p * (math.sqrt(2.0) * _erfinv(t_uf)))
    upper = u_max / (max_w * max_g)
    beta = torch.minimum(lower, upper)
    if not allow_below_one:
        beta = beta.clamp(min=1.0)
    beta = _floor_pow2(beta)
    return torch.where(torch.isfinite(beta) & (beta > 0), beta, torch.ones_like(beta))


def branch_loss_scale(alphas: torch.Tensor, max_abs: torch.Tensor, u_max: float) -> torch.Tensor:
    """Algorithm 5: the common alpha for gradients ``delta_k`` (scaled by ``alphas[k]``) meeting at a branch.

    Candidates are the incoming alphas in descending order; the first (largest) one under which every
    rescaled gradient ``(alpha / alphas[k]) * delta_k`` stays below ``u_max`` wins. If none does, the smallest
    alpha is used (the step will then overflow and be skipped). Vectorized: no host sync.
    """
    ratio = alphas[:, None] / alphas[None, :]  # [candidate, input]
    ok = (ratio * max_abs[None, :] < u_max).all(dim=1)
    best = torch.where(ok, alphas, torch.zeros_like(alphas)).amax()
    return torch.where(ok.any(), best, alphas.amin())


@dataclass
class GemmPoint:
    """A scaling point at one call of a conv/linear layer (a module called twice has two points)."""

    index: int
    name: str  # module path, with "#k" for the k-th extra call of the same module
    in_slot: int = -1  # slot holding alpha_j of the gradient this layer receives
    out_slot: int = -1  # slot this layer writes alpha_j * beta into


@dataclass
class BranchPoint:
    """A branch point: one tensor feeding several consumers, or several outputs of one op."""

    index: int
    name: str
    in_slots: list[int] = field(default_factory=list)  # one per consumer
    out_slot: int = -1


class AdaptiveState:
    """Per-model state of the adaptive scaler: slots of alphas, the betas, and what the host knows of them.

    ``alpha[s]`` are 0-dim device tensors written during the backward pass. ``beta`` holds one device
    tensor per GEMM point; ``beta_host`` and ``branch_factors_host`` are the host copies fetched once per
    update step, used on the steps in between to skip multiplications by 1.
    """

    def __init__(
        self,
        u_min: float,
        u_max: float,
        t_uf: float,
        allow_below_one: bool,
    ) -> None:
        self.u_min = u_min
        self.u_max = u_max
        self.t_uf = t_uf
        self.allow_below_one = allow_below_one
        self.gemms: list[GemmPoint] = []
        self.branches: list[BranchPoint] = []
        self.num_slots = 1
        self.alpha: list[torch.Tensor | None] = [None]
        self.beta: list[torch.Tensor | None] = []
        self.beta_host: list[float] | None = None
        self.branch_alpha: list[torch.Tensor | None] = []
        self.branch_factors: list[torch.Tensor | None] = []
        self.branch_factors_host: list[list[float]] | None = None
        self.branch_rescaled: list[torch.Tensor | None] = []
        self.recompute = True
        self.reduce_fn: Any = None
        self.param_slots: dict[str, int] = {}  # non-GEMM parameters -> slot of the gradient that scales them

    def new_slot(self) -> int:
        self.num_slots += 1
        self.alpha.append(None)
        return self.num_slots - 1

    def add_gemm(self, name: str) -> GemmPoint:
        point = GemmPoint(len(self.gemms), name)
        point.out_slot = self.new_slot()
        self.gemms.append(point)
        self.beta.append(None)
        return point

    def add_branch(self, name: str) -> BranchPoint:
        point = BranchPoint(len(self.branches), name)
        point.out_slot = self.new_slot()
        self.branches.append(point)
        self.branch_alpha.append(None)
        self.branch_factors.append(None)
        self.branch_rescaled.append(None)
        return point

    def start_backward(self, root_alpha: torch.Tensor, recompute: bool) -> None:
        """Called by ``scaler.scale(loss)``: reset the slots and set the root scale alpha_{N+1}."""
        self.alpha = [None] * self.num_slots
        self.alpha[0] = root_alpha
        self.recompute = recompute or self.beta_host is None

    def read_alpha(self, slot: int, where: str) -> torch.Tensor:
        a = self.alpha[slot]
        if a is None:
            raise RuntimeError(
                f"adaptive loss scaling: no scale reached {where}; call scaler.scale(loss).backward() rather "
                "than loss.backward() on a model returned by scaler.attach()"
            )
        return a


# --------------------------------------------------------------------------------------------------------
# GEMM


def _conv_forward(x, w, b, spec):
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[spec["dims"]]
    return conv(x, w, b, spec["stride"], spec["padding"], spec["dilation"], spec["groups"])


def _conv_transpose_forward(x, w, b, spec):
    conv = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[spec["dims"]]
    return conv(
        x, w, b, spec["stride"], spec["padding"], spec["output_padding"], spec["groups"], spec["dilation"]
    )


def _conv_backward(grad, x, w, spec, mask):
    return torch.ops.aten.convolution_backward(
        grad,
        x,
        w,
        None,
        spec["stride"],
        spec["padding"],
        spec["dilation"],
        spec["transposed"],
        spec["output_padding"],
        spec["groups"],
        mask,
    )


class ScaledGEMM(torch.autograd.Function):
    """A conv or linear layer whose backward pass is Algorithm 3 with Algorithm 4's local scale.

    ``spec`` describes the layer (``kind``: "linear" | "conv" | "conv_transpose", strides, padding, ...).
    In emulation it rounds like :class:`~adaloss.numerics.emulation.EmulatedAutocast` would around a GEMM:
    the weight copy, the output, the incoming gradient (counted for telemetry), the beta-scaled weight used
    for the input gradient, and the weight gradient before it is unscaled into the FP32 master gradient.
    Under CUDA autocast it computes in the autocast dtype explicitly.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, point: GemmPoint, state: AdaptiveState, spec: dict):  # type: ignore[override]
        emu = active_emulation()
        fmt = emu.fmt if emu is not None else None
        ctx.grad_fmt = emu.grad_fmt if emu is not None else None
        ctx.probe = emu.probe_for(point.name) if emu is not None else None
        ctx.point, ctx.state, ctx.spec = point, state, spec
        ctx.x_dtype = x.dtype
        ctx.w_dtype = weight.dtype  # the master weight's dtype: unscaled gradients are returned in it
        dtype = None
        if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
        with suspended():
            if dtype is not None:
                x, weight = x.to(dtype), weight.to(dtype)
                bias = bias.to(dtype) if bias is not None else None
            if fmt is not None:
                if not is_low_precision(x):  # usually already stored in the format by its producer
                    x = round_to_format(x, fmt)
                weight = round_to_format(weight, fmt)
                bias = round_to_format(bias, fmt) if bias is not None else None
            if spec["kind"] == "linear":
                y = F.linear(x, weight, bias)
            elif spec["kind"] == "conv":
                y = _conv_forward(x, weight, bias, spec)
            else:
                y = _conv_transpose_forward(x, weight, bias, spec)
            if fmt is not None:
                y = round_to_format(y, fmt)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        if fmt is not None:
            mark_low_precision(y)
        return y

    @staticmethod
    def backward(ctx, delta):  # type: ignore[override]
        x, w = ctx.saved_tensors
        point, state, spec, grad_fmt = ctx.point, ctx.state, ctx.spec, ctx.grad_fmt
        if grad_fmt is not None:
            rounded = round_to_format(delta, grad_fmt)
            if ctx.probe is not None:
                ctx.probe.record(delta, rounded)
            delta = rounded
        elif ctx.probe is not None:
            ctx.probe.record(delta)
        if delta.dtype != w.dtype:
            delta = delta.to(w.dtype)
        alpha_j = state.read_alpha(point.in_slot, point.name)
        k = point.index

        if state.recompute or state.beta[k] is None:
            beta = gemm_loss_scale(
                w, delta, state.u_min, state.u_max, state.t_uf, state.allow_below_one, state.reduce_fn
            )
            state.beta[k] = beta
            beta_host = None
        else:
            beta = state.beta[k]
            beta_host = state.beta_host[k] if state.beta_host is not None else None
        state.alpha[point.out_slot] = alpha_j * beta

        grad_x = grad_w = grad_b = None
        need_x = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2])
        # Paper: "beta is used to scale W before computing the scaled input activation gradients"; this
        # equals Backprop(beta * delta) and touches only weight-sized data.
        if not need_x or beta_host == 1.0:
            w_scaled = w
        else:
            w_scaled = w * beta.to(w.dtype)
            if grad_fmt is not None:
                w_scaled = round_to_format(w_scaled, grad_fmt)
        if spec["kind"] == "linear":
            if need_x:
                grad_x = delta.matmul(w_scaled)
            if need_w:
                d2 = delta.reshape(-1, delta.shape[-1])
                grad_w = d2.t().matmul(x.reshape(-1, x.shape[-1]))
                grad_b = d2.sum(0) if ctx.has_bias else None
        else:
            # One call for both: the weight gradient depends on delta and x only, not on the weight.
            grad_x, grad_w, grad_b = _conv_backward(
                delta, x, w_scaled, spec, [need_x, need_w, need_w and ctx.has_bias]
            )
        if need_x:
            grad_x = grad_x.to(ctx.x_dtype)
        if need_w:
            # The low-precision weight gradient reaches the FP32 master copy, then is unscaled there.
            if grad_fmt is not None:
                grad_w = round_to_format(grad_w, grad_fmt)
                grad_b = round_to_format(grad_b, grad_fmt) if grad_b is not None else None
            master = ctx.w_dtype
            inv = 1.0 / alpha_j.to(master)
            grad_w = grad_w.to(master) * inv
            grad_b = grad_b.to(master) * inv if grad_b is not None else None
        return grad_x, grad_w, grad_b, None, None, None


# --------------------------------------------------------------------------------------------------------
# Branches


class Rescale(torch.autograd.Function):
    """Identity in the forward pass; in the backward pass, Algorithm 5 over the gradients of its outputs.

    For a tensor with n consumers the transform calls ``Rescale.apply(point, state, x, x, ..., x)`` and
    hands one output to each consumer, so the n gradients arrive here together; each is brought to the
    common alpha and autograd then sums them into ``x``'s gradient. For an op with several outputs (split,
    chunk) it is called with those outputs instead.
    """

    @staticmethod
    def forward(ctx, point: BranchPoint, state: AdaptiveState, *xs):  # type: ignore[override]
        ctx.point, ctx.state = point, state
        outs = tuple(x.view_as(x) for x in xs)
        emu = active_emulation()
        if emu is not None and emu.fmt is not None:
            for o in outs:
                mark_low_precision(o)
        return outs

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        point, state = ctx.point, ctx.state
        k = point.index
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return (None, None, *grads)
        alphas = [state.read_alpha(point.in_slots[i], point.name) for i in present]
        if state.recompute or state.branch_factors[k] is None:
            a = torch.stack([x.float().reshape(()) for x in alphas])
            m = torch.stack([_max_abs(grads[i]).float() for i in present])
            if state.reduce_fn is not None:
                m = state.reduce_fn(None, m)[1]
            common = branch_loss_scale(a, m, state.u_max)
            factors = common / a
            state.branch_alpha[k] = common
            full = torch.ones(len(grads), dtype=factors.dtype, device=factors.device)
            full[present] = factors
            state.branch_factors[k] = full
            state.branch_rescaled[k] = (a != common).any()
            out = list(grads)
            for j, i in enumerate(present):
                out[i] = grads[i] * factors[j].to(grads[i].dtype)
        else:
            common = state.branch_alpha[k]
            host = state.branch_factors_host[k] if state.branch_factors_host is not None else None
            out = list(grads)
            for i in present:
                f = host[i] if host is not None else None
                if f != 1.0:
                    factor = f if f is not None else state.branch_factors[k][i].to(grads[i].dtype)
                    out[i] = grads[i] * factor
        state.alpha[point.out_slot] = common
        return (None, None, *out)
