"""One telemetry step under a scaler (:func:`measure`), the fixed batch it measures, the FP32 training
before the trained regimes, and the layer-by-layer comparison of the scalers' rates."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from adaloss.lab.reports.measurement import median
from adaloss.lab.underflow.settings import ADAPTIVE, DIGITS, MOMENTUM


def load_digits(data_dir: str | Path = "data"):
    from adaloss.runner.data import build_datasets

    train_set, _, info = build_datasets(OmegaConf.create(DIGITS), str(data_dir))
    return train_set, info


def measurement_batch(train_set, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch every measurement uses: the first batch of a loader shuffled with ``seed + 1``."""
    from adaloss.runner.data.loaders import make_loader

    x, y = next(iter(make_loader(train_set, batch, train=True, seed=seed + 1)))
    return x, y


def train_fp32(
    model: torch.nn.Module,
    train_set,
    steps: int,
    lr: float,
    batch: int,
    seed: int,
    log: Callable[[str], None],
) -> list[float]:
    """Plain FP32 SGD (momentum 0.9) for ``steps`` steps on shuffled digits; returns the loss per step.

    Stops with ``RuntimeError`` if the loss becomes non-finite (measuring a diverged model says nothing).
    """
    from adaloss.runner.data.loaders import make_loader

    loader = make_loader(train_set, batch, train=True, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    model.train()
    losses: list[float] = []
    it = iter(loader)
    t0 = time.perf_counter()
    for step in range(steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = float(loss.detach())
        losses.append(value)
        if not math.isfinite(value):
            raise RuntimeError(f"FP32 training diverged at step {step} (loss {value}); lower the lr")
        if (step + 1) % 25 == 0 or step + 1 == steps:
            recent = losses[-10:]
            log(
                f"[underflow]   step {step + 1}/{steps}: loss (mean of last {len(recent)}) "
                f"{sum(recent) / len(recent):.4f}, {time.perf_counter() - t0:.0f}s"
            )
    return losses


def measure(
    model: torch.nn.Module,
    precision_name: str,
    scaler_cfg: dict[str, Any],
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
) -> dict[str, Any]:
    """One telemetry step of a deep copy of ``model``: per-layer underflow rates, loss, adaptive alphas.

    ``loss_fn(output, y)``: the classifier's cross-entropy by default (``scripts/lm_underflow.py`` passes
    the language model's, over every position)."""
    from adaloss.precision import Precision
    from adaloss.runner.utils.targets import build_scaler
    from adaloss.telemetry import UnderflowMonitor

    precision = Precision(precision_name, "cpu")
    scaler = build_scaler(OmegaConf.create(scaler_cfg), precision.grad_format)
    net = precision.prepare(scaler.attach(copy.deepcopy(model)))
    net.train()
    monitor = UnderflowMonitor(every=1, fmt=precision.telemetry_format)
    with precision.autocast(monitor=monitor):
        loss = loss_fn(net(x), y)
    scaler.scale(loss).backward()
    rates = monitor.underflow_rates()
    alphas = scaler.layer_scales() if hasattr(scaler, "layer_scales") else {}
    finite = all(bool(torch.isfinite(p.grad).all()) for p in net.parameters() if p.grad is not None)
    return {"rates": rates, "loss": float(loss.detach()), "alphas": alphas, "grads_finite": finite}


def compare(per_scaler: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Layer-by-layer comparison of the scalers' rates (layers in network order); per adaptive variant
    ``<name>_le_fixed``, ``<name>_lt_none`` and its alphas' min / median / max and count of ones."""
    layers = list(per_scaler["none"]["rates"])
    for name in per_scaler:
        missing = set(layers) ^ set(per_scaler[name]["rates"])
        if missing:
            raise RuntimeError(f"scaler {name} reports different layers than none: {sorted(missing)}")
    from adaloss.telemetry import UnderflowMonitor

    none, fixed = per_scaler["none"]["rates"], per_scaler["fixed128"]["rates"]
    out: dict[str, Any] = {
        "layers": len(layers),
        "mean": {s: UnderflowMonitor.mean_rate(per_scaler[s]["rates"]) for s in per_scaler},
        "none_positive": sum(none[n] > 0 for n in layers),
    }
    for name in ADAPTIVE:
        ada = per_scaler[name]["rates"]
        alphas = list(per_scaler[name]["alphas"].values())
        out[f"{name}_le_fixed"] = sum(ada[n] <= fixed[n] for n in layers)
        out[f"{name}_lt_none"] = sum(ada[n] < none[n] for n in layers)
        out[f"{name}_alpha_median"] = median(alphas) if alphas else float("nan")
        out[f"{name}_alpha_min"] = min(alphas) if alphas else float("nan")
        out[f"{name}_alpha_max"] = max(alphas) if alphas else float("nan")
        out[f"{name}_alpha_one"] = sum(a == 1.0 for a in alphas)
    return out
