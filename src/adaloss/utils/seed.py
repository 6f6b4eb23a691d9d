"""Seeding every random number generator a run touches."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (all CUDA devices included) with ``seed``.

    Same seed, same initial weights, same data order and augmentation on the CPU. It does not switch torch
    to deterministic kernels: on CUDA that costs speed (cuDNN benchmark off, slower atomics), so GPU runs
    with one seed agree only up to summation order.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
