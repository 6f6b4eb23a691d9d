"""The lab's command line (``scripts/fp8_lab.py``, ``make fp8-lab``): the runs not yet done, then the
report."""

from __future__ import annotations

import argparse
from pathlib import Path

from adaloss.lab.fp8 import runs
from adaloss.lab.fp8.cells import MODELS, SMOKE_CELLS, all_cells
from adaloss.lab.fp8.report import report
from adaloss.lab.reports.measurement import ROOT

#: ``--help``'s first line.
DESCRIPTION = (
    "The FP8 scaling-recipes lab: loss scalers crossed with gradient quantizers, against FP32 and BF16."
)


def main(argv: list[str] | None = None, root: Path = ROOT) -> None:
    """Parse ``argv``, run what is missing (unless ``--report-only``), write and print the report. ``root``:
    the checkout the default ``--out`` and ``--runs-dir`` are in (the script's own)."""
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated (default 0-4; --smoke: 0,1)")
    parser.add_argument("--out", type=Path, default=root / "results" / "fp8")
    parser.add_argument("--runs-dir", type=Path, default=root / "outputs" / "fp8_lab", help="run folders")
    parser.add_argument("--smoke", action="store_true", help="tiny runs of a few cells (a test)")
    parser.add_argument("--report-only", action="store_true", help="no runs: the report of the finished ones")
    parser.add_argument("--docs", type=Path, default=None, help="also fill this page's fp8-lab region")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"error: unknown model(s) {', '.join(unknown)}: choose from {', '.join(MODELS)}")
    try:
        seeds = [
            int(s) for s in ("0,1" if args.smoke and args.seeds == "0,1,2,3,4" else args.seeds).split(",")
        ]
    except ValueError:
        raise SystemExit(f"error: --seeds must be comma-separated integers, got {args.seeds!r}") from None
    if not args.report_only:
        import torch

        torch.set_num_threads(1)
        cells = [c for c in all_cells() if not args.smoke or c.name in SMOKE_CELLS]
        runs.run_all(models, cells, seeds, args)
    args.out.mkdir(parents=True, exist_ok=True)
    print(report(models, args))
