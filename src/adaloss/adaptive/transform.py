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
import math
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
from adaloss.adaptive.capture import ATEN_METADATA, CapturedForward, CaptureError, capture, is_guard
from adaloss.adaptive.gemms import WEIGHT_GEMM_METHODS, GemmForm, weight_gemm
from adaloss.adaptive.mutation import (
    FIXED_VIEW_FUNCTIONS,
    FIXED_VIEW_METHODS,
    MutationError,
    aten_view,
    needs_copy,
    redirect_mutations,
    writable,
)
from adaloss.adaptive.ops import (
    AdaptiveState,
    BranchPoint,
    GradRound,
    ParamUnscale,
    Rescale,
    ScaledGEMM,
    UnscalePoint,
)
from adaloss.adaptive.rules import backward_fan_in
from adaloss.adaptive.weights import WeightSources, computed_weight_params, kept_buffers, weight_name
from adaloss.errors import ConfigError

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
    identities do not change. ``forward(x, point_index)``: the point index tells which call of the layer
    this is when a module is used several times. A call that carries the parameters of the module it feeds
    (``GemmPoint.carried``; ``carriers[point_index]`` is that module and the names of its parameters)
    returns ``(y, *their views)``, and that module uses the views.
    """

    def __init__(self, layer: nn.Module, state: AdaptiveState, path: str) -> None:
        super().__init__()
        computed = computed_weight_params(layer)
        if computed is None:
            self.weight = layer.weight
            self.register_parameter("bias", layer.bias)
            self.sources = [layer.weight]
        else:  # the layer's own tensors and children under their names: state_dict() keys do not change
            _adopt(self, layer)
            self.sources = [p for _, p in computed]
        object.__setattr__(self, "layer", layer)  # not a submodule: its parameters are already ours
        object.__setattr__(self, "state", state)
        self.computed = computed is not None
        with kept_buffers(layer):
            self.weight_shape = tuple(self._weight(None).shape)
        self.layer_type = type(layer).__name__
        self.spec = _layer_spec(layer, path)
        self.pad_mode = getattr(layer, "padding_mode", "zeros")
        # not submodules: the modules are registered where they are called
        object.__setattr__(self, "carriers", {})

    def _weight(self, x: torch.Tensor | None) -> torch.Tensor:
        """The weight the layer multiplies: its parameter, or the tensor its parametrization computes (an
        old-style ``weight_norm`` / ``spectral_norm`` hook run first, as the layer's call would)."""
        if not self.computed:
            return self._parameters["weight"]
        layer = self.layer
        for hook in layer._forward_pre_hooks.values():
            if getattr(hook, "name", None) == "weight" and hasattr(hook, "compute_weight"):
                hook(layer, (x,))
        return layer.weight

    def forward(self, x: torch.Tensor, point_index: int) -> Any:
        if self.pad_mode != "zeros":
            x = F.pad(x, self.layer._reversed_padding_repeated_twice, mode=self.pad_mode)
        state, params = self.state, self._parameters
        point = state.gemms[point_index]
        w, b, grad = self._weight(x), params.get("bias"), torch.is_grad_enabled()
        if not point.carried:
            return GradRound.wrap(ScaledGEMM.apply(x, w, b, point, state, self.spec, grad), point)
        owner, names = self.carriers[point_index]
        carried = [owner._parameters[name] for name in names]
        out = ScaledGEMM.apply(x, w, b, point, state, self.spec, grad, *carried)
        return (GradRound.wrap(out[0], point), *out[1:])

    def extra_repr(self) -> str:
        return f"{self.layer_type}({self.layer.extra_repr()}), adaptive loss scaling"


class BranchModule(nn.Module):
    """Identity with one alias per consumer; its backward is Algorithm 5 (see :class:`Rescale`)."""

    def __init__(self, point: BranchPoint, state: AdaptiveState) -> None:
        super().__init__()
        object.__setattr__(self, "point", point)
        object.__setattr__(self, "state", state)

    def forward(self, *xs: Any) -> tuple[Any, ...]:
        is_tensor = [isinstance(x, torch.Tensor) for x in xs]
        if all(is_tensor):
            if len(xs) > 1 and all(x is xs[0] for x in xs):  # one tensor, n consumers: passed once
                return Rescale.apply(self.point, self.state, len(xs), xs[0])
            return Rescale.apply(self.point, self.state, 1, *xs)
        # fx cannot tell a tensor from a shape or an int: a value that is not a tensor passes unchanged (in
        # Rescale's place an empty tensor that no gradient reaches, so the consumers keep their positions)
        for x, t in zip(xs, is_tensor, strict=True):
            if not t:
                _check_no_tensor_inside(x, self.point.name)
        if not any(is_tensor):
            self.point.inert = True
            return xs
        empty = torch.empty(0)
        outs = Rescale.apply(
            self.point, self.state, 1, *(x if t else empty for x, t in zip(xs, is_tensor, strict=True))
        )
        return tuple(o if t else x for o, x, t in zip(outs, xs, is_tensor, strict=True))

    def extra_repr(self) -> str:
        return f"{self.point.name}, {len(self.point.in_slots)} consumers"


def _adopt(wrapper: nn.Module, module: nn.Module) -> None:
    """Register ``module``'s own parameters (None entries too: a norm without bias), buffers and children on
    ``wrapper`` under the same names, so ``state_dict()`` keys do not change. One parameter table for both:
    what replaces a parameter in the wrapper (FSDP2's fully_shard swaps sharded and whole parameters in and
    out of the module it shards) is what the wrapped module's forward reads."""
    for name, p in module._parameters.items():
        wrapper.register_parameter(name, p)
    object.__setattr__(module, "_parameters", wrapper._parameters)
    persistent = set(getattr(module, "_non_persistent_buffers_set", ()))
    for name, b in module.named_buffers(recurse=False):
        wrapper.register_buffer(name, b, persistent=name not in persistent)
    for name, child in module.named_children():
        wrapper.add_module(name, child)


def _check_no_tensor_inside(value: Any, name: str) -> None:
    """A container used by several ops may hold shapes and ints, not tensors that carry gradients: their
    gradients would meet without Algorithm 5."""
    leaves = torch.utils._pytree.tree_leaves(value)
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
        raise AdaptiveTransformError(
            f"adaptive loss scaling: '{name}' is a {type(value).__name__} of tensors that several ops read "
            "whole; the adaptive scaler needs each tensor's uses visible: unpack it once (a, b = value) "
            "and pass the tensors on"
        )


class FunctionalGEMM(nn.Module):
    """A GEMM called as a function with a parameter (or a fixed view of one, such as a slice of
    ``nn.MultiheadAttention``'s packed ``in_proj_weight``) as its weight: ``F.linear``, ``F.conv*``,
    ``x @ W``. Algorithm 4 as for a layer (:class:`ScaledGEMM`): the weight and bias come in as graph
    values, so the parameters keep their owners and names, and the weight's gradient flows back through
    whatever view or tie made it."""

    pad_mode = "zeros"

    def __init__(self, state: AdaptiveState, spec: dict[str, Any], name: str, weights: list[str]) -> None:
        super().__init__()
        object.__setattr__(self, "state", state)
        self.spec = spec
        self.name = name
        self.weights = weights  # the parameters the weight is (or is computed from), largest first

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        point_index: int,
        offs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        point = self.state.gemms[point_index]
        spec = self.spec if offs is None else {**self.spec, "offs": offs}  # a grouped GEMM's group ends
        y = ScaledGEMM.apply(x, weight, bias, point, self.state, spec, torch.is_grad_enabled())
        return GradRound.wrap(y, point)

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
        return ParamUnscale.apply((self.point,), self.state, p)[0]

    def extra_repr(self) -> str:
        return f"{self.point.name}, unscaled by its own alpha"


class UnscaledParams(nn.Module):
    """A module outside the GEMM points that holds parameters (a batch norm, an ``nn.Embedding`` whose
    weight the output projection shares): it runs unchanged with each parameter behind a
    :class:`ParamUnscale` per call, so each call's contribution to the gradient is brought to the root
    scale by its own alpha. Registers the wrapped module's own parameters, buffers and children under the
    same names, so ``state_dict()`` keys do not change. Cost: the swap of the parameter tables per call
    (a few microseconds) and one multiply per parameter gradient in the backward pass."""

    def __init__(self, module: nn.Module, shared: list[str], state: AdaptiveState) -> None:
        super().__init__()
        _adopt(self, module)
        object.__setattr__(self, "module", module)  # not a submodule: its tensors are registered above
        object.__setattr__(self, "state", state)
        self.training = module.training
        self.shared = shared
        # per shared parameter: the path of the module that owns it ("" for its own) and its name there
        self.owner_paths = [name.rpartition(".")[0] for name in shared]
        self.leaves = [name.rpartition(".")[2] for name in shared]
        self.calls: list[tuple[UnscalePoint, ...]] = []  # per call of the module: a point per parameter

    def forward(self, *args: Any, _adaloss_call: int = 0, _adaloss_views: Any = None, **kwargs: Any) -> Any:
        module = self.module
        owners = [module.get_submodule(path) if path else module for path in self.owner_paths]
        saved = [owner._parameters for owner in owners]
        views = _adaloss_views  # made by the GEMM call feeding this one (``GemmPoint.carried``), or:
        if views is None:
            params = [table[leaf] for table, leaf in zip(saved, self.leaves, strict=True)]
            views = ParamUnscale.apply(self.calls[_adaloss_call], self.state, *params)
        try:
            for owner, leaf, view in zip(owners, self.leaves, views, strict=True):
                # a copy of the owner's parameter table with this call's view in it, restored below (set
                # past nn.Module.__setattr__, whose checks cost more than the swap: the value is a dict)
                object.__setattr__(owner, "_parameters", {**owner._parameters, leaf: view})
            return module(*args, **kwargs)
        finally:
            for owner, table in zip(owners, saved, strict=True):
                object.__setattr__(owner, "_parameters", table)

    def train(self, mode: bool = True) -> UnscaledParams:
        """``nn.Module.train``, the wrapped module's own mode included: it is not a submodule, so without
        this ``model.eval()`` would leave a wrapped batch norm on batch statistics."""
        self.module.training = mode
        return super().train(mode)

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
        if user.target in (len, isinstance, torch.numel) or user.target in ATEN_METADATA:
            return True
    return is_guard(user)


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
        elif node.target in (len, torch.numel) or node.target in ATEN_METADATA:
            result = True
        elif getattr(node.target, "__module__", None) in ("_operator", "operator"):
            parents = [a for a in node.args if isinstance(a, fx.Node)]
            result = bool(parents) and all(_is_metadata(p, cache) for p in parents)
    cache[node] = result
    return result


def _carries_no_gradient(node: fx.Node) -> bool:
    """Whether a captured graph records ``node``'s value as a tensor that cannot carry a gradient (integer
    or boolean: token ids, masks). fx's symbolic trace records no values, so there it is never known."""
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex())


