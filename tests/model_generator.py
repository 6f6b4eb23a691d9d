"""Random architectures for the adaptive scaler's exactness tests, as hypothesis strategies.

:func:`programs` draws a :class:`Program`: a list of ops over values of shape ``(B, C, *S)`` (1-D, 2-D or
3-D) and flat ``(B, C)`` values, each op reading earlier values and making new ones; :class:`GeneratedNet`
runs it. The vocabulary is what real models combine: convolutions (1-D/2-D/3-D, grouped, depthwise,
dilated, strided, transposed), linear layers, batch/group/layer/instance norms with and without affine
parameters, activations (in place too: modules, functions and methods), residual adds of 2-4 inputs,
concatenation, split and chunk, multiplicative gates (squeeze-excitation, GLU), pooling and interpolation,
attention (explicit products and ``F.scaled_dot_product_attention``), recurrent layers, dropout, heads at
several depths summed into the loss, an output the loss does not use, sizes and shapes passed along beside
the activations through a leaf function (as MViT's ``thw``), a leaf function that writes into its argument
(as MViT's ``_add_shortcut``), a module called twice, tied weights, frozen parameters, weights computed
from parameters (weight norm in both APIs, an orthogonal parametrization, weight standardization, a gain),
token-routed experts through a grouped GEMM and through a loop, and MobileViT's unfold/fold patch
attention.

Hypothesis shrinks a failing program to a small one: ops are drawn one by one (fewer and simpler ops
shrink first: the first kind listed is a convolution, and inputs are counted from the newest value).
``Program.describe()`` prints it.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

import adaloss.adaptive.gemms  # noqa: F401 - registers torch.ops.adaloss.grouped_mm (the "experts" op)

BATCH, CLASSES = 2, 3


# ----------------------------------------------------------------------------------------- leaf functions


def with_sizes(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], int]:
    """A leaf (fx keeps it a call): ``x`` with its spatial sizes and channel count, as MViT passes ``thw``."""
    return x, tuple(x.shape[2:]), x.shape[1]


def add_into(x: torch.Tensor, y: torch.Tensor) -> None:
    """A leaf that writes into its argument and returns nothing, as MViT's ``_add_shortcut``."""
    x.add_(y)


torch.fx.wrap("with_sizes")
torch.fx.wrap("add_into")


# ----------------------------------------------------------------------------------------------- programs


@dataclass(frozen=True)
class Value:
    channels: int
    size: tuple[int, ...]  # spatial sizes; () for a flat (B, C) value


@dataclass
class Op:
    kind: str
    inputs: tuple[int, ...]
    args: dict[str, Any]
    outputs: tuple[Value, ...]

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.args.items())
        return f"{self.kind}({', '.join(f'v{i}' for i in self.inputs)}{', ' if args else ''}{args})"


