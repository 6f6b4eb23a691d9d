"""What the adaptive transform scaled in one model: its GEMM points, the weights left without one, and why.

:func:`build_coverage` reads the rewritten module and its :class:`~adaloss.adaptive.ops.AdaptiveState`:

* the scaling points, in network order: each layer point with the parameter under its weight, each product
  with or without a beta of its own (``Product`` modules of ``einsum``, and every product under
  ``product_betas=False``, pass alpha through);
* every parameter with 2 or more dimensions under no point, with its module and the reason: a recurrent
  layer (``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and their cells: the whole layer is one ATen op that fx keeps
  as a leaf), an operand of a product without a beta, or anything else (a positional embedding added to the
  activations); embedding tables are listed apart, as lookups;
* given example inputs, the ATen count: one forward pass under :class:`GemmCalls` records every GEMM call
  (:func:`adaloss.adaptive.gemms.is_gemm_op`: ``mm``, ``addmm``, ``bmm``, ``convolution``, grouped and
  scaled GEMMs, fused attention and RNN kernels, GEMM-like custom ops) with an operand inside a parameter's
  storage or computed from parameters alone, and the point whose forward made it, if any. A GEMM the
  transform did not catch (a functional form it does not rewrite) shows up there, named by its parameter.

``AdaptiveLossScaler.coverage`` is the public entry point; ``attach()`` warns about recurrent layers with
:func:`recurrent_layers`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from adaloss.adaptive.attention import AttentionCore, LeafGEMMs, Product
from adaloss.adaptive.capture import CapturedForward
from adaloss.adaptive.gemms import is_gemm_op
from adaloss.adaptive.mutation import is_view_op
from adaloss.adaptive.ops import AdaptiveState, GemmPoint, ScaledGEMM
from adaloss.adaptive.transform import AdaptiveGEMM, FunctionalGEMM, ParamUnscaleModule, UnscaledParams

__all__ = [
    "Coverage",
    "GemmCall",
    "GemmCalls",
    "PointCoverage",
    "RecurrentLayer",
    "UnscaledWeight",
    "build_coverage",
    "recurrent_layers",
]

RECURRENT_REASON = "recurrent layer: its GEMMs run inside one ATen op the transform does not open"
LOOKUP_REASON = "lookup (embedding), not a GEMM"
OTHER_REASON = "not multiplied by a GEMM point"

#: Recurrent modules: fx keeps each a leaf, and its GEMMs run inside one ATen op (``aten::lstm``, ...).
RECURRENT_TYPES = (nn.RNNBase, nn.RNNCellBase)
_LOOKUP_TYPES = (nn.Embedding, nn.EmbeddingBag)
_LOOKUP_FUNCTIONS = {F.embedding, F.embedding_bag, torch.embedding, torch.ops.aten.embedding.default}

#: Ops that gather rows of their first argument: from a parameter of 3 or more dimensions (a stack of expert
#: matrices, ``weight[expert_ids]``), what they make is still named by the parameter in a GEMM
_GATHER_OPS = frozenset(
    getattr(torch.ops.aten, n) for n in ("index", "index_select") if hasattr(torch.ops.aten, n)
)
#: Ops that move the tensors of their first argument into a new buffer, in place (cuDNN's RNN weights).
_MOVE_OPS = frozenset(
    getattr(torch.ops.aten, n) for n in ("_cudnn_rnn_flatten_weight",) if hasattr(torch.ops.aten, n)
)

#: Casts, through which a parameter keeps its values (views: :func:`adaloss.adaptive.mutation.is_view_op`).
_CASTS = frozenset({"to", "type", "float", "half", "bfloat16", "double"})


@dataclass(frozen=True)
class PointCoverage:
    """One scaling point (or a product that passes alpha through): ``kind`` "layer" (a GEMM with a weight,
    ``weight`` the parameter under it) or "product" (two activations); ``beta``: it computes a beta of its
    own (Algorithm 4)."""

    name: str
    kind: str
    weight: str | None
    beta: bool


@dataclass(frozen=True)
class UnscaledWeight:
    """A parameter of 2 or more dimensions under no GEMM point. ``gemm``: it is known to be a GEMM operand
    (a recurrent layer's weight, an operand of a product without a beta, or one the ATen count saw in a
    GEMM outside every point), so a GEMM of the model goes without Algorithm 4."""

    name: str
    module: str  # path of the module holding it ("" for the root)
    module_type: str
    reason: str
    gemm: bool


@dataclass(frozen=True)
class GemmCall:
    """One ATen GEMM call with an operand inside a parameter's storage: the op (``mm``, ``convolution``,
    ``mkldnn_rnn_layer``), the parameter, and the point whose forward made it (None: outside every
    point). A call with several parameter operands (a fused RNN kernel) gives one per parameter."""

    op: str
    param: str
    point: str | None


@dataclass(frozen=True)
class RecurrentLayer:
    """A recurrent module of an attached model and its GEMM weights under no point (``weight_ih_l0``, ...)."""

    path: str
    module_type: str
    weights: tuple[str, ...]

    def warning(self) -> str:
        return (
            f"adaptive loss scaling: '{self.path}' ({self.module_type}) is a recurrent layer; its GEMMs run "
            "inside one ATen op the transform does not open, so its GEMM weights "
            f"{', '.join(self.weights)} get no scaling point (no beta). Their gradients stay exact: they are "
            "brought to the root scale by the alpha of the layer's output gradient. scaler.coverage() lists "
            "every weight without a point"
        )


@dataclass
class Coverage:
    """What the adaptive transform scaled in one model (see the module docstring). ``calls`` is None when
    no example inputs were given (nothing counted in ATen)."""

    points: list[PointCoverage] = field(default_factory=list)
    unscaled: list[UnscaledWeight] = field(default_factory=list)
    lookups: list[UnscaledWeight] = field(default_factory=list)
    calls: list[GemmCall] | None = None

    @property
    def outside(self) -> list[GemmCall]:
        """The counted GEMM calls that ran outside every point."""
        return [c for c in self.calls or () if c.point is None]

    @property
    def every_gemm_weight_has_a_point(self) -> bool:
        """Whether every GEMM with a weight got a scaling point: no recurrent weight or product operand is
        left unscaled and, where counted, no GEMM call multiplied a parameter outside every point. Without
        example inputs a GEMM the transform does not recognize is invisible here: pass them."""
        return not any(w.gemm for w in self.unscaled) and not self.outside

    def format(self) -> str:
        """A plain-text table of the points, the weights without one, the lookups and the ATen count."""
        layers = [p for p in self.points if p.kind == "layer"]
        products = [p for p in self.points if p.kind != "layer"]
        with_beta = sum(p.beta for p in products)
        lines = [
            f"Scaling points: {_count(len(layers), 'layer')}, {_count(len(products), 'product')} "
            f"({with_beta} with a beta, {len(products) - with_beta} passing alpha through)"
        ]
        rows = [(p.name, p.kind, "yes" if p.beta else "no", p.weight or "-") for p in self.points]
        lines += _table(("point", "kind", "beta", "weight"), rows)
        for title, entries in (("Weights under no point", self.unscaled), ("Lookups", self.lookups)):
            lines.append(f"{title}: {len(entries)}")
            rows = [(w.name, w.module or "(root)", w.module_type, w.reason) for w in entries]
            lines += _table(("parameter", "module", "type", "reason"), rows)
        if self.calls is None:
            lines.append("ATen GEMM calls: not counted (pass example inputs: scaler.coverage(x))")
        else:
            outside = self.outside
            lines.append(
                f"ATen GEMM calls with a parameter operand (one per call and parameter): {len(self.calls)}, "
                f"{len(self.calls) - len(outside)} inside a point, {len(outside)} outside"
            )
            counts = Counter((c.op, c.param) for c in outside)
            lines += _table(("op", "parameter", "calls"), [(op, p, str(n)) for (op, p), n in counts.items()])
        missed = sum(w.gemm for w in self.unscaled)
        verdict = (
            "yes"
            if self.every_gemm_weight_has_a_point
            else (
                f"no ({_count(missed, 'GEMM weight')} under no point, "
                f"{_count(len(self.outside), 'ATen GEMM call')} outside every point)"
            )
        )
        lines.append(f"Every GEMM weight has a point: {verdict}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """Rows under a header, columns aligned, indented by two spaces; nothing for no rows."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in (header, *rows)
    ]


