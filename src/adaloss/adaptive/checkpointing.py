"""Gradient checkpointing of a captured transformers model: each checkpointed block of the rewritten graph
recomputed in the backward pass, so its activations are freed after the forward pass.

``torch.export`` records a model with ``gradient_checkpointing_enable()`` on as the ops it runs: the
checkpoint is traced through, and the captured graph alone would keep every activation. The capture keeps
the blocks apart instead. transformers checkpoints its repeated layers (``GradientCheckpointingLayer``:
GPT-2's ``transformer.h.0``, Llama's ``model.layers.0``, BERT's ``bert.encoder.layer.0``), and every node
the export records inside one carries the layer in ``meta["nn_module_stack"]``. :func:`checkpointed_graph`
splits the rewritten graph at the layers (the nodes from a layer's first to its last, the scaling nodes
the rewrite put between them included) into one submodule per layer, and :class:`CheckpointedBlock` calls
each through the layer's own ``_gradient_checkpointing_func`` (``torch.utils.checkpoint.checkpoint`` with
the model's ``gradient_checkpointing_kwargs``) whenever that layer's ``gradient_checkpointing`` flag is on
and the model trains, as the layer itself would. The recomputed forward pass runs the rewritten ops again,
so the backward pass reaches the same scaling points.

What a recompute may and may not do: the backward pass uses the autograd nodes of the first forward pass
(non-reentrant checkpointing replaces only their saved tensors), so the pass kind, the points, the FP8
gradient sites and the telemetry probes each node kept are those of the first pass; what the recomputed
nodes note of their own is dropped with them. The operands of a product's beta travel as saved tensors
(:class:`~adaloss.adaptive.ops.ScaledProduct`), so they are freed and recomputed too. Dropout replays the
same masks (checkpoint restores the RNG state), and the CPU emulation active in the forward pass
(:class:`~adaloss.numerics.emulation.EmulatedAutocast`, which checkpoint does not know as it knows
autocast) is re-entered for the recompute, so the recomputed values are the stored ones.

transformers is not imported here: without it loaded, a model has no such layers.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module

from adaloss.errors import ConfigError
from adaloss.numerics.emulation import EmulatedAutocast, active_emulation

__all__ = ["CheckpointedBlock", "checkpointable_layers", "checkpointed_graph"]

#: ``gradient_checkpointing_kwargs`` the capture cannot honour, and why
_REFUSED = {
    "use_reentrant": "reentrant checkpointing runs the block again in a backward pass of its own",
    "context_fn": "the capture sets it to re-enter the CPU emulation in the recompute",
}


def checkpointable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """transformers' ``GradientCheckpointingLayer`` modules of ``model`` by qualified name; none where
    transformers was never imported."""
    layers = sys.modules.get("transformers.modeling_layers")
    kind = getattr(layers, "GradientCheckpointingLayer", None)
    if kind is None:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, kind)}


def checkpointing(layers: dict[str, nn.Module]) -> bool:
    """Whether some layer has transformers' ``gradient_checkpointing`` flag on (a few attribute reads)."""
    return any(getattr(m, "gradient_checkpointing", False) for m in layers.values())


