"""What every integration logs on a telemetry step: the per-layer underflow rates the monitor counted, the
scaler's per-layer alphas (the adaptive scaler) or its loss scale, and its counters."""

from __future__ import annotations

from adaloss.scalers import LossScaler
from adaloss.telemetry import UnderflowMonitor


def scaler_telemetry(scaler: LossScaler, monitor: UnderflowMonitor | None) -> dict[str, float]:
    """``underflow_rate/<layer>`` and ``mean_underflow_rate`` (with a monitor that counted this step; its
    counts are reset), ``alpha/<layer>`` or ``loss_scale``, ``skipped_steps`` and ``overflow_count``. One
    host sync (the counts, the alphas)."""
    out: dict[str, float] = {}
    if monitor is not None:
        rates = monitor.underflow_rates()
        out = {f"underflow_rate/{layer}": rate for layer, rate in rates.items()}
        out["mean_underflow_rate"] = UnderflowMonitor.mean_rate(rates)
    scale = scaler.loss_scale_metric()
    if isinstance(scale, dict):
        out.update({f"alpha/{layer}": alpha for layer, alpha in scale.items()})
    else:
        out["loss_scale"] = float(scale)
    out["skipped_steps"] = float(scaler.skipped_steps)
    out["overflow_count"] = float(scaler.overflow_count)
    return out
