"""``make_loader``: a DataLoader whose sample order and augmentation are fixed by one seed."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from adaloss.errors import ConfigError

__all__ = ["make_loader", "seed_worker"]


def seed_worker(worker_id: int) -> None:
    """Seed Python's and NumPy's RNGs in a DataLoader worker from its torch seed.

    PyTorch seeds each worker's torch RNG with ``base_seed + worker_id``, ``base_seed`` drawn from the
    loader's generator, but leaves ``random`` and ``numpy`` alone: without this, forked workers would share
    the parent's NumPy state and draw identical augmentations.
    """
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def make_loader(
    dataset: Dataset,
    batch_size: int,
    train: bool,
    seed: int,
    num_workers: int = 0,
    drop_last: bool | None = None,
) -> DataLoader:
    """A DataLoader for ``dataset``: shuffled with a seeded generator when ``train``, in order otherwise.

    * The shuffle order (every epoch's) depends only on ``seed``; so does each worker's RNG when
      ``num_workers > 0``. With ``num_workers == 0`` random augmentations use the main process's torch RNG,
      which the trainer seeds.
    * ``drop_last`` defaults to ``train``: no short final batch to skew BatchNorm statistics and the loss
      scale. A training set smaller than one batch is then a ``ConfigError`` (it would yield no steps).
    * Workers are persistent (no fork per epoch); memory is pinned only when CUDA is available.
    """
    if isinstance(batch_size, bool) or int(batch_size) < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    if int(num_workers) < 0:
        raise ConfigError(f"num_workers must be >= 0, got {num_workers!r}")
    batch_size, num_workers = int(batch_size), int(num_workers)
    if drop_last is None:
        drop_last = train
    if drop_last and len(dataset) < batch_size:  # type: ignore[arg-type]
        raise ConfigError(
            f"batch_size={batch_size} is larger than the dataset ({len(dataset)} samples) and the last "  # type: ignore[arg-type]
            "partial batch is dropped, so there is nothing to train on: lower the batch size"
        )
    generator = torch.Generator()
    generator.manual_seed(int(seed))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=train,
        generator=generator,
        drop_last=drop_last,
        num_workers=num_workers,
        worker_init_fn=seed_worker if num_workers > 0 else None,
        persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(),
    )
