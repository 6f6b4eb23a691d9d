"""Capture a model torch.fx cannot trace symbolically with ``torch.export``, for the same rewrite.

Models that branch on their inputs' Python values (Hugging Face transformers: ``GPT2LMHeadModel``,
``LlamaForCausalLM``, ``BertForSequenceClassification``, ...) do not trace with fx's symbolic tracer. Given
example inputs, :func:`capture` runs ``torch.export.export(..., strict=False)`` on them instead, with every
dimension of every tensor input of up to 3 dimensions ``Dim.AUTO`` (dynamic where the model allows, so one
capture serves other batch sizes and sequence lengths) and only the batch dimension of an image (4 or
more dimensions: another image size needs another ``attach``), and brings the exported graph to the
vocabulary the passes of :mod:`adaloss.adaptive.transform` read (:func:`to_torch_ops`): ATen GEMMs,
products and attention become the torch functions the recognizers know
(:data:`adaloss.adaptive.gemms.ATEN_AS_TORCH`: ``aten.linear`` -> ``F.linear``, ``aten.addmm`` (GPT-2's
``Conv1D``) -> ``torch.addmm``, transformers' ``grouped_mm_fallback`` -> ``torch._grouped_mm``, ...), the
dropouts, whose ``train`` flag export fixes, become ``nn.Dropout`` modules that follow ``train()`` /
``eval()``, and the other arguments export fixes at their training-mode value (attention's
``dropout_p``, batch norm's ``training``) become :class:`TrainingValue` calls. The graph's parameters are
the model's own objects, read by their qualified names (``transformer.h.0.attn.c_attn.weight``), so the
points are named after the model's modules.

:class:`CapturedForward` then becomes the model's own ``forward`` (an instance attribute): the model keeps
its class, its ``state_dict()`` keys and its methods (``generate()``, ``save_pretrained()``). A call with
the captured arguments (the same positional count and keywords; other shapes are fine) runs the rewritten
graph; any other call runs the model's own forward when no gradient is recorded (``generate()`` under
``torch.no_grad()``: the values are the same, only the backward pass differs), and is refused otherwise.
With transformers' gradient checkpointing on (before or after the capture), a training call runs the
rewritten graph split at the checkpointed layers, each recomputed in the backward pass
(:mod:`adaloss.adaptive.checkpointing`).
"""

from __future__ import annotations

import inspect
import traceback
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from adaloss.adaptive.checkpointing import checkpointable_layers, checkpointed_graph, checkpointing
from adaloss.adaptive.gemms import ATEN_AS_TORCH, as_torch
from adaloss.errors import ConfigError

__all__ = ["ATEN_AS_TORCH", "ATEN_METADATA", "CapturedForward", "TrainingValue", "capture", "to_torch_ops"]

_aten = torch.ops.aten

#: ATen ops that read only a tensor's metadata (sizes, strides) or check it: no gradient flows through them
ATEN_METADATA = {
    _aten.sym_size.int,
    _aten.sym_numel.default,
    _aten.sym_stride.int,
    _aten.sym_storage_offset.default,
    _aten._assert_tensor_metadata.default,
}

#: ops whose ``train`` argument export fixes and the rewrite cannot make follow ``train()`` / ``eval()``
_TRAINING_FIXED = {
    _aten.feature_dropout.default: "feature dropout",
    _aten.alpha_dropout.default: "alpha dropout",
}
#: ops with a training-mode argument the capture makes follow the mode: its position, its value in eval mode
_FOLLOWS_MODE = {
    F.scaled_dot_product_attention: (4, 0.0),  # dropout_p
    _aten.batch_norm.default: (5, False),  # training (with running statistics: argument 3 is a tensor)
    _aten.instance_norm.default: (5, False),  # use_input_stats (likewise)
}

_NORMS = (_aten.batch_norm.default, _aten.instance_norm.default)

#: the call_module node with which ``ep.module()`` checks its inputs against the exported shapes
GUARDS = "_guards_fn"


class CaptureError(ConfigError):
    """The model could not be captured with ``torch.export`` (raised as ``AdaptiveTransformError``)."""


class TrainingValue(nn.Module):
    """An argument export fixed at its training-mode value: ``training`` while the model trains, ``eval``
    otherwise (an attention call's ``dropout_p``: p or 0; batch norm's ``training``: True or False)."""

    def __init__(self, training: Any, eval: Any) -> None:  # noqa: A002 - the mode's name
        super().__init__()
        self.values = (training, eval)

    def forward(self) -> Any:
        return self.values[0] if self.training else self.values[1]

    def extra_repr(self) -> str:
        return f"{self.values[0]} while training, else {self.values[1]}"


#: tensor inputs of this many dimensions or more (images, video) get only their batch dimension dynamic
STATIC_FROM_DIMS = 4


