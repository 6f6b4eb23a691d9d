"""``make_loader``: a DataLoader whose sample order and augmentation are fixed by one seed; ``BatchStream``:
its batches epoch after epoch, from a position a checkpoint can save and restore.

Data-parallel runs (``make_loader(..., rank=r, world_size=W)``): ``batch_size`` is the *global* batch. Every
rank draws the same shuffled sequence of global batches (the shuffle depends only on the seed) and keeps
its contiguous ``1/W`` of each: rank ``r`` takes positions ``[r * B/W, (r + 1) * B/W)`` of every global
batch of ``B`` indices. So the union over ranks of one iteration's batches is exactly the batch a single
process draws at that iteration, the number of iterations per epoch does not depend on ``W``, and the data
position a checkpoint saves (epoch, global batches taken) means the same at any world size.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

from adaloss.errors import ConfigError

__all__ = ["BatchStream", "ResumableBatchSampler", "make_loader", "seed_worker"]


def seed_worker(worker_id: int, rank: int = 0) -> None:
    """Seed Python's and NumPy's RNGs in a DataLoader worker from its torch seed.

    PyTorch seeds each worker's torch RNG with ``base_seed + worker_id``, ``base_seed`` drawn from the
    loader's generator, but leaves ``random`` and ``numpy`` alone: without this, forked workers would share
    the parent's NumPy state and draw identical augmentations.

    ``rank`` (data-parallel runs): every rank's loader draws the same ``base_seed`` (the generator is seeded
    alike on all ranks, for the common shuffle), so the workers of rank ``r > 0`` re-seed torch too, from
    ``initial_seed + r * 2**32``: the ranks' augmentations are then independent. Rank 0 keeps PyTorch's
    seeding, so a one-process run is unchanged.
    """
    seed = torch.initial_seed()
    if rank:
        seed = (seed + rank * 2**32) % 2**63
        torch.manual_seed(seed)
    random.seed(seed % 2**32)
    np.random.seed(seed % 2**32)


def make_loader(
    dataset: Dataset,
    batch_size: int,
    train: bool,
    seed: int,
    num_workers: int = 0,
    drop_last: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    rank: int = 0,
    world_size: int = 1,
    pin_memory: bool = False,
) -> DataLoader:
    """A DataLoader for ``dataset``: shuffled with a seeded generator when ``train``, in order otherwise.

    * The shuffle order (every epoch's) depends only on ``seed``; so does each worker's RNG when
      ``num_workers > 0``. With ``num_workers == 0`` random augmentations use the main process's torch RNG,
      which the trainer seeds.
    * ``drop_last`` defaults to ``train``: no short final batch to skew BatchNorm statistics and the loss
      scale. A training set smaller than one batch is then a ``ConfigError`` (it would yield no steps).
    * Workers are persistent (no fork per epoch); memory is pinned when ``pin_memory`` (the trainer asks
      for it when training on a GPU: pinned pages speed up host-to-GPU copies and only cost elsewhere).
    * ``collate_fn``: how samples become a batch (default: stacking); detection data passes
      ``adaloss.runner.data.detection_collate``, which keeps one target dict per image.
    * Batches come from a :class:`ResumableBatchSampler` (``loader.batch_sampler``), which draws exactly the
      order a ``shuffle=True`` DataLoader would and can start a pass part-way (see :class:`BatchStream`).
      As with any ``batch_sampler``, ``loader.batch_size`` is ``None``; the sampler's is the batch size.
    * ``rank``/``world_size`` (data parallel): ``batch_size`` is the global batch and this loader yields
      rank ``rank``'s contiguous ``batch_size // world_size`` samples of each (see the module docstring);
      ``len(loader)`` is the number of global batches. A ``ConfigError`` unless ``world_size`` divides
      ``batch_size`` and ``drop_last`` holds (a short last batch could not be split evenly, and unequal
      shares would make the ranks' gradient averages unequal).
    """
    if isinstance(batch_size, bool) or int(batch_size) < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    if int(num_workers) < 0:
        raise ConfigError(f"num_workers must be >= 0, got {num_workers!r}")
    batch_size, num_workers = int(batch_size), int(num_workers)
    if drop_last is None:
        drop_last = train
    rank, world_size = int(rank), int(world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"make_loader: need 0 <= rank < world_size, got {rank=}, {world_size=}")
    if world_size > 1:
        if batch_size % world_size:
            fit = batch_size // world_size * world_size or world_size
            raise ConfigError(
                f"trainer.batch_size={batch_size} is the global batch and must be divisible by the number of "
                f"processes ({world_size}); e.g. trainer.batch_size={fit}"
            )
        if not drop_last:
            raise ConfigError("a data-parallel loader must drop the last partial batch (drop_last=True)")
    if drop_last and len(dataset) < batch_size:  # type: ignore[arg-type]
        raise ConfigError(
            f"batch_size={batch_size} is larger than the dataset ({len(dataset)} samples) and the last "  # type: ignore[arg-type]
            "partial batch is dropped, so there is nothing to train on: lower the batch size"
        )
    generator = torch.Generator()
    generator.manual_seed(int(seed))
    # What DataLoader(shuffle=train) builds, with a batch sampler that can resume mid-epoch.
    sampler = RandomSampler(dataset, generator=generator) if train else SequentialSampler(dataset)
    return DataLoader(
        dataset,
        batch_sampler=ResumableBatchSampler(sampler, batch_size, drop_last, rank=rank, world_size=world_size),
        generator=generator,
        num_workers=num_workers,
        worker_init_fn=functools.partial(seed_worker, rank=rank) if num_workers > 0 else None,
        persistent_workers=num_workers > 0,
        pin_memory=pin_memory,
        collate_fn=collate_fn,
    )


class ResumableBatchSampler(BatchSampler):
    """``BatchSampler`` whose next pass can restart an earlier pass part-way, without loading any data.

    Each pass first records the state of the shuffling generator (``epoch_state``: the state its
    permutation is drawn from). ``resume(epoch_state, batches)`` makes the next pass restore that state,
    draw the same permutation and drop its first ``batches`` index lists: only indices are generated, no
    sample is loaded, so fast-forwarding costs microseconds however far into the epoch the position is.
    The order of the batches is exactly ``BatchSampler(sampler, batch_size, drop_last)``'s.

    With ``world_size > 1`` each yielded index list is this rank's share of the global batch:
    ``indices[rank * n : (rank + 1) * n]`` with ``n = batch_size // world_size``. The position (``resume``)
    counts global batches, which every rank advances through together. ``len()`` is the number of global
    batches.
    """

    def __init__(
        self, sampler: Any, batch_size: int, drop_last: bool, rank: int = 0, world_size: int = 1
    ) -> None:
        super().__init__(sampler, batch_size, drop_last)
        if world_size > 1 and (batch_size % world_size or not drop_last):
            raise ValueError("a split batch sampler needs batch_size divisible by world_size and drop_last")
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.epoch_state: torch.Tensor | None = None
        self._resume: tuple[torch.Tensor | None, int] | None = None

    @property
    def generator(self) -> torch.Generator | None:
        """The generator that shuffles (``None`` for an unshuffled loader)."""
        return getattr(self.sampler, "generator", None)

    def resume(self, epoch_state: torch.Tensor | None, batches: int) -> None:
        """Let the next pass start from ``epoch_state`` (a pass's ``epoch_state``), ``batches`` batches in."""
        self._resume = (epoch_state, int(batches))

    def __iter__(self) -> Iterator[list[int]]:
        generator = self.generator
        skip = 0
        if self._resume is not None:
            state, skip = self._resume
            self._resume = None
            if generator is not None and state is not None:
                generator.set_state(state)
        self.epoch_state = generator.get_state() if generator is not None else None
        batches = super().__iter__()
        for _ in range(skip):
            if next(batches, None) is None:
                return
        if self.world_size == 1:
            yield from batches
            return
        share = self.batch_size // self.world_size
        start = self.rank * share
        for indices in batches:
            yield indices[start : start + share]


class BatchStream:
    """Batches from ``loader`` (a :func:`make_loader` loader), epoch after epoch, with a resumable position.

    ``next(stream)`` returns the next batch, starting a new pass over the data (a new shuffle drawn from the
    loader's generator) when an epoch ends. ``state_dict()`` is the position: the epoch, the batches of it
    already taken (``batch_index``) and the shuffling generator's state at the start of the epoch;
    ``load_state_dict(state)`` (before the first ``next``) continues from there with the same order, the
    skipped batches never loaded (see :class:`ResumableBatchSampler`).

    The order after a resume is exact. Random augmentation is exact with ``num_workers=0`` (it uses the
    main process's torch RNG, which the checkpoint restores); worker processes have RNGs of their own, which
    a checkpoint cannot capture, so with ``num_workers > 0`` the augmentations drawn after a resume differ.
    """

    def __init__(self, loader: DataLoader) -> None:
        if not isinstance(loader.batch_sampler, ResumableBatchSampler):
            raise TypeError("BatchStream needs a loader from make_loader (a ResumableBatchSampler)")
        self.loader = loader
        self.sampler: ResumableBatchSampler = loader.batch_sampler
        self.epoch = 0
        self.batch_index = 0  # batches taken from the current epoch
        self._batches: Iterator[Any] | None = None

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Any:
        while True:
            if self._batches is None:
                self._batches = iter(self.loader)
            try:
                batch = next(self._batches)
            except StopIteration:
                self._batches = None
                self.epoch += 1
                self.batch_index = 0
                continue
            self.batch_index += 1
            return batch

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "batch_index", "generator"}``: plain ints and a uint8 tensor (``None`` before the
        first batch of the stream, or for an unshuffled loader)."""
        state = self.sampler.epoch_state if self._batches is not None else None
        return {"epoch": self.epoch, "batch_index": self.batch_index, "generator": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict()``: the next batch is batch ``batch_index`` of that epoch."""
        if self._batches is not None:
            raise RuntimeError("load_state_dict() must come before the first batch")
        self.epoch = int(state["epoch"])
        self.batch_index = int(state["batch_index"])
        if state.get("generator") is not None:
            self.sampler.resume(state["generator"], self.batch_index)
