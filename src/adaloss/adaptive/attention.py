"""Attention for the adaptive transform: tracing through ``torch.nn``'s transformer modules, and the modules
that stand in for attention and activation-by-activation products in the rewritten graph.

Why: torch.fx treats every module of ``torch.nn`` as a leaf, so ``nn.MultiheadAttention`` (and the
``nn.Transformer*`` modules around it) would stay opaque calls whose projections pass alpha through
without a scale of their own. :class:`AdaptiveTracer` traces through them instead, with forward functions
that compute what their slow (training) path computes:

* ``nn.MultiheadAttention``: its input projections become ``F.linear`` calls on its own parameters (the
  packed ``in_proj_weight``, or fixed slices of it when query, key and value differ, or ``q/k/v_proj_weight``
  when ``kdim``/``vdim`` differ), its output projection a call of its ``out_proj`` module, so each is a GEMM
  point of the transform. What lies between (masks, heads, scaled dot-product attention or, with
  ``need_weights=True``, the explicit product-softmax-product; dropout) is one :class:`AttentionCore`,
  which passes alpha through. Supported: ``batch_first`` either way, batched (3-D) inputs, ``attn_mask``
  and ``key_padding_mask`` (bool or float), ``is_causal``, ``need_weights``; ``add_bias_kv`` and
  ``add_zero_attn`` raise :class:`AttentionTransformError` naming the module.
* ``nn.TransformerEncoderLayer``/``TransformerEncoder``/``TransformerDecoderLayer``/``TransformerDecoder``/
  ``nn.Transformer``: the same computation as their slow path (the fast path only serves inference); an
  ``is_causal=None`` hint is detected from the mask at run time, as they do.

Functions that torchvision marks ``torch.fx.wrap`` because their control flow depends on shapes stay
leaves; the one that holds GEMMs, Swin's ``shifted_window_attention``, is listed in :data:`LEAF_GEMMS`: its
two ``F.linear`` calls are intercepted at run time and made GEMM points (:class:`LeafGEMMs`).

Activation-by-activation products (``torch.matmul``, ``@``, ``bmm``, ``mm``, ``baddbmm``,
``F.scaled_dot_product_attention``) are linear in each input, so a gradient scaled by alpha yields input
gradients scaled by alpha: they need no scale and no node. In the rewritten graph each becomes a
:class:`Product` or :class:`AttentionCore` module only so that underflow telemetry can name and count it
(``<module path>.matmul``, ``<path>.scores``, ``<path>.values``): on a telemetry step an identity node on
its output counts its output gradient before rounding (:class:`adaloss.adaptive.ops.GradProbe`); on other
steps the module calls the op and adds nothing.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from adaloss.adaptive.ops import (
    AdaptiveState,
    AttentionOperands,
    GradProbe,
    GradRound,
    MatmulOperands,
    ScaledGEMM,
    ScaledProduct,
)
from adaloss.errors import ConfigError
from adaloss.numerics.emulation import active_emulation, is_low_precision, round_value

__all__ = [
    "AdaptiveTracer",
    "AttentionCore",
    "AttentionTransformError",
    "LEAF_GEMMS",
    "LeafGEMMs",
    "PRODUCT_FUNCTIONS",
    "PRODUCT_METHODS",
    "Product",
]


class AttentionTransformError(ConfigError):
    """An attention construct the adaptive scaler does not rewrite (the transform re-raises it as its own
    ``AdaptiveTransformError``)."""


# ---------------------------------------------------------------------------------------- tracing


def mha_core(index: int, *tensors: Any) -> Any:
    """Stand-in recorded in the traced graph for the part of an ``nn.MultiheadAttention`` call between its
    projections; the transform replaces each call with an :class:`AttentionCore` (``index`` picks its
    configuration in ``AdaptiveTracer.cores``). Never run."""
    raise RuntimeError("mha_core is a placeholder of the adaptive transform; it is never called")


torch.fx.wrap("mha_core")


class AdaptiveTracer(fx.Tracer):
    """``torch.fx`` tracer that traces through ``torch.nn``'s attention and transformer modules (see the
    module docstring) and otherwise behaves as ``fx.symbolic_trace``'s. ``cores`` collects the
    configuration of every ``nn.MultiheadAttention`` call, in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.cores: list[dict[str, Any]] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if _traced_forward(m) is not None:
            return False
        if isinstance(m, _TRAINING_LEAVES):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        traced = _traced_forward(m)
        if traced is not None:
            forward = functools.partial(traced, self, m)
        return super().call_module(m, forward, args, kwargs)


