"""The CNN underflow table's command line (``scripts/underflow_table.py``): train, measure every regime
under every scaler, print the summary, write the CSVs and ``underflow.json``."""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from adaloss.lab.reports.measurement import MODEL_CFGS, ROOT, machine_info, model_cfg, write_json
from adaloss.lab.underflow.measure import compare, load_digits, measure, measurement_batch, train_fp32
from adaloss.lab.underflow.settings import (
    DEFAULT_MODELS,
    DEFAULT_TRAIN,
    DIGITS,
    MOMENTUM,
    REGIMES,
    SCALERS,
    TRAIN_PLAN,
)
from adaloss.lab.underflow.table import render, write_csv

#: ``--help``'s first line.
DESCRIPTION = (
    "Per-layer activation-gradient underflow with no scaling, fixed scale 128 and adaptive scaling "
    "(both rules)."
)


def parse_args(argv: Sequence[str] | None, root: Path = ROOT) -> argparse.Namespace:
    """The options; ``root``: the checkout the default ``--data-dir`` and ``--out-dir`` are in."""
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--models", nargs="+", default=None, help="resnet110 vgg_nobn (space or comma separated)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 32; --quick: 8)")
    p.add_argument(
        "--train-steps",
        type=int,
        default=None,
        help="FP32 training steps before the trained regimes (default: resnet110 80, vgg_nobn 150)",
    )
    p.add_argument("--lr", type=float, default=None, help="FP32 training lr (default: 0.01 for both models)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=str(root / "data"))
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 0 keeps torch's default (default 1: fixed summation order, and far "
        "faster than 2 threads when other jobs share the 2 cores)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: vgg_nobn, batch 8, 2 training steps")
    p.add_argument("--out-dir", default=str(root / "results" / "underflow"))
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    models = args.models or (["vgg_nobn"] if args.quick else list(DEFAULT_MODELS))
    args.models = [m for item in models for m in item.split(",") if m]
    for m in args.models:
        if m not in MODEL_CFGS:
            p.error(f"unknown model '{m}': choose from {', '.join(MODEL_CFGS)}")
    if args.batch is None:
        args.batch = 8 if args.quick else 32
    if args.quick and args.train_steps is None:
        args.train_steps = 2
    if args.batch < 1 or (args.train_steps is not None and args.train_steps < 0):
        p.error("--batch must be >= 1 and --train-steps >= 0")
    return args


def main(argv: Sequence[str] | None = None, root: Path = ROOT) -> dict[str, Any]:
    """Measure, print the summary table, write CSVs and JSON under ``--out-dir``; returns the JSON payload."""
    args = parse_args(argv, root)
    if args.threads < 0:
        raise SystemExit(f"error: --threads must be >= 0, got {args.threads}")
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads_before)  # main() is importable: leave the caller's setting alone


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    info = machine_info()
    out_dir = Path(args.out_dir)
    train_set, data_info = load_digits(args.data_dir)
    x, y = measurement_batch(train_set, args.batch, args.seed)
    results: dict[str, Any] = {}
    for name in args.models:
        weights, training = _train(name, args, train_set, data_info)
        results[name] = {"training": training, "regimes": {}}
        for regime, (which, precision_name) in REGIMES.items():
            results[name]["regimes"][regime] = _measure_regime(
                name, regime, weights[which], which, precision_name, x, y, args.seed, out_dir
            )
    settings = {
        "models": args.models,
        "batch": args.batch,
        "seed": args.seed,
        "scalers": SCALERS,
        "regimes": {k: {"weights": w, "precision": p} for k, (w, p) in REGIMES.items()},
        "dataset": DIGITS,
        "quick": args.quick,
        "argv": args.argv,
    }
    text = render(info, settings, results)
    print(text, flush=True)
    payload = {
        "machine": info,
        "settings": settings,
        "results": results,
        "table_markdown": text,
        "wall_seconds": time.perf_counter() - t0,
    }
    path = write_json(out_dir / "underflow.json", payload)
    _log(f"[underflow] wrote {path} and the per-layer CSVs ({payload['wall_seconds']:.0f}s)")
    return payload


def _train(name: str, args: argparse.Namespace, train_set, data_info) -> tuple[dict, dict[str, Any]]:  # noqa: ANN001
    """Model ``name`` at initialization and after its FP32 training: ``({"init", "trained"}, training)``."""
    from adaloss.runner.models import build_model

    plan = TRAIN_PLAN.get(name, DEFAULT_TRAIN)
    steps = args.train_steps if args.train_steps is not None else plan["steps"]
    lr = args.lr if args.lr is not None else plan["lr"]
    torch.manual_seed(args.seed)
    init = build_model(model_cfg(name), data_info.num_classes, data_info.input_shape)
    _log(f"[underflow] {name}: training {steps} FP32 steps at lr {lr:g}")
    trained = copy.deepcopy(init)
    t_train = time.perf_counter()
    torch.manual_seed(args.seed)
    losses = train_fp32(trained, train_set, steps, lr, args.batch, args.seed, _log)
    training = {
        "steps": steps,
        "lr": lr,
        "momentum": MOMENTUM,
        "seconds": time.perf_counter() - t_train,
        "losses": losses,
        "final_loss_mean10": (sum(losses[-10:]) / len(losses[-10:])) if losses else float("nan"),
    }
    return {"init": init, "trained": trained}, training


def _measure_regime(
    name: str,
    regime: str,
    model: torch.nn.Module,
    which: str,
    precision_name: str,
    x: torch.Tensor,
    y: torch.Tensor,
    seed: int,
    out_dir: Path,
) -> dict[str, Any]:
    """Every scaler on ``model`` in ``precision_name``; the regime's CSV written, its JSON entry returned."""
    with torch.no_grad():
        fp32_loss = float(F.cross_entropy(copy.deepcopy(model).train()(x), y))
    per_scaler = {}
    for sname, scfg in SCALERS.items():
        torch.manual_seed(seed)
        per_scaler[sname] = measure(model, precision_name, scfg, x, y)
    cmp = compare(per_scaler)
    csv_path = out_dir / f"{name}_{regime}.csv"
    write_csv(csv_path, per_scaler)
    _log(
        f"[underflow] {name} {regime}: mean rates none {cmp['mean']['none']:.3g}, fixed128 "
        f"{cmp['mean']['fixed128']:.3g}, adaptive {cmp['mean']['adaptive']:.3g} (reference), "
        f"{cmp['mean']['adaptive_paper']:.3g} (paper)"
    )
    return {
        "weights": which,
        "precision": precision_name,
        "fp32_loss": fp32_loss,
        "scalers": per_scaler,
        "compare": cmp,
        "csv": str(csv_path),
    }