def _dynamic_shapes(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``Dim.AUTO`` (export specializes the ones the model fixes) for every dimension of every tensor input
    of up to 3 dimensions (token ids, masks, sequences, audio: other batch sizes and lengths), for the batch
    dimension only of an input of :data:`STATIC_FROM_DIMS` or more (images: the spatial sizes static, as the
    reasoning about dynamic sizes through a MobileViT's unfold/fold blocks grows without bound); None for
    everything else."""

    def spec(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            dims = range(v.dim()) if v.dim() < STATIC_FROM_DIMS else range(1)
            return {d: torch.export.Dim.AUTO for d in dims} if v.dim() else None
        return torch.utils._pytree.tree_map(lambda _: None, v)

    return tuple(spec(a) for a in args), {k: spec(v) for k, v in kwargs.items()}


def capture(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """``model`` exported on the example inputs (in training mode, so every dropout is in the graph) as an fx
    GraphModule whose ATen ops the transform reads (:func:`to_torch_ops`). Parameters are the model's own."""
    was_training = model.training
    model.train()
    try:
        dynamic_args, dynamic_kwargs = _dynamic_shapes(args, kwargs)
        shapes = {
            **dict(zip(_positional_names(model, len(args)), dynamic_args, strict=True)),
            **dynamic_kwargs,
        }
        program = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=shapes or None)
    except Exception as exc:  # export raises many types; the first line names the construct
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = " (a transformers model returning its key/value cache: pass use_cache=False)" * (
            "Cache" in first_line
        ) + _data_dependent_hint(model, exc)
        raise CaptureError(
            f"the adaptive scaler cannot rewrite {type(model).__name__}: torch.fx could not trace it and "
            f"torch.export could not capture it on the example inputs ({type(exc).__name__}: {first_line})"
            f"{hint}"
        ) from exc
    finally:
        model.train(was_training)
    gm = program.module()
    to_torch_ops(gm)
    return gm


def _data_dependent_hint(model: nn.Module, exc: BaseException) -> str:
    """For an export stopped by control flow on a tensor's values (a loop over the experts that received
    tokens, ``if mask.any()``): where it is in the model's code and what avoids it; else ""."""
    if "DataDependent" not in type(exc).__name__ and "data-dependent" not in str(exc):
        return ""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not any(part in f.filename for part in ("/torch/", "/adaloss/", "<"))
    ]
    where = (
        f" at {frames[-1].filename}:{frames[-1].lineno} ({(frames[-1].line or '').strip()})" if frames else ""
    )
    config = getattr(model, "config", None)
    experts = any("Experts" in type(m).__name__ for m in model.modules())
    if getattr(config, "layerdrop", 0) > 0:
        fix = "this transformers model draws LayerDrop per layer: set model.config.layerdrop = 0.0"
    elif experts and getattr(config, "_experts_implementation", None) == "eager":
        fix = (
            "this transformers model runs its experts in that loop (experts_implementation='eager'): "
            "call model.set_experts_implementation('grouped_mm') (or 'batched_mm') before attach()"
        )
    else:
        fix = (
            "run the experts through one grouped GEMM instead (torch._grouped_mm over the tokens sorted by "
            "expert, see docs/transform.md, 'Mixture-of-experts'), or keep the loop out of the captured part"
        )
    return (
        f". The model's code branches or loops on a tensor's values{where} (data-dependent control flow, "
        f"such as a mixture-of-experts loop over the experts that received tokens or a LayerDrop draw), "
        "which torch.export "
        f"cannot capture: {fix}"
    )