# ------------------------------------------------------------------------------------------ static part


def build_coverage(
    model: nn.Module,
    state: AdaptiveState,
    example_args: tuple = (),
    example_kwargs: dict[str, Any] | None = None,
) -> Coverage:
    """The coverage report of ``model``, the module ``attach_adaptive`` returned for ``state``. With example
    inputs, also the ATen count of one forward pass (:func:`count_gemm_calls`)."""
    names = _param_names(model)
    calls = None
    if example_args or example_kwargs:
        calls = count_gemm_calls(model, names, example_args, example_kwargs or {})
    rewritten = _rewritten_graph(model)
    report = Coverage(points=_points(rewritten, state, names), calls=calls)
    under = {id(p) for p in state.points.gemm_weights}
    graph = rewritten.graph if isinstance(rewritten, fx.GraphModule) else None
    uses = _param_uses(rewritten, graph) if graph is not None else {}
    seen_outside = {c.param: c.op for c in reversed(report.outside)}  # the first op per parameter
    seen_inside = {c.param for c in report.calls or () if c.point is not None}
    under_products = {name for name, (kind, _) in uses.items() if kind == "product"}
    for name, p in model.named_parameters():
        if p.dim() < 2 or id(p) in under or name in under_products:
            continue
        if name in seen_inside and name not in seen_outside:
            continue  # multiplied inside a point only (expert weights gathered per token for a product)
        path = name.rpartition(".")[0]
        owner = _unwrapped(model.get_submodule(path))
        entry = (name, path, type(owner).__name__)
        kind, detail = uses.get(name, (None, None))
        if isinstance(owner, RECURRENT_TYPES):
            report.unscaled.append(UnscaledWeight(*entry, RECURRENT_REASON, True))
        elif isinstance(owner, _LOOKUP_TYPES) or kind == "lookup":
            report.lookups.append(UnscaledWeight(*entry, LOOKUP_REASON, False))
        elif kind == "pass-through":
            reason = f"operand of '{detail}', a product without a beta (alpha passes through)"
            report.unscaled.append(UnscaledWeight(*entry, reason, True))
        elif name in seen_outside:
            reason = f"multiplied by aten.{seen_outside[name]} outside every point"
            report.unscaled.append(UnscaledWeight(*entry, reason, True))
        else:
            report.unscaled.append(UnscaledWeight(*entry, OTHER_REASON, False))
    return report


