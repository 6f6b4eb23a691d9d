"""The numerical core of adaptive loss scaling (Zhao et al., section 3): Algorithms 3, 4, 5 as autograd ops.

Backpropagation carries the pair ``<alpha, delta>``: ``delta`` is the gradient already multiplied by the
accumulated scale ``alpha`` (Algorithm 3). Autograd only passes gradients, so the alphas travel beside them,
in the device tensors of :class:`~adaloss.adaptive.state.ScaleBuffers`: every GEMM point and every branch
point writes the alpha of the gradient it emits into its own slot, and reads the alpha of the gradient it
receives from the slot of whichever point emitted it (that wiring is static and comes from
:mod:`adaloss.adaptive.transform`; :mod:`adaloss.adaptive.state` holds it). Element-wise ops sit between
points and pass alpha through unchanged (section 3.2.2), so they need no code at all.

* :class:`ScaledGEMM` (conv, linear): receives ``delta_j`` scaled by ``alpha_j``; computes the local scale
  ``beta`` from the statistics of its weight and ``delta_j`` (Algorithm 4, :func:`gemm_beta` and
  :mod:`adaloss.adaptive.rules`); computes the input gradient as ``Backprop(beta * delta_j)``, the scaled
  gradient stored in the gradient format (so an FP16 overflow of ``beta * delta_j`` is an overflow, as in
  FP16 training; scaling the weight instead would overflow wherever ``beta * W`` does) and emits
  ``alpha_j * beta``; computes the weight gradient from ``delta_j`` and multiplies it by ``alpha_{N+1} /
  alpha_j`` in FP32, so every parameter gradient leaves the backward pass carrying the root scale
  ``alpha_{N+1}``, as under ``torch.amp.GradScaler`` (``unscale_`` then divides by it).
* :class:`ScaledProduct` (an activation-by-activation product, an attention call): the same
  ``Backprop(beta * delta_j)`` with the beta of :func:`product_beta` (Algorithm 4 with the other operand in
  the weight's place); no weight gradient.
* :class:`Rescale` (branches, Algorithm 5): all gradients flowing into one tensor arrive together; they are
  brought to one common alpha (:func:`branch_scales`, :func:`~adaloss.adaptive.rules.branch_loss_scale`)
  and summed, the rescaling fused into the sum.
* :class:`ParamUnscale`: any other use of a parameter (a batch norm's affine parameters, a tied
  embedding), brought to the root scale by its own alpha; for a module fed directly by a conv or linear
  layer (a batch norm after a conv), that layer's :class:`ScaledGEMM` node does it instead.

One implementation for every device, eager or compiled: on a recompute pass the statistics, betas and
alphas are 0-dim tensors on the gradients' device, written into the scale buffers in place; on a reuse
pass each op reads its beta, branch factors and ``alpha_{N+1} / alpha_j`` there. No host sync, no
host-to-device copy and no Python float from a scale in any backward pass; no backward pass writes Python
state (what eager passes note besides, :func:`_pass_kind`, is not traced). Each op keeps the pass kind of
its forward pass (``ctx.kind``), so a compiled model has one graph per kind. The ops run with torch-function
modes disabled (under the CPU emulation's mode, every tensor op and even ``.dtype`` inside them would take a
Python round trip), and, eagerly, a branch adds its inputs' gradients in place into the gradient a GEMM
point made for it, as autograd's own accumulation would, instead of allocating a rescaled copy.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from adaloss.adaptive.gemms import grouped_mm, grouped_wgrad
from adaloss.adaptive.rules import (
    ScaleRule,
    Statistics,
    branch_loss_scale,
    gemm_bounds,
    gemm_loss_scale,
    max_magnitude,
    statistics,
)
from adaloss.adaptive.state import (
    AdaptiveState,
    BranchPoint,
    GemmPoint,
    UnscalePoint,
)
from adaloss.numerics.emulation import active_emulation, is_low_precision, mark_low_precision
from adaloss.numerics.formats import round_to_format
from adaloss.numerics.fp4_gemm import conv_geometry
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


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype Algorithm 4's statistics of a tensor are taken in: float64 for float64, else float32."""
    return torch.float64 if dtype is torch.float64 else torch.float32


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


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (a model spread over devices reads the scale buffers from another one)."""
    return t if t.device == device else t.to(device)


def _read(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A scale read from the buffers for use in this backward pass: a view of the buffer, or a copy in a
    pass that builds a graph (``create_graph=True``), which saves what it multiplies by: the buffer is
    written in place later (autograd would refuse the changed tensor)."""
    t = _on(t, device)
    return t.clone() if torch.is_grad_enabled() else t


