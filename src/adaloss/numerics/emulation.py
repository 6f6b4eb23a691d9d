"""CPU emulation of autocast mixed precision: compute in FP32, store in the low-precision format.

Real FP16 kernels on a CPU are far slower than FP32 ones, so on the CPU we emulate the numerics of CUDA
``torch.autocast(dtype=float16)`` instead: every op computes in FP32, and every value that autocast would
*store* in the low-precision format is rounded to it (:func:`round_to_format`). Following autocast's op
lists, :class:`EmulatedAutocast` tracks which tensors are "virtually FP16" and rounds at exactly these points:

- inputs of GEMM ops (conv, linear, matmul, ...): the per-step FP16 copy of each FP32 weight and bias, and
  any FP32 activation entering a GEMM. Rounding a weight is an autograd op whose backward rounds the weight
  gradient, so weight gradients are FP16 values before they reach the FP32 master copy, as with autocast's
  cast ops;
- outputs of GEMM ops and of every op that autocast runs in FP16 (batch norm, additions, pooling, ...);
  the same autograd op rounds, in the backward pass, the activation gradient with respect to that output;
- ops on autocast's FP32 list (softmax, losses, norms, exp/log, sum, ...) produce FP32 values and are not
  rounded; ops whose inputs mix FP32 and FP16 tensors promote to FP32, as type promotion does;
- value-preserving ops (ReLU, max-pooling, views, concatenation, indexing) are not rounded: their outputs
  are already representable.

Rounding maps magnitudes at or below half the smallest subnormal to zero and those past the largest finite
value to infinity, so underflow and overflow happen exactly where the real format has them.

Where emulation differs from real FP16 hardware: (1) GEMM and reduction results are accumulated in FP32 in
the order of the CPU kernels and rounded once; CUDA tensor cores also accumulate in FP32 but in a different
order, so results differ by rounding noise, never by underflow or overflow of the stored values. (2) Ops
inside a fused CUDA kernel (e.g. cuDNN batch norm) may keep intermediates in FP32 where the emulation does
too; ops we classify wrongly would only differ by one rounding. (3) Gradients that autograd sums at a branch
are summed in FP32 and rounded once where the branch's producer rounds them.

Cost: one rounding pass per stored tensor (:func:`adaloss.numerics.formats.round_to_format`) and a small
Python overhead per op call; see ``make bench`` for the measured ratio against FP32.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from adaloss.numerics.formats import FloatFormat, round_to_format, round_to_format_
from adaloss.numerics.fp4_gemm import FP4Conv2d, FP4Linear, conv_geometry
from adaloss.numerics.quantizers import GradQuantizer, GradSite, QuantStats, quantize_grad

__all__ = ["EmulatedAutocast", "active_emulation", "suspended", "Probe", "LayerNames"]

_LP_ATTR = "_adaloss_lowp"  # marks a tensor whose values are representable in the active format

# Ops that autocast runs in the low-precision format with all floating inputs cast (CUDA fp16 list).
_GEMM_OPS = {
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "convolution",
    "_convolution",
    "conv_tbc",
    "linear",
    "matmul",
    "mm",
    "bmm",
    "addmm",
    "addmv",
    "addbmm",
    "baddbmm",
    "mv",
    "chain_matmul",
    "prelu",
    "einsum",
    "addr",
}
# Ops that autocast runs in FP32 (CUDA "autocast to float32" list).
_FP32_OPS = {
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "softplus",
    "layer_norm",
    "group_norm",
    "norm",
    "normalize",
    "frobenius_norm",
    "nuclear_norm",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "softmax",
    "log_softmax",
    "softmin",
    "cross_entropy",
    "sum",
    "prod",
    "cumsum",
    "cumprod",
    "rpow",
    "rdiv",
    "rtruediv",
    "vector_norm",
    "linalg_vector_norm",
}
# Ops whose outputs take values from their inputs (or are exact): no rounding needed.
_EXACT_OPS = {
    "relu",
    "relu6",
    "threshold",
    "hardtanh",
    "clamp",
    "clip",
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "_max_pool1d",
    "_max_pool2d",
    "_max_pool3d",
    "max_pool1d_with_indices",
    "max_pool2d_with_indices",
    "adaptive_max_pool1d",
    "adaptive_max_pool2d",
    "view",
    "view_as",
    "reshape",
    "reshape_as",
    "flatten",
    "unflatten",
    "permute",
    "transpose",
    "t",
    "contiguous",
    "clone",
    "detach",
    "squeeze",
    "unsqueeze",
    "expand",
    "expand_as",
    "repeat",
    "cat",
    "concat",
    "concatenate",
    "stack",
    "split",
    "chunk",
    "unbind",
    "narrow",
    "select",
    "getitem",
    "index_select",
    "gather",
    "pad",
    "flip",
    "roll",
    "max",
    "min",
    "amax",
    "amin",
    "maximum",
    "minimum",
    "neg",
    "abs",
    "sign",
    "movedim",
    "split_with_sizes",
    "tensor_split",
    "masked_fill",
    "where",
    "zero",
    "pixel_shuffle",
    "pixel_unshuffle",
    "channel_shuffle",
    "topk",
    "sort",
    "identity",
}
# Ops whose output dtype follows their first input regardless of parameter dtypes (cuDNN batch norm).
_FOLLOW_INPUT_OPS = {"batch_norm", "instance_norm", "_batch_norm_impl_index", "native_batch_norm"}
# Dropout scales kept values by 1/(1-p), which is not exact: its output is rounded like any FP16 op.
_DROPOUT_OPS = {"dropout", "feature_alpha_dropout", "alpha_dropout", "dropout2d", "dropout3d"}

_state = threading.local()


def active_emulation() -> EmulatedAutocast | None:
    """The innermost active :class:`EmulatedAutocast`, or None. Used by ops that do their own rounding."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Turn the emulation's op interception off inside a custom op that rounds explicitly."""
    prev = getattr(_state, "suspended", False)
    _state.suspended = True
    try:
        yield
    finally:
        _state.suspended = prev