def recurrent_layers(model: nn.Module, state: AdaptiveState) -> list[RecurrentLayer]:
    """The recurrent modules of an attached ``model`` (:data:`RECURRENT_TYPES`) and their GEMM weights (2 or
    more dimensions) under no point. Host-side only: fast enough for ``attach()``."""
    under = {id(p) for p in state.points.gemm_weights}
    out = []
    for path, module in model.named_modules():
        inner = _unwrapped(module)
        if not isinstance(inner, RECURRENT_TYPES):
            continue
        weights = tuple(
            n for n, p in inner.named_parameters(recurse=False) if p.dim() >= 2 and id(p) not in under
        )
        if weights:
            out.append(RecurrentLayer(path, type(inner).__name__, weights))
    return out


def _unwrapped(module: nn.Module) -> nn.Module:
    """The user's module behind the transform's wrapper at its path (the layer, or the module holding
    parameters), else ``module``."""
    if isinstance(module, UnscaledParams):
        return module.module
    if isinstance(module, AdaptiveGEMM):
        return module.layer
    return module


def _param_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name``, the first name of a tied parameter."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def _rewritten_graph(model: nn.Module) -> nn.Module:
    """The module holding the rewritten graph: ``model`` itself, or for a model captured with
    ``torch.export`` the graph its forward runs (:class:`~adaloss.adaptive.capture.CapturedForward`)."""
    forward = model.__dict__.get("forward")
    return forward.gm if isinstance(forward, CapturedForward) else model