def _unit(state: AdaptiveState, part: int, index: int) -> bool:
    """Whether an eager reuse pass may skip a multiplication: the scale (``part`` 0: a beta, 1: a branch
    factor, 2: a ``to_root`` factor) is exactly 1 by the host's flags, read once after the last recompute
    (``AdaptiveState.note_units``). Never traced: a compiled pass multiplies by every scale."""
    if torch.compiler.is_compiling():  # first: a traced read of ``units`` would guard the graph on it
        return False
    units = state.units
    return units is not None and units[part][index]


def _emit(state: AdaptiveState, slot: int, alpha: torch.Tensor) -> None:
    """A recompute pass's point emits ``alpha`` into ``slot``: ``alpha[slot]`` and ``to_root[slot]`` are
    written in place (two small device ops; readers of the slot run later in the same backward pass)."""
    buf = state.buffers
    alpha = _on(alpha, buf.device)
    buf.alpha[slot].copy_(alpha)
    buf.to_root[slot].copy_(buf.alpha[0] / alpha)


def _root_factor(state: AdaptiveState, kind: str, slot: int, device: torch.device) -> torch.Tensor | None:
    """``alpha_{N+1} / alpha`` of slot ``slot`` (a 0-dim device tensor), or None where it is 1 by
    construction (slot 0, and every slot of a plain pass): what brings a gradient carrying that alpha to
    the root scale, as every parameter gradient leaves the backward pass (exact: powers of two)."""
    if kind == "plain" or slot == 0 or (kind == "reuse" and _unit(state, 2, slot)):
        return None
    return _read(state.buffers.to_root[slot], device)


# --------------------------------------------------------------------------------------------------------
# GEMM


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
# one call that says whether any device's autocast is on (most passes: no), before the per-device question
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _conv_forward(x, w, b, spec):
    return _CONV[spec["dims"]](x, w, b, spec["stride"], spec["padding"], spec["dilation"], spec["groups"])


def _conv_transpose_forward(x, w, b, spec):
    conv = _CONV_T[spec["dims"]]
    return conv(
        x, w, b, spec["stride"], spec["padding"], spec["output_padding"], spec["groups"], spec["dilation"]
    )


def _conv_backward(grad, x, w, spec, mask):
    # ``.default`` skips the overload resolution of the packet (a few microseconds per call)
    # the bias sizes (the output's channels) only where the bias gradient is asked for: the compiler's
    # shape function needs them then
    bias_sizes = [grad.shape[1]] if mask[2] else None
    return torch.ops.aten.convolution_backward.default(grad, x, w, bias_sizes, *spec["backward_args"], mask)


