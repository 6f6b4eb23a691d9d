"""Rewrite an unmodified model so its backward pass carries ``<alpha, delta>`` (torch.fx).

:func:`attach_adaptive` traces the model with ``torch.fx.symbolic_trace`` and edits the graph in three passes:

1. **GEMM points.** Every call of a conv / transposed conv / linear module becomes a call of an
   :class:`AdaptiveGEMM` installed at the same module path. It holds the *same* parameter objects under the
   same names, so ``state_dict()`` keys, optimizers and checkpoints are unchanged. A module called k times
   gets k scaling points (``fc``, ``fc#1``, ...).
2. **Branch points.** Every value consumed by several ops (a residual shortcut, a feature map feeding a
   detection head and the next layer, a parameter used twice) gets a :class:`BranchModule` that hands each
   consumer its own alias, so the consumers' gradients meet in one backward call (Algorithm 5). An op with
   several outputs whose gradients would carry different alphas (``split``, ``chunk``) gets one too.
3. **Slots.** Walking the graph from the outputs back to the inputs, each value learns which point emitted
   the alpha of its gradient: the loss (slot 0), the GEMM or branch point that consumes it, or, through any
   other (element-wise) op, whatever that op's output received. GEMM and branch points read their incoming
   alpha from that slot; parameters of non-GEMM ops (batch-norm affine weights, ...) are unscaled by it.

Models fx cannot trace (control flow on tensor values, ...) get an :class:`AdaptiveTransformError` naming the
construct.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from adaloss.adaptive.ops import AdaptiveState, BranchPoint, GradRound, Rescale, ScaledGEMM, unplanned_point
from adaloss.adaptive.rules import backward_fan_in
from adaloss.errors import ConfigError
from adaloss.numerics import fused
from adaloss.numerics.emulation import active_emulation, is_low_precision, mark_low_precision

__all__ = ["AdaptiveTransformError", "AdaptiveGEMM", "BranchModule", "attach_adaptive"]

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
        """In emulated FP16 on the CPU, the layer as one fused C++ node (:func:`adaloss.numerics.fused.gemm`)
        with the values of ScaledGEMM + GradRound bit for bit: on a reuse pass it carries the plan's beta
        and 1/alpha, on a recompute pass it computes them into the state's record. None when that does not
        apply (no FP16 emulation, underflow telemetry on, or an unsupported layer)."""
        state = self.state
        emu = active_emulation()
        if emu is None or not emu._fp16 or emu.monitor is not None or not self.fusable():
            return None
        with torch._C.DisableTorchFunction():  # plain attribute reads, not a round trip through the mode
            w = self.weight
            ok = x.dtype is torch.float32 and x.is_cpu and w.dtype is torch.float32 and w.is_cpu
            round_x = not is_low_precision(x)
            if state.fused_mode == "reuse":
                if not ok:
                    return None
                entry = state.plan.gemm[point_index]  # type: ignore[union-attr]
                if entry is None:  # no gradient reached this point in the last recompute pass
                    if x.requires_grad or any(p is not None and p.requires_grad for p in (w, self.bias)):
                        raise unplanned_point(state.gemms[point_index].name)
                    entry = (1.0, 1.0)  # no node is recorded: nothing requires a gradient
                beta, inv_alpha = entry
                y = fused.gemm(x, self.weight, self.bias, self._fused_spec, round_x, False, beta, inv_alpha)
            else:
                if not ok:  # the other points share the record: no Python node may join them
                    raise RuntimeError(
                        f"adaptive loss scaling: layer {state.gemms[point_index].name} got a {x.dtype} "
                        f"{x.device.type} input in emulated FP16; set ADALOSS_FUSED=0 to use the Python nodes"
                    )
                y = fused.gemm(
                    x,
                    self.weight,
                    self.bias,
                    self._fused_spec,
                    round_x,
                    False,
                    record=state.record,
                    where=state.record_where["gemm"][point_index],
                    consts=state.record_where["gemm_consts"][point_index],
                )
        state.fused_built = state.fused_mode
        return mark_low_precision(y)

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


def _layer_spec(layer: nn.Module, path: str) -> dict[str, Any]:
    if isinstance(layer, nn.Linear):
        return {"kind": "linear"}
    dims = len(layer.kernel_size)
    padding = layer.padding if layer.padding_mode == "zeros" else (0,) * dims
    if isinstance(padding, str):
        if padding == "valid":
            padding = (0,) * dims
        else:  # "same"
            total = [d * (k - 1) for d, k in zip(layer.dilation, layer.kernel_size, strict=True)]
            if any(t % 2 for t in total):
                raise AdaptiveTransformError(
                    f"layer '{path}' uses padding='same' with an even kernel (asymmetric padding), which the "
                    "adaptive scaler does not support: give explicit integer padding"
                )
            padding = tuple(t // 2 for t in total)
    spec = {
        "kind": "conv_transpose" if isinstance(layer, _CONV_T) else "conv",
        "dims": dims,
        "stride": tuple(layer.stride),
        "padding": tuple(padding),
        "dilation": tuple(layer.dilation),
        "groups": layer.groups,
        "transposed": isinstance(layer, _CONV_T),
        "output_padding": tuple(layer.output_padding) if isinstance(layer, _CONV_T) else (0,) * dims,
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


def attach_adaptive(model: nn.Module, state: AdaptiveState) -> fx.GraphModule:
    """Trace ``model`` and return the rewritten module (sharing ``model``'s parameters and buffers)."""
    try:
        gm = fx.symbolic_trace(model)
    except Exception as exc:  # fx raises several types; the message names the construct
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AdaptiveTransformError(
            f"the adaptive scaler cannot rewrite {type(model).__name__}: torch.fx could not trace it "
            f"({type(exc).__name__}: {first_line}). Make the untraceable part a leaf module or remove "
            "control flow that depends on tensor values"
        ) from exc
    graph = gm.graph
    modules = dict(gm.named_modules())
    branch_nodes: dict[fx.Node, BranchPoint] = {}
    gemm_nodes: dict[fx.Node, Any] = {}

    # 1. GEMM points ---------------------------------------------------------------------------------
    calls: Counter[str] = Counter()
    wrappers: dict[str, AdaptiveGEMM] = {}
    for node in list(graph.nodes):
        if node.op != "call_module" or not isinstance(modules.get(node.target), GEMM_TYPES):
            continue
        layer = modules[node.target]
        if node.kwargs or len(node.args) != 1:
            raise AdaptiveTransformError(
                f"layer '{node.target}' is called with extra arguments ({type(layer).__name__} with "
                "output_size?), which the adaptive scaler does not support"
            )
        k = calls[node.target]
        calls[node.target] += 1
        if node.target not in wrappers:
            wrappers[node.target] = AdaptiveGEMM(layer, state, node.target)
        wrapper = wrappers[node.target]
        fan_in = backward_fan_in(wrapper.spec["kind"], layer.weight.shape, wrapper.spec.get("groups", 1))
        point = state.add_gemm(node.target if k == 0 else f"{node.target}#{k}", fan_in, layer.weight.numel())
        node.args = (node.args[0], point.index)
        gemm_nodes[node] = point
    for path, wrapper in wrappers.items():
        _set_submodule(gm, path, wrapper)

    # 2. Branch points at values with several consumers ---------------------------------------------
    metadata: dict[fx.Node, bool] = {}
    for node in list(graph.nodes):
        if node.op == "output" or _is_metadata(node, metadata) or _is_container(node):
            continue
        if node.op == "get_attr" and not isinstance(_get_attr(gm, node.target), nn.Parameter):
            continue  # buffers and constants carry no gradient
        users = _diff_users(node)
        if len(users) < 2:
            continue
        point = state.add_branch(node.name)
        branch_nodes.update(_insert_branch(gm, graph, point, state, [node] * len(users), users, node))

    # 3. Slots, from the outputs back to the inputs --------------------------------------------------
    slot: dict[fx.Node, int | None] = {}

    def user_slot(user: fx.Node) -> int | None:
        if user.op == "output":
            return 0
        if user in gemm_nodes:
            return gemm_nodes[user].out_slot
        if user in branch_nodes:
            return branch_nodes[user].out_slot
        return slot.get(user)

    for node in reversed(list(graph.nodes)):
        if node.op == "output":
            continue
        if node in branch_nodes:
            point = branch_nodes[node]
            getitems = sorted(node.users, key=lambda g: g.args[1])
            point.in_slots = [slot.get(g) if slot.get(g) is not None else 0 for g in getitems]
            continue
        users = _diff_users(node)
        if _is_container(node) and len(users) > 1:
            slots = {slot.get(g) for g in users} - {None}
            if len(slots) > 1:  # outputs of one op reach points with different alphas: rescale them
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
        slots = {user_slot(u) for u in users} - {None}
        if len(slots) > 1:
            raise AdaptiveTransformError(
                f"internal error: value '{node.name}' has gradients with different scales but no branch point"
            )
        slot[node] = slots.pop() if slots else None
    for node, point in gemm_nodes.items():
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
        if _get_attr(gm, node.target).pad_mode != "zeros":
            continue  # F.pad sits between the alias and the GEMM
        point.feeds = (branch_nodes[branch].index, src.args[1])

    # Parameters of non-GEMM ops are scaled by the alpha of their op's output gradient.
    gemm_params = {id(p) for w in wrappers.values() for p in w.parameters()}
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
            if id(p) in gemm_params:
                raise AdaptiveTransformError(
                    f"parameter '{name}' is used both by a conv/linear layer and by another op; the adaptive "
                    "scaler needs each GEMM weight to be used only by GEMM layers"
                )
            if s is None:
                continue
            if id(p) in param_slot and param_slot[id(p)][1] != s:
                raise AdaptiveTransformError(
                    f"parameter '{name}' is used by a module called more than once at points with different "
                    "loss scales; the adaptive scaler supports repeated calls of conv/linear layers only"
                )
            param_slot[id(p)] = (name, s)
    state.param_slots = {name: s for name, s in param_slot.values()}
    state.param_slot_by_id = {pid: s for pid, (_, s) in param_slot.items()}

    graph.lint()
    gm.recompile()
    return gm


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
