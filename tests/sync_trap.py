"""A trap for host-device synchronization and host-to-device copies, caught where they happen in ATen.

On a GPU a backward pass must not wait for the device: reading a tensor's value on the host (``.item()``,
``float(t)``, ``bool(t)``, ``if t:``, ``.tolist()``, ``.cpu()``) blocks until every queued kernel has run, and
building a tensor from host data (``torch.tensor(...)``, ``torch.as_tensor(list)``, indexing with a Python
list) is a host-to-device copy. This machine has no GPU, so the trap works on what such code dispatches on
any device: ``aten._local_scalar_dense`` (every read of one value), ``aten.lift_fresh`` (every tensor made
from host data), and ``aten._to_copy`` / ``aten.copy_`` between devices. What never reaches ATen for a CPU
tensor (``.tolist()``, ``.numpy()``, ``.cpu()``, which on a GPU would copy to the host) is trapped at the
Python method instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostSyncError(AssertionError):
    """An op that would synchronize with the host, or copy host data to the device, ran where it must not."""


_READS = {aten._local_scalar_dense.default: "a tensor's value read on the host (.item(), float(t), bool(t))"}
_FROM_HOST = {
    aten.lift_fresh.default: "a tensor built from host data (torch.tensor, torch.as_tensor, a list index)",
    aten.lift_fresh_copy.default: "a tensor built from host data",
}
_COPIES = (aten._to_copy.default, aten.copy_.default)


def _device(value: object) -> torch.device | None:
    return value.device if isinstance(value, torch.Tensor) else None


class NoHostSync(TorchDispatchMode):
    """Fails on every dispatched op that reads a value on the host or brings host data to a device."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0  # ops that went through, to show the mode was active

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        what = _READS.get(func) or _FROM_HOST.get(func)
        if what is not None:
            raise HostSyncError(f"{func}: {what}")
        if func in _COPIES:
            src = _device(args[1]) if func is aten.copy_.default else _device(args[0])
            dst = _device(args[0]) if func is aten.copy_.default else kwargs.get("device")
            if src is not None and dst is not None and torch.device(dst) != src:
                raise HostSyncError(f"{func}: a copy from {src} to {dst}")
        self.seen += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_sync() -> Iterator[NoHostSync]:
    """Inside the block: :class:`NoHostSync`, and ``Tensor.tolist/numpy/cpu/__array__`` raise too."""
    methods = ("tolist", "numpy", "cpu", "__array__")
    saved = {name: getattr(torch.Tensor, name) for name in methods}

    def forbidden(name: str):
        def method(*args, **kwargs):
            raise HostSyncError(f"Tensor.{name}(): copies a tensor to the host")

        return method

    try:
        for name in methods:
            setattr(torch.Tensor, name, forbidden(name))
        with NoHostSync() as mode:
            yield mode
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def trapped_steps(scaler, model, optimizer, precision, batches, loss_fn) -> list[str | None]:
    """Training steps whose backward passes run inside :func:`no_host_sync`; per step, whether the
    adaptive scaler recomputed its scales or reused them (``scaler.last_pass``).
    ``loss_fn(model, batch)`` computes the loss under ``precision.autocast()``."""
    kinds = []
    for batch in batches:
        with precision.autocast():
            loss = loss_fn(model, batch)
        scaled = scaler.scale(loss)
        with no_host_sync() as mode:
            scaled.backward()
        assert mode.seen > 100, "the trap saw almost no ops: was the backward pass run inside it?"
        kinds.append(scaler.last_pass)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return kinds