class ScaledGEMM(torch.autograd.Function):
    """A conv or linear layer whose backward pass is Algorithm 3 with Algorithm 4's local scale.

    ``spec`` describes the layer (``kind``: "linear" | "conv" | "conv_transpose" | "grouped", strides,
    padding, ...; a grouped GEMM's ``offs``: one beta for all its groups, see docs/transform.md).
    In emulation it rounds like :class:`~adaloss.numerics.emulation.EmulatedAutocast` would around a GEMM:
    the weight copy, the output, the beta-scaled gradient used for the input gradient, and the weight
    gradient before it is brought to the root scale in the FP32 master gradient; the incoming gradient
    arrives already rounded (and counted for telemetry) by the :class:`GradRound` node on its output. Under
    autocast (CUDA, or the CPU's own FP16/BF16) it computes in the autocast dtype explicitly, backward pass
    included. ``record`` (grad mode was on at the call) gives an FP8 recipe's weight and bias gradients
    their quantizer sites. ``carried``: the parameters of the module the layer feeds directly
    (``GemmPoint.carried``, a batch norm after a conv); the node returns a view of each beside ``y`` and
    brings their gradients to the root scale as :class:`ParamUnscale` would (the module's backward pass
    runs just before this one, and its gradient carries this layer's ``alpha_j``): one Python node fewer
    per such module.

    Per backward call, beyond what the plain layer does: on a recompute pass the weight's and the gradient's
    statistics (four reductions), the beta arithmetic (about ten 0-dim ops,
    :meth:`adaloss.adaptive.rules.ScaleRule.beta`) and the writes of beta and the emitted alpha; on every
    pass one multiply of the incoming gradient by beta and one of the weight gradient by ``alpha_{N+1} /
    alpha_j`` (none where that is 1 by construction, or on a plain pass). No host sync.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x, weight, bias, point: GemmPoint, state: AdaptiveState, spec: dict, record: bool, *carried
    ):
        # Torch-function modes (the CPU emulation's) off: every op here, even ``.dtype``, would otherwise
        # take a Python round trip through the mode; the emulation's rounding is done explicitly below.
        with torch._C.DisableTorchFunction():
            y = ScaledGEMM._forward(ctx, x, weight, bias, point, state, spec, record)
            if not carried:
                return y
            ctx.set_materialize_grads(False)  # as in ParamUnscale
            return (y, *_param_views(ctx, carried))

    @staticmethod
    def _forward(ctx, x, weight, bias, point, state, spec, record):
        emu = active_emulation()
        fmt = emu.fmt if emu is not None else None
        # With a gradient format, GradRound (applied to this op's output by AdaptiveGEMM) rounds the incoming
        # gradient and feeds the probe; without one (FP32 telemetry) the probe is fed here.
        ctx.grad_fmt = emu.grad_fmt if emu is not None else None
        ctx.probe = emu.probe_for(point.name) if emu is not None and ctx.grad_fmt is None else None
        ctx.point, ctx.state, ctx.spec, ctx.kind = point, state, spec, state.kind
        ctx.x_dtype = x.dtype
        ctx.w_dtype = weight.dtype  # the master weight's dtype: parameter gradients are returned in it
        # Under autocast (any device type: CUDA, or the CPU's real FP16/BF16 kernels) the layer computes in
        # the autocast dtype, and so does its backward pass, which autocast does not cover: cast explicitly.
        if _ANY_AUTOCAST() and torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        if fmt is not None:
            if not is_low_precision(x):  # usually already stored in the format by its producer
                x = round_to_format(x, fmt)
            weight = round_to_format(weight, fmt)
            bias = round_to_format(bias, fmt) if bias is not None else None
        # With an FP8 recipe's quantizer (precision.grad_scaling) the weight and bias gradients are stored
        # through it, each at a site of its own, as the plain emulation stores them (None: plain rounding).
        sites = (None, None)
        if emu is not None and emu.grad_quantizer is not None and record:
            sites = (emu.grad_site(weight), emu.grad_site(bias) if bias is not None else None)
        ctx.sites = sites
        ctx.fp4, ctx.fp4_geometry = _fp4_of(emu, point, spec, x, weight)
        if ctx.fp4 is not None:
            ctx.fp4_probe = emu.probe_for(point.name)
            if ctx.fp4_geometry is None:
                y = ctx.fp4.forward(x, weight, bias)
            else:
                y = ctx.fp4.conv_forward(x, weight, bias, ctx.fp4_geometry)
        elif spec["kind"] == "linear":
            y = F.linear(x, weight, bias)
        elif spec["kind"] == "conv":
            y = _conv_forward(x, weight, bias, spec)
        elif spec["kind"] == "grouped":
            y = grouped_mm(x, weight, spec["offs"])
        else:
            y = _conv_transpose_forward(x, weight, bias, spec)
        if fmt is not None:
            y = mark_low_precision(round_to_format(y, fmt))
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, delta, *carried):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            if not carried:
                return ScaledGEMM._backward(ctx, delta)
            grads = ScaledGEMM._backward(ctx, delta) if delta is not None else (None,) * 7
            kind = _pass_kind(ctx, ctx.point.name)
            return (*grads, *_to_root_each(ctx.state, kind, ctx.point.carried, carried))

    @staticmethod
    def _backward(ctx, delta):
        # ``delta`` is already in the gradient format (GradRound rounded it).
        x, w = ctx.saved_tensors
        point, state = ctx.point, ctx.state
        kind = _pass_kind(ctx, point.name)
        if ctx.probe is not None:
            ctx.probe.record(delta)
        if delta.dtype != w.dtype:
            delta = delta.to(w.dtype)
        beta = _point_beta(state, kind, point, delta.device, lambda a: gemm_beta(state, point, w, delta, a))
        to_root = _root_factor(state, kind, point.in_slot, delta.device)
        return ScaledGEMM._gradients(ctx, delta, x, w, to_root, beta)

    @staticmethod
    def _gradients(ctx, delta, x, w, to_root, beta):
        """Input, weight and bias gradients from the (rounded) ``delta`` and the layer's beta (Algorithm 3).

        The input gradient is ``Backprop(beta * delta)``: the gradient is scaled, stored in the gradient
        format (an FP16 product beyond 65504 becomes infinite, as in FP16 training), then multiplied by the
        weight. The weight and bias gradients come from ``delta``, are rounded to the gradient format, and
        are multiplied by ``to_root = alpha_{N+1} / alpha_j`` in the master dtype, so that they carry the
        root scale as every parameter gradient does (exact: a power of two). None for either: 1.
        """
        point, state, spec, grad_fmt = ctx.point, ctx.state, ctx.spec, ctx.grad_fmt
        grad_x = grad_w = grad_b = None
        needs = ctx.needs_input_grad
        need_x = needs[0]
        need_w = needs[1] or (ctx.has_bias and needs[2])
        need_b = need_w and ctx.has_bias
        scaled = delta
        if need_x and beta is not None:
            scaled = delta * beta  # a 0-dim float32 beta: the product keeps delta's dtype
            # Stored in the gradient format. Under a quantizer's scales ``delta`` is already a stored value
            # (payload times its scale), and ``beta * delta`` is that payload with the scale times beta, a
            # power of two: rounding it again without the scale would flush what the scale kept.
            if grad_fmt is not None and ctx.sites[0] is None:
                scaled = round_to_format(scaled, grad_fmt)
        if ctx.fp4 is not None:  # FP4 operands (adaloss.numerics.fp4_gemm); the weight gradient in FP32
            grad_x, grad_w, grad_b = _fp4_gradients(ctx, delta, scaled, x, w, need_x, need_w)
        elif spec["kind"] == "linear":
            if need_x:
                grad_x = scaled.matmul(w)
            if need_w:
                d2 = delta.reshape(-1, delta.shape[-1])
                grad_w = d2.t().matmul(x.reshape(-1, x.shape[-1]))
                grad_b = d2.sum(0) if ctx.has_bias else None
        elif spec["kind"] == "grouped":  # one beta for every group: the input gradient is one tensor
            if need_x:
                grad_x = grouped_mm(scaled.contiguous(), w.transpose(-2, -1), spec["offs"])
            if need_w:
                grad_w = grouped_wgrad(x, delta.contiguous(), spec["offs"], w.shape[0])
        elif scaled is not delta:
            grad_x = _conv_backward(scaled, x, w, spec, [True, False, False])[0]
            if need_w:
                _, grad_w, grad_b = _conv_backward(delta, x, w, spec, [False, True, need_b])
        else:
            # One call for both: the weight gradient depends on delta and x only, not on the weight.
            grad_x, grad_w, grad_b = _conv_backward(delta, x, w, spec, [need_x, need_w, need_b])
        if need_x:
            if grad_x.dtype is not ctx.x_dtype:
                grad_x = grad_x.to(ctx.x_dtype)
            if point.feeds is not None and not torch.compiler.is_compiling():
                state.fresh[point.feeds] = grad_x
        if need_w:
            grad_w = _to_root(grad_w, grad_fmt, ctx.w_dtype, to_root, ctx.sites[0])
            if grad_b is not None:
                grad_b = _to_root(grad_b, grad_fmt, ctx.w_dtype, to_root, ctx.sites[1])
        return grad_x, grad_w, grad_b, None, None, None, None


def _fp4_of(emu: Any, point: GemmPoint, spec: dict, x: torch.Tensor, w: torch.Tensor) -> tuple[Any, Any]:
    """The FP4 GEMMs (:class:`~adaloss.numerics.fp4_gemm.FP4Gemm`) that run this layer and, for a conv, its
    im2col geometry: ``(None, None)`` where the layer stays in the base format (not an FP4 layer, or a
    conv other than a batched 2-D one with ``groups=1``)."""
    fp4 = emu.fp4 if emu is not None else None
    if fp4 is None or not fp4.applies(point.name):
        return None, None
    if spec["kind"] == "linear":
        return fp4, None
    if spec["kind"] != "conv" or spec["dims"] != 2 or spec["groups"] != 1 or x.dim() != 4:
        return None, None
    return fp4, conv_geometry(w, spec["stride"], spec["padding"], spec["dilation"])


def _fp4_gradients(
    ctx: Any, delta: torch.Tensor, scaled: torch.Tensor, x: torch.Tensor, w: torch.Tensor, need_x, need_w
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Input, weight and bias gradients of an FP4 layer: dgrad of the beta-scaled ``scaled``, wgrad of
    ``delta`` (in that order, as :class:`~adaloss.numerics.fp4_gemm.FP4Linear` draws its stochastic
    rounding), in FP32; a conv's through im2col (:meth:`~adaloss.numerics.fp4_gemm.FP4Gemm.conv_dgrad`)."""
    fp4, geometry, probe = ctx.fp4, ctx.fp4_geometry, ctx.fp4_probe
    grad_x = grad_w = grad_b = None
    if geometry is not None:
        if need_x:
            grad_x = fp4.conv_dgrad(scaled, w, x.shape, geometry, probe)
        if need_w:
            grad_w = fp4.conv_wgrad(delta, x, geometry, probe)
            grad_b = delta.sum((0, 2, 3)) if ctx.has_bias else None
        return grad_x, grad_w, grad_b
    d2 = delta.reshape(-1, delta.shape[-1])
    if need_x:
        grad_x = fp4.dgrad(scaled.reshape(d2.shape), w, probe).reshape(*delta.shape[:-1], -1)
    if need_w:
        grad_w = fp4.wgrad(d2, x.reshape(-1, x.shape[-1]), probe)
        grad_b = d2.sum(0) if ctx.has_bias else None
    return grad_x, grad_w, grad_b


