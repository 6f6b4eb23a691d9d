"""Weights computed from parameters: which graph values they are, what they hold, and what they are called.

A GEMM's weight operand need not be a parameter: weight norm (``torch.nn.utils.parametrizations.
weight_norm`` and the older ``nn.utils.weight_norm``), any ``torch.nn.utils.parametrize`` parametrization
(orthogonal, spectral norm), weight standardization (timm's ``StdConv2d``: the weight minus its mean over
its fan-in, divided by its deviation) and a weight times a gain are tensors computed from parameters in the
forward pass. :class:`WeightSources` tells them apart from activations in a traced or captured graph: a
value no model input reaches (only parameters, buffers and constants) that depends on at least one
parameter. The rewrite makes a GEMM with such a weight a scaling point like any other; the GEMM multiplies
(and Algorithm 4 takes the statistics of) the computed weight, and the weight's gradient, which leaves the
point at the root scale, flows back through the computation to the parameters. A value that has both a GEMM
and another reader gets its other reads unscaled by their own alpha, as a parameter's would be.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
from torch import nn

__all__ = ["WeightSources", "computed_weight_params", "kept_buffers", "weight_name"]


def _get_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _inputs(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


class WeightSources:
    """Per graph value: whether no model input reaches it (``free``) and whether a parameter does
    (``depends``), computed once in graph order; nodes added later are computed from their inputs."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.free: dict[fx.Node, bool] = {}
        self.depends: dict[fx.Node, bool] = {}
        for node in gm.graph.nodes:
            self._compute(node)

    def _compute(self, node: fx.Node) -> None:
        inputs = _inputs(node)
        for n in inputs:
            if n not in self.free:
                self._compute(n)
        if node.op == "get_attr":
            self.free[node] = True
            self.depends[node] = isinstance(_get_attr(self.gm, node.target), nn.Parameter)
        elif node.op in ("call_function", "call_method", "call_module"):
            self.free[node] = all(self.free[n] for n in inputs)
            own = node.op == "call_module" and any(
                True for _ in self.gm.get_submodule(node.target).parameters()
            )
            self.depends[node] = own or any(self.depends[n] for n in inputs)
        else:  # placeholder, output
            self.free[node] = self.depends[node] = False

    def is_free(self, value: Any) -> bool:
        """Whether ``value`` is computed without any model input (a constant counts)."""
        if not isinstance(value, fx.Node):
            return True
        if value not in self.free:
            self._compute(value)
        return self.free[value]

    def is_weight(self, value: Any) -> bool:
        """Whether ``value`` is a tensor computed from parameters alone (a parameter itself included)."""
        return isinstance(value, fx.Node) and self.is_free(value) and self.depends[value]

    def chain(self, node: fx.Node) -> list[fx.Node]:
        """The nodes that compute the weight ``node`` and depend on a parameter, in graph order (``node``
        last): the ones whose gradients arrive at the root scale from the GEMM."""
        seen: dict[fx.Node, None] = {}
        todo = [node]
        while todo:
            n = todo.pop()
            if n in seen or not self.depends.get(n, False):
                continue
            seen[n] = None
            todo.extend(_inputs(n))
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        return sorted(seen, key=lambda n: order.get(n, len(order)))

    def params(self, node: fx.Node) -> list[tuple[str, nn.Parameter]]:
        """The parameters (with their qualified names) the weight ``node`` is computed from."""
        out: dict[int, tuple[str, nn.Parameter]] = {}
        for n in self.chain(node):
            if n.op == "get_attr":
                p = _get_attr(self.gm, n.target)
                if isinstance(p, nn.Parameter):
                    out.setdefault(id(p), (n.target, p))
            elif n.op == "call_module":
                for name, p in self.gm.get_submodule(n.target).named_parameters():
                    out.setdefault(id(p), (f"{n.target}.{name}", p))
        return list(out.values())

    def value(self, node: fx.Node) -> torch.Tensor:
        """The tensor the weight ``node`` holds now, computed without a graph, for its shape. Buffers that
        a parametrization updates as it runs (spectral norm's power iteration) are restored after."""
        values: dict[fx.Node, Any] = {}
        load = lambda a: fx.node.map_arg(a, lambda n: values[n])  # noqa: E731
        nodes = self.chain_all(node)
        state = (
            nn.Module()
        )  # the buffers the computation may write (``div.out(..., out=_u)``), restored after
        for n in nodes:
            held = _get_attr(self.gm, n.target) if n.op == "get_attr" else None
            if isinstance(held, torch.Tensor) and not isinstance(held, nn.Parameter):
                state.register_buffer(f"b{len(state._buffers)}", held)
            elif n.op == "call_module":
                state.add_module(f"m{len(state._modules)}", self.gm.get_submodule(n.target))
        with kept_buffers(state):
            for n in nodes:
                if n.op == "get_attr":
                    values[n] = _get_attr(self.gm, n.target)
                elif n.op == "call_function":
                    values[n] = n.target(*load(n.args), **load(n.kwargs))
                elif n.op == "call_method":
                    self_arg, *rest = load(n.args)
                    values[n] = getattr(self_arg, n.target)(*rest, **load(n.kwargs))
                else:
                    values[n] = self.gm.get_submodule(n.target)(*load(n.args), **load(n.kwargs))
        return values[node].detach()

    def chain_all(self, node: fx.Node) -> list[fx.Node]:
        """Every node ``node`` is computed from (constants and buffers too), in graph order."""
        seen: dict[fx.Node, None] = {}
        todo = [node]
        while todo:
            n = todo.pop()
            if n not in seen:
                seen[n] = None
                todo.extend(_inputs(n))
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        return sorted(seen, key=lambda n: order.get(n, len(order)))


@contextmanager
def kept_buffers(module: nn.Module) -> Iterator[None]:
    """Run a look at a module's output without its side effects on its buffers; no gradient recorded."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        with torch.no_grad():
            yield
    finally:
        with torch.no_grad():
            for b, copy in saved:
                b.copy_(copy)


_PARAMETRIZED = re.compile(r"\.?parametrizations\.(\w+)\.original\d*$")


def weight_name(names: list[str]) -> str:
    """A GEMM point's name from the names of the parameters under its weight: the largest one's
    (``names[0]``), with its weight suffix dropped: ``blocks.0.attn.qkv.weight`` -> ``blocks.0.attn.qkv``,
    ``self_attn.in_proj_weight`` -> ``self_attn.in_proj``, weight norm's ``conv.weight_v`` and
    ``conv.parametrizations.weight.original1`` -> ``conv``."""
    target = names[0]
    parametrized = _PARAMETRIZED.search(target)
    if parametrized:
        return target[: parametrized.start()] or parametrized.group(1)
    for suffix in (".weight", "_weight", ".weight_v", ".weight_g", ".weight_orig"):
        if target.endswith(suffix):
            return target[: -len(suffix)]
    return target


def computed_weight_params(layer: nn.Module) -> list[tuple[str, nn.Parameter]] | None:
    """For a conv or linear module whose ``weight`` is not a parameter but computed from some (a
    parametrization, an old-style ``weight_norm`` / ``spectral_norm`` hook), those parameters with their
    names in the module; None for a plain layer."""
    if isinstance(layer._parameters.get("weight"), nn.Parameter):
        return None
    if torch.nn.utils.parametrize.is_parametrized(layer, "weight"):
        plist = layer.parametrizations["weight"]
        return [(f"parametrizations.weight.{n}", p) for n, p in plist.named_parameters()]
    return [(n, p) for n, p in layer._parameters.items() if p is not None and n.startswith("weight")]
