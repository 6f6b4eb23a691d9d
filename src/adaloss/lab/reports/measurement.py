"""What the measurement scripts share (the bench, the underflow tables, the labs): the models by name, how
the tables spell them, the machine a measurement ran on and its header line, quantiles, and JSON output.

Kept free of anything expensive at import time (no model building, no data loading)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adaloss.lab.reports.common import markdown_table  # noqa: F401  (the scripts' tables)
from adaloss.runner.provenance import cpu_name as cpu_model  # noqa: F401  (the CPU's marketing name)

#: The checkout's root (``configs/``, ``results/``), as ``scripts/_common.ROOT``.
ROOT = Path(__file__).resolve().parents[4]

#: The ``model`` config groups the scripts know by name (same fields as ``configs/model/*.yaml``).
MODEL_CFGS: dict[str, dict[str, Any]] = {
    "resnet20": {"name": "resnet20", "depth": 20},
    "resnet56": {"name": "resnet56", "depth": 56},
    "resnet110": {"name": "resnet110", "depth": 110},
    "vgg_nobn": {"name": "vgg_nobn", "widths": [64, "M", 128, "M", 256, 256, "M", 512, "M"]},
}

#: How the tables spell the models.
PRETTY = {
    "resnet20": "ResNet-20",
    "resnet56": "ResNet-56",
    "resnet110": "ResNet-110",
    "vgg_nobn": "VGG (no BN)",
    "gpt": "GPT (tiny)",
}


def model_cfg(name: str):
    """The OmegaConf ``model`` group for ``name``; raises ``SystemExit`` with the known names otherwise."""
    from omegaconf import OmegaConf

    if name not in MODEL_CFGS:
        raise SystemExit(f"error: unknown model '{name}': choose from {', '.join(MODEL_CFGS)}")
    return OmegaConf.create(MODEL_CFGS[name])


def machine_info() -> dict[str, Any]:
    """What the header line names: CPU, cores, torch version and threads, load average, date (UTC)."""
    import torch

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_avg_at_start": load,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def header_line(info: dict[str, Any]) -> str:
    load = info.get("load_avg_at_start")
    load_txt = f", load avg at start {'/'.join(f'{x:.2f}' for x in load)}" if load else ""
    return (
        f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, {info['threads']} threads"
        f"{load_txt}; {info['date']}"
    )


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method); NaN for an empty list."""
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


def write_json(path: str | os.PathLike[str], payload: Any) -> Path:
    """Write ``payload`` as indented JSON, creating the folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, allow_nan=True)
        f.write("\n")
    return path
