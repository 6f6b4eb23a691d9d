"""``telemetry.jsonl``: one JSON line per telemetry step, the input of ``scripts/make_figures.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaloss.runner.logging.run_log import trim_appended

if TYPE_CHECKING:
    from adaloss.scalers import LossScaler

__all__ = ["TelemetryLog"]


class TelemetryLog:
    """Appends one JSON line per telemetry step to ``telemetry.jsonl`` (the input of make_figures.py).

    Each line: ``step`` (iterations completed), ``underflow_rate`` ``{layer: rate}``, ``loss_scale`` (a
    float, or ``{layer: alpha}`` for the adaptive scaler, which adds ``loss_scale_beta``) and, when
    recorded, ``expected_loss_scale`` ``{layer: scale}``; then the gradient-storage quantities
    (``saturation_rate``, ``grad_scale_min``, ``grad_scale_max``, ``sqnr_db``, each ``{layer: value}``,
    :data:`adaloss.telemetry.STORAGE_KEYS`). Appending a line is atomic enough for a reader:
    a run killed mid-write leaves at most one truncated last line, which readers skip. Cost: one small
    write per telemetry step.
    """

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled  # False on data-parallel ranks other than 0: they write nothing

    def append(
        self,
        step: int,
        rates: dict[str, float],
        scaler: LossScaler,
        expected: dict[str, float],
        storage: dict[str, dict[str, float]] | None = None,
    ) -> dict[str, Any]:
        """Write the telemetry step's line (rank 0 only) and return it (W&B logs the same record)."""
        record: dict[str, Any] = {
            "step": step,
            "underflow_rate": rates,
            "loss_scale": scaler.loss_scale_metric(),
        }
        layer_betas = getattr(scaler, "layer_betas", None)
        if callable(layer_betas):
            record["loss_scale_beta"] = layer_betas()
        if expected:
            record["expected_loss_scale"] = expected
        record.update(storage or {})
        if not self.enabled:
            return record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, allow_nan=True) + "\n")
        return record

    def truncate(self, after: int) -> None:
        """Drop the lines of steps after ``after`` (and any unreadable line): what an interrupted run logged
        past the checkpoint a resumed run continues from, which the resumed run logs again. ``after=0`` (a
        fresh start, e.g. after a kill before the first checkpoint) leaves no line. Rewritten atomically."""
        if self.enabled:
            trim_appended(self.path, lambda line: _line_step(line) <= after)


def _line_step(line: str) -> float:
    """The ``step`` of a ``telemetry.jsonl`` line; infinity for an unreadable one (which is dropped)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf
