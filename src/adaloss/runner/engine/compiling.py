"""``trainer.compile``: the training step's forward pass (and so its backward pass) through ``torch.compile``.

``trainer.compile=true`` compiles the module the loop calls with ``torch.compile(module, mode=...)``
(``trainer.compile_mode``: ``default``, which passes ``mode=None``, ``reduce-overhead`` or
``max-autotune``). The compiled module is a wrapper that shares its parameters and buffers with the
uncompiled one, which the run keeps for everything else: state dicts (checkpoints, ``model.pt``: the keys of
an uncompiled run, no ``_orig_mod.`` prefix, so either kind of run resumes the other's checkpoint),
evaluation, layer names and the callbacks.

Under DDP the inner module is compiled and DDP wraps the compiled one, as PyTorch's "Where to apply
torch.compile?" recommends (Dynamo's DDPOptimizer then splits the graph at DDP's bucket boundaries, so the
gradient all-reduce still overlaps the backward pass).

Steps that run eagerly, under ``torch.compiler.set_stance("force_eager")`` (the same module and DDP, no
Dynamo): telemetry steps (the emulation counts every activation gradient before and after rounding, in
Python), and every step whose precision is emulated on the CPU, which cannot be compiled (see
:data:`EMULATION_REASON`); the latter is said once in the log. The first compiled step's time (Dynamo,
AOTAutograd and the backend compile during it) is logged once: ``compiled the training step in N s (mode
default)``, and recorded in ``metrics.json`` (``compile``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

from adaloss.precision import Precision

log = logging.getLogger(__name__)

__all__ = ["EMULATION_REASON", "StepCompiler"]

#: Why the CPU emulation of a low-precision format runs eagerly under ``trainer.compile=true``. Measured with
#: torch 2.14.1 (ResNet-20 on digits, ``TORCH_LOGS=graph_breaks,recompiles``): Dynamo traces into
#: ``EmulatedAutocast.__torch_function__``, breaks the graph at every op (``str.startswith`` on the op's
#: ``__name__`` in ``_op_name``), recompiles it per op, then fails with ``InternalTorchDynamoError``
#: (``AttributeError: 'function' object has no attribute '__func__'``) building a guard on the mode's
#: ``_mark_outputs``. ``tests/test_trainer_compile.py`` checks that it still fails.
EMULATION_REASON = (
    "Dynamo cannot trace its torch-function mode: a graph break at every op, then an internal error"
)


class StepCompiler:
    """The module a training step's forward pass calls, and whether a step runs it compiled.

    Args:
        module (nn.Module): the uncompiled module (after ``scaler.attach`` and ``precision.prepare``).
        enabled (bool): ``trainer.compile``; false: :attr:`model` is ``module`` and nothing changes.
        mode (str): ``trainer.compile_mode``.
        precision (Precision): the run's precision; an emulated one runs every step eagerly.
    """

    def __init__(self, module: nn.Module, enabled: bool, mode: str, precision: Precision) -> None:
        self.enabled = bool(enabled)
        self.mode = str(mode)
        #: Why every step runs eagerly (None: the steps that are not telemetry steps run compiled).
        self.eager_reason = (
            f"the CPU emulation of {precision.name} runs eagerly ({EMULATION_REASON})"
            if self.enabled and precision.emulated
            else None
        )
        self.model: nn.Module = module
        if self.enabled and self.eager_reason is None:
            self.model = torch.compile(module, mode=None if self.mode == "default" else self.mode)
        #: Seconds the first compiled step took (compiling included); None until it ran.
        self.first_step_s: float | None = None
        self._said_eager = False

    def compiles(self, telemetry_step: bool) -> bool:
        """Whether this step runs compiled."""
        return self.model_is_compiled and not telemetry_step

    @property
    def model_is_compiled(self) -> bool:
        return self.enabled and self.eager_reason is None

    def stance(self, telemetry_step: bool) -> contextlib.AbstractContextManager:
        """Around a step's forward pass: Dynamo off (``force_eager``, the same module runs eagerly) on a
        telemetry step of a compiled run; else nothing. The first step of a run that compiles nothing says
        why, once."""
        if self.eager_reason is not None and not self._said_eager:
            self._said_eager = True
            log.info("trainer.compile: %s", self.eager_reason)
        if self.model_is_compiled and telemetry_step:
            return torch.compiler.set_stance("force_eager")
        return contextlib.nullcontext()

    def step_done(self, telemetry_step: bool, seconds: float) -> None:
        """After a step of ``seconds``: the first compiled one's time, logged once."""
        if self.first_step_s is None and self.compiles(telemetry_step):
            self.first_step_s = seconds
            log.info("compiled the training step in %.1f s (mode %s)", seconds, self.mode)

    def metrics(self) -> dict[str, Any]:
        """``metrics.json``'s ``compile`` entry (empty without ``trainer.compile``)."""
        if not self.enabled:
            return {}
        return {"compile": {"mode": self.mode, "first_step_s": self.first_step_s, "eager": self.eager_reason}}