def _training_leaves() -> tuple[type[nn.Module], ...]:
    try:
        from torchvision.ops import StochasticDepth
    except ImportError:  # torchvision is optional for the transform
        return ()
    return (StochasticDepth,)


#: Parameterless modules outside ``torch.nn`` whose forward reads ``self.training``: kept as leaves, so
#: the flag is read when they run (tracing through them would freeze the value it had when attached).
_TRAINING_LEAVES = _training_leaves()


def _traced_forward(m: nn.Module) -> Callable | None:
    """The traceable forward for ``m`` if it is one of torch.nn's attention or transformer modules whose
    class does not override ``forward``; None otherwise."""
    for base, fn in _TRACED.items():
        if isinstance(m, base) and type(m).forward is base.forward:
            return fn
    return None


def _mha_forward(
    tracer: AdaptiveTracer,
    m: nn.MultiheadAttention,
    query: Any,
    key: Any,
    value: Any,
    key_padding_mask: Any = None,
    need_weights: bool = True,
    attn_mask: Any = None,
    average_attn_weights: bool = True,
    is_causal: bool | None = False,
) -> tuple[Any, Any]:
    """``nn.MultiheadAttention.forward`` as ``F.multi_head_attention_forward`` computes it in training, with
    the projections visible to the transform (module docstring)."""
    path = tracer.path_of_module(m)
    _check_mha_call(m, path, need_weights, average_attn_weights, is_causal)
    torch._assert(
        query.dim() == 3,
        f"adaptive loss scaling: nn.MultiheadAttention '{path}' takes batched (3-D) inputs only",
    )
    self_attention = query is key and key is value
    shared_kv = key is value
    if m.batch_first:  # to (sequence, batch, features), keeping the identities the projections rely on
        if self_attention:
            query = key = value = query.transpose(1, 0)
        elif shared_kv:
            query, key = query.transpose(1, 0), key.transpose(1, 0)
            value = key
        else:
            query, key, value = (t.transpose(1, 0) for t in (query, key, value))
    layout, projections = _mha_projections(m, query, key, value, self_attention, shared_kv)
    tracer.cores.append(
        {
            "module": m,
            "path": path,
            "layout": layout,
            "need_weights": need_weights,
            "average_attn_weights": average_attn_weights,
            "is_causal": is_causal,
        }
    )
    core = mha_core(len(tracer.cores) - 1, *projections, attn_mask, key_padding_mask)
    out = m.out_proj(core[0])  # (tgt_len * bsz, E), as F.multi_head_attention_forward calls it
    out = out.view(query.size(0), query.size(1), out.size(1))
    if m.batch_first:
        out = out.transpose(1, 0)
    return out, (core[1] if need_weights else None)


def _check_mha_call(
    m: nn.MultiheadAttention, path: str, need_weights: Any, average_attn_weights: Any, is_causal: Any
) -> None:
    """The options of an ``nn.MultiheadAttention`` call the rewrite supports, or one clear error."""
    for flag, what in ((m.bias_k is not None, "add_bias_kv=True"), (m.add_zero_attn, "add_zero_attn=True")):
        if flag:
            raise AttentionTransformError(
                f"nn.MultiheadAttention '{path}' uses {what}, which the adaptive scaler does not support; "
                "build it without that option"
            )
    for name, arg in (("need_weights", need_weights), ("average_attn_weights", average_attn_weights)):
        if not isinstance(arg, bool):
            raise AttentionTransformError(
                f"nn.MultiheadAttention '{path}' gets {name} computed in the forward pass; the adaptive "
                "scaler needs a Python bool there"
            )
    if is_causal is not None and not isinstance(is_causal, bool):
        raise AttentionTransformError(
            f"nn.MultiheadAttention '{path}' gets is_causal computed in the forward pass; the adaptive "
            "scaler needs a Python bool or None there"
        )


