"""The bench's command line (``scripts/bench.py``, ``make bench``): its options, and the run they ask for
(the ResNets' ratios, the tiny GPT's, the host-bound step eager and compiled, the op counts, or one of the
last three alone), printed and written to JSON."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import adaloss.lab.bench as _package
from adaloss.lab.bench import hostbound, timing
from adaloss.lab.bench.opcounts import OP_BATCH, OP_MODELS, measure_op_counts
from adaloss.lab.bench.report import render, render_gpt, render_op_counts
from adaloss.lab.bench.specs import (
    CLOCKS,
    DEFAULT_MODELS,
    GPT_MODEL,
    GPT_PLAN,
    GPT_RATIOS,
    GPT_SPECS,
    LR,
    MOMENTUM,
    PLAN,
    SPECS,
    selected_ratios,
)
from adaloss.lab.bench.stats import replica_ratios, summarize
from adaloss.lab.bench.timing import ModelResult, measure_model
from adaloss.lab.reports.measurement import ROOT, header_line, machine_info, write_json

Log = Callable[[str], None]


def _add_timing_options(p: argparse.ArgumentParser) -> None:
    """What is timed and how: models, batch, rounds, steps, budget, threads, clock, configurations, copies."""
    p.add_argument("--models", nargs="+", default=None, help="resnet20 resnet56 resnet110 (space or comma)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 32; --quick: 8)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per model (default: 25/12/8 by depth)")
    p.add_argument("--steps", type=int, default=None, help="timed plain steps per configuration per round")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per configuration")
    p.add_argument("--budget", type=float, default=840.0, help="seconds for the whole run (default 840)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 0 keeps torch's default (default 1: see the module docstring)",
    )
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="step timer: wall (perf_counter, default) or cpu (process_time; see the module docstring)",
    )
    p.add_argument(
        "--configs",
        nargs="+",
        default=None,
        help="measure only these configurations (space or comma; default all), e.g. a paired run of\n"
        "fp16_dynamic fp16_adaptive_u100; only the ratios between measured ones are reported",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="separately built copies of each configuration, timed in turn (default 1); the table\n"
        "adds each copy's A/A ratio to copy 0",
    )


def _add_section_options(p: argparse.ArgumentParser) -> None:
    """Seed, --quick, the op counts' and the tiny GPT's switches and settings, the output file."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="seconds-long smoke run: resnet20, batch 8, 2 rounds")
    p.add_argument(
        "--opcounts",
        choices=("on", "off", "only"),
        default=None,
        help="the dispatched-ops table (GPU-cost proxy): on (default; off with --quick), off, or only\n"
        "(no timing; default --out results/bench/opcounts.json)",
    )
    p.add_argument(
        "--opcount-models",
        nargs="+",
        default=None,
        help=f"models of the dispatched-ops table (default {' '.join(OP_MODELS)})",
    )
    p.add_argument(
        "--opcount-batch",
        type=int,
        default=OP_BATCH,
        help=f"batch of the op counts (default {OP_BATCH}; counts do not depend on it, see the table)",
    )
    p.add_argument(
        "--opcount-top", type=int, default=16, help="rows of each where-the-ops-come-from table (default 16)"
    )
    p.add_argument(
        "--gpt",
        choices=("on", "off", "only"),
        default=None,
        help="the tiny GPT's adaptive / dynamic row: on (default; off with --quick), off, or only (no\n"
        "ResNets, no op counts; default --out results/bench/gpt.json)",
    )
    p.add_argument(
        "--gpt-budget", type=float, default=240.0, help="seconds for the tiny GPT's rounds (default 240)"
    )
    _add_hostbound_options(p)
    p.add_argument("--out", default=None, help="JSON output (default results/bench/bench.json)")