def _points(model: nn.Module, state: AdaptiveState, names: dict[int, str]) -> list[PointCoverage]:
    """Every point of ``state``, in the graph's order where the graph shows it, with its weight's name, and
    the products without a point."""
    out: dict[int | str, PointCoverage] = {}
    for index, module, weight in _point_calls(model, names):
        if index is None:  # a product that passes alpha through
            out[f"product:{module.name}"] = PointCoverage(module.name, "product", None, False)
            continue
        point = state.gemms[index]
        out.setdefault(index, PointCoverage(point.name, point.kind, weight, True))
    for point in state.gemms:  # any the graph walk did not find
        if point.index not in out:
            out[point.index] = PointCoverage(point.name, point.kind, None, True)
    return list(out.values())


def _point_calls(
    model: nn.Module, names: dict[int, str]
) -> Iterator[tuple[int | None, nn.Module, str | None]]:
    """``(point index or None, module, weight name)`` per point call in the graph of ``model``."""
    if not isinstance(model, fx.GraphModule):
        return
    for node in model.graph.nodes:
        if node.op != "call_module":
            continue
        module = model.get_submodule(node.target)
        if isinstance(module, AdaptiveGEMM):
            yield node.args[1], module, ", ".join(names[id(p)] for p in module.sources if id(p) in names)
        elif isinstance(module, FunctionalGEMM):
            yield node.args[3], module, ", ".join(module.weights)
        elif isinstance(module, LeafGEMMs):
            bound = module.signature.bind(*node.args, **node.kwargs).arguments
            for (w_name, _, _), k in zip(module.entry["gemms"], module.points, strict=True):
                yield k, module, _root_param(model, bound.get(w_name))
        elif isinstance(module, (Product, AttentionCore)):
            yield module.point_index, module, None


def _root_param(model: nn.Module, node: Any) -> str | None:
    """The parameter a chain of views (and the transform's identity nodes) starts from, or None."""
    while isinstance(node, fx.Node):
        if node.op == "get_attr":
            try:
                model.get_parameter(node.target)
            except AttributeError:
                return None
            return node.target
        node = node.args[0] if node.args else None
    return None


def _param_uses(model: fx.GraphModule, graph: fx.Graph) -> dict[str, tuple[str, str]]:
    """``{parameter name: (kind, detail)}`` for parameters read directly in the graph whose values reach a
    lookup (``F.embedding``: kind "lookup") or a product (kind "product" with a beta, "pass-through" without;
    detail: the product's name), through views and the transform's identity nodes only."""
    out: dict[str, tuple[str, str]] = {}
    for node in graph.nodes:
        name = _root_param(model, node) if node.op == "get_attr" else None
        if name is None:
            continue
        todo, seen = list(node.users), set()
        while todo:
            user = todo.pop()
            if user in seen:
                continue
            seen.add(user)
            module = model.get_submodule(user.target) if user.op == "call_module" else None
            if user.op == "call_function" and user.target in _LOOKUP_FUNCTIONS:
                out.setdefault(name, ("lookup", ""))
            elif isinstance(module, (Product, AttentionCore)):
                kind = "pass-through" if module.point_index is None else "product"
                if out.get(name, ("",))[0] != "product":
                    out[name] = (kind, module.name)
            elif isinstance(module, ParamUnscaleModule) or _is_view(user):
                todo.extend(user.users)
    return out


