"""In-place ops in a traced graph, for the adaptive transform.

The transform hands each consumer of a shared value its own alias (a branch point) and puts identity
autograd nodes on GEMM outputs, and autograd forbids writing into the views such nodes return. Two passes
keep a model's in-place ops meaning what they meant:

* :func:`redirect_mutations`, before the rewrite: an op that writes into a value (``x.add_(p)``,
  ``torch.relu_(x)``, ``nn.ReLU(inplace=True)``, ``F.relu(x, inplace=True)``) is where that value changes,
  so every op after it reads the op's result instead of the value (they are the same tensor in the plain
  model). Without this, a branch point would give the readers after the write an alias the write never
  reaches (MViT's positional encoding, ``x.add_(pos); return x``). A write into a *view* of a value that
  is read afterwards cannot be redirected that way and is refused by name.
* :func:`needs_copy`, after it: an op that writes into one of the transform's outputs, directly, through
  views, or inside a function fx keeps as a leaf, gets :func:`writable` (a copy if the output is a view).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from adaloss.errors import ConfigError

__all__ = [
    "FIXED_VIEW_FUNCTIONS",
    "FIXED_VIEW_METHODS",
    "VIEW_FUNCTIONS",
    "VIEW_METHODS",
    "needs_copy",
    "redirect_mutations",
    "writable",
]

# ops that return a view of their first argument: those through which a GEMM weight may come as a fixed
# view of a parameter (with constant arguments), and the others
FIXED_VIEW_METHODS = {
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
FIXED_VIEW_FUNCTIONS = {
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
VIEW_METHODS = FIXED_VIEW_METHODS | {
    "expand",
    "view_as",
    "expand_as",
    "select",
    "unbind",
    "movedim",
    "swapaxes",
    "diagonal",
    "unfold",
    "tensor_split",
}
VIEW_FUNCTIONS = FIXED_VIEW_FUNCTIONS | {
    torch.select,
    torch.unbind,
    torch.movedim,
    torch.swapaxes,
    torch.diagonal,
    torch.tensor_split,
}

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

#: Where the functions of a traced graph come from when they are ops whose effect on their inputs is known
#: by name (an in-place op ends with an underscore).
_KNOWN_MODULES = ("torch", "_operator", "operator", "math", "builtins", "_tensor")


class MutationError(ConfigError):
    """An in-place write the adaptive transform cannot keep visible to the ops that read it."""


def writable(x: Any) -> Any:
    """``x``, or a copy of it if it is a view (what an identity autograd node returns, or a linear layer's
    output on a 3-D input): the input of an op that writes in place. Costs a copy only for views; a value
    that is not a tensor (an int passed to a leaf function) is returned as it is."""
    return x.clone() if isinstance(x, torch.Tensor) and x._base is not None else x


def mutated_input(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The node ``node`` writes into (its first argument), if it is an in-place op: a module built with
    ``inplace=True``, a method or function named with a trailing underscore (``relu_``), an augmented
    assignment operator, or a call with ``inplace=True``."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    first = node.args[0]
    if node.op == "call_module":
        return first if getattr(gm.get_submodule(node.target), "inplace", False) is True else None
    if node.op == "call_method":
        return first if node.target.endswith("_") and not node.target.startswith("_") else None
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True:
            return first
        # an ATen op's name is ``add_.Tensor``: its ``_opname`` is the part before the overload
        name = getattr(node.target, "_opname", None) or getattr(node.target, "__name__", "")
        return first if name.endswith("_") and not name.startswith("_") else None
    return None


def opaque_function(node: fx.Node) -> bool:
    """Whether ``node`` calls a function fx kept as a leaf (``torch.fx.wrap``: MViT's ``_add_rel_pos``,
    which adds into its first argument), which may write into any tensor it is given."""
    if node.op != "call_function":
        return False
    module = getattr(node.target, "__module__", None) or ""
    return module.split(".")[0] not in (*_KNOWN_MODULES, "adaloss")


class OpaqueCall(torch.nn.Module):
    """A call of a leaf function whose arguments other ops read after it: returns ``(result, *those
    arguments)``, so the ops after the call read the values as the function left them (MViT's
    ``_add_shortcut(x, q)`` adds ``q`` into ``x`` and returns nothing).

    ``watched``: arguments that share their storage with a value other ops read after the call (a view of
    it, or it of them). A write into such an argument would change that value in the plain model, but the
    rewrite hands the function a copy: the call compares the arguments' version counters before and after
    and refuses a write by name."""

    def __init__(self, fn: Any, positions: tuple[int | str, ...], watched: dict[int | str, str]) -> None:
        super().__init__()
        self.fn, self.positions, self.watched = fn, positions, watched

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        def arg(p: int | str) -> Any:
            return args[p] if isinstance(p, int) else kwargs[p]

        versions = {p: arg(p)._version for p in self.watched if isinstance(arg(p), torch.Tensor)}
        result = self.fn(*args, **kwargs)
        for p, version in versions.items():
            if arg(p)._version != version:
                raise MutationError(
                    f"adaptive loss scaling: {getattr(self.fn, '__qualname__', self.fn)} wrote into its "
                    f"argument {p!r}, {self.watched[p]}; the transform gives each reader of a shared value "
                    "its own alias, which that write would not reach: make the function return the value "
                    "it changes, or compute it out of place"
                )
        return (result, *(arg(p) for p in self.positions))

    def extra_repr(self) -> str:
        return f"{getattr(self.fn, '__qualname__', self.fn)}, returning its arguments {self.positions}"


#: ``node.meta`` key: the value a node is the same tensor as (an in-place op's result is the tensor written
#: into; an :class:`OpaqueCall` returns its arguments)
ALIAS_OF = "adaloss_alias_of"

#: view ops that return a tuple of views (``getitem`` on their result is a view of their input)
_TUPLE_VIEW_METHODS = {"split", "chunk", "unbind", "tensor_split"}
_TUPLE_VIEW_FUNCTIONS = {torch.split, torch.chunk, torch.unbind, torch.tensor_split}


def view_source(node: fx.Node) -> fx.Node | None:
    """The node whose storage ``node`` is a view of, or None. ``getitem`` is a view of a tensor it indexes
    (``x[:, 1:]``), or of the input of a view op returning a tuple (``x.chunk(2)[0]``); indexing any other
    tuple (a module's outputs: ``getitem`` with an int on a value only read that way) is not a view."""
    alias = node.meta.get(ALIAS_OF)
    if alias is not None:
        return alias
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    src = node.args[0]
    if node.op == "call_function" and node.target is operator.getitem:
        if _returns_views(src):
            return src
        tuple_like = all(
            u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
            for u in src.users
        )
        return None if tuple_like else src
    return src if is_view_op(node) else None


def aten_view(target: Any) -> bool:
    """Whether ``target`` is an ATen op (of a graph captured with ``torch.export``) that returns a view."""
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def _returns_views(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _TUPLE_VIEW_METHODS
    if node.op == "call_function" and aten_view(node.target):  # aten.split, aten.unbind, ...
        return isinstance(node.target._schema.returns[0].type, torch.ListType)
    return node.op == "call_function" and node.target in _TUPLE_VIEW_FUNCTIONS


def is_view_op(node: fx.Node) -> bool:
    """Whether ``node`` returns a view of its first argument (indexing included)."""
    if node.op == "call_method":
        return node.target in VIEW_METHODS or node.target in _TUPLE_VIEW_METHODS
    if node.op == "call_function":
        return (
            node.target in VIEW_FUNCTIONS
            or node.target in _TUPLE_VIEW_FUNCTIONS
            or node.target is operator.getitem
            or aten_view(node.target)
        )
    return False


def needs_copy(gm: fx.GraphModule, user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` of ``node`` writes into it: directly, inside a leaf function, or into a view of it
    (through any chain of view ops)."""
    if opaque_function(user) or mutated_input(gm, user) is node:
        return True
    if user.op == "call_module" and isinstance(gm.get_submodule(user.target), OpaqueCall):
        return True
    if is_view_op(user) and user.args and user.args[0] is node:
        return any(needs_copy(gm, u, user) for u in user.users)
    return False


def aliased_read(target: fx.Node, write: fx.Node, position: dict[fx.Node, int]) -> fx.Node | None:
    """A value sharing storage with ``target`` (its base, another view of that base, or a view of
    ``target`` taken before ``write``) that an op reads after ``write``, if there is one. Such a read sees
    the write in the plain model, but not once the rewrite gives the readers of a shared value aliases
    (reads of ``target`` itself after the write are redirected to the write's result)."""
    chain = [target]
    while (src := view_source(chain[-1])) is not None:
        chain.append(src)
    stack, seen = [chain[-1]], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        # n's readers, and the nodes that are the same tensor as n without reading it directly (an
        # OpaqueCall's outputs are getitems of the call)
        passed = [g for u in n.users for g in u.users if g.meta.get(ALIAS_OF) is n and g not in n.users]
        for u in [*n.users, *passed]:
            if u is write:
                continue
            if view_source(u) is n:
                if _returns_views(n) and n in chain and u not in chain:
                    continue  # another piece of the same split or chunk: other elements
                if n is not target or position[u] < position[write]:
                    stack.append(u)  # a view of the same storage (one of target's, if taken before)
            elif n is not target and position[u] > position[write]:
                return n
    return None


def redirect_mutations(gm: fx.GraphModule, skip: Any, keep: Any = ()) -> None:
    """Every op after an in-place write into a value reads the write's result instead (module
    docstring). ``skip(node)``: values left alone (parameters, buffers, sizes); ``keep``: leaf functions
    the transform rewrites itself (Swin's attention)."""
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if opaque_function(node) and node.target not in keep:
            _wrap_opaque_call(gm, node, skip, position)
            continue
        target = mutated_input(gm, node)
        if target is None or skip(target):
            continue
        other = aliased_read(target, node, position)
        if other is not None:
            raise MutationError(
                f"adaptive loss scaling: '{node.name}' ({_describe(node)}) writes in place into "
                f"'{target.name}', which shares its storage with '{other.name}', read after the write; the "
                "transform gives each reader of a shared value its own alias, which that write would not "
                "reach: compute it out of place (torch.cat, torch.where, x * mask) instead"
            )
        for user in [u for u in target.users if u is not node and position[u] > position[node]]:
            user.replace_input_with(target, node)
        node.meta[ALIAS_OF] = target


def _wrap_opaque_call(gm: fx.GraphModule, node: fx.Node, skip: Any, position: dict[fx.Node, int]) -> None:
    """A leaf function's call becomes an :class:`OpaqueCall` if ops after it read its tensor arguments
    (they read the arguments it returns instead: the function may have written into them), or if an
    argument shares its storage with a value read after the call (a write into it is refused at run
    time)."""
    args = [(p, a) for p, a in (*enumerate(node.args), *node.kwargs.items()) if isinstance(a, fx.Node)]
    positions = tuple(
        p
        for p, a in args
        if not skip(a) and any(u is not node and position[u] > position[node] for u in a.users)
    )
    watched = {}
    for p, a in args:
        other = None if skip(a) else aliased_read(a, node, position)
        if other is not None:
            watched[p] = f"which shares its storage with '{other.name}', read after the call"
    if not positions and not watched:
        return
    name = f"_adaloss_opaque_{sum(1 for _ in gm.named_children())}"
    gm.add_submodule(name, OpaqueCall(node.target, positions, watched))
    with gm.graph.inserting_after(node):
        call = gm.graph.call_module(name, node.args, node.kwargs)
    outs, prev = [], call
    for i in range(len(positions) + 1):
        with gm.graph.inserting_after(prev):
            prev = gm.graph.call_function(operator.getitem, (call, i))
        outs.append(prev)
    for n in (call, *outs):
        position[n] = position[node]
    node.replace_all_uses_with(outs[0])
    for p, out in zip(positions, outs[1:], strict=True):
        arg = node.args[p] if isinstance(p, int) else node.kwargs[p]
        out.meta[ALIAS_OF] = arg
        for user in [u for u in arg.users if u is not call and position[u] > position[node]]:
            user.replace_input_with(arg, out)
    gm.graph.erase_node(node)


def _describe(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"module {node.target}"
    return getattr(node.target, "__name__", str(node.target))