def _mha_projections(
    m: nn.MultiheadAttention, query: Any, key: Any, value: Any, self_attention: bool, shared_kv: bool
) -> tuple[str, tuple[Any, ...]]:
    """The layout of the input projections (``packed``, ``kv`` or ``separate``) and their ``F.linear``
    calls, with the packed weight sliced as ``F.multi_head_attention_forward`` slices it."""
    e = m.embed_dim
    b = m.in_proj_bias
    if not m._qkv_same_embed_dim:
        biases = (None, None, None) if b is None else (b[:e], b[e : 2 * e], b[2 * e :])
        weights = (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)
        return "separate", tuple(
            F.linear(t, w, bb) for t, w, bb in zip((query, key, value), weights, biases, strict=True)
        )
    w = m.in_proj_weight
    if self_attention:
        return "packed", (F.linear(query, w, b),)
    if shared_kv:  # F.multi_head_attention_forward splits the packed weight as [E, 2E]
        return "kv", (
            F.linear(query, w[:e], None if b is None else b[:e]),
            F.linear(key, w[e:], None if b is None else b[e:]),
        )
    return "separate", tuple(
        F.linear(t, w[i * e : (i + 1) * e], None if b is None else b[i * e : (i + 1) * e])
        for i, t in enumerate((query, key, value))
    )


def _encoder_layer_forward(
    tracer: AdaptiveTracer,
    m: nn.TransformerEncoderLayer,
    src: Any,
    src_mask: Any = None,
    src_key_padding_mask: Any = None,
    is_causal: bool | None = False,
) -> Any:
    """``nn.TransformerEncoderLayer``'s slow path (its fast path serves inference only)."""
    x = src
    if m.norm_first:
        x = x + _self_attention_block(m, m.norm1(x), src_mask, src_key_padding_mask, is_causal)
        return x + _feed_forward_block(m, m.norm2(x))
    x = m.norm1(x + _self_attention_block(m, x, src_mask, src_key_padding_mask, is_causal))
    return m.norm2(x + _feed_forward_block(m, x))


def _self_attention_block(m: nn.Module, x: Any, mask: Any, padding_mask: Any, is_causal: Any) -> Any:
    """An encoder layer's self-attention with its dropout, from the layer's public submodules (what
    torch's private ``_sa_block`` computes, without depending on it)."""
    out = m.self_attn(
        x, x, x, attn_mask=mask, key_padding_mask=padding_mask, need_weights=False, is_causal=is_causal
    )[0]
    return m.dropout1(out)


def _feed_forward_block(m: nn.Module, x: Any) -> Any:
    """An encoder or decoder layer's feed-forward part with its dropouts, from its public submodules."""
    return m.dropout2(m.linear2(m.dropout(m.activation(m.linear1(x)))))


def _encoder_forward(
    tracer: AdaptiveTracer,
    m: nn.TransformerEncoder,
    src: Any,
    mask: Any = None,
    src_key_padding_mask: Any = None,
    is_causal: bool | None = None,
) -> Any:
    """``nn.TransformerEncoder`` without its inference-only nested-tensor path; ``is_causal=None`` reaches
    each attention core, which detects a causal mask at run time as the encoder would."""
    output = src
    for layer in m.layers:
        output = layer(output, src_mask=mask, is_causal=is_causal, src_key_padding_mask=src_key_padding_mask)
    return output if m.norm is None else m.norm(output)


def _decoder_layer_forward(tracer: AdaptiveTracer, m: nn.TransformerDecoderLayer, *args, **kwargs) -> Any:
    """``nn.TransformerDecoderLayer``'s own forward, which is traceable (it has no fast path)."""
    return type(m).forward(m, *args, **kwargs)


def _decoder_forward(
    tracer: AdaptiveTracer,
    m: nn.TransformerDecoder,
    tgt: Any,
    memory: Any,
    tgt_mask: Any = None,
    memory_mask: Any = None,
    tgt_key_padding_mask: Any = None,
    memory_key_padding_mask: Any = None,
    tgt_is_causal: bool | None = None,
    memory_is_causal: bool = False,
) -> Any:
    """``nn.TransformerDecoder``; ``tgt_is_causal=None`` is detected at run time by the attention cores."""
    output = tgt
    for layer in m.layers:
        output = layer(
            output,
            memory,
            tgt_mask=tgt_mask,
            memory_mask=memory_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
            tgt_is_causal=tgt_is_causal,
            memory_is_causal=memory_is_causal,
        )
    return output if m.norm is None else m.norm(output)