@dataclass
class Program:
    dims: int
    input: Value
    ops: list[Op] = field(default_factory=list)
    heads: list[int] = field(default_factory=list)  # values summed into the output (each through a head)
    unused: int | None = None  # a value returned beside the output, which the loss does not use
    frozen: list[str] = field(default_factory=list)  # parameter names with requires_grad=False
    loss_factor: float = 2.0**-30

    def values(self) -> list[Value]:
        out = [self.input]
        for op in self.ops:
            out.extend(op.outputs)
        return out

    def describe(self) -> str:
        lines, k = [f"v0 = input {self.input}"], 1
        for op in self.ops:
            names = ", ".join(f"v{k + i}" for i in range(len(op.outputs)))
            lines.append(f"{names} = {op}")
            k += len(op.outputs)
        lines.append(f"heads {self.heads}, unused {self.unused}, frozen {self.frozen}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ strategy

ACTIVATIONS = ("relu", "gelu", "silu", "hardswish", "tanh", "sigmoid")
KINDS = (
    "conv",
    "linear",
    "norm",
    "act",
    "add",
    "mul",
    "cat",
    "chunk",
    "se",
    "glu",
    "pool",
    "interp",
    "attention",
    "twice",
    "tied",
    "sizes",
    "add_into",
    "add_",
    "head",
    "rnn",
    "dropout",
    "computed",
    "experts",
    "patches",
)


def _pick(draw: Any, values: list[Value], ok: Any = None) -> int | None:
    """An earlier value (counted from the newest, so shrinking makes chains) satisfying ``ok``."""
    idx = [i for i, v in enumerate(values) if ok is None or ok(v)]
    if not idx:
        return None
    return idx[-1 - draw(st.integers(0, len(idx) - 1))]


def _spatial(v: Value) -> bool:
    return bool(v.size)


def _conv_out(n: int, k: int, s: int, d: int) -> int:
    p = d * (k - 1) // 2
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def _conv(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op | None:
    i = _pick(draw, values, _spatial)
    if i is None:
        return None
    v = values[i]
    out_c = draw(st.sampled_from([v.channels, 2, 4, 6]))
    transposed = draw(st.booleans())
    if transposed:
        up = draw(st.booleans()) and max(v.size) <= 8
        k, s, d = (2, 2, 1) if up else (3, 1, 1)
        size = tuple(2 * n for n in v.size) if up else v.size
    else:
        k = draw(st.sampled_from([1, 3]))
        s = draw(st.sampled_from([1, 2])) if min(v.size) >= 2 else 1
        d = draw(st.sampled_from([1, 2])) if k == 3 else 1
        size = tuple(_conv_out(n, k, s, d) for n in v.size)
    shared = math.gcd(v.channels, out_c)
    groups = draw(st.sampled_from(sorted({1, shared, 2 if shared % 2 == 0 else 1})))
    bias = draw(st.booleans())
    args = {"out": out_c, "k": k, "s": s, "d": d, "groups": groups, "bias": bias, "transposed": transposed}
    return Op("conv", (i,), args, (Value(out_c, size),))


def _linear(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op:
    i = _pick(draw, values)
    out_c = draw(st.sampled_from([values[i].channels, 2, 4, 6]))
    args = {"out": out_c, "bias": draw(st.booleans()), "functional": draw(st.booleans())}
    return Op("linear", (i,), args, (Value(out_c, values[i].size),))


def _norm(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op:
    i = _pick(draw, values)
    v = values[i]
    kinds = ["batch", "layer"] + (["group", "instance"] if v.size and math.prod(v.size) > 1 else [])
    kind = draw(st.sampled_from(kinds))
    groups = draw(st.sampled_from([g for g in (1, 2, v.channels) if v.channels % g == 0]))
    return Op("norm", (i,), {"kind": kind, "affine": draw(st.booleans()), "groups": groups}, (v,))


def _act(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op:
    i = _pick(draw, values)
    name = draw(st.sampled_from(ACTIVATIONS))
    how = draw(st.sampled_from(["module", "inplace_module", "function_", "method_"]))
    if name in ("gelu",) and how != "module":
        how = "module"
    return Op("act", (i,), {"name": name, "how": how}, (values[i],))


def _others(draw: Any, values: list[Value], first: int, count: int, ok: Any) -> tuple[int, ...]:
    """``first`` and ``count - 1`` more values satisfying ``ok``, others than ``first`` where there are
    (a residual shortcut from an earlier value, rather than ``x + x``)."""
    pool = [i for i, v in enumerate(values) if ok(v) and i != first] or [first]
    return (first, *(pool[-1 - draw(st.integers(0, len(pool) - 1))] for _ in range(count - 1)))


def _same_shape(draw: Any, values: list[Value], first: int, count: int) -> tuple[int, ...]:
    return _others(draw, values, first, count, lambda v, f=values[first]: v == f)


def _add(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op:
    i = _pick(draw, values)
    inputs = _same_shape(draw, values, i, draw(st.integers(2, 4)))
    return Op("add", inputs, {}, (values[i],))


def _mul(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op:
    i = _pick(draw, values)
    return Op("mul", _same_shape(draw, values, i, 2), {"sigmoid": draw(st.booleans())}, (values[i],))


def _cat(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op:
    i = _pick(draw, values)
    _, j = _others(draw, values, i, 2, lambda v: v.size == values[i].size)
    return Op("cat", (i, j), {}, (Value(values[i].channels + values[j].channels, values[i].size),))


def _chunk(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op | None:
    i = _pick(draw, values, lambda v: v.channels >= 2)
    if i is None:
        return None
    v = values[i]
    if draw(st.booleans()) and v.channels % 2 == 0:
        half = Value(v.channels // 2, v.size)
        return Op("chunk", (i,), {"split": None}, (half, half))
    first = draw(st.integers(1, v.channels - 1))
    parts = (Value(first, v.size), Value(v.channels - first, v.size))
    return Op("chunk", (i,), {"split": first}, parts)


def _se(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op | None:
    i = _pick(draw, values, _spatial)
    if i is None:
        return None
    gate = draw(st.sampled_from(["sigmoid", "hardsigmoid"]))
    return Op("se", (i,), {"hidden": draw(st.sampled_from([1, 2, 4])), "gate": gate}, (values[i],))


def _glu(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op | None:
    i = _pick(draw, values, lambda v: v.channels % 2 == 0)
    if i is None:
        return None
    v = values[i]
    return Op("glu", (i,), {"functional": draw(st.booleans())}, (Value(v.channels // 2, v.size),))


def _pool(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op | None:
    i = _pick(draw, values, _spatial)
    if i is None:
        return None
    v = values[i]
    kind = draw(st.sampled_from(["max", "avg", "global"]))
    if kind != "global" and min(v.size) < 2:
        kind = "global"
    size = tuple(1 for _ in v.size) if kind == "global" else tuple(n // 2 for n in v.size)
    return Op("pool", (i,), {"kind": kind}, (Value(v.channels, size),))


def _interp(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op | None:
    i = _pick(draw, values, lambda v: v.size and max(v.size) <= 8)
    if i is None:
        return None
    v = values[i]
    mode = draw(st.sampled_from(["nearest", "linear"]))
    return Op("interp", (i,), {"mode": mode}, (Value(v.channels, tuple(2 * n for n in v.size)),))


def _attention(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op | None:
    i = _pick(draw, values, _spatial)
    if i is None:
        return None
    args = {
        "projections": draw(st.booleans()),
        "sdpa": draw(st.booleans()),
        "causal": draw(st.booleans()),
        "heads": draw(st.sampled_from([1, 2])) if values[i].channels % 2 == 0 else 1,
        "tokens": math.prod(values[i].size),
    }
    return Op("attention", (i,), args, (values[i],))


def _twice(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op | None:
    """A conv or linear layer of an earlier op, called again on a value of its input shape."""
    layers = [
        k for k, op in enumerate(ops) if op.kind in ("conv", "linear") and not op.args.get("functional")
    ]
    if not layers:  # a square linear layer called twice in a row
        i = _pick(draw, values)
        return Op("twice", (i,), {"op": None}, (values[i],))
    k = layers[-1 - draw(st.integers(0, len(layers) - 1))]
    src = values[ops[k].inputs[0]]
    i = _pick(draw, values, lambda v: v.channels == src.channels and v.size == src.size)
    return Op("twice", (i,), {"op": k}, ops[k].outputs)


def _tied(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op | None:
    """A new linear layer whose weight is an earlier linear layer's (the same Parameter), or an
    ``F.embedding`` lookup of that weight added to a value (a tied embedding)."""
    layers = [k for k, op in enumerate(ops) if op.kind == "linear" and not op.args["functional"]]
    if not layers:  # a square linear layer applied twice through two modules sharing its weight
        i = _pick(draw, values)
        return Op("tied", (i,), {"op": None, "embedding": False}, (values[i],))
    k = layers[-1 - draw(st.integers(0, len(layers) - 1))]
    src, out = values[ops[k].inputs[0]], ops[k].outputs[0]
    if draw(st.booleans()):
        i = _pick(draw, values, lambda v: v.channels == src.channels)
        return Op("tied", (i,), {"op": k, "embedding": False}, (Value(out.channels, values[i].size),))
    i = _pick(draw, values, lambda v: v.channels == src.channels and bool(v.size))
    if i is None:
        return None
    return Op("tied", (i,), {"op": k, "embedding": True}, (values[i],))


def _sizes(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op | None:
    i = _pick(draw, values, _spatial)
    return None if i is None else Op("sizes", (i,), {}, (values[i],))


def _add_into(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op:
    i = _pick(draw, values)
    return Op("add_into", _same_shape(draw, values, i, 2), {}, (values[i],))


def _add_(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op:
    i = _pick(draw, values)
    return Op("add_", _same_shape(draw, values, i, 2), {}, (values[i],))


def _head(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op:
    i = _pick(draw, values)
    return Op("head", (i,), {}, (Value(CLASSES, ()),))


def _rnn(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op | None:
    i = _pick(draw, values, lambda v: len(v.size) == 1)
    if i is None:
        return None
    kind = draw(st.sampled_from(["LSTM", "GRU", "RNN"]))
    hidden = draw(st.sampled_from([2, 4]))
    return Op("rnn", (i,), {"kind": kind, "hidden": hidden}, (Value(hidden, values[i].size),))


#: how a computed weight is made from its parameters (``computed`` ops)
COMPUTED = ("weight_norm", "old_weight_norm", "standardized", "gain", "orthogonal")


def _computed(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op | None:
    """A linear layer or a convolution whose weight is computed from parameters: weight norm (both APIs),
    weight standardization (timm's StdConv), a weight times a gain, an orthogonal parametrization."""
    i = _pick(draw, values)
    v = values[i]
    out_c = draw(st.sampled_from([v.channels, 2, 4]))
    conv = bool(v.size) and draw(st.booleans())
    args = {"how": draw(st.sampled_from(COMPUTED)), "conv": conv, "out": out_c, "bias": draw(st.booleans())}
    return Op("computed", (i,), args, (Value(out_c, v.size),))


def _experts(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op:
    """Token-routed experts over the positions of a value (top-1 of 2 or 3, the gate's probability as the
    weight): through one grouped GEMM over the tokens sorted by expert, or a loop over the experts with
    each token's mask (no data-dependent control flow)."""
    i = _pick(draw, values)
    v = values[i]
    args = {"experts": draw(st.sampled_from([2, 3])), "grouped": draw(st.booleans())}
    return Op("experts", (i,), args, (v,))


def _patches(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op | None:
    """MobileViT's patch attention: ``F.unfold`` into 2x2 patches, attention across the patches at each
    pixel position (with projections), ``F.fold`` back."""
    i = _pick(draw, values, lambda v: len(v.size) == 2 and all(n % 2 == 0 and n >= 4 for n in v.size))
    if i is None:
        return None
    return Op("patches", (i,), {"channels": values[i].channels, "size": values[i].size}, (values[i],))


def _dropout(draw: Any, values: list[Value], ops: list[Op], dims: int) -> Op:
    i = _pick(draw, values)
    return Op("dropout", (i,), {"p": draw(st.sampled_from([0.1, 0.5]))}, (values[i],))


BUILDERS = {kind: globals()[f"_{kind}"] for kind in KINDS}


@st.composite
def programs(draw: Any, max_ops: int = 10, kinds: tuple[str, ...] = KINDS) -> Program:
    """A random :class:`Program` of at most ``max_ops`` ops drawn from ``kinds``."""
    dims = draw(st.sampled_from([2, 1, 3]))
    size = {1: 8, 2: 6, 3: 4}[dims]
    program = Program(dims, Value(draw(st.integers(2, 4)), (size,) * dims))
    values = program.values()
    # residual adds and heads at several depths drawn more often: they make branches of different alphas
    weighted = (*kinds, *(k for k in ("add", "head") if k in kinds))
    for _ in range(draw(st.integers(1, max_ops))):
        op = BUILDERS[draw(st.sampled_from(weighted))](draw, values, program.ops, dims)
        if op is not None:
            program.ops.append(op)
            values.extend(op.outputs)
    spatial = [k for k, v in enumerate(values) if v.size or k == 0]
    program.heads = sorted({len(values) - 1, *draw(st.lists(st.sampled_from(spatial), max_size=2))})
    if draw(st.booleans()):
        program.unused = _pick(draw, values)
    program.loss_factor = 2.0 ** -draw(st.integers(20, 40))
    names = [n for n, _ in GeneratedNet(program).named_parameters()]
    if names and draw(st.booleans()):
        program.frozen = sorted(draw(st.sets(st.sampled_from(names), max_size=max(1, len(names) // 3))))
    return program


# ------------------------------------------------------------------------------------------------- module


class _Functional(nn.Module):
    """Parameters of a functional GEMM (``F.linear(x, self.weight, self.bias)``)."""

    def __init__(self, in_c: int, out_c: int, bias: bool) -> None:
        super().__init__()
        layer = nn.Linear(in_c, out_c, bias=bias)
        self.weight, self.bias = layer.weight, layer.bias


class _SE(nn.Module):
    """Squeeze-excitation on any number of spatial dimensions: pool, two linear layers, a gate."""

    def __init__(self, channels: int, hidden: int, gate: str, dims: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(channels, hidden), nn.Linear(hidden, channels)
        self.gate = nn.Sigmoid() if gate == "sigmoid" else nn.Hardsigmoid()
        self.trailing = (1,) * dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.gate(self.fc2(torch.relu(self.fc1(x.flatten(2).mean(2)))))
        return x * s.reshape(s.shape + self.trailing)


class _TiedPair(nn.Module):
    """Two square linear layers with one weight (``second.weight is first.weight``), applied in turn."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(channels, channels), nn.Linear(channels, channels)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


class _Attention(nn.Module):
    def __init__(self, channels: int, projections: bool) -> None:
        super().__init__()
        self.q = nn.Linear(channels, channels) if projections else None
        self.k = nn.Linear(channels, channels) if projections else None
        self.v = nn.Linear(channels, channels) if projections else None


_INPLACE_MODULES = {"relu": nn.ReLU, "silu": nn.SiLU, "hardswish": nn.Hardswish}
_MODULES = {**_INPLACE_MODULES, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}
_INPLACE_FUNCTIONS = {
    "relu": torch.relu_,
    "tanh": torch.tanh_,
    "sigmoid": torch.sigmoid_,
    "silu": lambda x: F.silu(x, inplace=True),
    "hardswish": lambda x: F.hardswish(x, inplace=True),
}
_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
_BN = {0: nn.BatchNorm1d, 1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_IN = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}
_POOL = {
    "max": {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d},
    "avg": {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d},
}
_GLOBAL_POOL = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}
_LINEAR_MODE = {1: "linear", 2: "bilinear", 3: "trilinear"}


def _module(op: Op, program: Program, values: list[Value], built: dict[str, nn.Module]) -> nn.Module | None:
    """The module an op holds (None for ops without parameters or state)."""
    a = op.args
    src = values[op.inputs[0]]
    if op.kind == "conv":
        d = len(src.size)
        if a["transposed"]:
            pad = 0 if a["k"] == 2 else 1
            return _CONV_T[d](src.channels, a["out"], a["k"], a["s"], pad, groups=a["groups"], bias=a["bias"])
        pad = a["d"] * (a["k"] - 1) // 2
        return _CONV[d](src.channels, a["out"], a["k"], a["s"], pad, a["d"], a["groups"], a["bias"])
    if op.kind == "linear":
        if a["functional"]:
            return _Functional(src.channels, a["out"], a["bias"])
        return nn.Linear(src.channels, a["out"], bias=a["bias"])
    if op.kind == "norm":
        c, kind, affine = src.channels, a["kind"], a["affine"]
        if kind == "batch":
            return _BN[len(src.size)](c, affine=affine)
        if kind == "layer":
            return nn.LayerNorm(c, elementwise_affine=affine)
        if kind == "group":
            return nn.GroupNorm(a["groups"], c, affine=affine)
        return _IN[len(src.size)](c, affine=affine)
    if op.kind == "act" and a["how"] in ("module", "inplace_module"):
        if a["how"] == "inplace_module" and a["name"] in _INPLACE_MODULES:
            return _INPLACE_MODULES[a["name"]](inplace=True)
        return _MODULES[a["name"]]()
    if op.kind == "se":
        return _SE(src.channels, a["hidden"], a["gate"], len(src.size))
    if op.kind == "attention":
        return _Attention(src.channels, a["projections"])
    if op.kind == "tied" and a["op"] is None:
        return _TiedPair(src.channels)
    if op.kind == "tied" and not a["embedding"]:
        ref = built[str(a["op"])]
        layer = nn.Linear(ref.in_features, ref.out_features, bias=True)
        layer.weight = ref.weight  # the same Parameter: one weight, two GEMMs
        return layer
    if op.kind == "head":
        return nn.Linear(src.channels, CLASSES)
    if op.kind == "twice" and a["op"] is None:
        return nn.Linear(src.channels, src.channels)
    if op.kind == "rnn":
        return getattr(nn, a["kind"])(src.channels, a["hidden"], batch_first=True)
    if op.kind == "dropout":
        return nn.Dropout(a["p"])
    if op.kind == "computed":
        return _computed_layer(a, src)
    if op.kind == "experts":
        return _Experts(src.channels, a["experts"], a["grouped"], flat=not src.size)
    if op.kind == "patches":
        return _Attention(src.channels, True)
    return None


def _computed_layer(a: dict[str, Any], src: Value) -> nn.Module:
    d = len(src.size)
    layer = _CONV[d](src.channels, a["out"], 3, padding=1, bias=a["bias"]) if a["conv"] else None
    layer = layer or nn.Linear(src.channels, a["out"], bias=a["bias"])
    if a["how"] == "weight_norm":
        torch.nn.utils.parametrizations.weight_norm(layer)
    elif a["how"] == "old_weight_norm":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated, still in use (HiFi-GAN's code)
            torch.nn.utils.weight_norm(layer)
    elif a["how"] == "orthogonal":
        torch.nn.utils.parametrizations.orthogonal(layer)
    elif a["how"] == "gain":
        layer.gain = nn.Parameter(torch.rand(a["out"], *([1] * (layer.weight.dim() - 1))) + 0.5)
    return layer


def _computed_weight(a: dict[str, Any], m: Any) -> torch.Tensor | None:
    """The weight a ``computed`` op's functional forms multiply (None: the module computes its own)."""
    if a["how"] == "gain":
        return m.gain * m.weight
    if a["how"] == "standardized":
        dims = (1,) if isinstance(m, nn.Linear) else tuple(range(1, 2 + len(m.kernel_size)))  # the fan-in
        w = m.weight - m.weight.mean(dims, keepdim=True)
        return w / (w.square().mean(dims, keepdim=True) + 1e-5).sqrt()
    return None


class _Experts(nn.Module):
    """Top-1 routed experts over the tokens of a ``(B, C, *S)`` or ``(B, C)`` value: a router, a ``(E, C,
    C)`` weight, the token's expert output times its gate probability, added to the token."""

    def __init__(self, channels: int, experts: int, grouped: bool, flat: bool) -> None:
        super().__init__()
        self.router = nn.Linear(channels, experts)
        self.w = nn.Parameter(torch.randn(experts, channels, channels) / channels**0.5)
        self.experts, self.grouped, self.flat, self.channels = experts, grouped, flat, channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x if self.flat else x.flatten(2).transpose(1, 2).reshape(-1, self.channels)  # (tokens, C)
        probs = torch.softmax(self.router(t), -1)
        gate, idx = probs.max(-1)
        if self.grouped:
            order = idx.argsort(stable=True)
            offs = torch.cumsum(torch.bincount(idx, minlength=self.experts), 0).to(torch.int32)
            y = torch.ops.adaloss.grouped_mm(t[order], self.w, offs)
            y = torch.zeros_like(y).index_copy(0, order, y)
        else:
            y = torch.zeros_like(t)
            for e in range(self.experts):
                y = y + (idx == e).unsqueeze(-1).to(t.dtype) * (t @ self.w[e])
        y = t + y * gate.unsqueeze(-1)
        if self.flat:
            return y
        return y.reshape(x.shape[0], -1, self.channels).transpose(1, 2).reshape(x.shape)


def _patch_attention(a: dict[str, Any], m: Any, x: torch.Tensor) -> torch.Tensor:
    """MobileViT's unfold/fold: attention across the 2x2 patches, one sequence per pixel position (the
    sizes are the program's: fold takes them as Python ints)."""
    c, (h, w) = a["channels"], a["size"]
    n = h * w // 4
    p = F.unfold(x, kernel_size=2, stride=2)  # (B, C*4, L)
    t = p.reshape(-1, c, 4, n).permute(0, 2, 3, 1).reshape(-1, n, c)  # (B*4, L, C)
    o = F.scaled_dot_product_attention(m.q(t), m.k(t), m.v(t))
    o = o.reshape(-1, 4, n, c).permute(0, 3, 1, 2).reshape(-1, c * 4, n)
    return x + F.fold(o, (h, w), kernel_size=2, stride=2)


class GeneratedNet(nn.Module):
    """Runs a :class:`Program` (its ops unroll when torch.fx traces the forward pass)."""

    def __init__(self, program: Program) -> None:
        super().__init__()
        self.program = program
        self.mods = nn.ModuleDict()
        values = self.shapes = program.values()
        for k, op in enumerate(program.ops):
            m = _module(op, program, values, self.mods)
            if m is not None:
                self.mods[str(k)] = m
        self.heads = nn.ModuleDict(
            {
                str(i): nn.Linear(values[i].channels, CLASSES)
                for i in program.heads
                if values[i].size or i == 0
            }
        )
        frozen = set(program.frozen)
        for name, p in self.named_parameters():
            if name in frozen:
                p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> Any:
        vals = [x]
        for k, op in enumerate(self.program.ops):
            vals.extend(self._run(k, op, vals))
        out = None
        for i in self.program.heads:
            h = vals[i]
            if str(i) in self.heads:
                h = self.heads[str(i)](h.flatten(2).mean(2) if self.shapes[i].size else h)
            out = h if out is None else out + h
        if self.program.unused is not None:
            return {"out": out, "aux": vals[self.program.unused]}
        return out

    def _run(self, k: int, op: Op, vals: list[Any]) -> list[Any]:
        a, m = op.args, self.mods[str(k)] if str(k) in self.mods else None
        x = vals[op.inputs[0]]
        if op.kind in ("conv", "linear", "twice", "tied", "head", "norm", "rnn"):
            return [_layer(op, m, x, self.mods, self.program, self.shapes[op.inputs[0]])]
        if op.kind == "act":
            return [_activation(a, m, x)]
        if op.kind == "add":
            out = x
            for i in op.inputs[1:]:
                out = out + vals[i]
            return [out]
        if op.kind == "mul":
            y = vals[op.inputs[1]]
            return [x * (torch.sigmoid(y) if a["sigmoid"] else y)]
        if op.kind == "cat":
            return [torch.cat([x, vals[op.inputs[1]]], dim=1)]
        if op.kind == "chunk":
            parts = (
                x.chunk(2, 1)
                if a["split"] is None
                else torch.split(x, [a["split"], x.shape[1] - a["split"]], 1)
            )
            return [parts[0], parts[1]]
        if op.kind == "se":
            return [m(x)]
        if op.kind == "glu":
            if a["functional"]:
                return [F.glu(x, dim=1)]
            u, g = x.chunk(2, dim=1)
            return [u * torch.sigmoid(g)]
        return _run_more(op, m, x, vals, len(self.shapes[op.inputs[0]].size))


def _channels_last(layer: Any, x: torch.Tensor, flat: bool) -> torch.Tensor:
    """``layer`` over the channels of ``(B, C, *S)`` (or of a flat ``(B, C)`` value)."""
    if flat:
        return layer(x)
    return layer(x.movedim(1, -1)).movedim(-1, 1)


def _layer(op: Op, m: Any, x: torch.Tensor, mods: nn.ModuleDict, program: Program, v: Value) -> torch.Tensor:
    a, flat = op.args, not v.size
    if op.kind == "twice" and a["op"] is None:
        return _channels_last(m, torch.tanh(_channels_last(m, x, flat)), flat)
    if op.kind == "twice":
        ref = program.ops[a["op"]]
        m = mods[str(a["op"])]
        if ref.kind == "conv":
            return m(x)
        return _channels_last(m, x, flat)
    if op.kind == "conv" or (op.kind == "norm" and a["kind"] in ("batch", "group", "instance")):
        return m(x)
    if op.kind == "linear" and a["functional"]:
        return _channels_last(lambda t: F.linear(t, m.weight, m.bias), x, flat)
    if op.kind in ("linear", "norm"):
        return _channels_last(m, x, flat)
    if op.kind == "tied":
        if a["op"] is None or not a["embedding"]:
            return _channels_last(m, x, flat)
        weight = mods[str(a["op"])].weight  # (out, in): a table of ``out`` rows of size ``in``
        idx = torch.arange(x[0, 0].numel(), device=x.device).reshape(x.shape[2:]) % weight.shape[0]
        return x + F.embedding(idx, weight).movedim(-1, 0)
    if op.kind == "head":
        return m(x if flat else x.flatten(2).mean(2))
    # rnn: (B, C, L) -> (B, L, C) -> (B, L, H) -> (B, H, L)
    return m(x.transpose(1, 2))[0].transpose(1, 2)


def _activation(a: dict[str, Any], m: Any, x: torch.Tensor) -> torch.Tensor:
    name, how = a["name"], a["how"]
    if m is not None:
        return m(x)
    if how == "method_" and name in ("relu", "tanh", "sigmoid"):
        return getattr(x, f"{name}_")()
    return _INPLACE_FUNCTIONS[name](x)


def _attention(a: dict[str, Any], m: Any, x: torch.Tensor) -> torch.Tensor:
    b, c, h = x.shape[0], x.shape[1], a["heads"]
    t = x.flatten(2).transpose(1, 2)  # (B, L, C)
    q, k, v = (t, t, t) if m.q is None else (m.q(t), m.k(t), m.v(t))
    q, k, v = (z.reshape(b, -1, h, c // h).transpose(1, 2) for z in (q, k, v))  # (B, h, L, C/h)
    if a["sdpa"]:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=a["causal"])
    else:
        scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(c // h))
        if a["causal"]:
            n = a["tokens"]
            mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        o = torch.softmax(scores, dim=-1) @ v
    return o.transpose(1, 2).reshape(b, -1, c).transpose(1, 2).reshape(x.shape)


def _run_more(op: Op, m: Any, x: torch.Tensor, vals: list[Any], d: int) -> list[Any]:
    a = op.args
    if op.kind == "pool":
        return [_GLOBAL_POOL[d](x, 1) if a["kind"] == "global" else _POOL[a["kind"]][d](x, 2)]
    if op.kind == "interp":
        mode = "nearest" if a["mode"] == "nearest" else _LINEAR_MODE[d]
        return [
            F.interpolate(
                x, scale_factor=2, mode=mode, **({} if mode == "nearest" else {"align_corners": False})
            )
        ]
    if op.kind == "attention":
        return [_attention(a, m, x)]
    if op.kind == "sizes":
        y, sizes, channels = with_sizes(x)
        y = y.reshape((y.shape[0], channels) + sizes)  # the sizes and the channel count used twice each
        return [y.narrow(2, 0, sizes[0]) * (channels / channels)]
    if op.kind == "add_into":
        add_into(x, vals[op.inputs[1]])
        return [x]
    if op.kind == "add_":
        x.add_(vals[op.inputs[1]])
        return [x]
    if op.kind == "dropout":
        return [m(x)]
    if op.kind == "computed":
        w = _computed_weight(a, m)
        if w is None:
            return [m(x) if a["conv"] else _channels_last(m, x, not d)]
        if a["conv"]:
            return [m._conv_forward(x, w, m.bias)]
        return [_channels_last(lambda t: F.linear(t, w, m.bias), x, not d)]
    if op.kind == "experts":
        return [m(x)]
    if op.kind == "patches":
        return [_patch_attention(a, m, x)]
    raise ValueError(op.kind)
