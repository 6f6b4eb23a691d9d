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

from adaloss.adaptive.ops import AdaptiveState, AttentionProbe, GradProbe, GradRound, ScaledGEMM
from adaloss.errors import ConfigError
from adaloss.numerics.emulation import active_emulation

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
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        traced = _traced_forward(m)
        if traced is not None:
            forward = functools.partial(traced, self, m)
        return super().call_module(m, forward, args, kwargs)


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
    e = m.embed_dim
    b = m.in_proj_bias
    if m._qkv_same_embed_dim:
        w = m.in_proj_weight
        if self_attention:
            layout, projections = "packed", (F.linear(query, w, b),)
        elif shared_kv:  # F.multi_head_attention_forward splits the packed weight as [E, 2E]
            layout = "kv"
            projections = (
                F.linear(query, w[:e], None if b is None else b[:e]),
                F.linear(key, w[e:], None if b is None else b[e:]),
            )
        else:
            layout = "separate"
            projections = tuple(
                F.linear(t, w[i * e : (i + 1) * e], None if b is None else b[i * e : (i + 1) * e])
                for i, t in enumerate((query, key, value))
            )
    else:
        layout = "separate"
        biases = (None, None, None) if b is None else (b[:e], b[e : 2 * e], b[2 * e :])
        weights = (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)
        projections = tuple(
            F.linear(t, w, bb) for t, w, bb in zip((query, key, value), weights, biases, strict=True)
        )
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
        x = x + m._sa_block(m.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
        return x + m._ff_block(m.norm2(x))
    x = m.norm1(x + m._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
    return m.norm2(x + m._ff_block(x))


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
    return GradProbe.apply(out, emu.probe_for(name), fmt)


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
    """An activation-by-activation product in the rewritten graph: calls ``fn`` unchanged and, on a
    telemetry step, counts the underflow of its output gradient under ``name``. Alpha passes through (the
    product is linear in each input), so no scaling node is needed."""

    def __init__(self, fn: Callable, name: str, state: AdaptiveState) -> None:
        super().__init__()
        self.fn = fn
        self.name = name
        object.__setattr__(self, "state", state)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _probed(self.fn(*args, **kwargs), self.name, self.state)

    def extra_repr(self) -> str:
        return f"{self.name}, alpha passes through"


class AttentionCore(nn.Module):
    """Attention between the projections: ``F.scaled_dot_product_attention`` called by the model
    (``kind="sdpa"``, the call's own arguments), or the part of an ``nn.MultiheadAttention`` call between
    its input and output projections (``kind="mha"``: mask handling, heads, attention, dropout while
    ``self.training``), computed as ``F.multi_head_attention_forward`` computes it.

    Alpha passes through. On a telemetry step it counts two products under ``<name>.values`` (the output
    gradient of the attention-weighted values) and ``<name>.scores`` (the gradient of the scores
    ``Q K^T``): with ``need_weights=True`` both are tensors of the explicit computation; inside scaled
    dot-product attention the scores' gradient exists only in the kernel, so :class:`AttentionProbe`
    recomputes it from the saved inputs and counts what storing it in the gradient format would lose (as
    GPU attention kernels store it in FP16 before its two products; attention dropout is not replayed).
    Cost outside telemetry steps: one Python module call.
    """

    def __init__(
        self, kind: str, name: str, state: AdaptiveState, config: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.kind = kind
        self.name = name
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

    def extra_repr(self) -> str:
        return f"{self.name}, {self.kind}, alpha passes through"

    def _sdpa(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = F.scaled_dot_product_attention(*args, **kwargs)
        tele = _telemetry(self.state)
        if tele is None or not out.requires_grad:
            return out
        bound = _SDPA_SIGNATURE.bind(*args, **kwargs).arguments
        emu, fmt = tele
        return AttentionProbe.apply(
            out,
            bound["query"],
            bound["key"],
            bound["value"],
            bound.get("attn_mask"),
            bool(bound.get("is_causal", False)),
            bound.get("scale"),
            emu.probe_for(f"{self.name}.values"),
            emu.probe_for(f"{self.name}.scores"),
            fmt,
        )

    def _mha(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Between the projections of ``F.multi_head_attention_forward`` (the same ops in the same order)."""
        *projections, attn_mask, key_padding_mask = args
        cfg = self.config
        e, heads = self.embed_dim, self.num_heads
        if cfg["layout"] == "packed":
            proj = projections[0].unflatten(-1, (3, e)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
            q, k, v = proj[0], proj[1], proj[2]
        elif cfg["layout"] == "kv":
            q = projections[0]
            kv = projections[1].unflatten(-1, (2, e)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
            k, v = kv[0], kv[1]
        else:
            q, k, v = projections
        tgt_len, bsz, _ = q.shape
        need_weights = cfg["need_weights"]
        is_causal = cfg["is_causal"]
        if is_causal is None:  # the encoder/decoder's hint: detect a causal mask, as they do
            is_causal = _is_causal_mask(attn_mask, tgt_len)
        key_padding_mask = _float_mask(key_padding_mask, q.dtype, "key_padding_mask")
        if is_causal and attn_mask is None:
            raise RuntimeError(
                f"nn.MultiheadAttention '{self.name}': need attn_mask if specifying the is_causal hint"
            )
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None
        else:
            attn_mask = _float_mask(attn_mask, q.dtype, "attn_mask")
            if key_padding_mask is not None:
                is_causal = False
        if attn_mask is not None and attn_mask.dim() == 2:
            attn_mask = attn_mask.unsqueeze(0)
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
            q_scaled = q * math.sqrt(1.0 / float(q.shape[-1]))
            if attn_mask is not None:
                weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
            else:
                weights = torch.bmm(q_scaled, k.transpose(-2, -1))
            weights = F.softmax(_probed(weights, f"{self.name}.scores", self.state), dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            out = _probed(torch.bmm(weights, v), f"{self.name}.values", self.state)
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
    :class:`ScaledGEMM` (Algorithm 4, the weight gradient unscaled by its own alpha) and names its
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
        point = self.state.gemms[k]
        y = ScaledGEMM.apply(x, w, b, point, self.state, {"kind": "linear"}, torch.is_grad_enabled())
        return GradRound.wrap(y, point, self.state)

    def fusable(self) -> bool:
        return False

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
