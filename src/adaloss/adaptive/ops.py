"""The autograd front ends of adaptive loss scaling (Zhao et al., section 3): the nodes around Algorithm 3.

The arithmetic is elsewhere, once: Algorithm 3's ``<alpha, delta>`` backward in
:mod:`adaloss.adaptive.algorithm3`, Algorithm 4 (a point's local scale ``beta``) in
:mod:`adaloss.adaptive.rules`, Algorithm 5 (branches) in :mod:`adaloss.adaptive.algorithm5`, and the GEMM's
numbers (autocast, emulated rounding, FP8 quantizer sites, FP4 GEMMs, telemetry probes) in
:class:`~adaloss.adaptive.gemm_numerics.GemmNumerics`. The classes here are ``torch.autograd.Function``
nodes the transform (:mod:`adaloss.adaptive.transform`) puts in the model; each keeps what its backward pass
needs, reads the kind of pass (:func:`_pass_kind`, the one place that does), and calls the core:

* :class:`ScaledGEMM` (conv, linear, grouped GEMM): :func:`~adaloss.adaptive.algorithm3.gemm_backward`.
* :class:`ScaledProduct` (an activation-by-activation product, an attention call):
  :func:`~adaloss.adaptive.algorithm3.product_backward`; its operands are :class:`MatmulOperands` and
  :class:`AttentionOperands`.
* :class:`Rescale` (branches): :func:`~adaloss.adaptive.algorithm5.rescale`.
* :class:`ParamUnscale`: any other use of a parameter (a batch norm's affine parameters, a tied
  embedding), :func:`~adaloss.adaptive.algorithm3.params_to_root`; for a module fed directly by a conv or
  linear layer (a batch norm after a conv), that layer's :class:`ScaledGEMM` node does it instead.
* :class:`GradRound` and :class:`GradProbe`: numerics nodes (the gradient format's rounding, telemetry).

One implementation for every device, eager or compiled: on a recompute pass the statistics, betas and
alphas are 0-dim tensors on the gradients' device, written into the scale buffers in place; on a reuse
pass each op reads its beta, branch factors and ``alpha_{N+1} / alpha_j`` there. No host sync, no
host-to-device copy and no Python float from a scale in any backward pass; no backward pass writes Python
state (what eager passes note besides, :func:`_pass_kind`, is not traced). Each op keeps the pass kind of
its forward pass (``ctx.kind``, :func:`_keep_pass_kind`), so a compiled model has one graph per kind. The ops
run with torch-function modes disabled (under the CPU emulation's mode, every tensor op and even ``.dtype``
inside them would take a Python round trip), and, eagerly, a branch adds its inputs' gradients in place into
the gradient a GEMM point made for it, as autograd's own accumulation would, instead of allocating a
rescaled copy.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from adaloss.adaptive import algorithm3, algorithm5
from adaloss.adaptive.algorithm3 import product_beta
from adaloss.adaptive.gemm_numerics import GemmNumerics
from adaloss.adaptive.state import (
    AdaptiveState,
    BranchPoint,
    GemmPoint,
    UnscalePoint,
)
from adaloss.numerics.emulation import active_emulation, is_low_precision, mark_low_precision
from adaloss.numerics.formats import round_to_format
from adaloss.numerics.quantizers import quantize_grad

__all__ = [
    "AdaptiveState",
    "AttentionOperands",
    "GemmPoint",
    "BranchPoint",
    "GradProbe",
    "ParamUnscale",
    "ScaledProduct",
    "ScaledGEMM",
    "GradRound",
    "MatmulOperands",
    "Rescale",
    "UnscalePoint",
    "product_beta",
]


def _pass_kind(ctx: Any, where: str) -> str:
    """The kind of this backward pass for an op whose forward pass kept ``ctx.kind`` (``state.kind`` then).

    Eager passes also note a pass that builds a graph (``create_graph=True``), refuse a backward pass the
    scaler did not arm (``loss.backward()`` instead of ``scaler.scale(loss).backward()``) and apply a
    plain pass; none of this is traced (a compiled step has none of the three), so a compiled backward
    reads no Python state set after its forward pass."""
    state = ctx.state
    if not torch.compiler.is_compiling():
        if torch.is_grad_enabled():
            state.graph_built = True
        if not state.armed:
            raise RuntimeError(state.unarmed_message(where))
        if state.kind == "plain":
            return "plain"
    return ctx.kind


def _keep_pass_kind(ctx: Any, state: AdaptiveState) -> None:
    """A forward pass keeps the kind of pass it runs in (``ctx.state``, ``ctx.kind``) for its backward pass,
    which reads it through :func:`_pass_kind`."""
    ctx.state, ctx.kind = state, state.kind


class ScaledGEMM(torch.autograd.Function):
    """A conv or linear layer whose backward pass is Algorithm 3 with Algorithm 4's local scale
    (:func:`adaloss.adaptive.algorithm3.gemm_backward`), its numbers those of a
    :class:`~adaloss.adaptive.gemm_numerics.GemmNumerics`.

    ``spec`` describes the layer (``kind``: "linear" | "conv" | "conv_transpose" | "grouped", strides,
    padding, ...; a grouped GEMM's ``offs``: one beta for all its groups, see docs/transform.md).
    ``record`` (grad mode was on at the call) gives an FP8 recipe's weight and bias gradients their quantizer
    sites. The incoming gradient arrives already rounded (and counted for telemetry) by the
    :class:`GradRound` node on its output. ``carried``: the parameters of the module the layer feeds directly
    (``GemmPoint.carried``, a batch norm after a conv); the node returns a view of each beside ``y`` and
    brings their gradients to the root scale as :class:`ParamUnscale` would (the module's backward pass
    runs just before this one, and its gradient carries this layer's ``alpha_j``): one Python node fewer
    per such module. The cost of a backward call beyond the plain layer's: see
    :func:`~adaloss.adaptive.algorithm3.gemm_backward`. No host sync.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x, weight, bias, point: GemmPoint, state: AdaptiveState, spec: dict, record: bool, *carried
    ):
        # Torch-function modes (the CPU emulation's) off: every op here, even ``.dtype``, would otherwise
        # take a Python round trip through the mode; the emulation's rounding is done explicitly.
        with torch._C.DisableTorchFunction():
            y = ScaledGEMM._forward(ctx, x, weight, bias, point, state, spec, record)
            if not carried:
                return y
            ctx.set_materialize_grads(False)  # as in ParamUnscale
            return (y, *_param_views(ctx, carried))

    @staticmethod
    def _forward(ctx, x, weight, bias, point, state, spec, record):
        ctx.point = point
        _keep_pass_kind(ctx, state)
        ctx.numerics = GemmNumerics(point.name, spec, record)
        y, x, weight = ctx.numerics.forward(x, weight, bias)
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, delta, *carried):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            if not carried:
                return ScaledGEMM._backward(ctx, delta)
            grads = ScaledGEMM._backward(ctx, delta) if delta is not None else (None,) * 7
            kind = _pass_kind(ctx, ctx.point.name)
            return (*grads, *algorithm3.params_to_root(ctx.state, kind, ctx.point.carried, carried))

    @staticmethod
    def _backward(ctx, delta):
        # ``delta`` is already in the gradient format (GradRound rounded it).
        x, w = ctx.saved_tensors
        point, state, numerics = ctx.point, ctx.state, ctx.numerics
        kind = _pass_kind(ctx, point.name)
        need = numerics.wanted(ctx.needs_input_grad)
        grad_x, grad_w, grad_b = algorithm3.gemm_backward(numerics, state, kind, point, delta, x, w, need)
        # A gradient made for a branch alone: the branch may add the others into it (Rescale).
        if need[0] and point.feeds is not None and not torch.compiler.is_compiling():
            state.fresh[point.feeds] = grad_x
        return grad_x, grad_w, grad_b, None, None, None, None