def is_low_precision(t: torch.Tensor) -> bool:
    return getattr(t, _LP_ATTR, False)


def mark_low_precision(t: torch.Tensor) -> torch.Tensor:
    setattr(t, _LP_ATTR, True)
    return t


def _op_name(func: Any) -> str:
    # an ATen op (a graph captured with torch.export calls them directly) is named ``layer_norm.default``;
    # its ``_opname`` is the name the tables use (``layer_norm``, ``add_``)
    name = getattr(func, "_opname", None) or getattr(func, "__name__", "") or ""
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith("i") and name[1:] in {"add", "sub", "mul", "truediv", "div", "pow", "matmul"}:
            return name[1:] + "_"  # in-place dunder
        if name.startswith("r") and name[1:] in {"add", "sub", "mul", "matmul"}:
            name = name[1:]
    return name


class Probe:
    """Counts activation-gradient underflow for one layer: elements non-zero before rounding, zero after.

    Also what storing the gradient did beyond underflow: ``saturated`` (finite elements whose scaled
    magnitude passed the format's largest value: clamped there, or Inf for E5M2 without a quantizer), the
    range of the quantizer's scales (``scale_min``/``scale_max``; 1 without one) and the squared error
    against the unquantized gradient for the SQNR (``signal`` = sum g^2, ``noise`` = sum (g - q)^2 over the
    finite elements, in float64). Counts accumulate as device tensors (no host sync); the monitor reads them
    once per telemetry step.
    With ``quantile`` set, the probe also keeps the ``ceil(quantile * n)``-th smallest non-zero ``|g|`` of
    the ``n`` non-zero gradient elements (the smallest over repeated calls of the layer): the inverse is
    the layer's *expected loss scale* of the paper's Figure 1b. Cost: a selection of the non-zero elements
    and one ``kthvalue`` per call (a host sync on CUDA, for the data-dependent size): telemetry steps only.
    """

    __slots__ = (
        "fmt", "underflow", "numel", "nonzero", "quantile", "kth", "saturated", "scale_min", "scale_max",
        "signal", "noise", "fp4",
    )  # fmt: skip

    def __init__(self, fmt: FloatFormat, quantile: float | None = None) -> None:
        self.fmt = fmt
        self.underflow: torch.Tensor | None = None
        self.nonzero: torch.Tensor | None = None
        self.numel = 0
        self.quantile = quantile
        self.kth: torch.Tensor | None = None
        self.saturated: torch.Tensor | None = None
        self.scale_min: torch.Tensor | None = None
        self.scale_max: torch.Tensor | None = None
        self.signal: torch.Tensor | None = None
        self.noise: torch.Tensor | None = None
        #: FP4 layers only (:mod:`adaloss.numerics.fp4_gemm`): accumulated block counts, the range of the
        #: blocks' log2 scales and the weight gradient's signal and FP4 noise (0-dim tensors); else None.
        self.fp4: dict[str, torch.Tensor] | None = None

    def record(
        self, grad: torch.Tensor, rounded: torch.Tensor | None = None, stats: QuantStats | None = None
    ) -> None:
        """Count ``grad`` against its stored value ``rounded`` (default: plain rounding to the format);
        ``stats`` is what a quantizer reported (default: scale 1, saturation past the format's maximum)."""
        if rounded is None:
            rounded = round_to_format(grad, self.fmt)
        nz = grad != 0
        lost = (nz & (rounded == 0)).sum()
        nzc = nz.sum()
        self.underflow = lost if self.underflow is None else self.underflow + lost
        self.nonzero = nzc if self.nonzero is None else self.nonzero + nzc
        self.numel += grad.numel()
        self._record_storage(grad.detach(), rounded.detach(), stats)
        if self.quantile is not None:
            magnitudes = grad.detach().abs()[nz].float()
            if magnitudes.numel() > 0:
                k = max(1, math.ceil(self.quantile * magnitudes.numel()))
                kth = magnitudes.kthvalue(k).values
                self.kth = kth if self.kth is None else torch.minimum(self.kth, kth)

    def _record_storage(self, grad: torch.Tensor, rounded: torch.Tensor, stats: QuantStats | None) -> None:
        if stats is None:
            one = torch.ones((), dtype=torch.float32, device=grad.device)
            saturated = (torch.isfinite(grad) & (grad.abs() > self.fmt.u_max)).sum()
            stats = QuantStats(saturated, one, one)
        finite = torch.isfinite(grad)
        # float64: the squares of large (loss-scaled) values stay finite
        g = torch.where(finite, grad, 0.0).double()
        signal = (g * g).sum()
        noise = torch.where(finite, (g - rounded.double()).square(), 0.0).sum()
        pairs = [("saturated", stats.saturated, torch.add), ("signal", signal, torch.add)]
        pairs += [("noise", noise, torch.add)]
        if stats.scale_min is not None:
            pairs += [("scale_min", stats.scale_min.float(), torch.minimum)]
            pairs += [("scale_max", stats.scale_max.float(), torch.maximum)]
        for name, value, merge in pairs:
            old = getattr(self, name)
            setattr(self, name, value if old is None else merge(old, value))

    def record_blocks(self, stats: dict[str, torch.Tensor]) -> None:
        """Accumulate an FP4 quantization's block statistics (:func:`adaloss.numerics.fp4.block_stats`)."""
        merge = {"log2_min": torch.minimum, "log2_max": torch.maximum}
        keys = ("blocks", "clamped", "subnormal", "log2_min", "log2_max")
        self._merge_fp4({k: stats[k].double() for k in keys}, merge)

    def record_wgrad(self, reference: torch.Tensor, quantized: torch.Tensor) -> None:
        """Accumulate a weight gradient's ``sum g^2`` and FP4 noise ``sum (q - g)^2`` (float64)."""
        ref = reference.detach().double()
        noise = (quantized.detach().double() - ref).square().sum()
        self._merge_fp4({"wgrad_signal": ref.square().sum(), "wgrad_noise": noise}, {})

    def _merge_fp4(self, values: dict[str, torch.Tensor], merge: dict) -> None:
        if self.fp4 is None:
            self.fp4 = {}
        for key, value in values.items():
            old = self.fp4.get(key)
            self.fp4[key] = value if old is None else merge.get(key, torch.add)(old, value)


