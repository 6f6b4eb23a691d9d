"""Rewrite an unmodified model so its backward pass carries ``<alpha, delta>`` (torch.fx).

:func:`attach_adaptive` traces the model (with :class:`~adaloss.adaptive.attention.AdaptiveTracer`, which
also traces through ``nn.MultiheadAttention`` and the ``nn.Transformer*`` modules) and edits the graph in
four passes:

1. **GEMM points**, in network order. Every call of a conv / transposed conv / linear module becomes a call
   of an :class:`AdaptiveGEMM` installed at the same module path. It holds the *same* parameter objects under
   the same names, so ``state_dict()`` keys, optimizers and checkpoints are unchanged. A module called k times
   gets k scaling points (``fc``, ``fc#1``, ...). ``F.linear``, ``F.conv*`` and ``x @ W`` whose weight is a
   parameter or a fixed view of one (a slice of a packed weight) become :class:`FunctionalGEMM` calls that
   take the weight as a graph value; functions fx keeps as leaves that hold GEMMs (Swin's attention,
   ``LEAF_GEMMS``) become :class:`~adaloss.adaptive.attention.LeafGEMMs`; activation-by-activation products
   and attention calls become :class:`~adaloss.adaptive.attention.Product` /
   :class:`~adaloss.adaptive.attention.AttentionCore` points (kind "product").
2. **Other uses of GEMM parameters** (a token embedding whose weight is also the output projection's): a
   :class:`ParamUnscaleModule` on each such use, or an :class:`UnscaledParams` around a module holding one,
   so each use's gradient is unscaled by its own alpha, as each GEMM call's is.
3. **Branch points.** Every value consumed by several ops (a residual shortcut, a feature map feeding a
   detection head and the next layer, a parameter used twice by non-GEMM ops) gets a :class:`BranchModule`
   that hands each consumer its own alias, so the consumers' gradients meet in one backward call
   (Algorithm 5). An op with several outputs whose gradients would carry different alphas (``split``,
   ``chunk``) gets one too. GEMM parameters get none: their gradients arrive unscaled.
4. **Slots.** Walking the graph from the outputs back to the inputs, each value learns which point emitted
   the alpha of its gradient: the loss (slot 0), the GEMM, product or branch point that consumes it, or,
   through any other (element-wise) op, whatever that op's output received. Points read their incoming
   alpha from that slot; parameters of non-GEMM ops (normalization weights, ...) are unscaled by it.

Models fx cannot trace (control flow on tensor values, ...) get an :class:`AdaptiveTransformError` naming the
construct.
"""

from __future__ import annotations

import inspect
import operator
from collections import Counter
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from adaloss.adaptive.attention import (
    LEAF_GEMMS,
    PRODUCT_FUNCTIONS,
    PRODUCT_METHODS,
    AdaptiveTracer,
    AttentionCore,
    AttentionTransformError,
    LeafGEMMs,
    Product,
    mha_core,
)
from adaloss.adaptive.ops import (
    AdaptiveState,
    BranchPoint,
    GradRound,
    ParamUnscale,
    Rescale,
    ScaledGEMM,
    UnscalePoint,
    contiguous,
    fused_gemm,
    unplanned_point,
)
from adaloss.adaptive.rules import backward_fan_in
from adaloss.errors import ConfigError
from adaloss.numerics import fused
from adaloss.numerics.emulation import active_emulation, is_low_precision, mark_low_precision

__all__ = [
    "AdaptiveTransformError",
    "AdaptiveGEMM",
    "BranchModule",
    "FunctionalGEMM",
    "ParamUnscaleModule",
    "UnscaledParams",
    "attach_adaptive",
]

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_T = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
GEMM_TYPES = (*_CONV, *_CONV_T, nn.Linear)

_NONDIFF_METHODS = {
    "size",
    "dim",
    "ndimension",
    "numel",
    "nelement",
    "stride",
    "is_contiguous",
    "data_ptr",
    "get_device",
    "element_size",
    "type_as_str",
    "is_floating_point",
    "is_complex",
    "storage_offset",
}
_NONDIFF_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"}


class AdaptiveTransformError(ConfigError):
    """The model contains a construct the adaptive scaler cannot rewrite."""


class AdaptiveGEMM(nn.Module):
    """A conv/linear layer whose backward pass applies Algorithm 4 (see :class:`ScaledGEMM`).

    Registers the wrapped layer's own ``weight`` and ``bias`` Parameter objects, so parameter names and
    identities do not change. ``forward(x, point_index)``: the point index tells which call of the layer this
    is when a module is used several times.
    """

    def __init__(self, layer: nn.Module, state: AdaptiveState, path: str) -> None:
        super().__init__()
        self.weight = layer.weight
        if layer.bias is not None:
            self.bias = layer.bias
        else:
            self.register_parameter("bias", None)
        object.__setattr__(self, "layer", layer)  # not a submodule: its parameters are already ours
        object.__setattr__(self, "state", state)
        self.layer_type = type(layer).__name__
        self.spec = _layer_spec(layer, path)
        self.pad_mode = getattr(layer, "padding_mode", "zeros")
        self._fused_spec: Any = None  # the C++ layer description, made on first use (False: unsupported)

    def forward(self, x: torch.Tensor, point_index: int) -> torch.Tensor:
        if self.pad_mode != "zeros":
            x = F.pad(x, self.layer._reversed_padding_repeated_twice, mode=self.pad_mode)
        if self.state.fused_mode is not None and torch.is_grad_enabled() and fused.enabled():
            y = self._fused(x, point_index)
            if y is not None:
                return y
        point = self.state.gemms[point_index]
        y = ScaledGEMM.apply(x, self.weight, self.bias, point, self.state, self.spec, torch.is_grad_enabled())
        return GradRound.wrap(y, point, self.state)

    def fusable(self) -> bool:
        """Whether this layer has a fused C++ form (conv or linear with numeric padding; not transposed)."""
        if self._fused_spec is None:
            self._fused_spec = fused.gemm_spec(self.spec) or False
        return self._fused_spec is not False

    def _fused(self, x: torch.Tensor, point_index: int) -> torch.Tensor | None:
        if not self.fusable():
            return None
        return fused_gemm(self.state, x, self.weight, self.bias, self._fused_spec, point_index)

    def extra_repr(self) -> str:
        return f"{self.layer_type}({self.layer.extra_repr()}), adaptive loss scaling"


