"""The tiny GPT's underflow table's command line (``scripts/lm_underflow.py``): compose the runs' configs,
train FP32, measure the initial and the trained weights, write ``underflow.json`` and ``table.md``."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from adaloss.lab.lm_runs import compose_run
from adaloss.lab.reports.measurement import ROOT, header_line, machine_info, write_json
from adaloss.lab.underflow.lm import PRECISIONS, measure_all, render
from adaloss.lab.underflow.measure import measurement_batch

#: ``--help``'s first line.
DESCRIPTION = (
    "Per-layer activation-gradient underflow of the tiny GPT under none, fixed, dynamic and adaptive scaling."
)


def main(argv: list[str] | None = None, root: Path = ROOT) -> dict[str, Any]:
    """Parse ``argv``, measure, write and print the table; returns the JSON payload. ``root``: the checkout
    the default ``--out`` is in (the script's own)."""
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=400, help="FP32 training steps (400: the whole recipe)")
    parser.add_argument("--fixed-scale", type=float, default=1024.0)
    parser.add_argument("--batch", type=int, default=None, help="measured batch (default: the recipe's)")
    parser.add_argument("--out", type=Path, default=root / "results" / "lm" / "underflow")
    parser.add_argument("overrides", nargs="*", help="more overrides, e.g. model.n_layer=2")
    args = parser.parse_args(argv)
    if args.steps < 1 or not args.fixed_scale > 0 or (args.batch is not None and args.batch < 1):
        raise SystemExit("error: --steps and --batch must be >= 1 and --fixed-scale > 0; e.g. --steps 400")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: the machine is shared, and one thread fixes the summation order
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _configs(args: argparse.Namespace) -> tuple[Any, dict[str, dict[str, Any]]]:
    """The FP32 training run's config and each scaler's config; a bad override is one ``error:`` line."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from adaloss.errors import ConfigError

    overrides = [f"trainer.steps={args.steps}", "trainer.save_final=true", *args.overrides]
    try:
        run_cfg = compose_run("fp32", args.seed, overrides, args.out)
        adaptive_cfg = compose_run("adaptive", args.seed, args.overrides, args.out).scaler
        dynamic_cfg = compose_run("dynamic", args.seed, args.overrides, args.out).scaler
    except (HydraException, OmegaConfBaseException, ConfigError) as error:
        raise SystemExit(f"error: {str(error).strip().splitlines()[0]}") from None
    configs = {
        "none": {"name": "none"},
        "fixed": {"name": "fixed", "scale": args.fixed_scale},
        "dynamic": OmegaConf.to_container(dynamic_cfg, resolve=True),
        "adaptive": {**OmegaConf.to_container(adaptive_cfg, resolve=True), "update_every": 1},
    }
    return run_cfg, configs


def _train(run_cfg, info, steps: int) -> tuple[torch.nn.Module, dict[str, Any]]:  # noqa: ANN001
    """The FP32 training run in a scratch folder: its final weights (built as the trainer builds them) and
    its metrics."""
    from adaloss.errors import ConfigError
    from adaloss.runner.engine import train
    from adaloss.runner.engine.tasks import build_task

    # the training run's folder is scratch: only its weights are measured, its numbers go into the JSON
    with tempfile.TemporaryDirectory(prefix="lm_underflow_") as scratch:
        OmegaConf.update(run_cfg, "paths.output_dir", scratch, force_add=True)
        print(f"[lm_underflow] training {steps} FP32 steps", file=sys.stderr, flush=True)
        try:
            metrics = train(run_cfg)
        except ConfigError as error:
            raise SystemExit(f"error: {str(error).strip().splitlines()[0]}") from None
        trained = build_task(run_cfg.task, run_cfg.model, info, torch.device("cpu")).model
        trained.load_state_dict(torch.load(Path(scratch) / "model.pt", weights_only=True))
    return trained, metrics


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from adaloss.runner.data import build_datasets
    from adaloss.runner.engine.tasks import build_task
    from adaloss.runner.utils import seed_everything

    began = time.perf_counter()
    machine = machine_info()
    run_cfg, configs = _configs(args)
    seed_everything(args.seed)  # the trainer's order: seed, data, model: the weights the run starts from
    train_set, _, info = build_datasets(run_cfg.dataset, run_cfg.paths.data_dir)
    init = build_task(run_cfg.task, run_cfg.model, info, torch.device("cpu")).model
    x, y = measurement_batch(train_set, args.batch or int(run_cfg.trainer.batch_size), args.seed)
    trained, metrics = _train(run_cfg, info, args.steps)
    measured = {
        "init": measure_all(init, configs, x, y),
        f"{args.steps} FP32 steps": measure_all(trained, configs, x, y),
    }
    table = render(measured, args.fixed_scale)
    setting = " ".join(["model=gpt", "dataset=pystdlib", *args.overrides])
    text = (
        f"{header_line(machine)}\n\n{setting}, seed {args.seed}, one training batch of {x.shape[0]} x "
        f"{x.shape[1]} tokens; trained: validation loss {metrics['val_loss']:.3f} after {metrics['steps']} "
        f"FP32 steps. A layer's rate counts the values non-zero before its own rounding: a gradient flushed "
        f"upstream arrives as exact zeros and is not counted again. —: no telemetry point.\n\n{table}\n"
    )
    payload = _payload(args, machine, x, configs, metrics, measured, table)
    payload["wall_seconds"] = time.perf_counter() - began
    write_json(args.out / "underflow.json", payload)
    (args.out / "table.md").write_text(text, encoding="utf-8")
    print(text, flush=True)
    return payload


def _payload(args, machine, x, configs, metrics, measured, table) -> dict[str, Any]:  # noqa: ANN001
    """``underflow.json`` but its ``wall_seconds``: the machine, the settings, the training run's numbers,
    every layer's rate, alphas and scale per regime, precision and scaler, and the table."""
    return {
        "machine": machine,
        "settings": {
            "seed": args.seed,
            "steps": args.steps,
            "batch": list(x.shape),
            "overrides": args.overrides,
            "scalers": configs,
            "precisions": list(PRECISIONS),
        },
        "training": {k: metrics[k] for k in ("steps", "val_loss", "best_val_loss", "perplexity")},
        "results": {
            regime: {
                precision: {
                    name: {k: r[k] for k in ("rates", "alphas", "scale", "loss", "grads_finite")}
                    for name, r in per_scaler.items()
                }
                for precision, per_scaler in per_precision.items()
            }
            for regime, per_precision in measured.items()
        },
        "table_markdown": table,
    }
