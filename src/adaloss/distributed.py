"""Data-parallel training helpers: start the process group from torchrun's environment, wrap the model.

One process per device, launched by ``torchrun --nproc_per_node=N train.py ...``, which sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. Without those variables everything here
is a single-process no-op, so the trainer (:mod:`adaloss.runner.engine.trainer`) has one code path:

* ``info = init_distributed()``; the model is attached to the scaler, prepared for the precision, then
  wrapped with :func:`wrap_model` (DDP must see the transformed module; the optimizer holds the unwrapped
  module's parameters, the same objects).
* ``trainer.batch_size`` is the *global* batch: every rank draws the same shuffled global batch (the
  resumable sampler of :mod:`adaloss.runner.data.loaders`) and keeps its contiguous ``1/world_size`` slice, so
  the union over ranks is the single-process batch and a checkpoint's data position means the same at any
  world size.
* Each rank backpropagates its local mean loss divided by ``world_size`` and a communication hook makes DDP
  *sum* the gradients: the optimizer sees the global-batch mean, and every rank's backward pass sees
  single-process gradient magnitudes, so loss scales, overflows and adaptive alphas do not depend on the
  number of processes.
* Only rank 0 evaluates, logs and writes checkpoints, ``telemetry.jsonl``, ``model.pt`` and ``metrics.json``.

``distributed.strategy=fsdp2`` shards the model instead (:func:`shard_model`, FSDP2's ``fully_shard``): each
rank holds ``1/world_size`` of every parameter, gradient and optimizer state; gradients are reduce-scattered
as sums, so the loss division above holds unchanged; checkpoints are sharded
(:meth:`adaloss.runner.engine.checkpoint.CheckpointManager.save_shards`) and every rank evaluates.
``docs/fsdp2.md`` says what is reduced where.

Batch-norm statistics stay per rank unless the model is converted with
``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` (CUDA only; not wired).

What the scalers do under ``torch.distributed`` (see :mod:`adaloss.scalers.base` and
:class:`adaloss.scalers.adaptive.AdaptiveLossScaler`): the found-Inf flag is all-reduced so every rank skips
the same steps, and the adaptive scaler all-reduces its statistics so every rank holds identical scales.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from adaloss.errors import ConfigError

__all__ = [
    "DistInfo",
    "destroy",
    "init_distributed",
    "is_main_process",
    "rank_seed",
    "shard_model",
    "shard_units",
    "wrap_model",
]

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits (global rank, number of processes, rank on this host, device, the process
    group's backend) and the few collectives the training loop needs.

    With one process (``world_size == 1``) every collective is a no-op that returns its input, so the loop
    has one shape. Every collective here must be called by all ranks at the same point of the loop (on
    steps that are the same on all ranks: logging, telemetry, evaluation, checkpoint and skipped steps).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # "nccl" or "gloo" in a process group; None for one process

    @classmethod
    def join(cls, device: torch.device) -> DistInfo:
        """Join torchrun's process group (NCCL for CUDA, gloo for the CPU) or stay a single process.

        ``device`` is the validated ``cfg.device``; under torchrun the device becomes ``cuda:LOCAL_RANK``.
        ``ConfigError`` for an inconsistent torchrun environment or a group whose backend does not fit it.
        """
        info = init_distributed(device.type)
        if not info.is_distributed:
            return cls(device=device)
        backend = str(dist.get_backend())
        if (device.type == "cuda") != (backend == "nccl"):
            raise ConfigError(
                f"device={device.type} but the process group uses {backend}: a CUDA run needs nccl and a "
                "CPU run gloo; set device= to match the group"
            )
        return cls(info.rank, info.world_size, info.local_rank, info.device, backend)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 (or the only process): the one that logs and writes."""
        return self.rank == 0

    @property
    def loss_factor(self) -> float:
        """What each rank multiplies its mean loss by before the backward pass (gradients are summed)."""
        return 1.0 / self.world_size

    def wrap(self, module: nn.Module, strategy: str) -> nn.Module:
        """``module`` in DDP (``strategy="ddp"``) or sharded in place by :func:`shard_model` (``"fsdp2"``),
        with gradients summed over the ranks either way (:func:`sum_gradients`); as it is for one process."""
        if not self.is_distributed:
            return module
        if strategy == "fsdp2":
            return shard_model(module)
        model = wrap_model(module, self)
        model.register_comm_hook(None, sum_gradients)
        return model

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()

    def any_(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (one tiny all-reduce under DDP)."""
        if not self.is_distributed:
            return flag
        tensor = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return bool(tensor.item())

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce (SUM) ``tensor`` in place over the ranks; returns it."""
        if self.is_distributed:
            dist.all_reduce(tensor)
        return tensor

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean over the ranks of their (local) losses, in float64: not finite iff any rank's is not."""
        if not self.is_distributed:
            return loss
        return self.sum_(loss.detach().double().reshape(()).clone()) / self.world_size

    def mean_rates(self, rates: dict[str, float]) -> dict[str, float]:
        """Per-layer underflow rates averaged over the ranks (every rank counts as many elements)."""
        if not self.is_distributed or not rates:
            return rates
        names = list(rates)  # the same layers in the same order on every rank
        values = torch.tensor([rates[n] for n in names], dtype=torch.float64, device=self.device)
        return dict(zip(names, (self.sum_(values) / self.world_size).tolist(), strict=True))

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (picklable), on every rank."""
        if not self.is_distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if not self.is_distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def sum_gradients(process_group, bucket):  # no annotations: DDP checks them, and ours would be strings
    """DDP comm hook ``(process group or None, dist.GradBucket) -> Future[Tensor]``: all-reduce SUM of a
    gradient bucket (DDP's default hook divides by the world size; the trainer divides the loss by it
    instead, see :attr:`DistInfo.loss_factor`)."""
    group = process_group if process_group is not None else dist.group.WORLD
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The seed of data-parallel rank ``rank > 0``'s global RNGs (its random augmentation), distinct from
    every other rank's and, with ``step``, from the stream of an earlier start."""
    return ((seed * 1_000_003 + rank) * 1_000_033 + step) % 2**63


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
    rank, world_size, local_rank = _env_place(present)
    dev, backend = _device_and_backend(wanted, local_rank)
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
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **kwargs)
    return DistInfo(rank, world_size, local_rank, dev)