def _add_hostbound_options(p: argparse.ArgumentParser) -> None:
    """The host-bound step's switch, rounds, budget and compiler backend
    (:mod:`adaloss.lab.bench.hostbound`)."""
    p.add_argument(
        "--hostbound",
        choices=("on", "off", "only"),
        default=None,
        help="the host-bound step's table, eager and compiled: on (default; off with --quick), off, or\n"
        "only (no ResNets, no tiny GPT, no op counts; default --out results/bench/hostbound.json)",
    )
    p.add_argument(
        "--hostbound-rounds", type=int, default=40, help="timed rounds of the host-bound step (default 40)"
    )
    p.add_argument(
        "--hostbound-budget",
        type=float,
        default=120.0,
        help="seconds for the host-bound step's timed rounds (default 120; compiling comes first, 1-5\n"
        "minutes on 2 cores)",
    )
    p.add_argument(
        "--hostbound-backend",
        default="inductor",
        help="torch.compile backend of the host-bound step's compiled columns (default inductor; none:\n"
        "eager only)",
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=_package.__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    _add_timing_options(p)
    _add_section_options(p)
    return p


def parse_args(argv: Sequence[str] | None, root: Path = ROOT) -> argparse.Namespace:
    """The options, with the defaults that depend on others filled in; bad values exit via ``p.error``.
    ``root``: the checkout the default ``--out`` is in (the script's own)."""
    p = _parser()
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    models = args.models or (["resnet20"] if args.quick else list(DEFAULT_MODELS))
    args.models = [m for item in models for m in item.split(",") if m]
    op_models = args.opcount_models or list(OP_MODELS)
    args.opcount_models = [m for item in op_models for m in item.split(",") if m]
    for m in args.models + args.opcount_models:
        if m not in PLAN:
            p.error(f"unknown model '{m}': choose from {', '.join(PLAN)}")
    for name in ("opcount_batch", "opcount_top"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    args.opcounts = args.opcounts or ("off" if args.quick else "on")
    args.gpt = args.gpt or ("off" if args.quick else "on")
    args.hostbound = args.hostbound or ("off" if args.quick else "on")
    only = [name for name in ("gpt", "opcounts", "hostbound") if getattr(args, name) == "only"]
    if len(only) > 1:
        p.error(f"{' and '.join(f'--{n} only' for n in only)} exclude each other: run them one at a time")
    if args.hostbound_rounds < 1:
        p.error(f"--hostbound-rounds must be positive, got {args.hostbound_rounds}")
    name = {"gpt": "gpt.json", "opcounts": "opcounts.json", "hostbound": "hostbound.json"}.get(
        only[0] if only else "", "bench.json"
    )
    args.out = args.out or str(root / "results" / "bench" / name)
    keys = [s.key for s in SPECS]
    chosen = [c for item in (args.configs or keys) for c in item.split(",") if c]
    for c in chosen:
        if c not in keys:
            p.error(f"unknown configuration '{c}': choose from {', '.join(keys)}")
    args.specs = tuple(s for s in SPECS if s.key in chosen)
    if not selected_ratios(chosen):
        p.error(f"no ratio can be formed from {', '.join(chosen)}: measure both sides of one")
    if args.batch is None:
        args.batch = 8 if args.quick else 32
    for name in ("batch", "rounds", "steps", "warmup", "replicas"):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "warmup" else 1):
            p.error(f"--{name} must be positive, got {v}")
    return args


def main(argv: Sequence[str] | None = None, root: Path = ROOT) -> dict[str, Any]:
    """Run the benchmark, print the tables to stdout (progress to stderr), write the JSON; returns it.
    ``root``: the checkout the default ``--out`` is in (``scripts/bench.py`` passes its own)."""
    args = parse_args(argv, root)
    from adaloss.runner.utils.allocator import tune_cpu_allocator

    args.malloc_tuned = tune_cpu_allocator()  # before any model is built: see adaloss.lab.bench
    if args.threads < 0:
        raise SystemExit(f"error: --threads must be >= 0, got {args.threads}")
    threads_before, clock_before = torch.get_num_threads(), timing._CLOCK
    if args.threads:
        torch.set_num_threads(args.threads)
    timing._CLOCK = CLOCKS[args.clock]
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads_before)  # main() is importable: leave the caller's setting alone
        timing._CLOCK = clock_before


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _run(args: argparse.Namespace, log: Log = _log) -> dict[str, Any]:
    """The run the options ask for: the op counts alone, the host-bound step alone, the tiny GPT alone, or
    the ResNets' ratios followed by the tiny GPT's, the host-bound step and the op counts (each when on)."""
    info = machine_info()
    if args.opcounts == "only":
        return _run_op_counts(args, info, log)
    if args.hostbound == "only":
        t0 = time.perf_counter()
        section = _hostbound_section(args, info, log)
        settings = {"argv": args.argv, "threads": 1}
        payload = {"machine": info, "settings": settings, "hostbound": section}
        payload["table_markdown"] = section["table_markdown"]
        return _write(args, payload, t0, log)
    if args.gpt == "only":
        t0 = time.perf_counter()
        gpt = _gpt_section(args, info, log)
        settings = {"argv": args.argv, "batch": args.batch, "clock": args.clock, "threads": args.threads}
        payload = {"machine": info, "settings": settings, **gpt}
        return _write(args, payload, t0, log)
    t0 = time.perf_counter()
    results = _measure_resnets(args, t0, log)
    settings = _settings(args)
    ratios = summarize(results, selected_ratios([s.key for s in args.specs]))
    text = render(info, settings, results, ratios)
    print(text, flush=True)
    gpt = None
    if args.gpt == "on":
        print(flush=True)
        gpt = _gpt_section(args, info, log)
        text += "\n\n" + gpt["table_markdown"]
    host = None
    if args.hostbound == "on":
        print(flush=True)
        host = _hostbound_section(args, info, log)
        text += "\n\n" + host["table_markdown"]
    op_counts = None
    if args.opcounts == "on":
        print(flush=True)
        op_counts, op_text = _op_count_section(args, info, log)
        text += "\n\n" + op_text
    payload = {
        "machine": info,
        "settings": settings,
        "ratios": ratios,
        "models": {r.model: _model_payload(r) for r in results},
        "gpt": gpt,
        "hostbound": host,
        "op_counts": op_counts,
        "table_markdown": text,
    }
    return _write(args, payload, t0, log)


