"""Choosing the training device from ``device=auto|cpu|cuda``."""

from __future__ import annotations

import torch

from adaloss.errors import ConfigError

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def select_device(name: str) -> torch.device:
    """The device for ``name``: ``auto`` is CUDA when available, else the CPU.

    Raises ``ConfigError`` for ``cuda`` on a machine without a CUDA device (rather than failing later
    inside the first ``.to()``), and for any other name. Cost: one CUDA availability query.
    """
    name = str(name).strip().lower()
    if name not in DEVICE_CHOICES:
        raise ConfigError(f"device={name} is not a choice: use device=auto, device=cpu or device=cuda")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available: use device=cpu or device=auto")
    return torch.device(name)
