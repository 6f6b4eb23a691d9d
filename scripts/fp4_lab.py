"""The FP4 lab (issue 37): BF16, FP8 tensor_current, MXFP8, NVFP4 and MXFP4 x rounding x Hadamard x scaler.

    python scripts/fp4_lab.py                           # every cell, 5 seeds, both models (hours on 2 cores)
    python scripts/fp4_lab.py --models resnet20 --seeds 0   # one model, one seed
    python scripts/fp4_lab.py --cells bf16,NVFP4/adaptive/sr/rht --seeds 0,1   # a subset
    python scripts/fp4_lab.py --report-only             # the tables of the finished runs
    python scripts/fp4_lab.py --smoke --out /tmp/fp4    # minutes: tiny runs of a few cells

Runs go to ``results/fp4/runs_<model>.jsonl`` (``gpt``, ``resnet20``; resumable: a run already there is not
run again), the tables, one per model, to ``results/fp4/fp4_lab.md``. The cells are
:mod:`adaloss.lab.fp8.fp4`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("ADALOSS_ROOT", str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import _common  # noqa: E402, F401  (puts src/ on sys.path)
from adaloss.lab.fp8 import runs  # noqa: E402
from adaloss.lab.fp8.cells import settings_digest  # noqa: E402
from adaloss.lab.fp8.fp4 import FP4_MODELS, FP4_SMOKE_CELLS, fp4_cells, fp4_report  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    """Run the missing runs of the chosen cells (unless ``--report-only``), then write and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated (default 0-4; --smoke: 0,1)")
    parser.add_argument("--cells", default="", help="comma-separated cell names (default: all)")
    parser.add_argument("--models", default=",".join(FP4_MODELS), help="comma-separated (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "fp4")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "outputs" / "fp4_lab", help="run folders")
    parser.add_argument("--smoke", action="store_true", help="tiny runs of a few cells (a test)")
    parser.add_argument("--report-only", action="store_true", help="no runs: the table of the finished ones")
    args = parser.parse_args(argv)
    cells = fp4_cells()
    names = [c.name for c in cells]
    wanted = args.cells.split(",") if args.cells else (list(FP4_SMOKE_CELLS) if args.smoke else names)
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise SystemExit(f"error: unknown cell(s) {', '.join(unknown)}: choose from {', '.join(names)}")
    try:
        seeds = [
            int(s) for s in ("0,1" if args.smoke and args.seeds == "0,1,2,3,4" else args.seeds).split(",")
        ]
    except ValueError:
        raise SystemExit(f"error: --seeds must be comma-separated integers, got {args.seeds!r}") from None
    models = args.models.split(",")
    unknown = [m for m in models if m not in FP4_MODELS]
    if unknown:
        raise SystemExit(f"error: unknown model(s) {', '.join(unknown)}: choose from {', '.join(FP4_MODELS)}")
    chosen = [c for c in cells if c.name in wanted]
    if not args.report_only:
        import torch

        torch.set_num_threads(1)
        runs.run_all(models, chosen, seeds, args)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {
        m: runs.read_rows(args.out / f"runs_{m}.jsonl", settings_digest(m, args.smoke)) for m in FP4_MODELS
    }
    report = fp4_report(rows, cells)
    (args.out / "fp4_lab.md").write_text(report + "\n", encoding="utf-8")
    print(report)


if __name__ == "__main__":
    main()