class GradRound(torch.autograd.Function):
    """Identity forward; backward stores the gradient reaching a GEMM point's output in the gradient format
    (:func:`adaloss.numerics.quantizers.quantize_grad`: plain rounding, or the FP8 recipe's quantizer).

    A separate autograd node rather than a step inside :class:`ScaledGEMM`'s backward, for memory: the
    engine frees the unrounded gradient as soon as this node returns, so the GEMM's own backward (whose
    input gradient is activation-sized) reuses that memory, as the plain layer's rounding node and
    convolution backward do. The probe (underflow telemetry) compares the gradient before and after
    rounding here.
    """

    @staticmethod
    def forward(ctx, y, grad_fmt, probe, site=None):  # type: ignore[override]
        ctx.grad_fmt, ctx.probe, ctx.site = grad_fmt, probe, site
        with torch._C.DisableTorchFunction():
            return mark_low_precision(y.view_as(y))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            rounded = quantize_grad(grad, ctx.grad_fmt, ctx.site, ctx.probe)
        return rounded, None, None, None

    @staticmethod
    def wrap(y: torch.Tensor, point: GemmPoint) -> torch.Tensor:
        """``y`` behind a GradRound node when an emulation with a gradient format is active and grad is on."""
        emu = active_emulation()
        if emu is None or emu.grad_fmt is None or not torch.is_grad_enabled():
            return y
        fp4 = emu.fp4 is not None and emu.fp4.applies(point.name)  # ScaledGEMM probes the FP4 operand
        return GradRound.apply(y, emu.grad_fmt, None if fp4 else emu.probe_for(point.name), emu.grad_site(y))


