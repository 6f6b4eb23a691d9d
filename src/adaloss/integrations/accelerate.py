"""Hugging Face Accelerate with an adaloss scaler: ``model = use_scaler(accelerator, scaler, model)``.

Accelerate already drives a GradScaler through one attribute, ``accelerator.scaler`` (``accelerator.py``):
``accelerator.backward(loss)`` calls ``scaler.scale(loss).backward()``, each ``AcceleratedOptimizer`` takes
the scaler when it is prepared and its ``step()`` calls ``scaler.step(optimizer)`` and ``scaler.update()``
(on the iterations that step, under gradient accumulation), and ``save_state``/``load_state`` write and
read ``scaler.state_dict()`` (``scaler.pt``). Our scalers keep GradScaler's method names, so putting one
there is most of the work. What :func:`use_scaler` adds:

* ``attach``: the adaptive scaler rewrites the model, which must happen before ``prepare`` wraps it (DDP),
  so the helper returns the module to prepare;
* ``unscale_gradients``: Accelerate unscales (in ``clip_grad_norm_`` and ``clip_grad_value_``) only under its
  own CUDA FP16 autocast; the helper makes it unscale through our scaler whatever the precision, so the
  gradients are clipped unscaled (on the CPU, with our emulation, as well as on a GPU).

The forward pass's precision stays the loop's: ``Accelerator(mixed_precision="fp16")`` on CUDA (Accelerate's
autocast), or :meth:`adaloss.precision.Precision.autocast` around the forward pass (the CPU emulation).
Importing this module does not import accelerate; :func:`use_scaler` only reads the accelerator it is given.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from adaloss.scalers import AdaptiveLossScaler, LossScaler

__all__ = ["use_scaler"]

#: Accelerate's distributed types that scale (or shard) the loss their own way, where our scaler cannot go.
_UNSUPPORTED = {
    "DEEPSPEED": "DeepSpeed scales the loss itself (its fp16 config)",
    "MEGATRON_LM": "Megatron-LM scales the loss itself",
    "XLA": "XLA devices have no FP16 loss scaling here",
}
#: Why Accelerate's FSDP is refused. Not the scales' statistics: under FSDP2 they need no reduction beyond
#: the gradient statistics' (docs/fsdp2.md). What is missing is a sharding that follows the rewrite.
_FSDP_ADAPTIVE = (
    "Accelerate shards the model by its own wrap policy after the adaptive scaler rewrote it: fully_shard "
    "replaces each wrapped module's parameters with sharded ones, which a captured transformers model's "
    "graph (it holds the parameter objects it was captured with) would never read, and a policy that puts a "
    "rewritten GEMM and the batch norm it carries in different units leaves the batch norm's parameters "
    "sharded where the GEMM reads them; this project's runner shards along the rewrite "
    "(distributed.strategy=fsdp2, docs/fsdp2.md)"
)
_FSDP_OTHER = (
    "Accelerate pairs FSDP's sharded gradients with a scaler of its own choosing (ShardedGradScaler under "
    "FSDP1), a path these scalers are not tested on"
)


def use_scaler(accelerator: Any, scaler: LossScaler, model: nn.Module | None = None) -> nn.Module | None:
    """Make ``accelerator`` train with ``scaler`` and return ``scaler.attach(model)`` (``None`` without a
    model), the module to pass to ``accelerator.prepare``. Call before ``prepare``.

    Afterwards ``accelerator.backward``, ``accelerator.clip_grad_norm_``/``clip_grad_value_``,
    ``optimizer.step()`` (skipped on an Inf/NaN gradient: ``optimizer.step_was_skipped``),
    ``accelerator.save_state`` and ``accelerator.load_state`` all go through ``scaler``. Host-device
    syncs: those of the scaler (one per optimizer step); the helper adds none.

    Raises:
        TypeError: ``scaler`` is not an adaloss scaler.
        RuntimeError: an optimizer was prepared already (it kept the accelerator's old scaler).
        ValueError: a distributed type that scales the loss its own way (DeepSpeed, Megatron-LM, XLA), or
            FSDP, whose wrap policy does not follow the adaptive scaler's rewrite (the message says why).
    """
    if not isinstance(scaler, LossScaler):
        raise TypeError(
            f"use_scaler needs an adaloss scaler, got {type(scaler).__name__}: pass one of adaloss.scalers "
            "(e.g. AdaptiveLossScaler()); for torch.amp.GradScaler use Accelerator(mixed_precision='fp16')"
        )
    if getattr(accelerator, "_optimizers", None):
        raise RuntimeError(
            "use_scaler was called after accelerator.prepare(optimizer): the prepared optimizer keeps the "
            "scaler it was prepared with; call use_scaler(accelerator, scaler, model) before prepare"
        )
    kind = str(getattr(accelerator.distributed_type, "name", accelerator.distributed_type))
    if kind == "FSDP":
        why = _FSDP_ADAPTIVE if isinstance(scaler, AdaptiveLossScaler) else _FSDP_OTHER
    else:
        why = _UNSUPPORTED.get(kind)
    if why is not None:
        raise ValueError(
            f"use_scaler does not support distributed_type={kind}: {why}; use DDP (MULTI_GPU, MULTI_CPU) or "
            "one process"
        )
    accelerator.scaler = scaler
    accelerator.unscale_gradients = functools.partial(_unscale_gradients, accelerator)
    return scaler.attach(model) if model is not None else None


def _unscale_gradients(accelerator: Any, optimizer: Any = None) -> None:
    """``Accelerator.unscale_gradients`` through our scaler, under any precision: ``optimizer`` (one, a list,
    or ``None`` for every prepared optimizer), each unwrapped from its ``AcceleratedOptimizer``. No sync."""
    from accelerate.optimizer import AcceleratedOptimizer

    if optimizer is None:
        optimizers = list(accelerator._optimizers)
    elif isinstance(optimizer, list | tuple):
        optimizers = list(optimizer)
    else:
        optimizers = [optimizer]
    for opt in optimizers:
        while isinstance(opt, AcceleratedOptimizer):
            opt = opt.optimizer
        accelerator.scaler.unscale_(opt)
