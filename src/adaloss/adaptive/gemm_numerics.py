"""The numbers of one GEMM call at a point: what Algorithm 3 (:mod:`adaloss.adaptive.algorithm3`) is handed.

Algorithm 3 says which gradients are computed from which scaled tensor; how those tensors are stored and
multiplied is the precision's business, and it lives here, in one object per call, :class:`GemmNumerics`,
built in the forward pass from the active numerics (:mod:`adaloss.numerics`):

* the compute dtype: under autocast (CUDA, or the CPU's own FP16/BF16 kernels) the layer computes in the
  autocast dtype, and so does its backward pass, which autocast does not cover: it is cast explicitly;
* emulated storage (:class:`~adaloss.numerics.emulation.EmulatedAutocast`): the inputs, weight and output
  rounded to the format as the emulation rounds around a GEMM, the beta-scaled gradient and the parameter
  gradients rounded to the gradient format;
* an FP8 recipe's quantizer sites (:func:`~adaloss.numerics.quantizers.quantize_grad`) for the weight and
  bias gradients;
* FP4 GEMMs (:class:`~adaloss.numerics.fp4_gemm.FP4Gemm`) in place of the layer's kernels;
* the underflow telemetry probe of the layer's gradient.

It lives in :mod:`adaloss.adaptive` beside the kernels it dispatches to (:mod:`adaloss.adaptive.gemms`'s
grouped GEMMs): :mod:`adaloss.numerics` may not import this package (the import contracts'
``acyclic_siblings``), so the numerics layer's pieces are composed here instead. Nothing here knows a
scale: every method is given the tensors Algorithm 3 chose. No host sync.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from adaloss.adaptive.gemms import grouped_mm, grouped_wgrad
from adaloss.numerics.emulation import active_emulation, is_low_precision, mark_low_precision
from adaloss.numerics.formats import round_to_format
from adaloss.numerics.fp4_gemm import conv_geometry
from adaloss.numerics.quantizers import quantize_grad

__all__ = ["GemmNumerics"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
# one call that says whether any device's autocast is on (most passes: no), before the per-device question
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


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


def _fp4_of(emu: Any, name: str, spec: dict, x: torch.Tensor, w: torch.Tensor) -> tuple[Any, Any]:
    """The FP4 GEMMs (:class:`~adaloss.numerics.fp4_gemm.FP4Gemm`) that run this layer and, for a conv, its
    im2col geometry: ``(None, None)`` where the layer stays in the base format (not an FP4 layer, or a
    conv other than a batched 2-D one with ``groups=1``)."""
    fp4 = emu.fp4 if emu is not None else None
    if fp4 is None or not fp4.applies(name):
        return None, None
    if spec["kind"] == "linear":
        return fp4, None
    if spec["kind"] != "conv" or spec["dims"] != 2 or spec["groups"] != 1 or x.dim() != 4:
        return None, None
    return fp4, conv_geometry(w, spec["stride"], spec["padding"], spec["dilation"])


class GemmNumerics:
    """How one call of a GEMM point (conv, linear, grouped GEMM; ``spec`` as :class:`~adaloss.adaptive.ops.
    ScaledGEMM` takes it) computes and stores its numbers, read from the active emulation or autocast by
    :meth:`forward`. ``record`` (grad mode was on at the call) gives an FP8 recipe's weight
    and bias gradients their quantizer sites.

    :meth:`forward` runs the layer; in its backward pass Algorithm 3 calls :meth:`received` on the
    incoming gradient, :meth:`store_scaled` on the beta-scaled one, :meth:`backprop` for the three
    gradients, :meth:`input_grad` and :meth:`param_grad` on what leaves. Keeps none of the call's tensors
    (the autograd node saves the input and the weight :meth:`forward` returns)."""

    def __init__(self, name: str, spec: dict, record: bool) -> None:
        self.name, self.spec, self.record = name, spec, record
        self.fmt = self.grad_fmt = self.probe = None
        self.sites: tuple[Any, Any] = (None, None)
        self.fp4 = self.fp4_geometry = self.fp4_probe = None
        self.x_dtype = self.w_dtype = None
        self.has_bias = False

    # ---------------------------------------------------------------------------------------------- forward

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """The layer's output, and the input and weight as the GEMM used them (to save for the backward
        pass): in the autocast dtype, stored in the emulated format. Call with torch-function modes off."""
        emu = active_emulation()
        self.fmt = fmt = emu.fmt if emu is not None else None
        # With a gradient format, GradRound (applied to this op's output by AdaptiveGEMM) rounds the incoming
        # gradient and feeds the probe; without one (FP32 telemetry) the probe is fed here.
        self.grad_fmt = emu.grad_fmt if emu is not None else None
        self.probe = emu.probe_for(self.name) if emu is not None and self.grad_fmt is None else None
        self.x_dtype = x.dtype
        self.w_dtype = weight.dtype  # the master weight's dtype: parameter gradients are returned in it
        # Under autocast the backward pass, which autocast does not cover, computes in its dtype too
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
        if emu is not None and emu.grad_quantizer is not None and self.record:
            self.sites = (emu.grad_site(weight), emu.grad_site(bias) if bias is not None else None)
        self.fp4, self.fp4_geometry = _fp4_of(emu, self.name, self.spec, x, weight)
        if self.fp4 is not None:
            self.fp4_probe = emu.probe_for(self.name)
        y = self._kernel(x, weight, bias)
        if fmt is not None:
            y = mark_low_precision(round_to_format(y, fmt))
        self.has_bias = bias is not None
        return y, x, weight

    def _kernel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        spec = self.spec
        if self.fp4 is not None:
            if self.fp4_geometry is None:
                return self.fp4.forward(x, weight, bias)
            return self.fp4.conv_forward(x, weight, bias, self.fp4_geometry)
        if spec["kind"] == "linear":
            return F.linear(x, weight, bias)
        if spec["kind"] == "conv":
            return _conv_forward(x, weight, bias, spec)
        if spec["kind"] == "grouped":
            return grouped_mm(x, weight, spec["offs"])
        return _conv_transpose_forward(x, weight, bias, spec)

    # --------------------------------------------------------------------------------------------- backward

    def wanted(self, needs: tuple[bool, ...]) -> tuple[bool, bool]:
        """Whether the input gradient and the parameter gradients are asked for (``ctx.needs_input_grad``)."""
        return needs[0], needs[1] or (self.has_bias and needs[2])

    def received(self, delta: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The incoming gradient (already stored in the gradient format by the GradRound on the output),
        counted by the probe when this call feeds it, in the weight's compute dtype."""
        if self.probe is not None:
            self.probe.record(delta)
        return delta if delta.dtype == w.dtype else delta.to(w.dtype)

    def store_scaled(self, scaled: torch.Tensor) -> torch.Tensor:
        """The beta-scaled gradient stored in the gradient format (an FP16 product beyond 65504 becomes
        infinite, as in FP16 training). Under a quantizer's scales ``delta`` is already a stored value
        (payload times its scale), and ``beta * delta`` is that payload with the scale times beta, a power
        of two: rounding it again without the scale would flush what the scale kept."""
        if self.grad_fmt is not None and self.sites[0] is None:
            return round_to_format(scaled, self.grad_fmt)
        return scaled

    def backprop(self, delta, scaled, x, w, need_x: bool, need_w: bool) -> Grads:
        """The input gradient from ``scaled`` and the weight and bias gradients from ``delta`` (the same
        tensor where they are), by the layer's kernels or its FP4 GEMMs."""
        spec, need_b = self.spec, need_w and self.has_bias
        if self.fp4 is not None:  # FP4 operands (adaloss.numerics.fp4_gemm); the weight gradient in FP32
            return self._fp4_backprop(delta, scaled, x, w, need_x, need_w)
        grad_x = grad_w = grad_b = None
        if spec["kind"] == "linear":
            if need_x:
                grad_x = scaled.matmul(w)
            if need_w:
                d2 = delta.reshape(-1, delta.shape[-1])
                grad_w = d2.t().matmul(x.reshape(-1, x.shape[-1]))
                grad_b = d2.sum(0) if self.has_bias else None
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
        return grad_x, grad_w, grad_b

    def _fp4_backprop(self, delta, scaled, x, w, need_x: bool, need_w: bool) -> Grads:
        """An FP4 layer's gradients: dgrad of the beta-scaled ``scaled``, wgrad of ``delta`` (in that order,
        as :class:`~adaloss.numerics.fp4_gemm.FP4Linear` draws its stochastic rounding), in FP32; a conv's
        through im2col (:meth:`~adaloss.numerics.fp4_gemm.FP4Gemm.conv_dgrad`)."""
        fp4, geometry, probe = self.fp4, self.fp4_geometry, self.fp4_probe
        grad_x = grad_w = grad_b = None
        if geometry is not None:
            if need_x:
                grad_x = fp4.conv_dgrad(scaled, w, x.shape, geometry, probe)
            if need_w:
                grad_w = fp4.conv_wgrad(delta, x, geometry, probe)
                grad_b = delta.sum((0, 2, 3)) if self.has_bias else None
            return grad_x, grad_w, grad_b
        d2 = delta.reshape(-1, delta.shape[-1])
        if need_x:
            grad_x = fp4.dgrad(scaled.reshape(d2.shape), w, probe).reshape(*delta.shape[:-1], -1)
        if need_w:
            grad_w = fp4.wgrad(d2, x.reshape(-1, x.shape[-1]), probe)
            grad_b = d2.sum(0) if self.has_bias else None
        return grad_x, grad_w, grad_b

    def input_grad(self, grad_x: torch.Tensor) -> torch.Tensor:
        """The input gradient in the input's dtype."""
        return grad_x if grad_x.dtype is self.x_dtype else grad_x.to(self.x_dtype)

    def param_grad(self, grad: torch.Tensor, which: int) -> torch.Tensor:
        """A parameter gradient (``which`` 0: the weight's, 1: the bias's) stored in the gradient format,
        through its site's quantizer under an FP8 recipe, then cast to the master weight's dtype."""
        if self.grad_fmt is not None:
            grad = quantize_grad(grad, self.grad_fmt, self.sites[which])
        return grad if grad.dtype == self.w_dtype else grad.to(self.w_dtype)
