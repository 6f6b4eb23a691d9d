"""Top-1 accuracy on the test set."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from adaloss.precision import Precision


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    precision: Precision,
    device: torch.device,
) -> float:
    """Top-1 accuracy (%) of ``model`` over ``loader``, in eval mode and under the run's precision.

    The forward pass runs in the training format (``precision.autocast()``: real autocast on CUDA,
    emulation on the CPU), so the number is the accuracy of the model as it is actually computed.
    Batch-norm layers use their running statistics; the model's train/eval mode is restored afterwards.
    Cost: one forward pass over the test set and one host sync at the end.
    """
    was_training = model.training
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    seen = 0
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with precision.autocast():
            logits = model(x)
        correct += (logits.argmax(dim=1) == y).sum()
        seen += y.numel()
    model.train(was_training)
    return 100.0 * correct.item() / max(seen, 1)
