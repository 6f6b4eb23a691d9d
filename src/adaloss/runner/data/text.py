"""Text datasets for language models: windows of token ids, nanoGPT style.

* ``pystdlib`` (the CPU's corpus): the Python standard library's own source, read at run time from the
  running interpreter's ``sysconfig.get_paths()["stdlib"]``: the ``.py`` files directly in that folder (not
  its packages), sorted by name, without the platform-specific ``_sysconfigdata_*`` and the site hooks
  ``sitecustomize``/``usercustomize`` a distribution may add. The same selection on every machine with the
  same Python version (on CPython 3.11.7, 167 files, 4.7 MB); the digest in ``DatasetInfo.source`` shows
  whether two machines' corpora are byte-identical (distributions may patch a file). Byte-level: a token
  is a byte, vocabulary 256. Every 10th file of the sorted list (``dataset.holdout_every``) is the
  validation split, the rest the training split: a fixed split by whole files, so no validation text
  appears in training.
* ``tokens`` (for GPUs): token ids in ``train.bin`` and ``val.bin`` (flat ``uint16`` arrays, as nanoGPT's
  ``prepare.py`` writes them) under ``paths.data_dir/<dataset.folder>``, read through ``np.memmap`` so a
  corpus of billions of tokens costs no RAM; ``meta.json`` beside them (``scripts/prepare_tokens.py``
  writes it) gives the vocabulary size and dtype. Nothing is downloaded.

A training sample is a window of ``block_size + 1`` tokens starting at any offset that is a multiple of
``dataset.stride`` (1: every offset, so shuffled batches are nanoGPT's random windows; the loader's seeded
shuffle makes them reproducible and resumable): ``x`` its first ``block_size`` tokens, ``y`` the same
shifted by one (the next token at every position). Validation uses ``dataset.val_windows`` windows spread
evenly over the validation split (or every non-overlapping window with ``val_windows: null``): the same
windows at every evaluation, so validation losses are comparable along a run and across runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from adaloss.errors import ConfigError
from adaloss.runner.data.datasets import DatasetInfo

__all__ = [
    "TEXT_DATASET_NAMES",
    "TextInfo",
    "TokenWindows",
    "pystdlib_files",
    "read_token_folder",
]

TEXT_DATASET_NAMES: tuple[str, ...] = ("pystdlib", "tokens")
_SKIPPED_PREFIXES = ("_sysconfigdata", "sitecustomize", "usercustomize")
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "uint8": np.uint8}


@dataclass(frozen=True)
class TextInfo(DatasetInfo):
    """``DatasetInfo`` of a text dataset: ``num_classes`` is the vocabulary size, ``train_size`` and
    ``test_size`` count windows, ``source`` describes the corpus for ``metrics.json`` (files, tokens, digest,
    the Python version for ``pystdlib``)."""

    vocab_size: int = 256
    block_size: int = 128
    source: dict[str, Any] = field(default_factory=dict)
    task: str = "language_model"


class TokenWindows(Dataset):
    """Windows of ``block_size + 1`` tokens of a flat token array (a uint8 tensor or a NumPy memmap).

    Sample ``i`` starts at ``starts[i]`` if ``starts`` is given, else at ``i * stride``; it is ``(x, y)``,
    two int64 tensors of ``block_size`` tokens, ``y`` shifted by one. Cost: one slice and one copy of
    ``block_size + 1`` tokens per sample.
    """

    def __init__(
        self, tokens: Any, block_size: int, stride: int = 1, starts: np.ndarray | None = None
    ) -> None:
        self.tokens = tokens
        self.block_size = int(block_size)
        self.stride = int(stride)
        self.starts = starts
        if len(tokens) < self.block_size + 1:
            raise ConfigError(
                f"a text split of {len(tokens)} tokens is shorter than one window of dataset.block_size + "
                "1 = "
                f"{self.block_size + 1}: lower dataset.block_size or use more text"
            )
        self._count = (
            len(starts) if starts is not None else (len(tokens) - self.block_size - 1) // self.stride + 1
        )

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[index]) if self.starts is not None else index * self.stride
        chunk = self.tokens[start : start + self.block_size + 1]
        chunk = torch.from_numpy(chunk.astype(np.int64)) if isinstance(chunk, np.ndarray) else chunk.long()
        return chunk[:-1], chunk[1:]


def _val_windows(n_tokens: int, block_size: int, count: int | None) -> np.ndarray:
    """Start offsets of ``count`` windows spread evenly over ``n_tokens`` (all non-overlapping ones if
    ``count`` is None or more than fit)."""
    last = n_tokens - block_size - 1
    every = np.arange(0, last + 1, block_size, dtype=np.int64)
    if count is None or count >= len(every):
        return every
    return np.linspace(0, last, count).round().astype(np.int64)


def pystdlib_files(stdlib: str | os.PathLike[str] | None = None) -> list[Path]:
    """The corpus files of ``pystdlib``, sorted by name (see the module docstring)."""
    root = Path(stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file() and not p.name.startswith(_SKIPPED_PREFIXES))
    if not files:
        raise ConfigError(
            f"no Python source files in the standard library folder {root}: dataset=pystdlib needs a Python "
            "installation with its .py files (some distributions strip them); use dataset=tokens instead"
        )
    return files


def _build_pystdlib(args: dict[str, Any]) -> tuple[Dataset, Dataset, TextInfo]:
    block_size, every, val_windows = args["block_size"], args["holdout_every"], args["val_windows"]
    stride = 1 if args["stride"] is None else args["stride"]  # null: every window
    files = pystdlib_files(args["stdlib"])
    train_parts, val_parts = [], []
    digest = hashlib.sha256()
    for i, path in enumerate(files):
        data = path.read_bytes()
        digest.update(path.name.encode() + b"\0" + data)
        (val_parts if i % every == every - 1 else train_parts).append(data)
    train = torch.frombuffer(bytearray(b"".join(train_parts)), dtype=torch.uint8)
    val = torch.frombuffer(bytearray(b"".join(val_parts)), dtype=torch.uint8)
    train_set = TokenWindows(train, block_size, stride)
    val_set = TokenWindows(val, block_size, starts=_val_windows(len(val), block_size, val_windows))
    source = {
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "stdlib": str(files[0].parent),
        "files": len(files),
        "train_files": len(train_parts),
        "val_files": len(val_parts),
        "train_tokens": len(train),
        "val_tokens": len(val),
        "sha256": digest.hexdigest(),
    }
    info = TextInfo("pystdlib", 256, 0, 0, len(train_set), len(val_set), 256, block_size, source)
    return train_set, val_set, info


def read_token_folder(folder: Path) -> tuple[np.memmap, np.memmap, dict[str, Any]]:
    """``(train, val, meta)``: the memory-mapped ``train.bin`` and ``val.bin`` of ``folder`` and its
    ``meta.json`` (``{}`` if absent). ``ConfigError`` naming the path and the fix for missing or malformed
    files. Cost: two ``mmap`` calls; no token is read."""
    missing = [name for name in ("train.bin", "val.bin") if not (folder / name).is_file()]
    if missing:
        raise ConfigError(
            f"token files not found: {folder} has no {' and no '.join(missing)}; write them with "
            f"python scripts/prepare_tokens.py <text files or folders> --out {folder}, or point "
            "dataset.folder (under paths.data_dir, or absolute) at the folder that holds them"
        )
    meta: dict[str, Any] = {}
    if (folder / "meta.json").is_file():
        try:
            meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ConfigError(
                f"{folder / 'meta.json'} is not readable JSON ({error}): rewrite or delete it"
            ) from None
    dtype_name = str(meta.get("dtype", "uint16"))
    if dtype_name not in _DTYPES:
        raise ConfigError(f"{folder / 'meta.json'} has dtype {dtype_name!r}: use one of {', '.join(_DTYPES)}")
    dtype = np.dtype(_DTYPES[dtype_name])
    arrays = []
    for name in ("train.bin", "val.bin"):
        path = folder / name
        size = path.stat().st_size
        if size == 0 or size % dtype.itemsize:
            raise ConfigError(
                f"{path} holds {size} bytes, not a whole number of {dtype_name} token ids: write it again "
                "with "
                "scripts/prepare_tokens.py"
            )
        arrays.append(np.memmap(path, dtype=dtype, mode="r"))
    return arrays[0], arrays[1], meta


def _build_tokens(args: dict[str, Any], data_dir: Path) -> tuple[Dataset, Dataset, TextInfo]:
    block_size, val_windows = args["block_size"], args["val_windows"]
    stride = block_size if args["stride"] is None else args["stride"]  # null: non-overlapping windows
    folder = Path(str(args["folder"])).expanduser()
    folder = folder if folder.is_absolute() else data_dir / folder
    train, val, meta = read_token_folder(folder)
    vocab = args["vocab_size"] or meta.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 2:
        raise ConfigError(
            f"the vocabulary size of {folder} is unknown (got {vocab!r}): set dataset.vocab_size=<tokens "
            "in the "
            "vocabulary>, or write meta.json with scripts/prepare_tokens.py"
        )
    top = int(val.max())  # the validation split only: the training split may be billions of tokens
    if top >= vocab:
        raise ConfigError(
            f"{folder / 'val.bin'} holds token id {top}, outside a vocabulary of {vocab}: set "
            "dataset.vocab_size "
            "to the tokenizer's size"
        )
    train_set = TokenWindows(train, block_size, stride)
    val_set = TokenWindows(val, block_size, starts=_val_windows(len(val), block_size, val_windows))
    source = {"folder": str(folder), "train_tokens": len(train), "val_tokens": len(val), **meta}
    info = TextInfo("tokens", int(vocab), 0, 0, len(train_set), len(val_set), int(vocab), block_size, source)
    return train_set, val_set, info


# ------------------------------------------------------------------------- the configs' _target_s


# Every field of the dataset's schema (adaloss.runner.schemas) is passed: its defaults and ranges live there
# alone.


def pystdlib(
    *, name: str, block_size: int, stride: int | None, val_windows: int | None, holdout_every: int,
    stdlib: str | None,
) -> tuple[Dataset, Dataset, TextInfo]:  # fmt: skip
    """``dataset=pystdlib`` (the config's ``_target_``)."""
    return _build_pystdlib(
        {"block_size": block_size, "stride": stride, "val_windows": val_windows,
         "holdout_every": holdout_every, "stdlib": stdlib}
    )  # fmt: skip


def tokens(
    data_dir: str | os.PathLike[str], *, name: str, folder: str, vocab_size: int | None, block_size: int,
    stride: int | None, val_windows: int | None,
) -> tuple[Dataset, Dataset, TextInfo]:  # fmt: skip
    """``dataset=tokens`` (the config's ``_target_``): ``train.bin``/``val.bin`` under ``data_dir``."""
    args = {"folder": folder, "vocab_size": vocab_size, "block_size": block_size, "stride": stride,
           "val_windows": val_windows}  # fmt: skip
    return _build_tokens(args, Path(data_dir).expanduser().resolve())