def _measure_resnets(args: argparse.Namespace, t0: float, log: Log) -> list[ModelResult]:
    """Time each ResNet's configurations in turn, each within its share of the budget left."""
    weights = {m: PLAN[m]["weight"] for m in args.models}
    results = []
    for m in args.models:
        plan = PLAN[m]
        rounds = args.rounds or (2 if args.quick else plan["rounds"])
        steps = args.steps or (1 if args.quick else plan["steps"])
        warmup = args.warmup if args.warmup is not None else (1 if args.quick else plan["warmup"])
        # Budget left for this model: its share of what remains, so an early overrun is absorbed later.
        remaining = args.budget - (time.perf_counter() - t0)
        share = remaining * weights[m] / sum(weights[x] for x in args.models[args.models.index(m) :])
        results.append(
            measure_model(
                m, args.batch, rounds, steps, warmup, share, args.seed, log, args.specs, args.replicas
            )
        )
    return results


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON's ``settings`` of a ResNet run: what was measured, how, and the command line."""
    return {
        "batch": args.batch,
        "models": args.models,
        "budget_s": args.budget,
        "quick": args.quick,
        "replicas": args.replicas,
        "clock": args.clock,
        "malloc_tuned": args.malloc_tuned,
        "lr": LR,
        "momentum": MOMENTUM,
        "configs": [
            {
                "key": s.key,
                "precision": s.precision,
                "grad_scaling": s.grad_scaling,
                "scaler": s.scaler,
                "extra": s.extra,
            }
            for s in args.specs
        ],
        "plan": {m: PLAN[m] for m in args.models},
        "argv": args.argv,
        "total_weight": sum({m: PLAN[m]["weight"] for m in args.models}.values()),  # each model once
    }


