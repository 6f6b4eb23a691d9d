"""One table of what a GEMM is, read by the rewrite, the capture and the coverage report.

* :data:`WEIGHT_GEMMS` (and :data:`WEIGHT_GEMM_METHODS`): the torch functions that multiply an activation
  by a weight, with their argument names; :mod:`adaloss.adaptive.transform` makes each call whose weight is
  a parameter, a fixed view of one or a tensor computed from parameters a scaling point.
* :data:`ATEN_AS_TORCH`: the ATen ops (and GEMM custom ops) of a graph captured with ``torch.export`` and
  the torch functions standing for them (:mod:`adaloss.adaptive.capture`), so the same recognizers read
  both kinds of graph.
* :func:`is_gemm_op`: whether an op seen at dispatch multiplies matrices, for the ATen count of
  :mod:`adaloss.adaptive.coverage`: the plain GEMMs, grouped and scaled ones, the fused attention and
  recurrent kernels, and any other op (a custom op included) whose name says it multiplies. A GEMM the
  rewrite does not know is counted there, so the report cannot miss it.

Grouped GEMMs (``torch._grouped_mm``, transformers' ``grouped_mm_fallback``): ``input`` ``(S, K)`` rows
sorted by group, ``weight`` ``(E, K, N)``, ``offs`` ``(E,)`` the cumulative row counts; row block ``g`` is
multiplied by ``weight[g]``. :func:`grouped_mm` and :func:`grouped_wgrad` compute it and its weight
gradient on any dtype without a host sync (the kernel where it applies, else one masked product per group).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "ATEN_AS_TORCH",
    "GROUPED_CUSTOM_OPS",
    "GemmForm",
    "WEIGHT_GEMMS",
    "WEIGHT_GEMM_METHODS",
    "grouped_mm",
    "grouped_wgrad",
    "is_gemm_op",
]

_aten = torch.ops.aten

CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
CONV_T_ARGS = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
GROUPED_ARGS = ("input", "weight", "offs", "bias", "out_dtype")


@dataclass(frozen=True)
class GemmForm:
    """How a GEMM function takes its operands: ``kind`` ("linear": ``F.linear``, weight ``(out, in)``;
    "conv" / "conv_transpose" of ``dims`` spatial dimensions; "matmul": ``x @ W``, weight ``(in, out)``;
    "addmm": ``bias + x @ W``; "grouped": a grouped GEMM, weight ``(E, in, out)``) and its argument
    names in positional order."""

    kind: str
    args: tuple[str, ...]
    dims: int = 0


WEIGHT_GEMMS: dict[Any, GemmForm] = {
    F.linear: GemmForm("linear", ("input", "weight", "bias")),
    **{f: GemmForm("conv", CONV_ARGS, d) for d, f in enumerate((F.conv1d, F.conv2d, F.conv3d), 1)},
    **{
        f: GemmForm("conv_transpose", CONV_T_ARGS, d)
        for d, f in enumerate((F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d), 1)
    },
    torch.addmm: GemmForm("addmm", ("bias", "input", "weight", "beta", "alpha")),
    torch.matmul: GemmForm("matmul", ("input", "weight")),
    operator.matmul: GemmForm("matmul", ("input", "weight")),
    torch.mm: GemmForm("matmul", ("input", "weight")),
    torch._grouped_mm: GemmForm("grouped", GROUPED_ARGS),
}
if hasattr(F, "grouped_mm"):
    WEIGHT_GEMMS[F.grouped_mm] = GemmForm("grouped", GROUPED_ARGS)
#: call_method names of ``x @ W``
WEIGHT_GEMM_METHODS = {"matmul": WEIGHT_GEMMS[torch.matmul], "mm": WEIGHT_GEMMS[torch.mm]}
WEIGHT_GEMM_METHODS["__matmul__"] = WEIGHT_GEMMS[torch.matmul]

#: custom ops (by qualified name) that are grouped GEMMs with ``(input, weight, offs)``: transformers'
#: fallback, which its MoE experts run under ``torch.export`` with weights other than bfloat16, and ours
#: (:func:`grouped_mm_op`)
GROUPED_CUSTOM_OPS = frozenset({"transformers::grouped_mm_fallback", "adaloss::grouped_mm"})
_GROUPED_CUSTOM = GemmForm("grouped", ("input", "weight", "offs"))


def op_name(target: Any) -> str | None:
    """The qualified name of a dispatcher op (``aten::mm``, ``transformers::grouped_mm_fallback``), whether
    a graph holds its overload or its packet; None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return target.name().split(".")[0]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def weight_gemm(target: Any) -> GemmForm | None:
    """The entry of :data:`WEIGHT_GEMMS` a called function is, a grouped GEMM custom op included."""
    form = WEIGHT_GEMMS.get(target)
    if form is None and op_name(target) in GROUPED_CUSTOM_OPS:
        return _GROUPED_CUSTOM
    return form


#: ATen ops of an exported graph and the torch functions the transform's recognizers read in their place
#: (same arguments, same results)
ATEN_AS_TORCH: dict[Any, Any] = {
    _aten.linear.default: F.linear,
    _aten.conv1d.default: F.conv1d,
    _aten.conv2d.default: F.conv2d,
    _aten.conv3d.default: F.conv3d,
    _aten.conv1d.padding: F.conv1d,
    _aten.conv2d.padding: F.conv2d,
    _aten.conv3d.padding: F.conv3d,
    _aten.conv_transpose1d.default: F.conv_transpose1d,
    _aten.conv_transpose2d.input: F.conv_transpose2d,
    _aten.conv_transpose3d.input: F.conv_transpose3d,
    _aten.matmul.default: torch.matmul,
    _aten.mm.default: torch.mm,
    _aten.bmm.default: torch.bmm,
    _aten.baddbmm.default: torch.baddbmm,
    _aten.addmm.default: torch.addmm,
    _aten.einsum.default: torch.einsum,
    _aten.scaled_dot_product_attention.default: F.scaled_dot_product_attention,
    _aten._grouped_mm.default: torch._grouped_mm,
}