def _point_beta(
    state: AdaptiveState, kind: str, point: GemmPoint, device: torch.device, compute: Any
) -> torch.Tensor | None:
    """GEMM point ``point``'s beta in a pass of ``kind``: on a recompute pass ``compute(alpha_j)``
    (Algorithm 4), written into ``beta[k]`` and emitted as ``alpha_j * beta``; on a reuse pass ``beta[k]``
    as the last recompute wrote it; None (1) on a plain pass. A 0-dim float32 device tensor. The scales
    are constants of the backward pass (powers of two): computed without a graph even under
    ``create_graph=True``."""
    if kind == "plain":
        return None
    buf = state.buffers
    if kind == "reuse":
        return None if _unit(state, 0, point.index) else _read(buf.beta[point.index], device)
    with torch.no_grad():
        alpha_j = _on(buf.alpha[point.in_slot], device)
        beta = compute(alpha_j)
        buf.beta[point.index].copy_(_on(beta, buf.device))
        _emit(state, point.out_slot, alpha_j * beta)
    return beta


def gemm_beta(
    state: AdaptiveState, point: GemmPoint, w: torch.Tensor, delta: torch.Tensor, alpha_j: torch.Tensor
) -> torch.Tensor:
    """Algorithm 4 at GEMM point ``point``: :func:`adaloss.adaptive.rules.gemm_loss_scale` with the point's
    constants, the gradient's statistics all-reduced under DDP. No host sync and no host-to-device copy."""
    return gemm_loss_scale(
        w, delta, state.rule, alpha_in=alpha_j, constants=point.constants, reduce_fn=state.reduce_fn
    )