def _alias(y: torch.Tensor) -> torch.Tensor:
    """A view of ``y`` for an identity node's output, stored in the format exactly when ``y`` is."""
    with torch._C.DisableTorchFunction():
        out = y.view_as(y)
        if is_low_precision(y):
            mark_low_precision(out)
    return out


def _param_views(ctx: Any, params: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The views an identity node returns for parameters (:class:`ParamUnscale`, or the parameters a
    :class:`ScaledGEMM` carries); a frozen parameter's view is marked as needing no gradient (else its
    module would compute one). Call with torch-function modes off (``requires_grad`` included)."""
    views = tuple(p.view_as(p) for p in params)
    frozen = [v for v, p in zip(views, params, strict=True) if not p.requires_grad]
    if frozen:
        ctx.mark_non_differentiable(*frozen)
    return views


class ParamUnscale(torch.autograd.Function):
    """Identity on the parameters of one use outside a GEMM point (:class:`UnscalePoint`: a batch norm's
    affine parameters, a tied embedding), one point per parameter; the backward pass multiplies each
    parameter's gradient from that use by ``alpha_{N+1} / alpha`` of its point, in the parameter's own
    dtype, so it joins the other contributions in ``.grad`` at the root scale, as every parameter gradient
    leaves the backward pass. One node for all the parameters of a call (a batch norm's weight and bias
    together). Cost: one pass over each gradient (none where the factor is 1 by construction); no sync.

    A module fed directly by a conv or linear layer (a batch norm after a conv) needs no node of its own:
    the layer's :class:`ScaledGEMM` carries its parameters (``GemmPoint.carried``) and does the same in
    its backward pass, which runs right after the module's and reads the same alpha."""

    @staticmethod
    def forward(ctx, points: tuple[UnscalePoint, ...], state: AdaptiveState, *params):  # type: ignore[override]
        ctx.points = points
        _keep_pass_kind(ctx, state)
        ctx.set_materialize_grads(False)  # a parameter without a gradient from this use gets None, not zeros
        with torch._C.DisableTorchFunction():  # as in ScaledGEMM.forward (``requires_grad`` included)
            return _param_views(ctx, params)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            kind = _pass_kind(ctx, ctx.points[0].name)
            return (None, None, *algorithm3.params_to_root(ctx.state, kind, ctx.points, grads))