def _model_payload(r: ModelResult) -> dict[str, Any]:
    """One model's entry in the JSON: its rounds, time, skipped steps, copies' A/A and raw step times."""
    return {
        "rounds": len(r.rounds),
        "cut_by_budget": r.cut_by_budget,
        "warmup_seconds": r.warmup_seconds,
        "seconds": r.seconds,
        "skipped_timed_steps": r.skipped,
        "replica_ratios": replica_ratios(r),
        "step_times": r.rounds,
        "raw": r.raw,
    }


def _gpt_section(args: argparse.Namespace, info: dict[str, Any], log: Log) -> dict[str, Any]:
    """Time the tiny GPT's configurations, print its table; returns its ratios, step times and table."""
    rounds = args.rounds or (2 if args.quick else GPT_PLAN["rounds"])
    steps = args.steps or (1 if args.quick else GPT_PLAN["steps"])
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else GPT_PLAN["warmup"])
    result = measure_model(
        GPT_MODEL,
        args.batch,
        rounds,
        steps,
        warmup,
        args.gpt_budget,
        args.seed,
        log,
        GPT_SPECS,
        args.replicas,
    )
    ratios = summarize([result], GPT_RATIOS)
    text = render_gpt(info, {"batch": args.batch, "clock": args.clock}, result, ratios)
    print(text, flush=True)
    return {
        "ratios": ratios,
        "rounds": len(result.rounds),
        "cut_by_budget": result.cut_by_budget,
        "seconds": result.seconds,
        "skipped_timed_steps": result.skipped,
        "step_times": result.rounds,
        "configs": [{"key": s.key, "scaler": s.scaler, "extra": s.extra} for s in GPT_SPECS],
        "table_markdown": text,
    }


def _hostbound_section(args: argparse.Namespace, info: dict[str, Any], log: Log) -> dict[str, Any]:
    """Time the host-bound step eagerly and compiled (:mod:`adaloss.lab.bench.hostbound`), print its table;
    returns its step times, ratios, compile counts and table."""
    backend = None if args.hostbound_backend == "none" else args.hostbound_backend
    log(
        f"[bench] host-bound step: eager{f' and compiled ({backend})' if backend else ''}, "
        f"{args.hostbound_rounds} rounds within {args.hostbound_budget:.0f}s"
        + (" (compiling first: 1-5 min)" if backend else "")
    )
    result = hostbound.measure(args.hostbound_rounds, backend=backend, budget_s=args.hostbound_budget)
    text = hostbound.render(result, header_line(info))
    print(text, flush=True)
    asked = {"rounds_asked": args.hostbound_rounds, "budget_s": args.hostbound_budget}
    return {**result, **asked, "table_markdown": text}


def _op_count_section(args: argparse.Namespace, info: dict[str, Any], log: Log) -> tuple[dict[str, Any], str]:
    """Count, print and return the dispatched-ops table (about a minute for ResNet-20 and -110)."""
    op_counts = measure_op_counts(args.opcount_models, args.opcount_batch, args.seed, log)
    text = render_op_counts(info, op_counts, args.opcount_top)
    print(text, flush=True)
    return op_counts, text


def _run_op_counts(args: argparse.Namespace, info: dict[str, Any], log: Log) -> dict:
    """``--opcounts only``: the dispatched-ops table alone."""
    t0 = time.perf_counter()
    op_counts, text = _op_count_section(args, info, log)
    settings = {"argv": args.argv, "opcount_models": args.opcount_models, "threads": args.threads}
    payload = {"machine": info, "settings": settings, "op_counts": op_counts, "table_markdown": text}
    return _write(args, payload, t0, log)


def _write(args: argparse.Namespace, payload: dict[str, Any], t0: float, log: Log) -> dict:
    payload["wall_seconds"] = time.perf_counter() - t0
    path = write_json(args.out, payload)
    log(f"[bench] wrote {path} ({payload['wall_seconds']:.0f}s)")
    return payload


if __name__ == "__main__":
    main()
