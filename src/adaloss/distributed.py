"""Data-parallel training helpers: start the process group from torchrun's environment, wrap the model.

One process per device, launched by ``torchrun --nproc_per_node=N train.py ...``, which sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. Without those variables everything here
is a single-process no-op, so the trainer (:mod:`adaloss.engine.trainer`) has one code path:

* ``info = init_distributed()``; the model is attached to the scaler, prepared for the precision, then
  wrapped with :func:`wrap_model` (DDP must see the transformed module; the optimizer holds the unwrapped
  module's parameters, the same objects).
* ``trainer.batch_size`` is the *global* batch: every rank draws the same shuffled global batch (the
  resumable sampler of :mod:`adaloss.data.loaders`) and keeps its contiguous ``1/world_size`` slice, so the
  union over ranks is the single-process batch and a checkpoint's data position means the same at any
  world size.
* Each rank backpropagates its local mean loss divided by ``world_size`` and a communication hook makes DDP
  *sum* the gradients: the optimizer sees the global-batch mean, and every rank's backward pass sees
  single-process gradient magnitudes, so loss scales, overflows and adaptive alphas do not depend on the
  number of processes.
* Only rank 0 evaluates, logs and writes checkpoints, ``telemetry.jsonl``, ``model.pt`` and ``metrics.json``.

Batch-norm statistics stay per rank unless the model is converted with
``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` (CUDA only; not wired).

What the scalers do under ``torch.distributed`` (see :mod:`adaloss.scalers.base` and
:class:`adaloss.scalers.adaptive.AdaptiveLossScaler`): the found-Inf flag is all-reduced so every rank skips
the same steps, and the adaptive scaler all-reduces its statistics so every rank holds identical scales.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from adaloss.errors import ConfigError

__all__ = ["DistInfo", "destroy", "init_distributed", "is_main_process", "wrap_model"]

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, number of processes, rank on this host, device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str) -> int:
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be an integer, got {raw!r}") from None


def init_distributed(device: str | None = None, timeout_s: float | None = None) -> DistInfo:
    """Initialize the default process group from torchrun's environment and return this process's place.

    Reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``. If none is set, returns the single-process
    ``DistInfo(0, 1, 0, device)`` without touching ``torch.distributed``. Otherwise picks the backend from
    the device (``nccl`` on CUDA, binding this process to ``cuda:LOCAL_RANK``; ``gloo`` on the CPU) and
    calls ``init_process_group`` (rendezvous through ``MASTER_ADDR``/``MASTER_PORT``). If the group is
    already initialized (e.g. by a test), it is reused and checked against the environment.

    Args:
        device: "cuda" or "cpu"; default: CUDA if available.
        timeout_s: collective timeout in seconds (default: torch's).

    Raises:
        ConfigError: for an inconsistent environment: only some of the variables set, non-integers,
            ``WORLD_SIZE < 1``, ``RANK`` outside ``[0, WORLD_SIZE)``, ``LOCAL_RANK`` negative or without a
            CUDA device of that index, ``MASTER_ADDR``/``MASTER_PORT`` missing for a new group, or an already
            initialized group whose rank or size differs from the environment.
    """
    present = [name for name in _ENV if name in os.environ]
    wanted = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if wanted not in ("cuda", "cpu"):
        raise ConfigError(f"init_distributed(device=...) takes 'cuda' or 'cpu', got {wanted!r}")
    if not present:
        return DistInfo(0, 1, 0, torch.device("cuda" if wanted == "cuda" else "cpu"))
    missing = [name for name in _ENV if name not in os.environ]
    if missing:
        raise ConfigError(
            f"distributed launch: {', '.join(present)} set but {', '.join(missing)} missing; launch with "
            "torchrun (which sets RANK, WORLD_SIZE and LOCAL_RANK) or unset them for a single process"
        )
    rank, world_size, local_rank = (_env_int(name) for name in _ENV)
    if world_size < 1:
        raise ConfigError(f"WORLD_SIZE must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"RANK must lie in [0, WORLD_SIZE={world_size}), got {rank}")
    if local_rank < 0:
        raise ConfigError(f"LOCAL_RANK must be >= 0, got {local_rank}")
    if wanted == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("distributed launch on CUDA requested but no CUDA device is available")
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK={local_rank} but this host has {torch.cuda.device_count()} CUDA device(s); "
                "launch at most one process per device (torchrun --nproc_per_node)"
            )
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        dev = torch.device("cpu")
        backend = "gloo"
    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise ConfigError(
                f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the environment says rank {rank} of {world_size}"
            )
        return DistInfo(rank, world_size, local_rank, dev)
    if world_size == 1:
        return DistInfo(rank, world_size, local_rank, dev)  # nothing to synchronize with
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ConfigError(
            f"distributed launch: {', '.join(missing)} not set; torchrun sets them, or export them yourself"
        )
    kwargs = {}
    if timeout_s is not None:
        import datetime

        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **kwargs)
    return DistInfo(rank, world_size, local_rank, dev)


def is_main_process() -> bool:
    """Whether this is rank 0 (or the only process): the one that logs and writes checkpoints."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def wrap_model(model: nn.Module, info: DistInfo, **ddp_kwargs) -> nn.Module:
    """Wrap ``model`` in ``DistributedDataParallel`` when ``info.world_size > 1``; else return it as is.

    The model must already be on ``info.device``. On CUDA DDP gets ``device_ids=[local_rank]``; on the CPU
    no device ids. DDP broadcasts rank 0's parameters and buffers at construction, so every rank starts from
    the same weights. Wrap the module returned by ``scaler.attach(model)`` (the adaptive scaler's backward
    pass lives in it); ``model.module`` is that module again, for ``state_dict()``. ``ddp_kwargs`` go to DDP.
    """
    if info.world_size <= 1:
        return model
    if not dist.is_initialized():
        raise RuntimeError("wrap_model: call init_distributed() first (torch.distributed is not initialized)")
    from torch.nn.parallel import DistributedDataParallel

    if info.device.type == "cuda":
        return DistributedDataParallel(
            model, device_ids=[info.device.index], output_device=info.device.index, **ddp_kwargs
        )
    return DistributedDataParallel(model, **ddp_kwargs)


def destroy() -> None:
    """Tear down the default process group if one exists (call once at the end of training)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