def _to_root(
    grad: torch.Tensor,
    grad_fmt: Any,
    master: torch.dtype,
    to_root: torch.Tensor | None,
    site: Any = None,
) -> torch.Tensor:
    """A parameter gradient computed from ``delta``: stored in the gradient format (through ``site``'s
    quantizer under an FP8 recipe, :func:`adaloss.numerics.quantizers.quantize_grad`), cast to the master
    dtype and multiplied by ``alpha_{N+1} / alpha_j`` (None: 1), in place where the tensor is fresh."""
    if grad_fmt is not None:
        grad = quantize_grad(grad, grad_fmt, site)
    if grad.dtype != master:
        grad = grad.to(master)
    if to_root is None:
        return grad
    if grad._base is not None:  # a view (e.g. of a reshaped matmul): do not write into its base
        return grad * to_root
    return grad.mul_(to_root)


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


def _to_root_each(
    state: AdaptiveState,
    kind: str,
    points: tuple[UnscalePoint, ...],
    grads: tuple[torch.Tensor | None, ...],
) -> list[torch.Tensor | None]:
    """Each parameter gradient of a use times ``alpha_{N+1} / alpha`` of its point, in its own dtype (none
    where the factor is 1 by construction; None stays None). Call with torch-function modes off."""
    out: list[torch.Tensor | None] = []
    for point, grad in zip(points, grads, strict=True):
        if grad is not None:
            factor = _root_factor(state, kind, point.in_slot, grad.device)
            if factor is not None:
                grad = grad * factor
        out.append(grad)
    return out


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
        ctx.points, ctx.state, ctx.kind = points, state, state.kind
        ctx.set_materialize_grads(False)  # a parameter without a gradient from this use gets None, not zeros
        with torch._C.DisableTorchFunction():  # as in ScaledGEMM.forward (``requires_grad`` included)
            return _param_views(ctx, params)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            kind = _pass_kind(ctx, ctx.points[0].name)
            return (None, None, *_to_root_each(ctx.state, kind, ctx.points, grads))


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