class BranchModule(nn.Module):
    """Identity with one alias per consumer; its backward is Algorithm 5 (see :class:`Rescale`)."""

    def __init__(self, point: BranchPoint, state: AdaptiveState) -> None:
        super().__init__()
        object.__setattr__(self, "point", point)
        object.__setattr__(self, "state", state)

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state = self.state
        if state.fused_mode is not None and torch.is_grad_enabled() and fused.enabled():
            emu = active_emulation()
            if emu is not None and emu._fp16 and emu.monitor is None:
                outs = self._fused(xs)
                if outs is not None:
                    state.fused_built = state.fused_mode
                    # marked as their inputs are (see Rescale.forward); never marks an input itself
                    return tuple(
                        mark_low_precision(o) if o is not x and is_low_precision(x) else o
                        for x, o in zip(xs, outs, strict=True)
                    )
        return Rescale.apply(self.point, self.state, *xs)

    def _fused(self, xs: tuple[torch.Tensor, ...]) -> list[torch.Tensor] | None:
        """The fused C++ branch point (:func:`adaloss.numerics.fused.rescale`): the plan's factors on a
        reuse pass, Algorithm 5 into the state's record on a recompute pass."""
        state, k = self.state, self.point.index
        with torch._C.DisableTorchFunction():
            ok = all(x.dtype is torch.float32 and x.is_cpu for x in xs)
            shared = len(xs) > 1 and all(x is xs[0] for x in xs)
            if state.fused_mode == "reuse":
                if not ok:
                    return None
                factors = state.plan.branch[k]  # type: ignore[union-attr]
                if factors is None:  # no gradient reached this point in the last recompute pass
                    if any(x.requires_grad for x in xs):
                        raise unplanned_point(self.point.name)
                    return list(xs)
                if all(f == 1.0 for f in factors):
                    # Nothing to rescale: autograd's own accumulation is this point's backward, so no node
                    # and no views are made (on ResNet-110 all but one of the 54 points, most steps).
                    return list(xs)
                return fused.rescale(list(xs), factors, shared)
            if not ok:
                raise RuntimeError(
                    f"adaptive loss scaling: branch point {self.point.name} got a non-float32 or non-CPU "
                    "input in emulated FP16; set ADALOSS_FUSED=0 to use the Python nodes"
                )
            where = state.record_where["branch"][k]
            reference = state.rule.reference
            return fused.rescale(
                list(xs), [1.0] * len(xs), shared, state.record, where, state.u_max, reference
            )

    def extra_repr(self) -> str:
        return f"{self.point.name}, {len(self.point.in_slots)} consumers"


class FunctionalGEMM(nn.Module):
    """A GEMM called as a function with a parameter (or a fixed view of one, such as a slice of
    ``nn.MultiheadAttention``'s packed ``in_proj_weight``) as its weight: ``F.linear``, ``F.conv*``,
    ``x @ W``. Algorithm 4 as for a layer (:class:`ScaledGEMM`): the weight and bias come in as graph
    values, so the parameters keep their owners and names, and the weight's gradient flows back through
    whatever view or tie made it. On reuse passes in emulated FP16 it is a fused C++ node as a layer is
    (the plan's constants); recompute passes run the Python nodes (``fusable()`` is False: its parameter
    may also be used elsewhere, by a :class:`ParamUnscaleModule` that reads the alphas in Python)."""

    pad_mode = "zeros"

    def __init__(self, state: AdaptiveState, spec: dict[str, Any], name: str) -> None:
        super().__init__()
        object.__setattr__(self, "state", state)
        self.spec = spec
        self.name = name
        self._fused_spec: Any = None  # the C++ GEMM description, made on first use (False: unsupported)

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, point_index: int
    ) -> torch.Tensor:
        state = self.state
        # (a transposed view, from ``x @ W``, stays in Python: the C++ rounding takes contiguous tensors)
        if state.fused_mode == "reuse" and torch.is_grad_enabled() and fused.enabled() and contiguous(weight):
            if self._fused_spec is None:
                self._fused_spec = fused.gemm_spec(self.spec) or False
            y = fused_gemm(state, x, weight, bias, self._fused_spec, point_index)
            if y is not None:
                return y
        point = self.state.gemms[point_index]
        y = ScaledGEMM.apply(x, weight, bias, point, self.state, self.spec, torch.is_grad_enabled())
        return GradRound.wrap(y, point, self.state)

    def fusable(self) -> bool:
        return False

    def extra_repr(self) -> str:
        return f"{self.name}: {self.spec['kind']} with a parameter weight, adaptive loss scaling"