class GradProbe(torch.autograd.Function):
    """Identity; on the way back, counts the underflow of the gradient passing through (telemetry of an
    activation-by-activation product's output gradient, which the emulation rounds just after this node
    in the backward pass) and passes it on unchanged. ``operands`` (an :class:`AttentionOperands`, or
    None) counts the attention scores' gradient as well. Telemetry steps only."""

    @staticmethod
    def forward(ctx, y, probe, fmt, operands, *tensors):  # type: ignore[override]
        ctx.probe, ctx.fmt, ctx.operands = probe, fmt, operands
        with torch._C.DisableTorchFunction():
            ctx.save_for_backward(*tensors)  # the operands' tensors (``_Operands.take``)
        return _alias(y)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        with torch._C.DisableTorchFunction(), torch.no_grad():
            rounded = round_to_format(grad, ctx.fmt) if ctx.fmt is not None else None
            if ctx.probe is not None:
                ctx.probe.record(grad, rounded)
            if ctx.operands is not None:
                ctx.operands.give(ctx.saved_tensors).record(rounded if rounded is not None else grad, None)
        return (grad, *(None,) * (len(ctx.needs_input_grad) - 1))


# --------------------------------------------------------------------------------------------------------
# Activation-by-activation products


class _Operands:
    """The operands a product's beta is computed from. They reach the backward pass through
    ``ctx.save_for_backward``, not as Python attributes: the caller hands :meth:`take`'s tensors to the
    autograd function as inputs, which saves them, and its backward pass puts them back (:meth:`give`).
    So saved-tensor hooks see them, and activation checkpointing (``torch.utils.checkpoint``) frees them
    after the forward pass and recomputes them with the rest of the checkpointed block."""

    _TENSORS: tuple[str, ...] = ()

    def take(self) -> tuple[torch.Tensor | None, ...]:
        """The operand tensors, removed from this object (to be passed to the autograd function). None
        while compiling: a compiled step has no checkpointing, and dynamo refuses a backward pass that
        writes into an object of its forward pass, so the tensors stay attributes there."""
        if torch.compiler.is_compiling():
            return ()
        tensors = tuple(getattr(self, name) for name in self._TENSORS)
        for name in self._TENSORS:
            setattr(self, name, None)
        return tensors

    def give(self, tensors: tuple[torch.Tensor | None, ...]) -> _Operands:
        """This object with the tensors :meth:`take` removed put back (``ctx.saved_tensors``; none: it
        took none, and the object is returned as it is)."""
        if not tensors:
            return self
        for name, t in zip(self._TENSORS, tensors, strict=True):
            setattr(self, name, t)
        return self


class MatmulOperands(_Operands):
    """What :func:`product_beta` needs of ``y = a @ b`` (``torch.matmul``, ``@``, ``bmm``, ``mm``, and the
    ``input @ weight^T`` of an ``F.linear`` whose weight is an activation): ``da = delta b^T`` sums
    ``b.shape[-1]`` products, ``db = a^T delta`` sums ``a.shape[-2]``. Only the inputs that need a gradient
    count. The operands are the ones the product saved for its own backward: no extra memory."""

    _TENSORS = ("a", "b")

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a.detach(), b.detach()
        self.need = (a.requires_grad, b.requires_grad)

    def pairs(self, delta: torch.Tensor) -> list[tuple[torch.Tensor, float, int, torch.Tensor]]:
        a, b = self.a, self.b
        out = []
        if self.need[0]:
            out.append((b, 1.0, b.shape[-1] if b.dim() > 1 else 1, delta))
        if self.need[1]:
            out.append((a, 1.0, a.shape[-2] if a.dim() > 1 else 1, delta))
        return out

    def record(self, delta: torch.Tensor, beta: torch.Tensor | None, pairs: list | None = None) -> None:
        """Nothing beyond the output gradient (counted where it is rounded)."""