class _Round(torch.autograd.Function):
    """Store a value in the low-precision format: round forward, round the gradient backward.

    This is the emulated counterpart of autocast's casts: the forward rounding is the FP16 copy, and the
    backward rounding is the FP16 gradient of that copy. ``fmt=None`` rounds nothing (FP32 telemetry).
    ``grad_fmt`` is the format gradients are stored in (the same as ``fmt`` except for FP8 gradients);
    ``site`` the gradient quantizer's site when ``precision.grad_scaling`` scales them
    (:func:`adaloss.numerics.quantizers.quantize_grad`).
    """

    @staticmethod
    def forward(ctx, x, fmt, grad_fmt, probe, site=None):  # type: ignore[override]
        ctx.grad_fmt = grad_fmt
        ctx.probe = probe
        ctx.site = site
        return round_to_format(x, fmt) if fmt is not None else x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        fmt, probe = ctx.grad_fmt, ctx.probe
        if fmt is not None:
            return quantize_grad(grad, fmt, ctx.site, probe), None, None, None, None
        if probe is not None:
            probe.record(grad)
        return grad, None, None, None, None


class _RoundInplace(torch.autograd.Function):
    """In-place variant for results of in-place ops (``out += identity``)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: torch.Tensor, fmt: FloatFormat, grad_fmt: FloatFormat, site: GradSite | None = None
    ):
        ctx.fmt, ctx.site = grad_fmt, site
        round_to_format_(x, fmt)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return quantize_grad(grad, ctx.fmt, ctx.site), None, None, None


def round_value(
    x: torch.Tensor,
    fmt: FloatFormat | None,
    probe: Probe | None = None,
    grad_fmt: FloatFormat | None = None,
    block_dim: int | None = None,
) -> torch.Tensor:
    """Round ``x`` to ``fmt`` and, in backward, store its gradient in ``grad_fmt`` (default ``fmt``) through
    the active emulation's gradient quantizer, if any (``block_dim``: see :meth:`EmulatedAutocast.grad_site`).

    The result is marked low precision. Without autograd this is a plain rounding.
    """
    if x.requires_grad and torch.is_grad_enabled():
        emu = active_emulation()
        site = emu.grad_site(x, block_dim) if emu is not None and fmt is not None else None
        out = _Round.apply(x, fmt, grad_fmt if grad_fmt is not None else fmt, probe, site)
    else:
        out = round_to_format(x, fmt) if fmt is not None else x
        if out is x:
            out = x.view_as(x)
    return mark_low_precision(out) if fmt is not None else out


class LayerNames:
    """Tracks which named module is running, so GEMM ops can be attributed to layers like ``layer3.2.conv1``.

    Installed by :meth:`adaloss.precision.Precision.prepare` as forward pre/post hooks on GEMM modules.
    """

    def __init__(self) -> None:
        self._stack: list[str] = []

    def push(self, name: str) -> None:
        self._stack.append(name)

    def pop(self) -> None:
        if self._stack:
            self._stack.pop()

    @property
    def current(self) -> str | None:
        return self._stack[-1] if self._stack else None


LAYER_NAMES = LayerNames()


def _float_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            if a.is_floating_point():
                out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor) and t.is_floating_point())
    return out


class EmulatedAutocast(TorchFunctionMode):
    """A ``TorchFunctionMode`` that emulates autocast's low-precision storage by rounding (module docstring).

    Args:
        fmt (FloatFormat or None): the format values are stored in; ``None`` rounds nothing, which lets an
            FP32 run measure underflow against ``probe_format`` without changing its numerics.
        monitor (optional): an :class:`adaloss.telemetry.UnderflowMonitor`; when given, the gradient with
            respect to each named GEMM layer's output is counted for underflow in the backward pass.
        grad_fmt (FloatFormat, optional): the format gradients are stored in, if not ``fmt`` (FP8 gradients
            with FP16 activations).
        grad_quantizer (GradQuantizer, optional): scales every gradient the emulation stores in ``grad_fmt``
            (``precision.grad_scaling``); None or the ``none`` recipe rounds them as they are.
        fp4 (FP4Gemm, optional): runs the linear and ``groups=1`` 2-D conv layers it applies to with FP4
            operands in all three GEMMs (:class:`adaloss.numerics.fp4_gemm.FP4Linear`, ``FP4Conv2d``;
            ``precision=nvfp4`` or ``mxfp4``); their probes count the FP4-stored output gradient instead of
            its rounding to ``grad_fmt``.
    """

    def __init__(
        self,
        fmt: FloatFormat | None,
        monitor: Any = None,
        grad_fmt: FloatFormat | None = None,
        grad_quantizer: GradQuantizer | None = None,
        fp4: Any = None,
    ) -> None:
        super().__init__()
        self.fp4 = fp4
        self.fmt = fmt
        self.grad_fmt = grad_fmt if grad_fmt is not None else fmt
        self.monitor = monitor
        self.grad_quantizer = grad_quantizer if grad_quantizer is not None and grad_quantizer.scales else None
        self._sites = 0  # gradient sites made in this forward pass: the keys of delayed scaling's state
        self._kinds: dict[Any, str] = {}

    # -- context management: keep a stack so custom ops can find the active emulation -----------------
    def __enter__(self):
        stack = getattr(_state, "stack", None)
        if stack is None:
            stack = _state.stack = []
        stack.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _state.stack.pop()
        return super().__exit__(*exc)

    def grad_site(self, value: torch.Tensor, block_dim: int | None = None) -> GradSite | None:
        """The site where the gradient of ``value`` will be stored, or None without a quantizer. Sites are
        numbered in forward order (with the layer's name), so a training step's n-th site is the same
        tensor every step: delayed scaling keeps its history under that key. ``block_dim`` is the dimension
        MX blocks run along; None: 1 (channels) for 4-D and 5-D values, else the last."""
        if self.grad_quantizer is None:
            return None
        self._sites += 1
        if block_dim is None:
            block_dim = 1 if value.dim() in (4, 5) else -1
        return GradSite(self.grad_quantizer, f"{self._sites}:{LAYER_NAMES.current or ''}", block_dim)

    def probe_for(self, name: str | None) -> Probe | None:
        if self.monitor is None or name is None:
            return None
        return self.monitor.probe(name)

    def _classify(self, func: Any) -> str:
        kind = self._kinds.get(func)
        if kind is None:
            name = _op_name(func)
            base = name[:-1] if name.endswith("_") and not name.startswith("_") else name
            if base in _GEMM_OPS:
                kind = "gemm"
            elif base in _FP32_OPS:
                kind = "fp32"
            elif base in _DROPOUT_OPS:
                kind = "default"
            elif base in _EXACT_OPS:
                kind = "exact"
            elif base in _FOLLOW_INPUT_OPS:
                kind = "follow"
            elif base in {"float", "double"}:
                kind = "to_fp32"
            elif base in {"half", "bfloat16"}:
                kind = "to_lowp"
            else:
                kind = "default"
            if kind not in {"gemm", "to_fp32", "to_lowp"} and name.endswith("_") and not name.startswith("_"):
                kind += "_inplace"
            self._kinds[func] = kind
        return kind

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_state, "suspended", False):
            return func(*args, **kwargs)
        kind = self._classify(func)
        fmt = self.fmt
        if kind == "gemm":
            return self._gemm(func, args, kwargs)
        if fmt is None:  # FP32 telemetry: only GEMM outputs are probed
            return func(*args, **kwargs)
        if kind in ("fp32", "fp32_inplace"):
            return func(*args, **kwargs)
        if kind == "to_fp32":
            return func(*args, **kwargs)  # a new FP32 tensor: not marked
        if kind == "to_lowp":
            out = func(*args, **kwargs)
            return round_value(out.float(), fmt, None, self.grad_fmt) if out.is_floating_point() else out
        inputs = _float_tensors(args, kwargs)
        out = func(*args, **kwargs)
        if not inputs:
            return out
        if kind.startswith("follow"):
            lowp = is_low_precision(inputs[0])
        else:
            # Type promotion: a dimensioned FP32 tensor makes the result FP32; 0-dim tensors don't count
            # unless every input is 0-dim.
            dimensioned = [t for t in inputs if t.dim() > 0] or inputs
            lowp = all(is_low_precision(t) for t in dimensioned)
        return self._store(kind, out) if lowp else out

    def _gemm(self, func, args: tuple, kwargs: dict):
        """A GEMM (matmul, linear, conv) under the mode: inputs stored in the format, an FP4 layer's GEMM
        through its FP4 operands, the output stored in the format and counted by the layer's probe."""
        fmt = self.fmt
        probe = self.probe_for(LAYER_NAMES.current)
        if fmt is not None:
            args = tuple(self._cast_input(a) for a in args)
            kwargs = {k: self._cast_input(v) for k, v in kwargs.items()}
        if self.fp4 is not None and self.fp4.applies(LAYER_NAMES.current):
            out = self._fp4_gemm(_op_name(func), args, kwargs, probe)
            if out is not None:
                return out
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            if fmt is None and probe is None:
                return out
            conv = _op_name(func).startswith(("conv", "_conv"))  # blocks along channels, see grad_site
            return round_value(out, fmt, probe, self.grad_fmt, block_dim=1 if conv else -1)
        return out

    def _store(self, kind: str, out: Any) -> Any:
        """The output ``out`` of a non-GEMM op of ``kind`` whose inputs were stored in the format: marked as
        stored (an exact op), rounded in place (an in-place op), or rounded (every floating output)."""
        fmt = self.fmt
        if kind.startswith("exact"):
            return self._mark_outputs(out)
        if kind.endswith("_inplace"):
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                if out.requires_grad and torch.is_grad_enabled():
                    out = _RoundInplace.apply(out, fmt, self.grad_fmt, self.grad_site(out))
                else:
                    round_to_format_(out, fmt)
                return mark_low_precision(out)
            return out
        if isinstance(out, torch.Tensor):
            return round_value(out, fmt, None, self.grad_fmt) if out.is_floating_point() else out
        if isinstance(out, (tuple, list)):
            return type(out)(
                round_value(o, fmt, None, self.grad_fmt)
                if isinstance(o, torch.Tensor) and o.is_floating_point()
                else o
                for o in out
            )
        return out

    def _fp4_gemm(self, op: str, args: tuple, kwargs: dict, probe: Probe | None) -> torch.Tensor | None:
        """``F.linear`` through :class:`~adaloss.numerics.fp4_gemm.FP4Linear`, or a batched ``F.conv2d``
        with ``groups=1`` through :class:`~adaloss.numerics.fp4_gemm.FP4Conv2d`, the output stored in the
        base format (its gradient too, before FP4 quantizes it; the probe is FP4's); None for any other
        GEMM (it stays in the base format)."""
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
        if op == "linear":
            x, w, b = (*args, *(kwargs.get(n) for n in names[len(args) : 3]))
            out = FP4Linear.apply(x, w, b, self.fp4, probe)
            return round_value(out, self.fmt, None, self.grad_fmt, block_dim=-1)
        if op != "conv2d":
            return None
        given = {**dict(zip(names, args, strict=False)), **kwargs}
        x, w = given["input"], given["weight"]
        geometry = conv_geometry(w, given.get("stride", 1), given.get("padding", 0), given.get("dilation", 1))
        if geometry is None or given.get("groups", 1) != 1 or x.dim() != 4:
            return None
        out = FP4Conv2d.apply(x, w, given.get("bias"), self.fp4, geometry, probe)
        return round_value(out, self.fmt, None, self.grad_fmt, block_dim=1)

    def _cast_input(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            if a.is_floating_point() and not is_low_precision(a):
                return round_value(a, self.fmt, None, self.grad_fmt)
            return a
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return type(a)(self._cast_input(t) for t in a)
        return a

    @staticmethod
    def _mark_outputs(out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            if out.is_floating_point():
                mark_low_precision(out)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor) and o.is_floating_point():
                    mark_low_precision(o)
        return out
