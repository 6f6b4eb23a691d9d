"""timm's training loop (``train.py``) with any adaloss scaler: :class:`TimmScaler` has the call signature and
checkpoint key of timm's ``NativeScaler`` (``timm/utils/cuda.py``), so the loop takes it in ``NativeScaler``'s
place::

    loss_scaler = TimmScaler(AdaptiveLossScaler(device.type))  # was: NativeScaler(device=device.type)
    model = loss_scaler.attach(model)  # the adaptive scaler rewrites the model: before DDP, as attach says

Each call is ``NativeScaler.__call__``'s sequence with our scaler in GradScaler's place: ``scale(loss)``,
``backward(create_graph=...)``, and when ``need_update`` (the last micro-batch of a gradient-accumulation
group), ``unscale_`` and timm's ``dispatch_clip_grad`` if ``clip_grad`` is set, ``step``, ``update``. timm's
``CheckpointSaver`` stores ``state_dict()`` under ``state_dict_key`` (``"amp_scaler"``) and
``resume_checkpoint`` hands it back to ``load_state_dict``.

Host-device syncs per call: those of the scaler (``step``: one, on the Inf/NaN flag; see each scaler), and
those of timm's clipping; the wrapper adds none.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from adaloss.scalers import LossScaler

try:
    from timm.utils.clip_grad import dispatch_clip_grad
except ImportError as exc:  # pragma: no cover - exercised only where timm is absent
    raise ImportError(f"adaloss.integrations.timm needs timm: pip install timm; {exc}") from exc

__all__ = ["TimmScaler"]


class TimmScaler:
    """timm's ``NativeScaler`` interface over an adaloss scaler.

    Args:
        scaler (LossScaler): one of :mod:`adaloss.scalers` (not yet attached: :meth:`attach` does it).

    Attributes:
        state_dict_key (str): ``"amp_scaler"``, the key timm's checkpoints keep the scaler's state under.
    """

    state_dict_key = "amp_scaler"

    def __init__(self, scaler: LossScaler) -> None:
        if not isinstance(scaler, LossScaler):
            raise TypeError(
                f"TimmScaler needs an adaloss scaler, got {type(scaler).__name__}: pass one of "
                "adaloss.scalers (e.g. AdaptiveLossScaler('cuda')); for torch.amp.GradScaler use timm's own "
                "NativeScaler"
            )
        self.scaler = scaler

    def attach(self, model: nn.Module, *example_inputs: Any, **example_kwargs: Any) -> nn.Module:
        """``scaler.attach(model, ...)``: the module to train (the adaptive scaler's rewrite; the model
        itself for the others). Call it before wrapping the model in DDP. No sync."""
        return self.scaler.attach(model, *example_inputs, **example_kwargs)

    def __call__(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        clip_grad: float | None = None,
        clip_mode: str = "norm",
        parameters: Iterable[torch.Tensor] | None = None,
        create_graph: bool = False,
        need_update: bool = True,
    ) -> None:
        """``NativeScaler.__call__``: backward the scaled loss; when ``need_update``, unscale and clip
        (``clip_grad`` with ``clip_mode``: ``norm``, ``value`` or ``agc``, over ``parameters``), step
        (skipped on an Inf/NaN gradient) and update the scale. One sync when ``need_update`` (the Inf/NaN
        flag), plus the scaler's own and the clipping's."""
        self.scaler.scale(loss).backward(create_graph=create_graph)
        if not need_update:
            return
        if clip_grad is not None:
            if parameters is None:
                raise ValueError(
                    "clip_grad needs parameters=... (the parameters to clip), as timm's NativeScaler does: "
                    "pass model_parameters(model) or model.parameters()"
                )
            self.scaler.unscale_(optimizer)  # clip the true gradients
            dispatch_clip_grad(parameters, clip_grad, mode=clip_mode)
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """The scaler's ``state_dict()``, what timm's ``CheckpointSaver`` saves under ``state_dict_key``."""
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``scaler.load_state_dict``, as timm's ``resume_checkpoint`` calls it (before or after
        :meth:`attach`)."""
        self.scaler.load_state_dict(state_dict)