class AttentionOperands(_Operands):
    """What :func:`product_beta` needs of scaled dot-product attention ``O = softmax(s Q K^T + M) V``
    (``s = 1/sqrt(d)`` unless given): its four products, ``dP = dO V^T`` (F = d), ``dV = P^T dO``
    (F = queries), ``dQ = s dS K`` (F = keys), ``dK = s dS^T Q`` (F = queries), with
    ``dS = P (dP - rowsum(dP P))``. ``P`` and ``dS`` exist only inside the attention kernel, so they are
    recomputed from the saved query, key and value (recompute passes, and telemetry steps: an attention
    forward and half a backward; attention dropout is not replayed, so its statistics are those without
    dropout). On a telemetry step :meth:`record` counts what storing ``dS`` at the scale the kernel sees it
    (the gradient times beta) would lose: GPU attention kernels store it in half precision before its
    two products; the emulation keeps it in FP32 inside the kernel, as the CPU's does."""

    _TENSORS = ("q", "k", "v", "mask")

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        scale: float | None,
        scores_probe: Any = None,
        grad_fmt: Any = None,
    ) -> None:
        self.q, self.k, self.v = q.detach(), k.detach(), v.detach()
        self.mask = None if mask is None else mask.detach()
        self.is_causal = is_causal
        self.scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        self.scores_probe, self.grad_fmt = scores_probe, grad_fmt

    def _recompute(
        self, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k, v, P, dS)`` in float32 (float64 for float64 inputs), heads of k/v repeated to q's."""
        dtype = torch.promote_types(self.q.dtype, torch.float32)
        q, k, v, d_out = (t.to(dtype) for t in (self.q, self.k, self.v, delta))
        if k.dim() > 2 and k.shape[-3] != q.shape[-3]:  # grouped-query attention
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        # every score-sized tensor below is made here and updated in place: a pass over the scores costs
        # more than the products that make them (T x T against T x d)
        s = q.matmul(k.transpose(-2, -1)).mul_(self.scale)
        if self.is_causal:  # an additive -inf mask: a broadcast masked_fill_ takes 4x longer on the CPU
            drop = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).triu_(1)
            s.add_(torch.zeros(drop.shape, dtype=s.dtype, device=s.device).masked_fill_(drop, -math.inf))
        if self.mask is not None:
            s = s.masked_fill_(~self.mask, -math.inf) if self.mask.dtype == torch.bool else s.add_(self.mask)
        p = torch.softmax(s, dim=-1)
        d_p = d_out.matmul(v.transpose(-2, -1))
        # dS = P (dP - rowsum(dP P)): softmax's own backward kernel, one pass (four as separate ops)
        d_s = torch.ops.aten._softmax_backward_data(d_p, p, -1, p.dtype)
        return k, v, p, d_s

    def pairs(self, delta: torch.Tensor) -> list[tuple[torch.Tensor, float, int, torch.Tensor]]:
        k, v, p, d_s = self._recompute(delta)
        q = self.q
        n_q, n_k = q.shape[-2], k.shape[-2]
        return [
            (v, 1.0, q.shape[-1], delta),  # dP = dO V^T
            (p, 1.0, n_q, delta),  # dV = P^T dO
            (k, self.scale, n_k, d_s),  # dQ = s dS K
            (q, self.scale, n_q, d_s),  # dK = s dS^T Q
        ]

    def record(self, delta: torch.Tensor, beta: torch.Tensor | None, pairs: list | None = None) -> None:
        """On a telemetry step, count what storing ``dS`` at the scale the kernel sees it would lose;
        ``pairs`` (what :meth:`pairs` returned in this backward pass) saves recomputing it."""
        if self.scores_probe is None:
            return
        d_s = pairs[2][3] if pairs else self._recompute(delta)[3]
        self.scores_probe.record(d_s if beta is None else d_s * beta)