def _env_place(present: list[str]) -> tuple[int, int, int]:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` from torchrun's environment (``present``: those of them set, at
    least one), each checked; a bad environment is a one-line ConfigError."""
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
    return rank, world_size, local_rank


def _device_and_backend(wanted: str, local_rank: int) -> tuple[torch.device, str]:
    """This process's device and the process group's backend: ``cuda:LOCAL_RANK`` (made the current
    device) and ``nccl``, or the CPU and ``gloo``."""
    if wanted != "cuda":
        return torch.device("cpu"), "gloo"
    if not torch.cuda.is_available():
        raise ConfigError("distributed launch on CUDA requested but no CUDA device is available")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but this host has {torch.cuda.device_count()} CUDA device(s); "
            "launch at most one process per device (torchrun --nproc_per_node)"
        )
    dev = torch.device("cuda", local_rank)
    torch.cuda.set_device(dev)
    return dev, "nccl"


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
    if info.device.type == "cuda":
        return DistributedDataParallel(
            model, device_ids=[info.device.index], output_device=info.device.index, **ddp_kwargs
        )
    return DistributedDataParallel(model, **ddp_kwargs)


def shard_units(module: nn.Module) -> list[list[nn.Module]]:
    """The groups of submodules :func:`shard_model` gives a ``fully_shard`` group of their own, in order.

    FSDP2 all-gathers a group's parameters when the forward pass first calls one of its modules, and again
    before their backward pass, so a group must be modules whose ``forward`` runs and that alone use their
    parameters. A module holding parameters directly qualifies when none of them is held by another module
    (tied weights) and, in a ``torch.fx.GraphModule`` (what the adaptive scaler's ``attach`` returns), it is
    called as a module (``call_module``) and none of its parameters is read by a ``get_attr`` node (those
    feed functional GEMMs outside its forward). A GEMM layer of the adaptive scaler that carries the
    parameters of the module it feeds (``AdaptiveGEMM.carriers``: a batch norm after a conv, whose
    parameters it reads in its own forward) shares one group with that module. Everything else stays with
    the root's group.
    """
    owners: dict[int, list[nn.Module]] = {}
    for sub in module.modules():
        for param in sub.parameters(recurse=False):
            owners.setdefault(id(param), []).append(sub)
    graph = getattr(module, "graph", None)
    called = read = None
    if isinstance(graph, torch.fx.Graph):
        called = {module.get_submodule(str(n.target)) for n in graph.nodes if n.op == "call_module"}
        values = (_attr(module, str(n.target)) for n in graph.nodes if n.op == "get_attr")
        read = {id(v) for v in values if isinstance(v, nn.Parameter)}
    group_of: dict[int, list[nn.Module]] = {}
    groups: list[list[nn.Module]] = []
    for sub in module.modules():
        params = list(sub.parameters(recurse=False))
        if sub is module or not params or id(sub) in group_of:
            continue
        members = [sub] + [_holder(owner, owners) for owner, _ in getattr(sub, "carriers", {}).values()]
        mine = [p for m in members if m is not None for p in m.parameters(recurse=False)]
        if None in members or any(len(owners[id(p)]) > 1 or (read and id(p) in read) for p in mine):
            continue
        if called is not None and any(m not in called for m in members):
            continue
        groups.append(members)
        group_of.update((id(m), members) for m in members)
    return groups


def _holder(owner: nn.Module, owners: dict[int, list[nn.Module]]) -> nn.Module | None:
    """The module of the tree that holds ``owner``'s parameters (``owner`` may be a wrapped module outside
    the tree that reads the same parameter table); None if there is not exactly one."""
    holders = {id(m): m for p in owner.parameters(recurse=False) for m in owners.get(id(p), [])}
    return next(iter(holders.values())) if len(holders) == 1 else None


def _attr(module: nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part, None)
    return module


def shard_model(module: nn.Module) -> nn.Module:
    """Shard ``module`` in place over the default process group with FSDP2 and return it.

    ``fully_shard`` on each of :func:`shard_units` (its own all-gather and reduce-scatter, resharded after
    its forward pass), then on ``module`` for the remaining parameters. Each rank then holds a ``1/world``
    shard (dim 0) of every parameter, gradient and optimizer state as ``DTensor``s; inside a group's forward
    and backward passes its parameters are whole again (all-gathered), so the adaptive scaler's GEMM
    backward reads the full weight (Algorithm 4's ``||W||``, ``max|W|`` need no reduction of their own).
    Gradients are reduce-scattered as sums (divide factor 1), as :func:`sum_gradients` makes DDP's: the
    trainer divides the loss by the world size. Call after ``scaler.attach`` and ``precision.prepare``,
    before building the optimizer (it must see the sharded parameters).
    """
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise RuntimeError("shard_model: call init_distributed() first (no process group)")
    for group in shard_units(module):
        fully_shard(group[0] if len(group) == 1 else group)
        _sum_gradients(group[0])  # the group's state: one for all its modules
    _sum_gradients(fully_shard(module))
    return module


def _sum_gradients(unit: Any) -> None:
    """Make an FSDP2 group reduce-scatter its gradients as plain sums: divide factor 1, and ``ReduceOp.SUM``
    itself (without it a float32 group asks for ``PREMUL_SUM``, which gloo refuses)."""
    unit.set_gradient_divide_factor(1.0)
    unit.set_force_sum_reduction_for_comms(True)


def destroy() -> None:
    """Tear down the default process group if one exists (call once at the end of training)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