def _is_container(node: fx.Node) -> bool:
    users = _diff_users(node)
    return bool(users) and all(u.op == "call_function" and u.target is operator.getitem for u in users)


def _output_leaves(users: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The elements an op's outputs reach (``getitem`` nodes, through nested tuples), and every ``getitem``
    on the way, in the order they come."""
    leaves, getitems = [], []
    for g in users:
        getitems.append(g)
        if _is_container(g):
            inner_leaves, inner = _output_leaves(_diff_users(g))
            leaves.extend(inner_leaves)
            getitems.extend(inner)
        else:
            leaves.append(g)
    return leaves, getitems


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, module)


def attach_adaptive(
    model: nn.Module, state: AdaptiveState, product_betas: bool = True, example: tuple | None = None
) -> nn.Module:
    """Trace ``model`` and return the rewritten module (sharing ``model``'s parameters and buffers).

    ``product_betas``: activation-by-activation products and attention calls get a beta of their own
    (:class:`~adaloss.adaptive.ops.ScaledProduct`); without, alpha passes through them unchanged.
    ``example``: ``(args, kwargs)`` of a forward call; when fx cannot trace the model symbolically, it is
    captured with ``torch.export`` on these (:mod:`adaloss.adaptive.capture`), rewritten by the same passes,
    and ``model`` itself is returned with the rewritten graph as its ``forward``.

    The rewrite runs as named passes over the traced graph (:class:`_Rewrite`), after in-place writes are
    made visible to the ops that follow them (:func:`adaloss.adaptive.mutation.redirect_mutations`): GEMM
    points, parameter uses, branch points, slots (and the branch points of several outputs), writable
    copies, the branches' fed inputs and the carried parameters.
    """
    tracer = AdaptiveTracer()
    gm = _traced(model, tracer, example)
    rewrite = _Rewrite(gm, state, tracer)
    try:
        redirect_mutations(rewrite.gm, rewrite.untouched, keep=LEAF_GEMMS)
    except MutationError as exc:
        raise AdaptiveTransformError(str(exc)) from exc
    rewrite.gemm_points(product_betas)
    rewrite.parameter_uses()
    rewrite.branch_points()
    rewrite.slots()
    rewrite.writable_copies()
    rewrite.fed_branches()
    rewrite.carried_params()
    state.points.gemm_weights = list(rewrite.weight_params.values())
    gm.graph.lint()
    gm.recompile()
    first = next(iter(gm.parameters()), None)
    state.allocate(first.device if first is not None else torch.device("cpu"))
    if getattr(gm, "_adaloss_captured", False):
        model.forward = CapturedForward(model, gm, *example)
        return model
    return gm


def _traced(model: nn.Module, tracer: AdaptiveTracer, example: tuple | None) -> fx.GraphModule:
    """The model's graph: fx's symbolic trace, else (given example inputs) ``torch.export``'s capture."""
    try:
        graph = tracer.trace(model)
    except AttentionTransformError as exc:
        raise AdaptiveTransformError(str(exc)) from exc
    except Exception as exc:  # fx raises several types; the message names the construct
        if example is not None:
            try:
                gm = capture(model, *example)
            except CaptureError as captured:
                raise AdaptiveTransformError(str(captured)) from exc
            gm._adaloss_captured = True
            return gm
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AdaptiveTransformError(
            f"the adaptive scaler cannot rewrite {type(model).__name__}: torch.fx could not trace it "
            f"({type(exc).__name__}: {first_line}). Make the untraceable part a leaf module or remove "
            "control flow that depends on tensor values, or give attach() example inputs "
            "(scaler.attach(model, input_ids=ids)) so that torch.export captures it"
        ) from exc
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


class _Rewrite:
    """The passes of :func:`attach_adaptive` over one traced module, and the tables they share."""

    def __init__(self, gm: fx.GraphModule, state: AdaptiveState, tracer: AdaptiveTracer) -> None:
        self.gm, self.graph, self.state, self.tracer = gm, gm.graph, state, tracer
        self.gemm_nodes: dict[fx.Node, Any] = {}
        self.weight_args: dict[fx.Node, set[fx.Node]] = {}  # GEMM node -> its weight and bias arguments
        self.leaf_nodes: dict[fx.Node, LeafGEMMs] = {}
        self.branch_nodes: dict[fx.Node, BranchPoint] = {}
        self.unscale_nodes: dict[fx.Node, UnscalePoint] = {}  # ParamUnscale nodes on parameter uses
        self.tied_nodes: dict[fx.Node, list[UnscalePoint]] = {}  # calls of modules holding parameters
        self.weight_params: dict[int, nn.Parameter] = {}  # the parameters under GEMM weights
        # nodes holding a weight a GEMM uses (a parameter, a fixed view of one, or a tensor computed from
        # parameters alone), and per node the name of the largest parameter it is made from
        self.chains: dict[fx.Node, str] = {}
        self.nondiff: set[fx.Node] = set()  # integer arguments of GEMM points (a grouped GEMM's offsets)
        self.sources: WeightSources | None = None  # made once in-place writes are redirected
        self.metadata: dict[fx.Node, bool] = {}
        self.calls: Counter[str] = Counter()  # one name counter for every kind of point

    def untouched(self, node: fx.Node) -> bool:
        """Values whose in-place writes the rewrite leaves as they are: sizes, parameters and buffers (and
        fixed views of parameters), and in a captured graph tensors that carry no gradient (token ids)."""
        return (
            node.op == "get_attr"
            or _is_metadata(node, self.metadata)
            or _param_chain(self.gm, node) is not None
            or _carries_no_gradient(node)
        )

    def point_name(self, base: str) -> str:
        k = self.calls[base]
        self.calls[base] += 1
        return base if k == 0 else f"{base}#{k}"

    def own(self, w: fx.Node, b: Any) -> list[str]:
        """Record the nodes and parameters behind a GEMM's weight and bias; the names of the weight's
        parameters, largest first."""
        params = sorted(self.sources.params(w), key=lambda item: -item[1].numel())
        for _, p in params:
            self.weight_params[id(p)] = p
        for value in (w, b):
            if isinstance(value, fx.Node):
                names = [n for n, _ in sorted(self.sources.params(value), key=lambda item: -item[1].numel())]
                for node in self.sources.chain(value):
                    self.chains.setdefault(node, names[0])
        return [n for n, _ in params]

    def replace(self, node: fx.Node, target: str, module: nn.Module, args: tuple, kwargs: dict) -> fx.Node:
        self.gm.add_submodule(target, module)
        with self.graph.inserting_before(node):
            new = self.graph.call_module(target, args, kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
        return new

    # 1. GEMM points, in network order -------------------------------------------------------------------

    def gemm_points(self, product_betas: bool) -> None:
        """Every conv/linear call, functional GEMM with a parameter weight, wrapped function holding GEMMs
        and (with ``product_betas``) activation-by-activation product becomes a point."""
        modules = dict(self.gm.named_modules())
        wrappers: dict[str, AdaptiveGEMM] = {}
        products = 0
        self.sources = WeightSources(self.gm)
        for node in list(self.graph.nodes):
            if node.op == "call_module" and isinstance(modules.get(node.target), GEMM_TYPES):
                self._layer_point(node, modules[node.target], wrappers)
            elif (call := _functional_gemm(self.gm, node, self.sources)) is not None:
                self._functional_point(node, call)
            elif node.op == "call_function" and node.target in LEAF_GEMMS:
                self._leaf_points(node)
            elif self._weights_only(node):
                continue  # a product of weights (LoRA's B @ A): part of a weight's computation, no point
            else:
                module = _product_module(node, self.state, self.tracer, self.point_name, product_betas)
                if module is None:
                    continue
                args = node.args[1:] if node.op == "call_function" and node.target is mha_core else node.args
                new = self.replace(node, f"_adaloss_product_{products}", module, args, node.kwargs)
                products += 1
                if module.point_index is not None:
                    self.gemm_nodes[new] = self.state.gemms[module.point_index]
                    self.weight_args[new] = set()
        for path, wrapper in wrappers.items():
            _set_submodule(self.gm, path, wrapper)

    def _layer_point(self, node: fx.Node, layer: nn.Module, wrappers: dict[str, AdaptiveGEMM]) -> None:
        """A call of a conv/linear module."""
        if node.kwargs or len(node.args) != 1:
            raise AdaptiveTransformError(
                f"layer '{node.target}' is called with extra arguments ({type(layer).__name__} with "
                "output_size?), which the adaptive scaler does not support"
            )
        if node.target not in wrappers:
            wrappers[node.target] = AdaptiveGEMM(layer, self.state, node.target)
            for p in wrappers[node.target].sources:
                self.weight_params[id(p)] = p
        wrapper = wrappers[node.target]
        shape = wrapper.weight_shape
        fan_in = backward_fan_in(wrapper.spec["kind"], shape, wrapper.spec.get("groups", 1))
        point = self.state.add_gemm(self.point_name(node.target), fan_in, math.prod(shape))
        node.args = (node.args[0], point.index)
        self.gemm_nodes[node] = point
        self.weight_args[node] = set()

    def _functional_point(self, node: fx.Node, call: tuple) -> None:
        """``F.linear`` / ``F.conv*`` / ``x @ W`` / a grouped GEMM whose weight is a parameter, a fixed view
        of one or computed from parameters (:class:`~adaloss.adaptive.weights.WeightSources`)."""
        x, w, b, spec, value, transpose, offs = call
        names = self.own(w, b)
        if transpose:  # x @ W computes F.linear(x, W^T)
            with self.graph.inserting_before(node):
                t = self.graph.call_method("t", (w,))
            self.chains[t] = self.chains[w]
            w, value = t, value.t()
        shape = (value.shape[-1], value.shape[-2]) if spec["kind"] == "grouped" else value.shape
        fan_in = backward_fan_in(
            "linear" if spec["kind"] == "grouped" else spec["kind"], shape, spec.get("groups", 1)
        )
        point = self.state.add_gemm(self.point_name(weight_name(names)), fan_in, value.numel())
        module = FunctionalGEMM(self.state, spec, point.name, names)
        args = (x, w, b, point.index) if offs is None else (x, w, b, point.index, offs)
        new = self.replace(node, f"_adaloss_gemm_{point.index}", module, args, {})
        self.gemm_nodes[new] = point
        self.weight_args[new] = {v for v in (w, b, offs) if isinstance(v, fx.Node)}
        if isinstance(offs, fx.Node):
            self.nondiff.add(offs)

    def _weights_only(self, node: fx.Node) -> bool:
        """Whether ``node`` is an op fed by weights alone (no model input reaches it, a parameter does)."""
        product = (node.op == "call_function" and node.target in PRODUCT_FUNCTIONS) or (
            node.op == "call_method" and node.target in PRODUCT_METHODS
        )
        return product and self.sources.is_weight(node) and _feeds_only_weights(node, self.sources)

    def _leaf_points(self, node: fx.Node) -> None:
        """A call of a function fx keeps as a leaf that holds GEMMs (Swin's attention)."""
        entry = LEAF_GEMMS[node.target]
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs).arguments
        points = []
        for w_name, b_name, _ in entry["gemms"]:
            w, b = bound.get(w_name), bound.get(b_name)
            if not self.sources.is_weight(w) or (b is not None and not self.sources.is_weight(b)):
                raise AdaptiveTransformError(
                    f"{node.target.__qualname__} at '{_module_path(node)}' is called with {w_name} or "
                    f"{b_name} not a parameter; the adaptive scaler needs parameters there"
                )
            value = self.sources.value(w)
            name = self.point_name(weight_name(self.own(w, b)))
            points.append(
                self.state.add_gemm(name, backward_fan_in("linear", value.shape), value.numel()).index
            )
        leaf = LeafGEMMs(node.target, entry, points, self.state, _module_path(node) or node.name)
        new = self.replace(node, f"_adaloss_leaf_{len(self.leaf_nodes)}", leaf, node.args, node.kwargs)
        self.leaf_nodes[new] = leaf

    # 2. Parameter uses outside GEMM points ---------------------------------------------------------------

    def parameter_uses(self) -> None:
        """Every other use of a parameter (a batch norm's affine parameters, a token embedding tied to the
        output projection): its gradient is brought to the root scale in the backward pass by its own
        alpha, as each GEMM call's contribution is, so every parameter gradient leaves the backward pass
        carrying ``alpha_{N+1}``, as under GradScaler. A parameter read directly gets a
        :class:`ParamUnscaleModule` per use; a module holding parameters becomes :class:`UnscaledParams`."""
        gm, graph, state = self.gm, self.graph, self.state
        for node in list(graph.nodes):
            is_param = node.op == "get_attr" and isinstance(_get_attr(gm, node.target), nn.Parameter)
            if not (node in self.chains or is_param):
                continue
            for user in list(node.users):
                if (
                    user in self.chains
                    or node in self.weight_args.get(user, ())
                    or _is_nondiff_use(user, node)
                ):
                    continue
                if user in self.leaf_nodes and _leaf_param_use(user, self.leaf_nodes[user], node):
                    continue
                point = state.add_unscale(self.point_name(self.chains.get(node, node.target)))
                target = f"_adaloss_unscale_{point.index}"
                gm.add_submodule(target, ParamUnscaleModule(point, state))
                with graph.inserting_before(user):
                    new = graph.call_module(target, (node,))
                user.replace_input_with(node, new)
                self.unscale_nodes[new] = point
        tied_modules: dict[str, UnscaledParams] = {}
        for node in list(graph.nodes):
            if node.op != "call_module" or node in self.gemm_nodes or node.target.startswith("_adaloss_"):
                continue
            if node in self.chains:
                continue  # a module computing a GEMM's weight (a parametrization): at the root scale
            mod = gm.get_submodule(node.target)
            shared = [n for n, _ in mod.named_parameters()]
            if not shared:
                continue
            if node.target not in tied_modules:
                tied_modules[node.target] = UnscaledParams(mod, shared, state)
                _set_submodule(gm, node.target, tied_modules[node.target])
            tied = tied_modules[node.target]
            points = [state.add_unscale(self.point_name(f"{node.target}.{n}")) for n in shared]
            node.kwargs = {**node.kwargs, "_adaloss_call": len(tied.calls)}
            tied.calls.append(tuple(points))
            self.tied_nodes[node] = points

    # 3. Branch points at values with several consumers -----------------------------------------------------

    def branch_points(self) -> None:
        """A value with several differentiable consumers gets a :class:`BranchModule` (Algorithm 5).
        Parameters have none: each use's gradient is brought to the root scale on its own (pass 2)."""
        for node in list(self.graph.nodes):
            if node.op == "output" or _is_metadata(node, self.metadata) or _is_container(node):
                continue
            if (
                node in self.chains
                or node in self.nondiff
                or node.op == "get_attr"
                or _carries_no_gradient(node)
            ):
                continue  # GEMM weights, parameters (per use), buffers, constants, integer tensors
            users = _diff_users(node)
            if len(users) < 2:
                continue
            point = self.state.add_branch(node.name)
            self.branch_nodes.update(
                _insert_branch(self.gm, self.graph, point, self.state, [node] * len(users), users, node)
            )

    def writable_copies(self) -> None:
        """An op that writes into a point's output or a branch alias (``nn.ReLU(inplace=True)`` right after
        a conv, ``x += y``) must not write into a view one of our autograd nodes returned: it gets a copy."""
        aliases = [g for b in self.branch_nodes for g in b.users]
        for node in [*self.gemm_nodes, *self.leaf_nodes, *aliases]:
            for user in list(node.users):
                if needs_copy(self.gm, user, node):
                    with self.graph.inserting_before(user):
                        copy = self.graph.call_function(writable, (node,))
                    user.replace_input_with(node, copy)

    # 4. Slots, from the outputs back to the inputs ---------------------------------------------------------

    def _user_slot(self, user: fx.Node, node: fx.Node, slot: dict[fx.Node, int | None]) -> int | None:
        if user.op == "output":
            return 0
        if user in self.gemm_nodes:
            return None if node in self.weight_args[user] else self.gemm_nodes[user].out_slot
        if user in self.leaf_nodes:
            return _leaf_arg_slot(user, node, self.leaf_nodes[user], self.state)
        if user in self.branch_nodes:
            return self.branch_nodes[user].out_slot
        if user in self.unscale_nodes:
            return None  # the parameter behind ParamUnscale: its gradient is brought to the root there
        return slot.get(user)

    def _container_slot(self, node: fx.Node, users: list[fx.Node], slot: dict[fx.Node, int | None]) -> None:
        """The outputs of one op (split, chunk): a branch point when they reach points of different alphas.
        An output that is itself a tuple (a leaf function's result) takes part through its elements."""
        leaves, getitems = _output_leaves(users)
        slots = {slot.get(g) for g in leaves} - {None}
        if len(slots) <= 1:
            slot[node] = slots.pop() if slots else None
            return
        prev = node  # the outputs right after the op, so the branch precedes all their consumers
        for g in sorted(getitems, key=lambda g: _position(self.graph, g)):
            prev.append(g)
            prev = g
        point = self.state.add_branch(f"{node.name}.outputs")
        inserted = _insert_branch(self.gm, self.graph, point, self.state, leaves, None, None)
        point.in_slots = [slot.get(g) or 0 for g in leaves]
        for g in leaves:
            slot[g] = point.out_slot
        self.branch_nodes.update(inserted)
        slot[node] = point.out_slot

    def slots(self) -> None:
        """Which slot's alpha each point reads: the static wiring of ``<alpha, delta>`` (Algorithm 3)."""
        slot: dict[fx.Node, int | None] = {}
        for node in reversed(list(self.graph.nodes)):
            if node.op == "output" or _is_metadata(node, self.metadata) or _carries_no_gradient(node):
                continue  # sizes, shapes, ids, masks: no gradient (and may feed ops on both sides of a GEMM)
            if node in self.branch_nodes:
                getitems = sorted(node.users, key=lambda g: g.args[1])
                self.branch_nodes[node].in_slots = [slot.get(g) or 0 for g in getitems]
                continue
            users = _diff_users(node)
            if _is_container(node) and len(users) > 1:
                self._container_slot(node, users, slot)
                continue
            slots = {self._user_slot(u, node, slot) for u in users} - {None}
            if len(slots) > 1:
                raise AdaptiveTransformError(
                    f"internal error: value '{node.name}' has gradients with different scales but no "
                    "branch point"
                )
            slot[node] = slots.pop() if slots else None
        for node, point in self.gemm_nodes.items():
            point.in_slot = slot.get(node) or 0
        for node, leaf in self.leaf_nodes.items():
            after = slot.get(node) or 0
            for k in reversed(leaf.points):  # the last GEMM receives the call's output gradient
                self.state.gemms[k].in_slot = after
                after = self.state.gemms[k].out_slot
        for node, points in [*((n, [p]) for n, p in self.unscale_nodes.items()), *self.tied_nodes.items()]:
            for point in points:
                point.in_slot = slot.get(node) or 0

    def fed_branches(self) -> None:
        """GEMM calls whose input is directly one alias of a shared-value branch (and nothing else reads
        that alias): their input gradient reaches the branch's backward unshared, so it may accumulate
        into it (:attr:`adaloss.adaptive.ops.GemmPoint.feeds`)."""
        for node, point in self.gemm_nodes.items():
            src = node.args[0]
            if not (
                isinstance(src, fx.Node) and src.op == "call_function" and src.target is operator.getitem
            ):
                continue
            branch = src.args[0]
            if branch not in self.branch_nodes or len(src.users) != 1:
                continue
            if getattr(_get_attr(self.gm, node.target), "pad_mode", None) != "zeros":
                continue  # a product (no ScaledGEMM), or F.pad sits between the alias and the GEMM
            point.feeds = (self.branch_nodes[branch].index, src.args[1])

    def carried_params(self) -> None:
        """A module holding parameters whose input is directly a conv or linear layer's output (a batch
        norm after a conv), with its own parameters at the layer's alpha: the layer's node carries them
        (``GemmPoint.carried``), so their gradients need no :class:`ParamUnscale` node of their own. The
        layer's call returns ``(y, *views)`` and the module gets the views (``_adaloss_views``)."""
        modules = dict(self.gm.named_modules())
        for node, points in self.tied_nodes.items():
            src = node.args[0] if node.args else None
            if not isinstance(src, fx.Node) or src not in self.gemm_nodes:
                continue
            gemm, tied = modules.get(src.target), modules[node.target]
            point = self.gemm_nodes[src]
            if (
                not isinstance(gemm, AdaptiveGEMM)
                or point.carried
                or any(tied.owner_paths)
                or any(p.in_slot != point.in_slot for p in points)
            ):
                continue
            names = tuple(tied.leaves)
            with self.graph.inserting_after(src):  # each right after ``src``: made last to first
                outs = [
                    self.graph.call_function(operator.getitem, (src, i))
                    for i in reversed(range(len(names) + 1))
                ]
            y, *views = reversed(outs)
            src.replace_all_uses_with(y, delete_user_cb=lambda user, outs=outs: user not in outs)
            node.kwargs = {**node.kwargs, "_adaloss_views": tuple(views)}
            point.carried = tuple(points)
            gemm.carriers[point.index] = (tied, names)


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
    elif node.op == "call_function" and aten_view(node.target):
        pass  # a captured graph's aten.t, aten.view, aten.split, ...
    elif not (
        (node.op == "call_method" and node.target in FIXED_VIEW_METHODS)
        or (node.op == "call_function" and node.target in FIXED_VIEW_FUNCTIONS)
    ):
        return None
    if _has_node((node.args[1:], node.kwargs)):
        return None
    chain = _param_chain(gm, node.args[0])
    return None if chain is None else [*chain, node]


def _module_path(node: fx.Node) -> str:
    """The path of the module whose forward made ``node`` ("" for the root)."""
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else ""


def _gemm_form(node: fx.Node) -> GemmForm | None:
    """The entry of :data:`~adaloss.adaptive.gemms.WEIGHT_GEMMS` that ``node`` calls, if any."""
    if node.op == "call_function":
        return weight_gemm(node.target)
    if node.op == "call_method":
        return WEIGHT_GEMM_METHODS.get(node.target)
    return None


def _functional_gemm(gm: fx.GraphModule, node: fx.Node, sources: WeightSources) -> tuple | None:
    """``(input, weight node, bias node, spec, weight value, transpose, offs)`` if ``node`` is a GEMM of
    :data:`~adaloss.adaptive.gemms.WEIGHT_GEMMS` (``F.linear``, ``F.conv*``, ``x @ W``, ``torch.addmm(b, x,
    W)``, a grouped GEMM) whose weight (and bias) is a parameter, a fixed view of one or computed from
    parameters alone, and whose input is not; ``transpose``: the weight is ``W`` of ``x @ W`` (``F.linear``
    takes W^T); ``offs``: a grouped GEMM's group ends."""
    form = _gemm_form(node)
    if form is None:
        return None
    bound = _bind(node, form.args)
    if bound is None or "weight" not in bound:
        return None
    if form.kind == "addmm" and (bound.pop("beta", 1) != 1 or bound.pop("alpha", 1) != 1):
        return None
    if form.kind == "grouped" and (bound.get("bias") is not None or bound.get("out_dtype") is not None):
        return None  # a bias or an output dtype of the kernel's own: counted by coverage() as unscaled
    x, w, b = bound.get("input"), bound["weight"], bound.get("bias")
    if not isinstance(x, fx.Node) or _param_chain(gm, x) is not None or not sources.is_weight(w):
        return None
    if sources.is_free(x) and _feeds_only_weights(node, sources):
        return None  # a GEMM of weights computing a GEMM's weight: part of that weight's computation
    if b is not None and not sources.is_weight(b):
        return None  # an activation bias: its gradient must keep its alpha, so not a GEMM point here
    value = sources.value(w)
    transpose = form.kind in ("matmul", "addmm")
    wanted = {"grouped": 3, "linear": 2, "matmul": 2, "addmm": 2}.get(form.kind)
    if wanted is not None and value.dim() != wanted:
        return None
    return x, w, b, _spec(node, form, bound, value), value, transpose, bound.get("offs")


def _feeds_only_weights(node: fx.Node, sources: WeightSources) -> bool:
    """Whether every path from ``node`` (a value computed from weights alone) through further such values
    ends as the weight or bias operand of a GEMM (LoRA's ``B @ A`` in ``W + B @ A``); False where the value
    meets an activation (a learned query projected and attended to)."""
    todo, seen = [node], set()
    while todo:
        value = todo.pop()
        for user in value.users:
            if user in seen:
                continue
            seen.add(user)
            if sources.is_free(user):
                todo.append(user)
                continue
            form = _gemm_form(user)
            bound = _bind(user, form.args) if form is not None else None
            if bound is None or not any(bound.get(k) is value for k in ("weight", "bias")):
                return False
    return True


def _spec(node: fx.Node, form: GemmForm, bound: dict[str, Any], value: torch.Tensor) -> dict[str, Any]:
    """The description :class:`ScaledGEMM` takes of a functional GEMM."""
    if form.kind not in ("conv", "conv_transpose"):
        return {"kind": "grouped" if form.kind == "grouped" else "linear"}
    where = f"{node.target.__name__} at '{_module_path(node) or node.name}'"
    options = {k: v for k, v in bound.items() if k not in ("input", "weight", "bias")}
    if _has_node(options):
        raise AdaptiveTransformError(
            f"{where} gets its stride, padding or groups from a tensor; the adaptive scaler needs constants "
            "there"
        )
    return _conv_spec(
        where,
        form.kind == "conv_transpose",
        tuple(value.shape[2:]),
        options.get("stride", 1),
        options.get("padding", 0),
        options.get("dilation", 1),
        options.get("groups", 1),
        options.get("output_padding", 0),
    )


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
