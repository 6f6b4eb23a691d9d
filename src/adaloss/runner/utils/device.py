"""Choosing the training device from ``device=auto|cpu|cuda``, and host numbers put on it without a sync."""

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


def host_to_device(values: object, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device`` without the host waiting for the device.

    From pageable memory a host-to-device copy is synchronous (``torch.cuda.set_sync_debug_mode("error")``
    raises on it); from pinned memory with ``non_blocking=True`` it is queued on the stream like a kernel,
    and PyTorch's pinned-memory allocator keeps the host buffer until the copy has run. On the CPU it is
    the plain tensor. Does not synchronize.
    """
    host = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