class ScaledProduct(torch.autograd.Function):
    """Algorithm 3 at an activation-by-activation product: ``Backprop(beta * delta)``, beta from
    :func:`~adaloss.adaptive.algorithm3.product_beta` (:func:`~adaloss.adaptive.algorithm3.product_backward`).

    The transform wires a product like a GEMM point (a :class:`GemmPoint` of kind "product"): the gradient
    of its output arrives with ``alpha_j``, and every input gradient it makes leaves with ``alpha_j *
    beta``. It sits on the product's output: its forward is the identity (and, in emulation, the output's
    rounding to the format); its backward receives ``delta`` already stored in the gradient format (by the
    :class:`GradRound` on its output) and hands ``beta * delta`` to the product's own backward, whose input
    gradients, linear in ``delta``, then carry ``beta`` (exact: a power of two). Multiplying before the
    product's backward rather than after keeps the scaled values inside an attention kernel too (``dS``).
    ``operands``: :class:`MatmulOperands` or :class:`AttentionOperands`. Betas are computed on recompute
    passes and reused in between, as a layer's; no host sync.
    Per backward call: one multiply of the output gradient by beta (none on a plain pass); on a
    recompute pass the statistics of the operands and gradients (an attention call also recomputes its
    scores, see :class:`AttentionOperands`).
    """

    @staticmethod
    def forward(ctx, y, point: GemmPoint, state: AdaptiveState, operands: Any, round_fmt: Any, *tensors):  # type: ignore[override]
        ctx.point, ctx.operands = point, operands
        _keep_pass_kind(ctx, state)
        with torch._C.DisableTorchFunction():
            ctx.save_for_backward(*tensors)  # the operands' tensors (``_Operands.take``)
            if round_fmt is None:
                return _alias(y)
            return mark_low_precision(round_to_format(y, round_fmt))

    @staticmethod
    def backward(ctx, delta):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            point, state, operands = ctx.point, ctx.state, ctx.operands.give(ctx.saved_tensors)
            kind = _pass_kind(ctx, point.name)
            scaled = algorithm3.product_backward(state, kind, point, delta, operands)
            return (scaled, *(None,) * (len(ctx.needs_input_grad) - 1))


# --------------------------------------------------------------------------------------------------------
# Branches


class Rescale(torch.autograd.Function):
    """Identity in the forward pass; in the backward pass, Algorithm 5 over the gradients of its outputs
    (:func:`adaloss.adaptive.algorithm5.rescale`).

    For a tensor with n consumers the transform calls ``Rescale.apply(point, state, n, x)`` and hands one
    of the n outputs to each consumer, so the n gradients arrive here together; each is brought to the
    common alpha and they are summed here, the rescaling fused into the sum (``addcmul``) so no separately
    scaled copy is made. For an op with several outputs (split, chunk) it is called with those outputs
    instead (``copies`` 1), and each gradient is rescaled on its own.
    """

    @staticmethod
    def forward(ctx, point: BranchPoint, state: AdaptiveState, copies: int, *xs):  # type: ignore[override]
        ctx.point = point
        _keep_pass_kind(ctx, state)
        ctx.shared = copies > 1
        # An output no gradient reaches (a head the loss does not use) arrives as None, not as zeros: its
        # consumer emitted no alpha, and it must not count in Algorithm 5.
        ctx.set_materialize_grads(False)
        if ctx.shared:
            xs = xs * copies
        with torch._C.DisableTorchFunction():  # as in ScaledGEMM.forward
            outs = tuple(x.view_as(x) for x in xs)
            emu = active_emulation()
            if emu is not None and emu.fmt is not None:
                # A view holds its input's values: stored in the format only if the input was (an
                # unrounded FP32 input, the network's own for one, still gets rounded by its consumers).
                for x, o in zip(xs, outs, strict=True):
                    if is_low_precision(x):
                        mark_low_precision(o)
        return outs

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            return Rescale._backward(ctx, *grads)

    @staticmethod
    def _backward(ctx, *grads):
        point, state = ctx.point, ctx.state
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return (None, None, None, *(grads[:1] if ctx.shared else grads))
        kind = _pass_kind(ctx, point.name)
        # A gradient made by a GEMM point feeding this branch directly is ours to write into (eagerly).
        owned = None
        if state.fresh and not torch.compiler.is_compiling():
            for i in range(len(grads)):
                t = state.fresh.pop((point.index, i), None)
                if owned is None and t is not None and t is grads[i]:
                    owned = i
        return (None, None, None, *algorithm5.rescale(state, kind, point, grads, present, ctx.shared, owned))