def _positional_names(model: nn.Module, n: int) -> list[str]:
    """The names of the first ``n`` parameters of ``model.forward`` (export keys dynamic shapes by name)."""
    params = [
        p.name
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if n > len(params):
        raise CaptureError(
            f"{type(model).__name__}.forward takes {len(params)} positional arguments, the example gives {n}"
        )
    return params[:n]


def to_torch_ops(gm: fx.GraphModule) -> None:
    """Rewrite an exported graph's ATen GEMMs, products and attention to the torch functions the transform
    recognizes (:data:`ATEN_AS_TORCH`), and its dropouts to modules that follow ``train()`` / ``eval()``."""
    dropouts = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _TRAINING_FIXED:
            raise CaptureError(
                f"'{_where(node)}' calls {_TRAINING_FIXED[node.target]}, whose training flag torch.export "
                "fixes; the adaptive scaler captures such models only when fx can trace them: make the "
                "module a traceable one or train without it"
            )
        node.target = as_torch(node.target)
        if node.target in _FOLLOWS_MODE:
            dropouts += _follow_mode(gm, node, dropouts)
        elif node.target is _aten.dropout.default:
            x, p, train = node.args
            if not train:
                node.replace_all_uses_with(x)
                gm.graph.erase_node(node)
                continue
            gm.add_submodule(f"_adaloss_dropout_{dropouts}", nn.Dropout(p))
            with gm.graph.inserting_before(node):
                new = gm.graph.call_module(f"_adaloss_dropout_{dropouts}", (x,))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            dropouts += 1
    gm.graph.lint()
    gm.recompile()


def _follow_mode(gm: fx.GraphModule, node: fx.Node, k: int) -> int:
    """An argument export fixed at its training-mode value (:data:`_FOLLOWS_MODE`) becomes a
    :class:`TrainingValue` call, unless it is already its eval-mode value (or batch norm has no running
    statistics: then it always normalizes by the batch's). Returns how many modules it added (0 or 1)."""
    position, eval_value = _FOLLOWS_MODE[node.target]
    args = list(node.args)
    if node.target in _NORMS and not isinstance(args[3], fx.Node):  # no running statistics
        return 0
    if position < len(args):
        value = args[position]
    else:
        value = node.kwargs.get("dropout_p", eval_value)  # sdpa's only keyword that follows the mode
    if isinstance(value, fx.Node) or value == eval_value:
        return 0
    gm.add_submodule(f"_adaloss_mode_{k}", TrainingValue(value, eval_value))
    with gm.graph.inserting_before(node):
        flag = gm.graph.call_module(f"_adaloss_mode_{k}", ())
    if position < len(args):
        args[position] = flag
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, "dropout_p": flag}
    return 1


def _where(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else node.name


class CapturedForward:
    """The forward of a captured model: the rewritten graph for calls with the captured arguments (by name:
    ``model(ids)`` and ``model(input_ids=ids)`` are one call), the model's own forward for other calls
    without gradients (see the module docstring). Keeps the graph's ``train()`` / ``eval()`` mode that of
    the model (one flag compare per call). A training call with gradients while some transformers layer
    has its ``gradient_checkpointing`` flag on runs the graph split at those layers
    (:func:`~adaloss.adaptive.checkpointing.checkpointed_graph`, made on the first such call; the flags
    are read on every call, a few attribute reads). No host sync."""

    def __init__(self, model: nn.Module, gm: fx.GraphModule, args: tuple, kwargs: dict) -> None:
        self.model = model
        self.gm = gm
        self.own = type(model).forward  # unbound: a deep copy of the model must not bind it to this one
        self.signature = inspect.signature(self.own.__get__(model))
        # the name of forward's **kwargs, whose keywords (transformers' loss kwargs) count one by one
        self.var_keyword = next(
            (p.name for p in self.signature.parameters.values() if p.kind is p.VAR_KEYWORD), None
        )
        self.positional = _positional_names(model, len(args))
        self.keywords = tuple(kwargs)
        self.names = frozenset((*self.positional, *self.keywords))
        self.layers = checkpointable_layers(model)
        self.checkpointed: fx.GraphModule | None = None  # gm split at the layers, made when first used

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model, gm = self.model, self.gm
        try:
            given = self.signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            given = None
        if given is not None and self.var_keyword in given:
            extra = given.pop(self.var_keyword)
            given = {**given, **extra}
        if given is not None and given.keys() == self.names:
            if self.layers and model.training and torch.is_grad_enabled() and checkpointing(self.layers):
                if self.checkpointed is None:
                    self.checkpointed = checkpointed_graph(gm, self.layers)
                gm = self.checkpointed
            if gm.training != model.training:  # ep.module() refuses train(): the flags are set one by one
                for module in gm.modules():
                    module.training = model.training
            try:
                return gm(*(given[n] for n in self.positional), **{k: given[k] for k in self.keywords})
            except AssertionError as exc:  # ep.module()'s check of the inputs against the captured sizes
                if not str(exc).startswith("Guard failed"):
                    raise
                raise CaptureError(
                    f"adaptive loss scaling: {type(model).__name__} was captured for inputs of other sizes "
                    f"({exc}); an input of 4 or more dimensions (an image) keeps its captured sizes but the "
                    "batch size: attach a fresh model (and scaler) with an example of this size"
                ) from None
        if not torch.is_grad_enabled():
            return self.own(model, *args, **kwargs)
        called = sorted(given) if given is not None else [f"{len(args)} positional", *sorted(kwargs)]
        raise CaptureError(
            f"adaptive loss scaling: {type(model).__name__} was captured for a call with "
            f"({', '.join(sorted(self.names))}) and is called with ({', '.join(called)}) while gradients "
            "are recorded; call it with the captured arguments, or attach it with an example of this call"
        )


def is_guard(node: fx.Node) -> bool:
    """Whether ``node`` is ``ep.module()``'s input check (reads shapes only)."""
    return node.op == "call_module" and node.target == GUARDS