def product_beta(
    pairs: list[tuple[torch.Tensor, float, int, torch.Tensor]],
    rule: ScaleRule,
    alpha_in: torch.Tensor | float,
    reduce_fn: Any = None,
) -> torch.Tensor:
    """The beta of an activation-by-activation product: Algorithm 4's bounds for each input gradient the
    product makes, with the other operand in the weight's place (:func:`adaloss.adaptive.rules.statistics`,
    :func:`~adaloss.adaptive.rules.gemm_bounds`), combined into one scale for all of them
    (:meth:`~adaloss.adaptive.rules.ScaleRule.beta`).

    ``pairs``: per input gradient ``(operand, multiplier, F, delta)``: the operand it is multiplied by (times
    the Python float ``multiplier``, e.g. attention's ``1/sqrt(d)``), its backward fan-in, and the gradient it
    is computed from. Each gives Algorithm 4's underflow bound ``lower_i`` and overflow bound ``upper_i``
    (module docstring of :mod:`adaloss.adaptive.rules`; the layer constants come from the operand's size, so
    they are Python floats, constants of a traced graph, not scales). The product's beta is the rule's beta
    for ``lower = max_i lower_i`` and ``upper = min_i upper_i``: as large as the most demanding input asks, as
    long as no input passes its own overflow bound (the branch point all of them would otherwise need,
    Algorithm 5, decided with the bounds instead of the gradients, which exist only after the product's
    backward). Bounded, rounded down to a power of two and 1 for an all-zero or non-finite gradient, as every
    beta. Under ``torch.distributed`` (``reduce_fn``) every tensor's second moment and max are combined over
    the ranks first, as the activations differ between ranks. Cost: two reductions per tensor and a few scalar
    ops; no host sync.
    """
    lowers, uppers = [], []
    seen: dict[int, Statistics] = {}  # a tensor in several pairs is read once

    def stats(t: torch.Tensor) -> Statistics:
        if id(t) not in seen:
            seen[id(t)] = statistics(_dense_on_cpu(t), reduce_fn)
        return seen[id(t)]

    for w, multiplier, fan_in, delta in pairs:
        a_const, b_const = rule.layer_constants(w.numel(), fan_in)
        lower_constant = rule.lower_constant(a_const / multiplier, delta.numel())
        lower, upper = gemm_bounds(stats(w), stats(delta), lower_constant, b_const / multiplier)
        lowers.append(lower)
        uppers.append(upper)
    return rule.beta(torch.stack(lowers).amax(), torch.stack(uppers).amin(), alpha_in)