def _transformer_forward(
    tracer: AdaptiveTracer,
    m: nn.Transformer,
    src: Any,
    tgt: Any,
    src_mask: Any = None,
    tgt_mask: Any = None,
    memory_mask: Any = None,
    src_key_padding_mask: Any = None,
    tgt_key_padding_mask: Any = None,
    memory_key_padding_mask: Any = None,
    src_is_causal: bool | None = None,
    tgt_is_causal: bool | None = None,
    memory_is_causal: bool = False,
) -> Any:
    """``nn.Transformer``: its encoder, then its decoder (its shape checks are left to the layers)."""
    memory = m.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=src_is_causal)
    return m.decoder(
        tgt,
        memory,
        tgt_mask=tgt_mask,
        memory_mask=memory_mask,
        tgt_key_padding_mask=tgt_key_padding_mask,
        memory_key_padding_mask=memory_key_padding_mask,
        tgt_is_causal=tgt_is_causal,
        memory_is_causal=memory_is_causal,
    )


_TRACED: dict[type[nn.Module], Callable] = {
    nn.MultiheadAttention: _mha_forward,
    nn.TransformerEncoderLayer: _encoder_layer_forward,
    nn.TransformerEncoder: _encoder_forward,
    nn.TransformerDecoderLayer: _decoder_layer_forward,
    nn.TransformerDecoder: _decoder_forward,
    nn.Transformer: _transformer_forward,
}


# ---------------------------------------------------------------------------------------- telemetry


def _telemetry(state: AdaptiveState) -> tuple[Any, Any] | None:
    """``(emulation, gradient format)`` when the forward pass counts underflow (a telemetry step)."""
    emu = active_emulation()
    if emu is None or emu.monitor is None or not torch.is_grad_enabled():
        return None
    return emu, emu.grad_fmt


def _probed(out: Any, name: str, state: AdaptiveState) -> Any:
    """``out`` behind a :class:`GradProbe` named ``name`` on a telemetry step; ``out`` itself otherwise."""
    tele = _telemetry(state)
    if tele is None or not isinstance(out, torch.Tensor) or not out.requires_grad:
        return out
    emu, fmt = tele
    return GradProbe.apply(out, emu.probe_for(name), fmt, None)


# ---------------------------------------------------------------------------------------- products

#: call_function targets that multiply two activations (when no operand is a parameter; see transform)
PRODUCT_FUNCTIONS: dict[Any, str] = {
    torch.matmul: "matmul",
    operator.matmul: "matmul",
    torch.bmm: "bmm",
    torch.mm: "mm",
    torch.baddbmm: "baddbmm",
    torch.addmm: "addmm",
    F.linear: "linear",
    torch.einsum: "einsum",
}
#: call_method names that do the same, and the function each stands for
PRODUCT_METHODS: dict[str, Any] = {
    "matmul": torch.matmul,
    "__matmul__": torch.matmul,
    "bmm": torch.bmm,
    "mm": torch.mm,
    "baddbmm": torch.baddbmm,
    "addmm": torch.addmm,
}


