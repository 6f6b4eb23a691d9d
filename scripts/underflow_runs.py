"""Per-layer activation-gradient underflow of finished runs, side by side: a column per loss-scaling method.

    python scripts/underflow_runs.py results/mini --model ssd512 --methods none,fixed8,adaptive
    python scripts/underflow_runs.py results/sweeps/<table3 sweep> --model ssd512 --batch 8

For each method (``none``, ``fixed<scale>``, ``dynamic``, ``adaptive``; FP16-family runs only) the script
takes one finished run of the given model and dataset (the first in path order; ``--seed`` / ``--batch``
narrow the choice) and reads its ``telemetry.jsonl``: a layer's rate is the mean over the last ``--last``
telemetry steps (default 5: the end of training, where gradients are small) of the share of the layer's
activation-gradient elements that the training format lost. It prints a Markdown table with a row per layer
(network order), the mean over layers, and on how many layers adaptive is at or below each other method.
Nothing is computed that the runs did not record.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402  (puts src/ on the path)
from adaloss.lab.reports import figures as mf  # noqa: E402
from adaloss.lab.reports.common import ReportError, fmt_num  # noqa: E402


def method_of(run: mf.RunInfo) -> str:
    """``none``, ``fixed128``, ``dynamic``, ``adaptive`` (the ``variant`` names)."""
    if run.scaler == "fixed" and run.scale is not None:
        return f"fixed{fmt_num(run.scale)}"
    return run.scaler


def layer_rates(run: mf.RunInfo, last: int) -> dict[str, float]:
    """``{layer: mean underflow rate over the last `last` telemetry steps}`` in network order."""
    rows = [r for r in run.telemetry if isinstance(r.get("underflow_rate"), dict)][-last:]
    if not rows:
        raise mf.NoData(f"{run.path} has no telemetry.jsonl records")
    layers = mf.network_order([r["underflow_rate"] for r in rows])
    return {
        layer: sum(r["underflow_rate"].get(layer, math.nan) for r in rows) / len(rows) for layer in layers
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", help="folders holding finished runs")
    parser.add_argument("--model", required=True, help="model name, e.g. ssd512")
    parser.add_argument("--dataset", default=None, help="dataset name (default: any)")
    parser.add_argument("--methods", default="none,fixed8,adaptive", help="comma-separated methods")
    parser.add_argument("--batch", type=int, default=None, help="only runs of this batch size")
    parser.add_argument("--seed", type=int, default=None, help="only runs of this seed")
    parser.add_argument("--last", type=int, default=5, help="telemetry steps averaged, from the end")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        runs, _ = mf.read_runs(args.folders)
    except ReportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    chosen: dict[str, mf.RunInfo] = {}
    for run in runs:
        if run.model != args.model or (args.dataset and run.dataset != args.dataset):
            continue
        if run.precision == "fp32" or (args.batch is not None and run.batch_size != args.batch):
            continue
        if args.seed is not None and run.seed != args.seed:
            continue
        chosen.setdefault(method_of(run), run)
    missing = [m for m in methods if m not in chosen]
    if missing:
        print(
            f"error: no finished {args.model} run for {', '.join(missing)} under {', '.join(args.folders)} "
            f"(found: {', '.join(sorted(chosen)) or 'none'})",
            file=sys.stderr,
        )
        return 2
    try:
        rates = {m: layer_rates(chosen[m], args.last) for m in methods}
    except mf.NoData as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    layers = mf.network_order(list(rates.values()))
    rows = [[layer, *(_pct(rates[m].get(layer, math.nan)) for m in methods)] for layer in layers]
    rows.append(["**mean**", *(_pct(_mean(rates[m].values())) for m in methods)])
    for m in methods:
        print(f"{m}: {chosen[m].describe()}", file=sys.stderr)
    print(C.markdown_table(["layer", *methods], rows))
    if "adaptive" in methods:
        for other in (m for m in methods if m != "adaptive"):
            wins = sum(
                rates["adaptive"][layer] <= rates[other].get(layer, math.inf) for layer in rates["adaptive"]
            )
            print(f"\nadaptive <= {other} on {wins}/{len(rates['adaptive'])} layers")
    return 0


def _mean(values) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _pct(rate: float) -> str:
    return "—" if not math.isfinite(rate) else f"{100 * rate:.3g}%"


if __name__ == "__main__":
    sys.exit(main())
