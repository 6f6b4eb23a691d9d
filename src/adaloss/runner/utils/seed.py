"""Seeding every random number generator a run touches, and saving and restoring their states."""

from __future__ import annotations

import random
from typing import Any

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


def capture_rng_state() -> dict[str, Any]:
    """The state of Python's, NumPy's and torch's global generators (CUDA's if CUDA is in use), as tensors,
    numbers and strings only, so a checkpoint holding it loads with ``torch.load(weights_only=True)``.

    Per-loader generators (the shuffle order) are saved with the data position instead
    (:class:`adaloss.runner.data.BatchStream`). CUDA states are captured only once CUDA is initialized, so a
    CPU run never initializes it. Cost: a few KB of copies.
    """
    version, internal, gauss_next = random.getstate()
    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "kind": str(kind),
            "key": torch.from_numpy(np.asarray(key, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
    }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` returned. CUDA states are restored when this process sees as
    many CUDA devices as the one that captured them (otherwise they are left as seeded)."""
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["internal"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        (
            npy["kind"],
            npy["key"].numpy().astype(np.uint32),
            int(npy["pos"]),
            int(npy["has_gauss"]),
            float(npy["cached_gaussian"]),
        )
    )
    torch.set_rng_state(state["torch"])
    cuda = list(state.get("cuda") or [])
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)
