"""The root-scale lab's command line (``scripts/root_scale.py``): every run and benchmark, or the tables
again from ``root_scale.json`` (``--from-json``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from adaloss.lab.reports.measurement import ROOT, machine_info
from adaloss.lab.root_scale.runs import bench, run_one
from adaloss.lab.root_scale.tables import report
from adaloss.lab.root_scale.tasks import ROOTS, TASKS

#: ``--help``'s first line.
DESCRIPTION = (
    "The root scale alpha_{N+1} (adaptive scaler): ``scaler.root`` = fixed (the paper's), dynamic "
    "or adaptive."
)


def merge(earlier: dict[str, Any], summary: dict[str, Any], tasks: list[str]) -> dict[str, Any]:
    """``earlier``'s runs and benchmarks of the tasks not in ``tasks``, with ``summary``'s of those tasks (in
    the order of :data:`TASKS`); the machine of the tasks run now is kept under ``merged``."""
    order = list(TASKS)
    runs = [r for r in earlier["runs"] if r["task"] not in tasks] + summary["runs"]
    bench = [b for b in earlier["bench"] if b["task"] not in tasks] + summary["bench"]
    merged = {k: v for k, v in earlier.get("merged", {}).items() if k not in tasks}
    return {
        "machine": earlier["machine"],
        "merged": {**merged, **{t: summary["machine"] for t in tasks}},
        "runs": sorted(runs, key=lambda r: order.index(r["task"])),
        "bench": sorted(bench, key=lambda b: order.index(b["task"])),
    }


def main(argv: list[str] | None = None, root: Path = ROOT) -> None:
    """Parse ``argv``; run and benchmark every task (or read ``--from-json``), write and print the tables.
    ``root``: the checkout the default ``--out`` is in (the script's own)."""
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"of {', '.join(TASKS)}")
    parser.add_argument("--out", type=Path, default=root / "results" / "root")
    parser.add_argument("--bench-steps", type=int, default=3)
    parser.add_argument("--bench-rounds", type=int, default=5)
    parser.add_argument("--from-json", action="store_true", help="only rebuild the tables from the json")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other tasks' runs and benchmarks from <out>/root_scale.json",
    )
    args = parser.parse_args(argv)
    path = args.out / "root_scale.json"
    if args.from_json:
        if not path.is_file():
            raise SystemExit(
                f"error: {path} does not exist; run scripts/root_scale.py without --from-json first"
            )
        summary = json.loads(path.read_text(encoding="utf-8"))
    else:
        tasks = args.tasks.split(",")
        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            raise SystemExit(f"error: unknown task(s) {', '.join(unknown)}: choose from {', '.join(TASKS)}")
        try:
            seeds = [int(s) for s in args.seeds.split(",")]
        except ValueError:
            raise SystemExit(
                f"error: --seeds takes integers separated by commas, got {args.seeds!r}"
            ) from None
        if args.merge and not path.is_file():
            raise SystemExit(f"error: --merge: {path} does not exist; run without --merge first")
        import torch

        torch.set_num_threads(1)
        summary = {"machine": machine_info(), "runs": [], "bench": []}
        for task in tasks:
            for seed in seeds:
                for root in ROOTS:
                    row = run_one(task, root, seed, args.out)
                    summary["runs"].append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "underflow_rate"}), flush=True)
            summary["bench"].append(bench(task, args.bench_steps, args.bench_rounds))
            print(json.dumps(summary["bench"][-1]["median_s"]), flush=True)
        if args.merge:
            summary = merge(json.loads(path.read_text(encoding="utf-8")), summary, tasks)
    text = report(summary)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (args.out / "root_scale.md").write_text(text, encoding="utf-8")
    print(f"\n{text}")