class Product(nn.Module):
    """An activation-by-activation product in the rewritten graph, and a scaling point of its own
    (:class:`ScaledProduct`: Algorithm 4 with each operand in the other's weight's place): ``matmul``,
    ``@``, ``bmm``, ``mm``, ``baddbmm``, ``addmm``, ``F.linear`` whose weight is an activation. ``einsum``
    has no point (``point_index`` None): alpha passes through it unchanged. In emulation the product is
    stored as the emulation stores a GEMM's (inputs and output in the format), with the scaling node
    between the output and its gradient's rounding, so ``beta`` multiplies the stored gradient. On a
    telemetry step its output gradient is counted under ``name``."""

    def __init__(
        self, fn: Callable, label: str, name: str, state: AdaptiveState, point_index: int | None
    ) -> None:
        super().__init__()
        self.fn = fn
        self.label = label
        self.name = name
        self.point_index = point_index
        object.__setattr__(self, "state", state)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        operands = _matmul_operands(self.label, args, kwargs) if self.point_index is not None else None
        if operands is None or not torch.is_grad_enabled():
            return _probed(self.fn(*args, **kwargs), self.name, self.state)
        emu = active_emulation()
        if emu is None or emu.fmt is None:
            y = self.fn(*args, **kwargs)
        else:  # as the emulation runs a GEMM op: inputs stored in the format, the output rounded (below)
            args = tuple(_stored(a, emu) for a in args)
            kwargs = {k: _stored(v, emu) for k, v in kwargs.items()}
            with torch._C.DisableTorchFunction():
                y = self.fn(*args, **kwargs)
            operands = _matmul_operands(self.label, args, kwargs)
        point = self.state.gemms[self.point_index]
        return _scaled(y, point, self.state, MatmulOperands(*operands), emu, True, self.name)

    def fusable(self) -> bool:
        return self.point_index is None

    def extra_repr(self) -> str:
        scaled = self.point_index is not None
        return f"{self.name}, {'adaptive loss scaling' if scaled else 'alpha passes through'}"


_MATMUL_ARGS = {
    "matmul": ("input", "other"),
    "mm": ("input", "mat2"),
    "bmm": ("input", "mat2"),
    "baddbmm": ("input", "batch1", "batch2"),
    "addmm": ("input", "mat1", "mat2"),
    "linear": ("input", "weight"),
}