def _owner(node: fx.Node, layers: dict[str, nn.Module]) -> str | None:
    """The layer of ``layers`` inside whose call the export recorded ``node`` (None: outside every one)."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if path in layers:
            return path
    return None


def _partition(gm: fx.GraphModule, layers: dict[str, nn.Module]) -> tuple[dict[fx.Node, int], dict[int, str]]:
    """Each node's partition: a layer's nodes from its first to its last (in graph order) form one, the
    nodes between two layers another. Returns the partition of every node and the layer of each layer
    partition."""
    nodes = list(gm.graph.nodes)
    spans: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        owner = _owner(node, layers)
        if owner is not None:
            spans.setdefault(owner, [i, i])[1] = i
    starts = {first: (path, last) for path, (first, last) in spans.items()}
    part: dict[fx.Node, int] = {}
    layer_of: dict[int, str] = {}
    index, end = 0, -1
    for i, node in enumerate(nodes):
        if i in starts:
            if i <= end:
                raise ConfigError(
                    f"gradient checkpointing: the captured graph interleaves {starts[i][0]} with the layer "
                    "before it; turn checkpointing off (model.gradient_checkpointing_disable()) to train it"
                )
            index += 1
            layer_of[index], end = starts[i]
        elif i == end + 1 and index in layer_of:  # the first node after a layer
            index += 1
        part[node] = index
    return part, layer_of


def checkpointed_graph(gm: fx.GraphModule, layers: dict[str, nn.Module]) -> fx.GraphModule:
    """``gm`` (a captured, rewritten graph) with each layer of ``layers`` a :class:`CheckpointedBlock`
    submodule (``checkpoint_<layer>``); the other nodes between them as they were, in submodules of their
    own. Parameters and modules are ``gm``'s own objects. Cost: one pass over the graph and a recompile
    (milliseconds; made once per capture, on the first checkpointed call)."""
    part, layer_of = _partition(gm, layers)
    if not layer_of:
        named = ", ".join(sorted(layers)[:3])
        raise ConfigError(
            f"gradient checkpointing: none of the layers {named}, ... is named in the "
            "captured graph (its nodes' nn_module_stack), so none can be recomputed; turn checkpointing off "
            "(model.gradient_checkpointing_disable()) to train the captured model"
        )
    split = split_module(gm, None, lambda node: part[node], keep_original_order=True)
    for index, path in layer_of.items():
        name = f"submod_{index}"
        block = CheckpointedBlock(path, layers[path], getattr(split, name))
        delattr(split, name)
        target = f"checkpoint_{path.replace('.', '_')}"
        split.add_submodule(target, block)
        for node in split.graph.nodes:
            if node.op == "call_module" and node.target == name:
                node.target = target
    # the export's calling convention: keyword inputs flattened, the output (a ModelOutput) rebuilt
    split.graph._codegen = copy.deepcopy(gm.graph._codegen)
    split.graph.lint()
    split.recompile()
    return split


class CheckpointedBlock(nn.Module):
    """One transformers layer's part of a captured graph, checkpointed as the layer would be: through the
    layer's ``_gradient_checkpointing_func`` while its ``gradient_checkpointing`` flag is on, the layer
    trains and gradients are recorded, else called directly. The flag is read on each call, so
    ``gradient_checkpointing_enable()`` / ``disable()`` after ``attach()`` (and ``every_n_layers``) take
    effect as on the model's own forward. No host sync."""

    def __init__(self, path: str, layer: nn.Module, block: fx.GraphModule) -> None:
        super().__init__()
        self.path = path
        self.block = block
        object.__setattr__(self, "layer", layer)  # the model's module: not registered a second time

    def forward(self, *args: Any) -> Any:
        layer = self.layer
        on = getattr(layer, "gradient_checkpointing", False) and layer.training
        if not (on and torch.is_grad_enabled()):
            return self.block(*args)
        run = layer._gradient_checkpointing_func
        given = getattr(run, "keywords", {})
        for key, why in _REFUSED.items():
            if given.get(key, False):
                raise ConfigError(
                    f"gradient checkpointing of {self.path} with {key} given: {why}, which the "
                    "adaptive scaler's captured model does not support; call model.gradient_checkpointing_"
                    "enable(gradient_checkpointing_kwargs={'use_reentrant': False}) before attach()"
                )
        return run(self.block, *args, use_reentrant=False, context_fn=_recompute_contexts)

    def extra_repr(self) -> str:
        return f"{self.path}, checkpointed while its gradient_checkpointing flag is on"


def _recompute_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``checkpoint``'s ``context_fn``: nothing around the forward pass; around the recompute, the CPU
    emulation active in the forward pass (None: nothing)."""
    return contextlib.nullcontext(), _reentered(active_emulation())


@contextlib.contextmanager
def _reentered(emulation: EmulatedAutocast | None) -> Iterator[None]:
    """``emulation`` active again for a recompute in the backward pass, unless it still is."""
    if emulation is None or active_emulation() is emulation:
        yield
        return
    with emulation:
        yield
