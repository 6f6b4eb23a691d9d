"""Hugging Face ``transformers.Trainer`` with any adaloss scaler: ``ScalerTrainer(..., scaler=scaler)``.

A ``Trainer`` subclass that changes what the Trainer's own extension points let a subclass change
(``transformers/trainer.py``, 5.24):

* ``create_accelerator_and_postprocess``: after the Trainer builds its ``Accelerator``, our scaler takes the
  place of the GradScaler that ``fp16=True`` gives it (:func:`adaloss.integrations.accelerate.use_scaler`):
  ``training_step``'s ``accelerator.backward(loss)`` scales the loss, ``_clip_grad_norm`` unscales before
  clipping (``max_grad_norm``), the prepared optimizer's ``step()`` steps (skipped on an Inf/NaN gradient) and
  updates the scale. The Trainer saves ``accelerator.scaler.state_dict()`` in each checkpoint (``scaler.pt``)
  and loads it on ``train(resume_from_checkpoint=...)``, so the scaler's state travels with no more code.
* ``train``: before the Trainer prepares (and, over several processes, wraps) the model, the scaler is
  attached. A transformers model is captured with ``torch.export`` on the call the Trainer will make
  (``scaler.attach(model, **inputs)``: one batch of the training data, with ``num_items_in_batch`` where the
  model takes it; see docs/transformers.md), with ``model.config.use_cache = False`` (export cannot return a
  key/value cache). The RNG states are restored after that batch is drawn.
* ``compute_loss_context_manager``: the forward pass runs under :class:`adaloss.precision.Precision`'s
  context (real autocast on CUDA, the FP16 emulation on the CPU), counting the activation gradients'
  underflow on the steps the Trainer logs.
* ``log``: on the Trainer's logging steps, ``underflow_rate/<layer>``, ``mean_underflow_rate``,
  ``alpha/<layer>`` (the adaptive scaler) or ``loss_scale``, ``skipped_steps`` and ``overflow_count`` join
  the Trainer's logs (``state.log_history``, the ``report_to`` integrations, callbacks' ``on_log``).

Host-device syncs: the scaler's (one per optimizer step) and one more on logging steps (the telemetry).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from adaloss.integrations._telemetry import scaler_telemetry
from adaloss.integrations.accelerate import use_scaler
from adaloss.precision import Precision
from adaloss.scalers import AdaptiveLossScaler, LossScaler
from adaloss.telemetry import UnderflowMonitor

try:
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - exercised only where transformers is absent
    raise ImportError(
        "adaloss.integrations.hf_trainer needs transformers and accelerate: "
        f"pip install -e '.[hf,accelerate]'; {exc}"
    ) from exc

__all__ = ["ScalerTrainer"]


class ScalerTrainer(Trainer):
    """``transformers.Trainer`` that trains with an adaloss scaler in GradScaler's place.

    Args:
        *args, **kwargs: ``Trainer``'s (``model``, ``args``, ``train_dataset``, ``optimizers``, ...).
        scaler (LossScaler): one of :mod:`adaloss.scalers`, not yet attached (the trainer attaches it).
        precision (str or Precision, optional, default=None): the forward pass's precision (``fp16``,
            ``bf16``, ``fp32``, ``fp8_e5m2``, ...: real autocast on CUDA, the emulation on the CPU); None:
            ``fp16`` under ``args.fp16``, ``bf16`` under ``args.bf16``, else ``fp32``.
        telemetry (bool, optional, default=True): per-layer underflow rates and alphas in the logs of the
            Trainer's logging steps (``logging_steps``).
    """

    def __init__(
        self,
        *args: Any,
        scaler: LossScaler,
        precision: str | Precision | None = None,
        telemetry: bool = True,
        **kwargs: Any,
    ) -> None:
        if not isinstance(scaler, LossScaler):
            raise TypeError(
                f"ScalerTrainer needs an adaloss scaler, got {type(scaler).__name__}: pass one of "
                "adaloss.scalers (e.g. AdaptiveLossScaler()); for torch.amp.GradScaler use Trainer with "
                "fp16=True"
            )
        self.loss_scaler = scaler  # read by create_accelerator_and_postprocess, which Trainer.__init__ calls
        super().__init__(*args, **kwargs)
        if not isinstance(precision, Precision):
            name = precision or ("fp16" if self.args.fp16 else "bf16" if self.args.bf16 else "fp32")
            precision = Precision(name, self.args.device)
        self.precision = precision
        self.monitor = UnderflowMonitor(every=1, fmt=precision.telemetry_format) if telemetry else None
        self._counted = False  # the monitor counted the step about to be logged
        self._attached = False

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator, with our scaler where ``fp16=True`` puts a GradScaler. ``ValueError``
        for the distributed types that scale the loss their own way (DeepSpeed, FSDP: see
        :func:`~adaloss.integrations.accelerate.use_scaler`)."""
        super().create_accelerator_and_postprocess()
        use_scaler(self.accelerator, self.loss_scaler)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, the scaler attached first (once) to the model as the Trainer will call it."""
        if not self._attached:
            self._attach()
        return super().train(*args, **kwargs)

    def _attach(self) -> None:
        """``scaler.attach(model, **inputs)`` on one training batch as ``compute_loss`` passes it (the
        adaptive scaler; the others attach nothing). RNG states are restored after the batch is drawn."""
        model = self.model
        if isinstance(self.loss_scaler, AdaptiveLossScaler) and self.loss_scaler.is_enabled():
            if getattr(getattr(model, "config", None), "use_cache", False):
                model.config.use_cache = False  # export cannot return a key/value cache
            with torch.random.fork_rng(devices=[] if self.args.device.type == "cpu" else None):
                batch = next(iter(self.get_train_dataloader()))
            attached = self.loss_scaler.attach(model, **self._model_inputs(batch))
        else:
            attached = self.loss_scaler.attach(model)
        if attached is not model:  # a model torch.fx traced: train the rewritten module
            self.model = self.model_wrapped = attached
        self._attached = True

    def _model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """What ``compute_loss`` passes to the model for ``batch``: the prepared inputs, less ``labels`` where
        a label smoother or ``compute_loss_func`` takes them, plus ``num_items_in_batch`` where the model
        accepts loss kwargs."""
        inputs = dict(self._prepare_inputs(batch))
        if self.label_smoother is not None or self.compute_loss_func is not None:
            inputs.pop("labels", None)
        if self.model_accepts_loss_kwargs:
            count = self._get_num_items_in_batch([batch], self.args.device)
            if count is not None:
                inputs["num_items_in_batch"] = count
        return inputs

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """The Trainer's context and the precision's; on a training step the Trainer will log, with the
        underflow monitor (the emulated path). No sync."""
        stack = super().compute_loss_context_manager()
        due = (
            self.monitor is not None
            and self.model.training
            and torch.is_grad_enabled()
            and (self.state.global_step + 1) % max(int(self.args.logging_steps), 1) == 0
        )
        self._counted = self._counted or due
        stack.enter_context(self.precision.autocast(monitor=self.monitor if due else None))
        return stack

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """``Trainer.log``; a training log (one with ``loss``) gains the scaler's telemetry. One sync."""
        if "loss" in logs and self._attached:
            monitor = self.monitor if self._counted else None
            logs = {**logs, **scaler_telemetry(self.loss_scaler, monitor)}
            self._counted = False
        super().log(logs, *args, **kwargs)