def _matmul_operands(label: str, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(a, b)`` of ``a @ b`` for a product op (``F.linear``'s weight transposed); None if not tensors."""
    names = _MATMUL_ARGS.get(label)
    if names is None:
        return None
    bound = dict(zip(names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    a, b = (bound.get(n) for n in names[-2:])
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    return (a, b.transpose(-2, -1) if label == "linear" and b.dim() > 1 else b)


def _stored(a: Any, emu: Any) -> Any:
    """An input of a GEMM op as the emulation stores it (rounded to the format, its gradient too)."""
    if isinstance(a, torch.Tensor) and a.is_floating_point() and not is_low_precision(a):
        return round_value(a, emu.fmt, None, emu.grad_fmt)
    return a


def _scaled(
    y: torch.Tensor, point: Any, state: AdaptiveState, operands: Any, emu: Any, round_out: bool, probe: str
) -> torch.Tensor:
    """``y`` behind its :class:`ScaledProduct` and, when the emulation stores it in the format, behind the
    :class:`GradRound` that stores its gradient there (counted under ``probe`` on a telemetry step)."""
    fmt = emu.fmt if emu is not None and round_out else None
    y = ScaledProduct.apply(y, point, state, operands, fmt, *operands.take())
    if fmt is not None:
        return GradRound.apply(y, emu.grad_fmt, emu.probe_for(probe), emu.grad_site(y))
    return _probed(y, probe, state)


class AttentionCore(nn.Module):
    """Attention between the projections, and a scaling point of its own: ``F.scaled_dot_product_attention``
    called by the model (``kind="sdpa"``, the call's own arguments), or the part of an
    ``nn.MultiheadAttention`` call between its input and output projections (``kind="mha"``: mask handling,
    heads, attention, dropout while ``self.training``), computed as ``F.multi_head_attention_forward``
    computes it.

    Its beta (:class:`ScaledProduct` with :class:`AttentionOperands`) covers the attention's four products:
    the gradient of its output is multiplied by beta before the attention's backward, so the query, key
    and value gradients all leave with ``alpha * beta``. On a telemetry step it counts two products under
    ``<name>.values`` (the output gradient of the attention-weighted values) and ``<name>.scores`` (the
    gradient of the scores ``Q K^T``: a tensor of the explicit computation with ``need_weights=True``,
    else recomputed, see :class:`AttentionOperands`). Cost outside recompute and telemetry steps: one
    Python module call and one multiply of the output gradient by beta.
    """

    def __init__(
        self,
        kind: str,
        name: str,
        state: AdaptiveState,
        point_index: int | None,
        config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.kind = kind
        self.name = name
        self.point_index = point_index
        object.__setattr__(self, "state", state)
        config = dict(config or {})
        mha = config.pop("module", None)
        if mha is not None:
            self.embed_dim, self.num_heads, self.dropout = mha.embed_dim, mha.num_heads, mha.dropout
        self.config = config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.kind == "sdpa":
            return self._sdpa(*args, **kwargs)
        return self._mha(*args)

    def fusable(self) -> bool:
        return self.point_index is None

    def extra_repr(self) -> str:
        scaled = self.point_index is not None
        return f"{self.name}, {self.kind}, {'adaptive loss scaling' if scaled else 'alpha passes through'}"

    def _sdpa(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return F.scaled_dot_product_attention(*args, **kwargs)
        bound = _SDPA_SIGNATURE.bind(*args, **kwargs).arguments
        q, k, v, mask = bound["query"], bound["key"], bound["value"], bound.get("attn_mask")
        tele = _telemetry(self.state)
        if self.point_index is None:  # alpha passes through; telemetry only
            out = F.scaled_dot_product_attention(*args, **kwargs)
            if tele is None or not out.requires_grad:
                return out
            is_causal, scale = bool(bound.get("is_causal", False)), bound.get("scale")
            scores = AttentionOperands(
                q, k, v, mask, is_causal, scale, tele[0].probe_for(f"{self.name}.scores")
            )
            probe = tele[0].probe_for(f"{self.name}.values")
            return GradProbe.apply(out, probe, tele[1], scores, *scores.take())
        emu = active_emulation()
        if emu is None or emu.fmt is None:
            out, round_out = F.scaled_dot_product_attention(*args, **kwargs), False
        else:  # as the emulation runs an op of no autocast list: rounded if every input is in the format
            floats = [t for t in (q, k, v, mask) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            round_out = all(is_low_precision(t) for t in ([t for t in floats if t.dim() > 0] or floats))
            with torch._C.DisableTorchFunction():
                out = F.scaled_dot_product_attention(*args, **kwargs)
        operands = AttentionOperands(
            q,
            k,
            v,
            mask,
            bool(bound.get("is_causal", False)),
            bound.get("scale"),
            tele[0].probe_for(f"{self.name}.scores") if tele is not None else None,
        )
        point = self.state.gemms[self.point_index]
        return _scaled(out, point, self.state, operands, emu, round_out, f"{self.name}.values")

    def _mha(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Between the projections of ``F.multi_head_attention_forward`` (the same ops in the same order)."""
        *projections, attn_mask, key_padding_mask = args
        cfg = self.config
        e, heads = self.embed_dim, self.num_heads
        q, k, v = self._split(projections)
        tgt_len, bsz, _ = q.shape
        need_weights = cfg["need_weights"]
        attn_mask, key_padding_mask, is_causal = self._masks(attn_mask, key_padding_mask, tgt_len, q.dtype)
        head_dim = e // heads
        q = q.view(tgt_len, bsz * heads, head_dim).transpose(0, 1)
        k = k.view(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
        v = v.view(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
        src_len = k.size(1)
        if key_padding_mask is not None:
            key_padding_mask = (
                key_padding_mask.view(bsz, 1, 1, src_len)
                .expand(-1, heads, -1, -1)
                .reshape(bsz * heads, 1, src_len)
            )
            attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            out, weights = self._explicit(q, k, v, attn_mask, dropout_p)
            out = out.transpose(0, 1).reshape(tgt_len * bsz, e)
            weights = weights.view(bsz, heads, tgt_len, src_len)
            if cfg["average_attn_weights"]:
                weights = weights.mean(dim=1)
            return out, weights
        if attn_mask is not None:
            if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0)
            else:
                attn_mask = attn_mask.view(bsz, heads, -1, src_len)
        q = q.view(bsz, heads, tgt_len, head_dim)
        k = k.view(bsz, heads, src_len, head_dim)
        v = v.view(bsz, heads, src_len, head_dim)
        out = self._sdpa(q, k, v, attn_mask, dropout_p, is_causal)
        return out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, e), None

    def _split(self, projections: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query, key and value from the projections' outputs (one packed, key and value packed, or
        three), as ``F.multi_head_attention_forward`` splits them."""
        e, layout = self.embed_dim, self.config["layout"]
        if layout == "packed":
            proj = projections[0].unflatten(-1, (3, e)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
            return proj[0], proj[1], proj[2]
        if layout == "kv":
            kv = projections[1].unflatten(-1, (2, e)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
            return projections[0], kv[0], kv[1]
        q, k, v = projections
        return q, k, v

    def _masks(
        self, attn_mask: Any, key_padding_mask: Any, tgt_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
        """The attention mask (3-D, or None where the causal hint replaces it), the key padding mask as a
        float mask, and whether the call is causal, as ``F.multi_head_attention_forward`` decides them."""
        is_causal = self.config["is_causal"]
        if is_causal is None:  # the encoder/decoder's hint: detect a causal mask, as they do
            is_causal = _is_causal_mask(attn_mask, tgt_len)
        key_padding_mask = _float_mask(key_padding_mask, dtype, "key_padding_mask")
        if is_causal and attn_mask is None:
            raise RuntimeError(
                f"nn.MultiheadAttention '{self.name}': need attn_mask if specifying the is_causal hint"
            )
        if is_causal and key_padding_mask is None and not self.config["need_weights"]:
            attn_mask = None
        else:
            attn_mask = _float_mask(attn_mask, dtype, "attn_mask")
            if key_padding_mask is not None:
                is_causal = False
        if attn_mask is not None and attn_mask.dim() == 2:
            attn_mask = attn_mask.unsqueeze(0)
        return attn_mask, key_padding_mask, is_causal

    def _explicit(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``need_weights=True``: scores, softmax, dropout and the weighted values as explicit ops (those of
        ``F.multi_head_attention_forward``); the point sits on the weighted values' product."""
        q_scaled = q * math.sqrt(1.0 / float(q.shape[-1]))
        if mask is not None:
            weights = torch.baddbmm(mask, q_scaled, k.transpose(-2, -1))
        else:
            weights = torch.bmm(q_scaled, k.transpose(-2, -1))
        weights = F.softmax(_probed(weights, f"{self.name}.scores", self.state), dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        emu = active_emulation()
        if not torch.is_grad_enabled() or self.point_index is None:
            return _probed(torch.bmm(weights, v), f"{self.name}.values", self.state), weights
        if emu is None or emu.fmt is None:
            out = torch.bmm(weights, v)
        else:
            stored = _stored(weights, emu), _stored(v, emu)
            with torch._C.DisableTorchFunction():
                out = torch.bmm(*stored)
        operands = AttentionOperands(q_scaled, k, v, mask, False, 1.0)
        point = self.state.gemms[self.point_index]
        return _scaled(out, point, self.state, operands, emu, True, f"{self.name}.values"), weights


_SDPA_SIGNATURE = inspect.Signature(
    [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
        for n, d in (
            ("query", inspect.Parameter.empty),
            ("key", inspect.Parameter.empty),
            ("value", inspect.Parameter.empty),
            ("attn_mask", None),
            ("dropout_p", 0.0),
            ("is_causal", False),
        )
    ]
    + [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d)
        for n, d in (("scale", None), ("enable_gqa", False))
    ]
)


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype, name: str) -> torch.Tensor | None:
    """An attention mask as ``F.multi_head_attention_forward`` uses it: bool (True: masked) to 0 / -inf."""
    if mask is None or torch.is_floating_point(mask):
        return mask
    if mask.dtype != torch.bool:
        raise TypeError(f"nn.MultiheadAttention: only bool and floating types of {name} are supported")
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def _is_causal_mask(mask: torch.Tensor | None, size: int) -> bool:
    """Whether ``mask`` is the square causal mask of ``size`` (``nn.TransformerEncoder``'s detection of an
    ``is_causal=None`` hint; one host read of a forward-pass value, as there)."""
    if mask is None:
        return False
    causal = nn.Transformer.generate_square_subsequent_mask(size, device=mask.device, dtype=mask.dtype)
    return mask.size() == causal.size() and bool((mask == causal).all())


# ---------------------------------------------------------------------------------------- wrapped leaves


def _swin_attention() -> Callable | None:
    try:
        from torchvision.models import swin_transformer
    except ImportError:  # torchvision is optional for the transform
        return None
    return swin_transformer.shifted_window_attention


#: Functions torch.fx keeps as leaves that hold GEMMs with parameter weights: for each, its ``(weight,
#: bias)`` arguments in the order the function calls ``F.linear`` with them (each feeding the next through
#: alpha-passing ops), which other differentiable arguments enter after which GEMM, names for its
#: activation products in call order, and the argument carrying the module's training flag (fx records it
#: as a constant at tracing; the leaf module passes its own at run time).
LEAF_GEMMS: dict[Callable, dict[str, Any]] = {
    fn: {
        "gemms": (("qkv_weight", "qkv_bias", "qkv"), ("proj_weight", "proj_bias", "proj")),
        "enters_after": {"input": 0, "relative_position_bias": 1, "logit_scale": 1},
        "products": ("scores", "values"),
        "training": "training",
    }
    for fn in (_swin_attention(),)
    if fn is not None
}


class LeafGEMMs(nn.Module):
    """A call of a :data:`LEAF_GEMMS` function whose ``F.linear`` calls with the listed weights are GEMM
    points: the function runs unchanged under a torch-function mode that routes each such call to
    :meth:`gemm` (Algorithm 4, the weight gradient unscaled by its own alpha) and names its
    activation products for telemetry. Alpha wiring (static, set by the transform): the last GEMM reads
    the alpha of the call's output gradient, each earlier one the alpha the next one emits.
    Cost: the mode adds a Python round trip to each op inside the function (a few dozen per call)."""

    def __init__(
        self, fn: Callable, entry: dict[str, Any], points: list[int], state: AdaptiveState, name: str
    ) -> None:
        super().__init__()
        self.fn = fn
        self.entry = entry
        self.points = points
        self.name = name
        object.__setattr__(self, "state", state)
        self.signature = inspect.signature(fn)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        if self.entry.get("training"):
            arguments[self.entry["training"]] = self.training
        weights = {}
        for (w_name, _, _), k in zip(self.entry["gemms"], self.points, strict=True):
            weights[id(arguments[w_name])] = k
        mode = _InnerGEMMs(self, weights)
        with mode:
            out = self.fn(*bound.args, **bound.kwargs)
        if sorted(mode.used) != sorted(weights.values()):
            missing = [self.state.gemms[k].name for k in weights.values() if mode.used.count(k) != 1]
            raise RuntimeError(
                f"adaptive loss scaling: {self.name} ({self.fn.__qualname__}) did not call F.linear once "
                f"with each listed weight (points {missing}); its entry in LEAF_GEMMS is out of date"
            )
        return out

    def gemm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, k: int) -> torch.Tensor:
        """GEMM point ``k``: :class:`ScaledGEMM` behind its :class:`GradRound`."""
        point = self.state.gemms[k]
        y = ScaledGEMM.apply(x, w, b, point, self.state, {"kind": "linear"}, torch.is_grad_enabled())
        return GradRound.wrap(y, point)

    def extra_repr(self) -> str:
        return f"{self.name}: {self.fn.__module__}.{self.fn.__qualname__}, adaptive loss scaling"


_LINEAR = {F.linear, torch._C._nn.linear}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}


class _InnerGEMMs(TorchFunctionMode):
    """Inside a :class:`LeafGEMMs` call: ``F.linear`` with a listed weight becomes its GEMM point;
    matmuls get telemetry names in call order. Every other op goes on to the outer modes (the emulation)."""

    def __init__(self, leaf: LeafGEMMs, weights: dict[int, int]) -> None:
        super().__init__()
        self.leaf = leaf
        self.weights = weights
        self.used: list[int] = []
        self.products = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in _LINEAR:
            x = args[0] if args else kwargs["input"]
            w = args[1] if len(args) > 1 else kwargs["weight"]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            k = self.weights.get(id(w))
            if k is not None:
                self.used.append(k)
                return self.leaf.gemm(x, w, b, k)
        out = func(*args, **kwargs)
        if func in _MATMUL:
            names = self.leaf.entry.get("products", ())
            i = self.products
            self.products += 1
            label = names[i] if i < len(names) else f"matmul#{i}"
            out = _probed(out, f"{self.leaf.name}.{label}", self.leaf.state)
        return out
