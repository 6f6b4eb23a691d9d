"""The run's own log: a line every ``trainer.log_every`` iterations, ``scalars.csv`` with every iteration's
numbers, trimming of append-only files on resume, and the run name on log lines of a sweep.

The progress bar (:mod:`adaloss.runner.logging.progress`) only shows on a terminal and W&B only with
``logger=wandb``; what this module writes exists with any logger and any terminal: ``train.log`` (Hydra's
log file) gets the periodic lines, and ``scalars.csv`` keeps the whole training curve.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from adaloss.runner.logging.metrics import write_atomic
from adaloss.runner.logging.progress import format_scale

__all__ = ["ScalarLog", "progress_line", "run_name_on_log_lines", "trim_appended"]


def progress_line(
    done: int,
    steps: int,
    loss: float,
    accuracy: float | None,
    lr: float,
    scale: float | dict[str, float] | None,
    skipped: int,
    images_per_s: float,
) -> str:
    """``iteration 50/200: loss 0.5321, acc 84.4%, lr 0.1, scale 65536, skipped 0, 1234 img/s`` (no
    accuracy for detection; a layer-wise scale as ``min..max``)."""
    acc = f", acc {accuracy:.1f}%" if accuracy is not None else ""
    return (
        f"iteration {done}/{steps}: loss {loss:.4f}{acc}, lr {lr:.4g}, scale {format_scale(scale)}, "
        f"skipped {skipped}, {images_per_s:.0f} img/s"
    )


def trim_appended(path: Path, keep: Callable[[str], bool]) -> None:
    """Rewrite the append-only file ``path`` with only the lines ``keep`` accepts (atomically); remove it
    when none is left. A truncated last line (a run killed mid-write) is dropped unless kept. Raises
    ``OSError`` from the filesystem. Cost: reads and rewrites the file, once per start."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if line.endswith("\n") and keep(line)]
    if kept == lines:
        return
    if not kept:
        path.unlink()
        return
    text = "".join(kept)
    write_atomic(path, lambda handle: handle.write(text.encode("utf-8")))


class ScalarLog:
    """``scalars.csv``: one row per iteration, appended and flushed, so the curve survives any logger.

    Columns: ``step`` (iterations completed), ``loss`` (the iteration's training loss; under DDP the mean
    over the ranks), ``lr`` (the learning rate the update used), ``loss_scale`` (for a layer-wise scaler
    ``loss_scale_min`` and ``loss_scale_max`` over the layers), ``skipped`` (1 if the update was skipped),
    ``skipped_steps`` and ``overflow_count`` (the scaler's counters so far).

    :meth:`add` keeps the loss on the device (no host sync); :meth:`flush`, on logging steps, before a
    checkpoint and at the end, reads the buffered losses in one sync and appends the rows. Every rank calls
    both (``flush`` all-reduces the losses under DDP); only ``enabled`` writes. Rows after the checkpoint a
    run resumes from are dropped by :meth:`trim`, so no iteration appears twice.
    """

    def __init__(self, path: Path, layerwise: bool, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled
        scale = ["loss_scale_min", "loss_scale_max"] if layerwise else ["loss_scale"]
        self.columns = ["step", "loss", "lr", *scale, "skipped", "skipped_steps", "overflow_count"]
        self._losses: list[torch.Tensor] = []
        self._rows: list[list[Any]] = []

    def add(
        self,
        step: int,
        loss: torch.Tensor,
        lr: float,
        scale: float | dict[str, float],
        skipped: bool,
        skipped_steps: int,
        overflow_count: int,
    ) -> None:
        if isinstance(scale, dict):
            scales = [min(scale.values()), max(scale.values())] if scale else [math.nan, math.nan]
        else:
            scales = [scale]
        self._losses.append(loss.detach().float().reshape(()))
        self._rows.append([step, lr, *scales, int(skipped), skipped_steps, overflow_count])

    def flush(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Append the buffered rows (``reduce``: the mean over data-parallel ranks). One host sync."""
        if not self._rows:
            return
        losses = torch.stack(self._losses)
        if reduce is not None:
            losses = reduce(losses)
        values = losses.cpu().tolist()  # note: the host sync
        rows, self._rows, self._losses = self._rows, [], []
        if not self.enabled:
            return
        new = not self.path.is_file()
        with open(self.path, "a", encoding="utf-8", newline="") as handle:
            writer = csv.writer(handle, lineterminator="\n")
            if new:
                writer.writerow(self.columns)
            for loss, (step, *rest) in zip(values, rows, strict=True):
                writer.writerow([step, _number(loss), *(_number(v) for v in rest)])
            handle.flush()

    def trim(self, after: int) -> None:
        """Keep the rows of iterations ``<= after`` (none for a fresh start). Raises ``OSError``."""
        if self.enabled:
            trim_appended(self.path, lambda line: line.startswith("step,") or _step(line, ",") <= after)


def _number(value: Any) -> str:
    return f"{value:.7g}" if isinstance(value, float) else str(value)


def _step(line: str, sep: str) -> float:
    try:
        return int(line.split(sep, 1)[0])
    except ValueError:
        return math.inf  # an unreadable row: dropped


@contextlib.contextmanager
def run_name_on_log_lines(tag: str | None) -> Iterator[None]:
    """Prefix every log record's message with ``[tag] `` while the block runs (``None``: unchanged).

    In a sweep (``-m``) several jobs write to one terminal (joblib, submitit logs); the tag (the job number
    and run name) tells their lines apart. Done with a record factory, so every logger and handler shows it
    without touching Hydra's formatters; the previous factory is restored afterwards.
    """
    if not tag:
        yield
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        record.msg = f"[{tag}] {record.msg}"
        return record

    logging.setLogRecordFactory(factory)
    try:
        yield
    finally:
        logging.setLogRecordFactory(previous)