class ParamUnscaleModule(nn.Module):
    """A non-GEMM use of a GEMM's parameter (``F.embedding(idx, wte.weight)`` beside
    ``F.linear(h, wte.weight)``): :class:`ParamUnscale` divides this use's gradient by its own alpha."""

    def __init__(self, point: UnscalePoint, state: AdaptiveState) -> None:
        super().__init__()
        object.__setattr__(self, "point", point)
        object.__setattr__(self, "state", state)

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return ParamUnscale.apply(p, self.point, self.state)

    def fusable(self) -> bool:
        return False

    def extra_repr(self) -> str:
        return f"{self.point.name}, unscaled by its own alpha"


class UnscaledParams(nn.Module):
    """A module (``nn.Embedding``) holding a parameter that a GEMM point also multiplies by (tied input and
    output embeddings): it runs unchanged (``torch.func.functional_call``) with that parameter behind a
    :class:`ParamUnscale` per call, so each call's contribution to the gradient is unscaled by its own
    alpha. Registers the wrapped module's own parameters, buffers and children under the same names, so
    ``state_dict()`` keys do not change. Cost: the swap of the parameter per call (tens of microseconds)."""

    def __init__(self, module: nn.Module, shared: list[str], state: AdaptiveState) -> None:
        super().__init__()
        for name, p in module.named_parameters(recurse=False):
            self.register_parameter(name, p)
        persistent = set(getattr(module, "_non_persistent_buffers_set", ()))
        for name, b in module.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in persistent)
        for name, child in module.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "module", module)  # not a submodule: its tensors are registered above
        object.__setattr__(self, "state", state)
        self.shared = shared
        self.calls: list[list[UnscalePoint]] = []  # per call of the module, one point per shared parameter

    def forward(self, *args: Any, _adaloss_call: int = 0, **kwargs: Any) -> Any:
        swapped = {
            name: ParamUnscale.apply(self.module.get_parameter(name), point, self.state)
            for name, point in zip(self.shared, self.calls[_adaloss_call], strict=True)
        }
        return torch.func.functional_call(self.module, swapped, args, kwargs)

    def fusable(self) -> bool:
        return False

    def extra_repr(self) -> str:
        return f"{type(self.module).__name__}, {', '.join(self.shared)} unscaled per call"


def _layer_spec(layer: nn.Module, path: str) -> dict[str, Any]:
    if isinstance(layer, nn.Linear):
        return {"kind": "linear"}
    padding = layer.padding if layer.padding_mode == "zeros" else 0
    transposed = isinstance(layer, _CONV_T)
    return _conv_spec(
        f"layer '{path}'",
        transposed,
        tuple(layer.kernel_size),
        layer.stride,
        padding,
        layer.dilation,
        layer.groups,
        layer.output_padding if transposed else 0,
    )