def as_torch(target: Any) -> Any:
    """The torch function a captured graph's op stands for (:data:`ATEN_AS_TORCH`, a grouped GEMM custom
    op as ``torch._grouped_mm``), else ``target``."""
    if target in ATEN_AS_TORCH:
        return ATEN_AS_TORCH[target]
    if op_name(target) in GROUPED_CUSTOM_OPS:
        return torch._grouped_mm
    return target


#: ATen ops (overload packets, by name) that multiply matrices: plain, grouped and scaled GEMMs, the fused
#: attention kernels, the fused recurrent kernels (cuDNN, MIOpen, oneDNN) and the quantized-weight ones
_GEMM_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "mv",
    "addmv",
    "addr",
    "dot",
    "vdot",
    "_addmm_activation",
    "_scaled_mm",
    "_scaled_grouped_mm",
    "_grouped_mm",
    "_int_mm",
    "_weight_int4pack_mm",
    "_weight_int8pack_mm",
    "convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "_cudnn_rnn",
    "miopen_rnn",
    "mkldnn_rnn_layer",
)
GEMM_OPS = frozenset(getattr(_aten, n) for n in _GEMM_OP_NAMES if hasattr(_aten, n))
#: words in an op's name that say it multiplies (an op outside :data:`GEMM_OPS`, a custom op)
_GEMM_WORDS = frozenset(
    {"mm", "bmm", "gemm", "matmul", "linear", "conv", "convolution", "attention", "rnn", "lstm", "gru"}
    | {"conv1d", "conv2d", "conv3d", "einsum", "tensordot"}
)


def is_gemm_op(func: Any) -> bool:
    """Whether a dispatched op multiplies matrices (:data:`GEMM_OPS`, or a word of its name in
    :data:`_GEMM_WORDS`: ``mylib::fused_gemm``, ``transformers::grouped_mm_fallback``)."""
    packet = getattr(func, "overloadpacket", func)
    if packet in GEMM_OPS:
        return True
    name = getattr(packet, "__name__", "")
    qualified = getattr(func, "name", lambda: name)()
    return any(w in _GEMM_WORDS for w in re.split(r"[_:.]+", qualified.lower()))


# --------------------------------------------------------------------------------------- grouped GEMMs

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel_fits(*ts: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm``'s kernel takes these operands: its dtypes, and every stride (but the
    unit one) and address a multiple of 16 bytes. Metadata only: no sync."""
    for t in ts:
        size = t.element_size()
        try:
            ptr = t.data_ptr()
        except RuntimeError:  # a fake tensor (torch.compile's tracing): the masked products are traced
            return False
        if t.dtype not in _KERNEL_DTYPES or ptr % 16:
            return False
        if any(s != 1 and (s * size) % 16 for s in t.stride()):
            return False
    return True


def _masks(offs: torch.Tensor, rows: int, groups: int, like: torch.Tensor) -> torch.Tensor:
    """``(groups, rows, 1)``: 1 where a row belongs to the group (``offs`` cumulative ends), else 0."""
    ends = offs.to(torch.long)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    r = torch.arange(rows, device=offs.device)
    inside = (r >= starts[:groups, None]) & (r < ends[:groups, None])
    return inside.to(like.dtype).unsqueeze(-1)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``(S, K) x (E, K, N) -> (S, N)``: row block ``g`` of ``a`` times ``b[g]``; rows past ``offs[-1]``
    come out 0. The kernel where it fits (:func:`_kernel_fits`), else one masked product per group (exact:
    the other rows add zeros). No sync."""
    if _kernel_fits(a, b):
        return torch._grouped_mm(a, b, offs=offs)
    masks = _masks(offs, a.shape[0], b.shape[0], a)
    out = a.new_zeros(a.shape[0], b.shape[-1])
    for g in range(b.shape[0]):
        out = out + masks[g] * (a @ b[g])
    return out


def grouped_wgrad(a: torch.Tensor, delta: torch.Tensor, offs: torch.Tensor, groups: int) -> torch.Tensor:
    """The weight gradient of :func:`grouped_mm`: ``(E, K, N)``, block ``g`` is ``a[rows g]^T delta[rows
    g]``. No sync."""
    at = a.t()
    if _kernel_fits(at, delta):
        return torch._grouped_mm(at, delta, offs=offs)
    masks = _masks(offs, a.shape[0], groups, a)
    return torch.stack([(masks[g] * a).t() @ delta for g in range(groups)])


@torch.library.custom_op("adaloss::grouped_mm", mutates_args=())
def grouped_mm_op(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """``torch.ops.adaloss.grouped_mm``: ``torch._grouped_mm(input, weight, offs=offs)`` on any dtype
    (float64 included, which the kernel lacks), with its backward; the rewrite makes it a grouped point as
    it does ``torch._grouped_mm``. No sync."""
    return grouped_mm(input, weight, offs)


@grouped_mm_op.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # noqa: A002
    return input.new_empty(input.shape[0], weight.shape[-1])


def _grouped_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    x, w, offs = ctx.saved_tensors
    grad = grad.contiguous()
    return grouped_mm(grad, w.transpose(-2, -1), offs), grouped_wgrad(x, grad, offs, w.shape[0]), None


grouped_mm_op.register_autograd(_grouped_backward, setup_context=_grouped_setup)