def _dense_on_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied first if it is a strided view on the CPU (the heads of a split projection): the norm's
    strided CPU path takes 3.5x the copy and the norm together (tiny GPT's keys, 131,072 floats: 117 us
    against 33 us, one core). Elsewhere the view is reduced as it is (unmeasured there, and the copy would
    be one more pass)."""
    return t.contiguous() if t.device.type == "cpu" and not t.is_contiguous() else t


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
    :func:`product_beta`.

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
        ctx.point, ctx.state, ctx.operands, ctx.kind = point, state, operands, state.kind
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
            pairs: list = []

            def compute(alpha: torch.Tensor) -> torch.Tensor:
                pairs.extend(operands.pairs(delta))
                return product_beta(pairs, state.rule, alpha, state.reduce_fn)

            beta = _point_beta(state, kind, point, delta.device, compute)
            operands.record(delta, beta, pairs)
            nones = (None,) * (len(ctx.needs_input_grad) - 1)
            return ((delta if beta is None else delta * beta), *nones)


# --------------------------------------------------------------------------------------------------------
# Branches


class Rescale(torch.autograd.Function):
    """Identity in the forward pass; in the backward pass, Algorithm 5 over the gradients of its outputs.

    For a tensor with n consumers the transform calls ``Rescale.apply(point, state, n, x)`` and hands one
    of the n outputs to each consumer, so the n gradients arrive here together; each is brought to the
    common alpha and they are summed here, the rescaling fused into the sum (``addcmul``) so no separately
    scaled copy is made. For an op with several outputs (split, chunk) it is called with those outputs
    instead (``copies`` 1), and each gradient is rescaled on its own.
    """

    @staticmethod
    def forward(ctx, point: BranchPoint, state: AdaptiveState, copies: int, *xs):  # type: ignore[override]
        ctx.point, ctx.state, ctx.kind = point, state, state.kind
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
        factor = dict(zip(present, _branch_factors(state, kind, point, grads, present), strict=True))
        # A gradient made by a GEMM point feeding this branch directly is ours to write into (eagerly).
        owned = None
        if state.fresh and not torch.compiler.is_compiling():
            for i in range(len(grads)):
                t = state.fresh.pop((point.index, i), None)
                if owned is None and t is not None and t is grads[i]:
                    owned = i
        if not ctx.shared:
            out: list[torch.Tensor | None] = list(grads)
            for i in present:
                if factor[i] is not None:
                    out[i] = grads[i].mul_(factor[i]) if i == owned else grads[i] * factor[i]
            return (None, None, None, *out)
        order = present if owned is None else [owned, *(i for i in present if i != owned)]
        total, fresh = None, False
        if owned is not None:
            total, fresh = grads[owned], True
            if factor[owned] is not None:
                total = total.mul_(factor[owned])
        for i in order[1 if owned is not None else 0 :]:
            total, fresh = _accumulate(total, fresh, grads[i], factor[i])
        return None, None, None, total


def _branch_factors(
    state: AdaptiveState, kind: str, point: BranchPoint, grads: tuple, present: list[int]
) -> list[torch.Tensor | None]:
    """The factors that bring branch ``point``'s present incoming gradients to its common alpha: Algorithm
    5 on a recompute pass (:func:`branch_scales`), the buffers' on a reuse pass, None (1) on a plain pass;
    0-dim device tensors on the gradients' device."""
    if kind == "plain":
        return [None] * len(present)
    device = grads[present[0]].device
    if kind == "recompute":
        with torch.no_grad():
            return list(_on(branch_scales(state, point, grads, present), device).unbind(0))
    factors, start = state.buffers.branch_factors, point.offset
    return [None if _unit(state, 1, start + i) else _read(factors[start + i], device) for i in present]