def _conv_spec(
    where: str,
    transposed: bool,
    kernel: tuple[int, ...],
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: int,
    output_padding: Any,
) -> dict[str, Any]:
    """The description ScaledGEMM takes of a convolution (of a module or of an ``F.conv*`` call)."""
    dims = len(kernel)

    def tup(v: Any) -> tuple[int, ...]:
        return tuple(int(i) for i in v) if isinstance(v, (tuple, list)) else (int(v),) * dims

    dilation = tup(dilation)
    if isinstance(padding, str):
        if padding == "valid":
            padding = (0,) * dims
        else:  # "same"
            total = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
            if any(t % 2 for t in total):
                raise AdaptiveTransformError(
                    f"{where} uses padding='same' with an even kernel (asymmetric padding), which the "
                    "adaptive scaler does not support: give explicit integer padding"
                )
            padding = tuple(t // 2 for t in total)
    spec = {
        "kind": "conv_transpose" if transposed else "conv",
        "dims": dims,
        "stride": tup(stride),
        "padding": tup(padding),
        "dilation": dilation,
        "groups": int(groups),
        "transposed": transposed,
        "output_padding": tup(output_padding),
    }
    # the arguments aten.convolution_backward takes after (grad, input, weight, bias_sizes), in its order
    spec["backward_args"] = (
        spec["stride"],
        spec["padding"],
        spec["dilation"],
        spec["transposed"],
        spec["output_padding"],
        spec["groups"],
    )
    return spec


def _is_nondiff_use(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` reads only metadata (shape, dtype, ...) of ``node``: no gradient flows through it."""
    if user.op == "call_method" and user.target in _NONDIFF_METHODS:
        return True
    if user.op == "call_function":
        if user.target is getattr and len(user.args) > 1 and user.args[1] in _NONDIFF_ATTRS:
            return True
        if user.target in (len, isinstance, torch.numel):
            return True
    return False


def _diff_users(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if not _is_nondiff_use(u, node)]


def _is_metadata(node: fx.Node, cache: dict[fx.Node, bool]) -> bool:
    """Whether a node's value is metadata (an int from ``x.size(0)``, arithmetic on such ints, ...)."""
    if node in cache:
        return cache[node]
    result = False
    if node.op == "call_method" and node.target in _NONDIFF_METHODS:
        result = True
    elif node.op == "call_function":
        if node.target is getattr and len(node.args) > 1 and node.args[1] in _NONDIFF_ATTRS:
            result = True
        elif node.target in (len, torch.numel):
            result = True
        elif getattr(node.target, "__module__", None) in ("_operator", "operator"):
            parents = [a for a in node.args if isinstance(a, fx.Node)]
            result = bool(parents) and all(_is_metadata(p, cache) for p in parents)
    cache[node] = result
    return result


def _is_container(node: fx.Node) -> bool:
    users = _diff_users(node)
    return bool(users) and all(u.op == "call_function" and u.target is operator.getitem for u in users)


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, module)


def attach_adaptive(model: nn.Module, state: AdaptiveState, product_betas: bool = True) -> fx.GraphModule:
    """Trace ``model`` and return the rewritten module (sharing ``model``'s parameters and buffers).

    ``product_betas``: activation-by-activation products and attention calls get a beta of their own
    (:class:`~adaloss.adaptive.ops.ScaledProduct`); without, alpha passes through them unchanged (and a
    model whose GEMMs all have fused forms keeps the fused C++ nodes).
    """
    tracer = AdaptiveTracer()
    try:
        graph = tracer.trace(model)
    except AttentionTransformError as exc:
        raise AdaptiveTransformError(str(exc)) from exc
    except Exception as exc:  # fx raises several types; the message names the construct
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AdaptiveTransformError(
            f"the adaptive scaler cannot rewrite {type(model).__name__}: torch.fx could not trace it "
            f"({type(exc).__name__}: {first_line}). Make the untraceable part a leaf module or remove "
            "control flow that depends on tensor values"
        ) from exc
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    graph = gm.graph
    modules = dict(gm.named_modules())
    branch_nodes: dict[fx.Node, BranchPoint] = {}
    gemm_nodes: dict[fx.Node, Any] = {}
    weight_args: dict[fx.Node, set[fx.Node]] = {}  # GEMM node -> its weight and bias argument nodes
    leaf_nodes: dict[fx.Node, LeafGEMMs] = {}
    unscale_nodes: dict[fx.Node, UnscalePoint] = {}  # ParamUnscale nodes on uses of GEMM parameters
    tied_nodes: dict[fx.Node, list[UnscalePoint]] = {}  # calls of modules holding a GEMM parameter
    calls: Counter[str] = Counter()  # one name counter for every kind of GEMM point

    def point_name(base: str) -> str:
        k = calls[base]
        calls[base] += 1
        return base if k == 0 else f"{base}#{k}"

    # 1. GEMM points, in network order ---------------------------------------------------------------
    wrappers: dict[str, AdaptiveGEMM] = {}
    point_modules: list[nn.Module] = []
    gemm_params: dict[int, nn.Parameter] = {}  # every parameter a GEMM point multiplies by (or adds)
    weight_params: dict[int, nn.Parameter] = {}  # the parameters under GEMM weights
    chains: set[fx.Node] = set()  # nodes that hold a parameter (or a fixed view of one) a GEMM uses
    products: list[fx.Node] = []

    def own(w_chain: list[fx.Node], b_chain: list[fx.Node]) -> None:
        """Record the parameters behind a GEMM's weight and bias chains."""
        chains.update(w_chain)
        chains.update(b_chain)
        for chain in (w_chain, b_chain):
            if chain:
                p = _get_attr(gm, chain[0].target)
                gemm_params[id(p)] = p
        root = _get_attr(gm, w_chain[0].target)
        weight_params[id(root)] = root

    def replace(node: fx.Node, target: str, module: nn.Module, args: tuple, kwargs: dict) -> fx.Node:
        gm.add_submodule(target, module)
        with graph.inserting_before(node):
            new = graph.call_module(target, args, kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        return new

    for node in list(graph.nodes):
        # a. a call of a conv/linear module
        if node.op == "call_module" and isinstance(modules.get(node.target), GEMM_TYPES):
            layer = modules[node.target]
            if node.kwargs or len(node.args) != 1:
                raise AdaptiveTransformError(
                    f"layer '{node.target}' is called with extra arguments ({type(layer).__name__} with "
                    "output_size?), which the adaptive scaler does not support"
                )
            if node.target not in wrappers:
                wrappers[node.target] = AdaptiveGEMM(layer, state, node.target)
                point_modules.append(wrappers[node.target])
                for p in wrappers[node.target].parameters():
                    gemm_params[id(p)] = p
                weight_params[id(layer.weight)] = layer.weight
            wrapper = wrappers[node.target]
            fan_in = backward_fan_in(wrapper.spec["kind"], layer.weight.shape, wrapper.spec.get("groups", 1))
            point = state.add_gemm(point_name(node.target), fan_in, layer.weight.numel())
            node.args = (node.args[0], point.index)
            gemm_nodes[node] = point
            weight_args[node] = set()
            continue
        # b. F.linear / F.conv* / x @ W whose weight is a parameter or a fixed view of one
        call = _functional_gemm(gm, node)
        if call is not None:
            x, w, b, spec, value, transpose = call
            w_chain = _param_chain(gm, w)
            b_chain = _param_chain(gm, b) if b is not None else []
            if transpose:  # x @ W computes F.linear(x, W^T)
                with graph.inserting_before(node):
                    w = graph.call_method("t", (w,))
                w_chain = [*w_chain, w]
                value = value.t()
            fan_in = backward_fan_in(spec["kind"], value.shape, spec.get("groups", 1))
            point = state.add_gemm(point_name(_weight_name(w_chain[0].target)), fan_in, value.numel())
            module = FunctionalGEMM(state, spec, point.name)
            new = replace(node, f"_adaloss_gemm_{point.index}", module, (x, w, b, point.index), {})
            gemm_nodes[new] = point
            weight_args[new] = {w} if b is None else {w, b}
            own(w_chain, b_chain)
            point_modules.append(module)
            continue
        # c. a call of a function fx keeps as a leaf that holds GEMMs (Swin's attention)
        if node.op == "call_function" and node.target in LEAF_GEMMS:
            entry = LEAF_GEMMS[node.target]
            bound = inspect.signature(node.target).bind(*node.args, **node.kwargs).arguments
            points = []
            for w_name, b_name, _ in entry["gemms"]:
                w, b = bound.get(w_name), bound.get(b_name)
                w_chain = _param_chain(gm, w)
                b_chain = _param_chain(gm, b) if b is not None else []
                if not w_chain or b_chain is None:
                    raise AdaptiveTransformError(
                        f"{node.target.__qualname__} at '{_module_path(node)}' is called with {w_name} or "
                        f"{b_name} not a parameter; the adaptive scaler needs parameters there"
                    )
                value = _chain_value(gm, w)
                name = point_name(_weight_name(w_chain[0].target))
                points.append(
                    state.add_gemm(name, backward_fan_in("linear", value.shape), value.numel()).index
                )
                own(w_chain, b_chain)
            leaf = LeafGEMMs(node.target, entry, points, state, _module_path(node) or node.name)
            new = replace(node, f"_adaloss_leaf_{len(leaf_nodes)}", leaf, node.args, node.kwargs)
            leaf_nodes[new] = leaf
            point_modules.append(leaf)
            continue
        # d. an activation-by-activation product or an attention call: Algorithm 4 with the operands
        module = _product_module(node, state, tracer, point_name, product_betas)
        if module is not None:
            args = node.args[1:] if node.op == "call_function" and node.target is mha_core else node.args
            new = replace(node, f"_adaloss_product_{len(products)}", module, args, node.kwargs)
            products.append(new)
            if module.point_index is not None:
                gemm_nodes[new] = state.gemms[module.point_index]
                weight_args[new] = set()
                point_modules.append(module)
    for path, wrapper in wrappers.items():
        _set_submodule(gm, path, wrapper)

    # 2. Other uses of GEMM parameters (a token embedding tied to the output projection): unscaled in the
    #    backward pass by their own alpha, as each GEMM call's contribution is --------------------------
    for node in list(graph.nodes):
        holds = node in chains or (node.op == "get_attr" and id(_get_attr(gm, node.target)) in gemm_params)
        if not holds:
            continue
        for user in list(node.users):
            if user in chains or node in weight_args.get(user, ()) or _is_nondiff_use(user, node):
                continue
            if user in leaf_nodes and _leaf_param_use(user, leaf_nodes[user], node):
                continue
            name = _chain_root(node).target
            point = state.add_unscale(point_name(name))
            module = ParamUnscaleModule(point, state)
            target = f"_adaloss_unscale_{point.index}"
            gm.add_submodule(target, module)
            with graph.inserting_before(user):
                new = graph.call_module(target, (node,))
            user.replace_input_with(node, new)
            unscale_nodes[new] = point
            point_modules.append(module)
    tied_modules: dict[str, UnscaledParams] = {}
    for node in list(graph.nodes):
        if node.op != "call_module" or node in gemm_nodes or node.target.startswith("_adaloss_"):
            continue
        mod = gm.get_submodule(node.target)
        shared = [n for n, p in mod.named_parameters() if id(p) in gemm_params]
        if not shared:
            continue
        if node.target not in tied_modules:
            tied_modules[node.target] = UnscaledParams(mod, shared, state)
            _set_submodule(gm, node.target, tied_modules[node.target])
            point_modules.append(tied_modules[node.target])
        tied = tied_modules[node.target]
        points = [state.add_unscale(point_name(f"{node.target}.{n}")) for n in shared]
        node.kwargs = {**node.kwargs, "_adaloss_call": len(tied.calls)}
        tied.calls.append(points)
        tied_nodes[node] = points

    # 3. Branch points at values with several consumers ---------------------------------------------
    metadata: dict[fx.Node, bool] = {}
    for node in list(graph.nodes):
        if node.op == "output" or _is_metadata(node, metadata) or _is_container(node):
            continue
        if node in chains:
            continue  # a GEMM weight: each use's gradient is unscaled in the backward pass
        if node.op == "get_attr":
            value = _get_attr(gm, node.target)
            if not isinstance(value, nn.Parameter) or id(value) in gemm_params:
                continue  # buffers and constants carry no gradient; GEMM parameters are unscaled per use
        users = _diff_users(node)
        if len(users) < 2:
            continue
        point = state.add_branch(node.name)
        branch_nodes.update(_insert_branch(gm, graph, point, state, [node] * len(users), users, node))

    # An op that writes into a point's output or a branch alias (``nn.ReLU(inplace=True)`` right after a
    # conv, ``x += y``) must not write into a view one of our autograd nodes returned: it gets a copy then.
    aliases = [g for b in branch_nodes for g in b.users]
    for node in [*gemm_nodes, *leaf_nodes, *aliases]:
        for user in list(node.users):
            if _mutates_first_argument(gm, user, node):
                with graph.inserting_before(user):
                    copy = graph.call_function(writable, (node,))
                user.replace_input_with(node, copy)

    # 4. Slots, from the outputs back to the inputs --------------------------------------------------
    slot: dict[fx.Node, int | None] = {}

    def user_slot(user: fx.Node, node: fx.Node) -> int | None:
        if user.op == "output":
            return 0
        if user in gemm_nodes:
            return None if node in weight_args[user] else gemm_nodes[user].out_slot
        if user in leaf_nodes:
            return _leaf_arg_slot(user, node, leaf_nodes[user], state)
        if user in branch_nodes:
            return branch_nodes[user].out_slot
        if user in unscale_nodes:
            return None  # the parameter behind ParamUnscale: its gradient arrives unscaled
        return slot.get(user)

    for node in reversed(list(graph.nodes)):
        if node.op == "output" or _is_metadata(node, metadata):
            continue  # sizes and shapes carry no gradient (and may feed ops on both sides of a GEMM)
        if node in branch_nodes:
            point = branch_nodes[node]
            getitems = sorted(node.users, key=lambda g: g.args[1])
            point.in_slots = [slot.get(g) if slot.get(g) is not None else 0 for g in getitems]
            continue
        users = _diff_users(node)
        if _is_container(node) and len(users) > 1:
            slots = {slot.get(g) for g in users} - {None}
            if len(slots) > 1:  # outputs of one op reach points with different alphas: rescale them
                prev = node  # the outputs right after the op, so the branch precedes all their consumers
                for g in sorted(users, key=lambda g: _position(graph, g)):
                    prev.append(g)
                    prev = g
                point = state.add_branch(f"{node.name}.outputs")
                inserted = _insert_branch(gm, graph, point, state, users, None, None)
                point.in_slots = [slot[g] for g in users]
                for g in users:
                    slot[g] = point.out_slot
                branch_nodes.update(inserted)
                slot[node] = point.out_slot
            else:
                slot[node] = slots.pop() if slots else None
            continue
        slots = {user_slot(u, node) for u in users} - {None}
        if len(slots) > 1:
            raise AdaptiveTransformError(
                f"internal error: value '{node.name}' has gradients with different scales but no branch point"
            )
        slot[node] = slots.pop() if slots else None
    for node, point in gemm_nodes.items():
        point.in_slot = slot.get(node) if slot.get(node) is not None else 0
    for node, leaf in leaf_nodes.items():
        after = slot.get(node) if slot.get(node) is not None else 0
        for k in reversed(leaf.points):  # the last GEMM receives the call's output gradient
            state.gemms[k].in_slot = after
            after = state.gemms[k].out_slot
    for node, points in [*((n, [p]) for n, p in unscale_nodes.items()), *tied_nodes.items()]:
        for point in points:
            point.in_slot = slot.get(node) if slot.get(node) is not None else 0
    # GEMM calls whose input is directly one alias of a shared-value branch (and nothing else reads that
    # alias): their input gradient reaches the branch's backward unshared, so it may accumulate into it.
    for node, point in gemm_nodes.items():
        src = node.args[0]
        if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target is operator.getitem):
            continue
        branch = src.args[0]
        if branch not in branch_nodes or len(src.users) != 1:
            continue
        if getattr(_get_attr(gm, node.target), "pad_mode", None) != "zeros":
            continue  # a product (no ScaledGEMM), or F.pad sits between the alias and the GEMM
        point.feeds = (branch_nodes[branch].index, src.args[1])

    # Parameters of non-GEMM ops are scaled by the alpha of their op's output gradient.
    param_slot: dict[int, tuple[str, int]] = {}
    for node in graph.nodes:
        params: list[tuple[str, nn.Parameter]] = []
        if node.op == "call_module" and node not in gemm_nodes and node not in branch_nodes:
            mod = gm.get_submodule(node.target)
            params = [(f"{node.target}.{n}", p) for n, p in mod.named_parameters()]
        elif node.op == "get_attr":
            value = _get_attr(gm, node.target)
            if isinstance(value, nn.Parameter):
                params = [(node.target, value)]
        s = slot.get(node)
        for name, p in params:
            if id(p) in gemm_params or s is None:
                continue  # GEMM parameters are unscaled in the backward pass, use by use
            if id(p) in param_slot and param_slot[id(p)][1] != s:
                raise AdaptiveTransformError(
                    f"parameter '{name}' is used by a module called more than once at points with different "
                    "loss scales; the adaptive scaler supports repeated calls of conv/linear layers only"
                )
            param_slot[id(p)] = (name, s)
    state.param_slots = {name: s for name, s in param_slot.values()}
    state.param_slot_by_id = {pid: s for pid, (_, s) in param_slot.items()}
    state.unscaled_params = list(gemm_params.values())
    state.gemm_weight_params = list(weight_params.values())
    state.point_modules = point_modules

    graph.lint()
    gm.recompile()
    return gm


_CONV_FUNCTIONS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
_CONV_T_FUNCTIONS = {F.conv_transpose1d: 1, F.conv_transpose2d: 2, F.conv_transpose3d: 3}
_MATMUL_FUNCTIONS = {torch.matmul, operator.matmul, torch.mm}
_MATMUL_METHODS = {"matmul", "mm", "__matmul__"}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_T_ARGS = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
# ops that take a fixed view of a parameter (with constant arguments): a GEMM weight may come through them
_VIEW_METHODS = {
    "t",
    "transpose",
    "permute",
    "view",
    "reshape",
    "split",
    "chunk",
    "narrow",
    "contiguous",
    "unflatten",
    "flatten",
    "squeeze",
    "unsqueeze",
}
_VIEW_FUNCTIONS = {
    torch.t,
    torch.transpose,
    torch.permute,
    torch.reshape,
    torch.split,
    torch.chunk,
    torch.narrow,
    torch.flatten,
    torch.squeeze,
    torch.unsqueeze,
}


def writable(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy of it if it is a view (what an identity autograd node returns, or a linear layer's
    output on a 3-D input): the input of an op that writes in place. Costs a copy only for views."""
    return x.clone() if x._base is not None else x


_INPLACE_OPERATORS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imod,
    operator.ipow,
    operator.imatmul,
    operator.iand,
    operator.ior,
    operator.ixor,
}


def _mutates_first_argument(gm: fx.GraphModule, user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` writes into ``node``, its first argument: a module built with ``inplace=True``, a
    method or function named with a trailing underscore (``relu_``), an augmented assignment, or a call
    with ``inplace=True``."""
    if not user.args or user.args[0] is not node:
        return False
    if user.op == "call_module":
        return getattr(gm.get_submodule(user.target), "inplace", False) is True
    if user.op == "call_method":
        return user.target.endswith("_") and not user.target.startswith("_")
    if user.op == "call_function":
        if user.target in _INPLACE_OPERATORS or user.kwargs.get("inplace") is True:
            return True
        name = getattr(user.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_")
    return False


def _bind(node: fx.Node, names: tuple[str, ...], start: int = 0) -> dict[str, Any] | None:
    """``node``'s arguments by name (positional from ``names[start:]``), or None if they do not fit."""
    if len(node.args) > len(names) - start or any(k not in names for k in node.kwargs):
        return None
    bound = dict(zip(names[start:], node.args, strict=False))
    if any(k in bound for k in node.kwargs):
        return None
    bound.update(node.kwargs)
    return bound


def _has_node(value: Any) -> bool:
    found = []
    fx.node.map_arg(value, found.append)
    return bool(found)


def _param_chain(gm: fx.GraphModule, node: Any) -> list[fx.Node] | None:
    """The nodes from a parameter's ``get_attr`` to ``node`` if ``node`` is the parameter or a fixed view of
    it (slices, transposes, reshapes, splits with constant arguments); None otherwise."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr":
        return [node] if isinstance(_get_attr(gm, node.target), nn.Parameter) else None
    if not node.args:
        return None
    if node.op == "call_function" and node.target is operator.getitem:
        pass
    elif node.op == "call_function" and node.target is getattr:
        if node.args[1] not in ("T", "mT"):
            return None
    elif not (
        (node.op == "call_method" and node.target in _VIEW_METHODS)
        or (node.op == "call_function" and node.target in _VIEW_FUNCTIONS)
    ):
        return None
    if _has_node((node.args[1:], node.kwargs)):
        return None
    chain = _param_chain(gm, node.args[0])
    return None if chain is None else [*chain, node]


def _chain_value(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    """The (detached) tensor a :func:`_param_chain` node holds, computed now, for its shape."""
    if node.op == "get_attr":
        return _get_attr(gm, node.target).detach()
    src = _chain_value(gm, node.args[0])
    with torch.no_grad():
        if node.op == "call_method":
            return getattr(src, node.target)(*node.args[1:], **node.kwargs)
        return node.target(src, *node.args[1:], **node.kwargs)


def _chain_root(node: fx.Node) -> fx.Node:
    while node.op != "get_attr":
        node = node.args[0]
    return node


def _weight_name(target: str) -> str:
    """A GEMM point's name from its weight's: ``blocks.0.attn.qkv.weight`` -> ``blocks.0.attn.qkv``,
    ``self_attn.in_proj_weight`` -> ``self_attn.in_proj``."""
    for suffix in (".weight", "_weight"):
        if target.endswith(suffix):
            return target[: -len(suffix)]
    return target


def _module_path(node: fx.Node) -> str:
    """The path of the module whose forward made ``node`` ("" for the root)."""
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else ""


def _functional_gemm(gm: fx.GraphModule, node: fx.Node) -> tuple | None:
    """``(input, weight node, bias node, spec, weight value, transpose)`` if ``node`` is ``F.linear``,
    ``F.conv*`` or ``x @ W`` / ``torch.mm(x, W)`` whose weight (and bias) is a parameter or a fixed view of
    one and whose input is not; ``transpose``: the weight is ``W`` of ``x @ W`` (``F.linear`` takes W^T)."""
    transpose = False
    if node.op == "call_function" and node.target is F.linear:
        bound = _bind(node, ("input", "weight", "bias"))
        spec_of = lambda value: {"kind": "linear"}  # noqa: E731
    elif node.op == "call_function" and (node.target in _CONV_FUNCTIONS or node.target in _CONV_T_FUNCTIONS):
        transposed = node.target in _CONV_T_FUNCTIONS
        bound = _bind(node, _CONV_T_ARGS if transposed else _CONV_ARGS)
        if bound is None:
            return None
        options = {k: v for k, v in bound.items() if k not in ("input", "weight", "bias")}
        if _has_node(options):
            raise AdaptiveTransformError(
                f"{node.target.__name__} at '{_module_path(node) or node.name}' gets its stride, padding or "
                "groups from a tensor; the adaptive scaler needs constants there"
            )

        def spec_of(value: torch.Tensor, options=options, transposed=transposed) -> dict[str, Any]:
            return _conv_spec(
                f"{node.target.__name__} at '{_module_path(node) or node.name}'",
                transposed,
                tuple(value.shape[2:]),
                options.get("stride", 1),
                options.get("padding", 0),
                options.get("dilation", 1),
                options.get("groups", 1),
                options.get("output_padding", 0),
            )
    elif (node.op == "call_function" and node.target in _MATMUL_FUNCTIONS) or (
        node.op == "call_method" and node.target in _MATMUL_METHODS
    ):
        bound = _bind(node, ("input", "weight"))
        transpose = True
        spec_of = lambda value: {"kind": "linear"}  # noqa: E731
    else:
        return None
    if bound is None or "weight" not in bound:
        return None
    x, w, b = bound.get("input"), bound["weight"], bound.get("bias")
    if not isinstance(x, fx.Node) or _param_chain(gm, x) is not None or _param_chain(gm, w) is None:
        return None
    if b is not None and _param_chain(gm, b) is None:
        return None  # an activation bias: its gradient must keep its alpha, so not a GEMM point here
    value = _chain_value(gm, w)
    if transpose and value.dim() != 2:
        return None
    if not transpose and node.target is F.linear and value.dim() != 2:
        return None
    return x, w, b, spec_of(value), value, transpose


def _product_module(
    node: fx.Node, state: AdaptiveState, tracer: AdaptiveTracer, point_name: Any, scaled: bool
) -> nn.Module | None:
    """The module, with its scaling point, for an attention call or an activation-by-activation product
    (None if ``node`` is neither). Names: ``<module path>.<op>`` (``#k`` for the k-th more), and for
    attention ``<module path>``, whose products telemetry counts as ``<path>.scores`` and
    ``<path>.values``."""
    path = _module_path(node)

    def point(name: str) -> tuple[str, int | None]:
        name = point_name(name)
        return name, (state.add_gemm(name, kind="product").index if scaled else None)

    if node.op == "call_function" and node.target is mha_core:
        config = tracer.cores[node.args[0]]
        name, index = point(config["path"] or "attention")
        return AttentionCore("mha", name, state, index, config)
    if node.op == "call_function" and node.target is F.scaled_dot_product_attention:
        name, index = point(path or "attention")
        return AttentionCore("sdpa", name, state, index)
    if node.op == "call_function" and node.target in PRODUCT_FUNCTIONS:
        fn, label = node.target, PRODUCT_FUNCTIONS[node.target]
    elif node.op == "call_method" and node.target in PRODUCT_METHODS:
        fn = PRODUCT_METHODS[node.target]
        label = fn.__name__
    else:
        return None
    base = f"{path}.{label}" if path else label
    if label == "einsum":  # no beta of its own: alpha passes through
        return Product(fn, label, point_name(base), state, None)
    name, index = point(base)
    return Product(fn, label, name, state, index)


def _leaf_names(user: fx.Node, node: fx.Node, leaf: LeafGEMMs) -> list[str]:
    bound = leaf.signature.bind(*user.args, **user.kwargs).arguments
    return [name for name, value in bound.items() if value is node]


def _leaf_param_use(user: fx.Node, leaf: LeafGEMMs, node: fx.Node) -> bool:
    """Whether ``node`` is a weight or bias argument of the leaf call ``user``."""
    params = {n for w, b, _ in leaf.entry["gemms"] for n in (w, b)}
    return bool(set(_leaf_names(user, node, leaf)) & params)


def _leaf_arg_slot(user: fx.Node, node: fx.Node, leaf: LeafGEMMs, state: AdaptiveState) -> int | None:
    """The slot whose alpha the gradient of ``node`` gets from the leaf call ``user``: none for weights and
    biases (unscaled), else the slot of the GEMM after which that argument enters the computation."""
    params = {n for w, b, _ in leaf.entry["gemms"] for n in (w, b)}
    slots = set()
    for name in _leaf_names(user, node, leaf):
        if name in params:
            slots.add(None)
        elif name in leaf.entry["enters_after"]:
            slots.add(state.gemms[leaf.points[leaf.entry["enters_after"][name]]].out_slot)
        else:
            raise AdaptiveTransformError(
                f"{leaf.name}: argument '{name}' of {leaf.fn.__qualname__} carries a gradient the adaptive "
                "scaler has no scale for (LEAF_GEMMS lists where each differentiable argument enters)"
            )
    if len(slots) > 1:
        raise AdaptiveTransformError(
            f"{leaf.name}: one value is passed to {leaf.fn.__qualname__} as a weight and as an activation"
        )
    return slots.pop() if slots else None


def _get_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _insert_branch(
    gm: fx.GraphModule,
    graph: fx.Graph,
    point: BranchPoint,
    state: AdaptiveState,
    inputs: list[fx.Node],
    consumers: list[fx.Node] | None,
    shared: fx.Node | None,
) -> dict[fx.Node, BranchPoint]:
    """Insert a BranchModule over ``inputs`` and rewire consumers to its outputs.

    With ``shared`` (one value, several consumers): consumer i reads output i instead of ``shared``.
    Without (several outputs of one op): every user of ``inputs[i]`` other than the branch reads output i.
    """
    name = f"_adaloss_branch_{point.index}"
    gm.add_submodule(name, BranchModule(point, state))
    anchor = max(inputs, key=lambda n: _position(graph, n))
    with graph.inserting_after(anchor):
        branch = graph.call_module(name, args=tuple(inputs))
    outs = []
    prev = branch
    for i in range(len(inputs)):
        with graph.inserting_after(prev):
            prev = graph.call_function(operator.getitem, (branch, i))
        outs.append(prev)
    if shared is not None:
        for consumer, out in zip(consumers, outs, strict=True):
            consumer.replace_input_with(shared, out)
    else:
        for original, out in zip(inputs, outs, strict=True):
            for user in list(original.users):
                if user is not branch:
                    user.replace_input_with(original, out)
    return {branch: point}


def _position(graph: fx.Graph, node: fx.Node) -> int:
    for i, n in enumerate(graph.nodes):
        if n is node:
            return i
    raise ValueError(node)