def _is_view(node: fx.Node) -> bool:
    """A node that passes its first argument's values on as they are (a view, a transpose, a cast)."""
    if is_view_op(node) or (node.op == "call_method" and node.target in _CASTS):
        return True
    return node.op == "call_function" and node.target is getattr and node.args[1:2] in (("T",), ("mT",))


# ------------------------------------------------------------------------------------------ ATen count


class GemmCalls(TorchDispatchMode):
    """Records every GEMM call at dispatch (:func:`adaloss.adaptive.gemms.is_gemm_op`: plain, grouped and
    scaled GEMMs, fused attention and recurrent kernels, GEMM-like custom ops) with an operand inside a
    parameter's storage (the weight, its transpose, a slice of a packed weight) or computed from parameters
    alone, as a :class:`GemmCall` per such parameter, with ``point``: the name of the point whose forward
    is running (set by :func:`count_gemm_calls`).

    Every tensor is told apart as it is made: a constant (``constants``: the model's buffers; and what an
    op makes from no tensor or from constants alone: ``zeros``, ``arange``), a weight computed from
    parameters (what an op makes from parameters and constants alone, named by those parameters: autocast's
    copies, weight norm, weight standardization, a gain, cuDNN's move of an RNN's weights into one buffer),
    or an activation (a tensor it has not seen made, such as the model's inputs, and what an op makes from
    one). A GEMM of computed weights alone (LoRA's ``B @ A``, spectral norm's power iteration) counts as
    outside every point unless its result reaches a weight operand of a GEMM inside a point. The tensors
    told apart are kept alive while the mode is, so their memory is not reused by another tensor during the
    count (one forward pass's activations, as a pass with gradients keeps)."""

    def __init__(self, params: dict[str, torch.Tensor], constants: list[torch.Tensor] = ()) -> None:
        super().__init__()
        self.spans: dict[int, list[tuple[int, int, str]]] = {}  # storage pointer -> (start, end, name)
        self.activations: set[int] = set()  # storage pointers of activations
        self.constants: set[int] = set()
        self.pending: dict[int, frozenset[int]] = {}  # computed weight's storage -> weights-only GEMM calls
        self.kept: list[torch.Tensor] = []
        for name, p in params.items():
            self._add(p, name)
        for t in constants:
            self._keep(t, self.constants)
        self.calls: list[GemmCall] = []
        self.point: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        named = {n: None for t in tensors for n in self._params(t)}
        activation = any(
            _storage(t) in self.activations or (_storage(t) not in self.constants and not self._params(t))
            for t in tensors
        )
        pending = frozenset().union(*(self.pending.get(_storage(t), ()) for t in tensors))
        if is_gemm_op(func):
            pending = self._gemm(func, tensors, activation, pending)
        moved = [(t, self._whole(t)) for t in args[0]] if func.overloadpacket in _MOVE_OPS else []
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            if activation:
                self._keep(t, self.activations)
            elif not named:
                self._keep(t, self.constants)
            else:  # a tensor computed from parameters alone (written into a buffer by ``out=`` too)
                known = set(self._params(t))
                for name in named:
                    if name not in known:
                        self._add(t, name, keep=True)
                if pending:
                    self.pending[_storage(t)] = self.pending.get(_storage(t), frozenset()) | pending
        for t, name in moved:
            if name is not None:
                self._add(t, name, keep=True)
        if func.overloadpacket in _GATHER_OPS and isinstance(out, torch.Tensor) and args[0].dim() >= 3:
            for name in self._params(args[0]):  # a stack of weight matrices gathered per token (MoE)
                self._add(out, name, keep=True)
        return out

    def _gemm(
        self, func: Any, tensors: list[torch.Tensor], activation: bool, pending: frozenset
    ) -> frozenset:
        """Record a GEMM call; returns the weights-only calls its result carries on (see the class)."""
        found: list[str] = []
        for a in tensors:
            if a.dim() >= 2:
                found += [n for n in self._params(a) if n not in found]
        name = func.overloadpacket.__name__
        if self.point is not None:  # inside a point: the weights-only GEMMs behind its weight are covered
            for k in pending:
                self.calls[k] = GemmCall(self.calls[k].op, self.calls[k].param, self.point)
            pending = frozenset()
        first = len(self.calls)
        self.calls += [GemmCall(name, n, self.point) for n in found]
        if not activation and self.point is None:
            pending = pending | frozenset(range(first, len(self.calls)))
        return pending

    def _keep(self, t: torch.Tensor, kind: set[int]) -> None:
        ptr = _storage(t)
        if ptr and ptr not in kind:
            kind.add(ptr)
            self.kept.append(t)

    def _add(self, t: torch.Tensor, name: str, keep: bool = False) -> None:
        ptr = _storage(t)
        if ptr:
            self.spans.setdefault(ptr, []).append((*_span(t), name))
            if keep:
                self.kept.append(t)

    def _params(self, t: torch.Tensor) -> list[str]:
        """The parameters whose memory ``t`` overlaps, or which it was computed from."""
        start, end = _span(t)
        return [n for s, e, n in self.spans.get(_storage(t), ()) if s < end and start < e]

    def _whole(self, t: torch.Tensor) -> str | None:
        """The parameter ``t`` covers exactly (the parameter, a transpose of it), or None."""
        span = _span(t)
        return next((n for s, e, n in self.spans.get(_storage(t), ()) if (s, e) == span), None)


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage; 0 for a tensor without one."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range of its storage a strided tensor can touch."""
    size = t.element_size()
    if t.numel() == 0:
        return 0, 0
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))
    return t.storage_offset() * size, (t.storage_offset() + extent) * size