def branch_scales(state: AdaptiveState, point: BranchPoint, grads: tuple, present: list[int]) -> torch.Tensor:
    """Algorithm 5 (:func:`adaloss.adaptive.rules.branch_loss_scale`) at branch ``point`` on a recompute
    pass: the common alpha of its present incoming gradients and the factor of each, written into the
    buffers (common alpha, factors, whether they differ) and emitted; returns the factors. No host sync."""
    buf = state.buffers
    a = torch.stack([buf.alpha[point.in_slots[i]] for i in present])
    m = torch.stack([_on(max_magnitude(grads[i]), buf.device) for i in present]).float()
    if state.reduce_fn is not None:
        m = state.reduce_fn(None, m)[1]
    common = branch_loss_scale(a, m, state.u_max, state.rule.name)
    vec = common / a
    k, start = point.index, point.offset
    buf.branch_alpha[k].copy_(common)
    buf.rescaled[k].copy_((a != common).any())
    if len(present) == len(grads):
        buf.branch_factors[start : start + len(grads)].copy_(vec)
    else:  # element by element: indexing with a list would copy host data to the device
        for i, v in zip(present, vec.unbind(0), strict=True):
            buf.branch_factors[start + i].copy_(v)
    _emit(state, point.out_slot, common)
    return vec


def _accumulate(
    total: torch.Tensor | None, fresh: bool, grad: torch.Tensor, factor: torch.Tensor | None
) -> tuple[torch.Tensor, bool]:
    """``total + factor * grad`` in one pass (``total`` is None for the first term; ``factor`` None: 1);
    never writes ``grad``.

    ``fresh`` says whether ``total`` was made here (then it is updated in place). ``factor`` is a power of
    two, so ``factor * grad`` is exact and the fused op rounds once, as a separate multiply and add would.
    Returns the new total and whether it is fresh.
    """
    if factor is None:
        if total is None:
            return grad, False
        return (total.add_(grad), True) if fresh else (total + grad, True)
    if total is None:
        return grad * factor, True
    if fresh:
        return total.addcmul_(grad, factor), True
    return torch.addcmul(total, grad, factor), True