def count_gemm_calls(
    model: nn.Module, names: dict[int, str], args: tuple, kwargs: dict[str, Any]
) -> list[GemmCall]:
    """One forward pass of ``model`` under :class:`GemmCalls`, each call tagged with the point whose
    ``ScaledGEMM`` (or product with a beta) made it. No grad, so the scaler's state is not touched; the
    training flag is kept, the buffers (batch-norm statistics) and the random generators are restored."""
    params = {name: p for p in model.parameters() if (name := names.get(id(p))) is not None}
    counter = GemmCalls(params, list(model.buffers()))
    gemm_forward = ScaledGEMM.__dict__["_forward"]
    products = {cls: cls.__dict__["forward"] for cls in (Product, AttentionCore)}

    def in_gemm(*a: Any, **k: Any) -> Any:
        point = next((x for x in a if isinstance(x, GemmPoint)), None)
        with _inside(counter, point.name if point is not None else None):
            return gemm_forward.__func__(*a, **k)

    def in_product(self: Product | AttentionCore, *a: Any, **k: Any) -> Any:
        with _inside(counter, self.name if self.point_index is not None else counter.point):
            return products[type(self)](self, *a, **k)

    tensors = [
        t for t in tree_leaves((args, kwargs, list(model.parameters()))) if isinstance(t, torch.Tensor)
    ]
    cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    tables = [(m, dict(m._buffers)) for m in model.modules()]  # a buffer may be replaced, not written
    buffers = [(t, t.detach().clone()) for t in model.buffers()]
    ScaledGEMM._forward = staticmethod(in_gemm)
    for cls in products:
        cls.forward = in_product
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad(), counter:
            model(*args, **kwargs)
    finally:
        ScaledGEMM._forward = gemm_forward
        for cls, forward in products.items():
            cls.forward = forward
        for m, table in tables:
            m._buffers.update(table)
        with torch.no_grad():
            for t, saved in buffers:
                t.copy_(saved)
    return counter.calls


@contextmanager
def _inside(counter: GemmCalls, point: str | None) -> Iterator[None]:
    """``counter.point`` is ``point`` for the duration of a point's forward; the outer one after it."""
    outer, counter.point = counter.point, point
    try:
        yield
    finally:
        counter.point = outer
