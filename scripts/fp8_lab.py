"""The FP8 scaling-recipes lab: loss scalers crossed with gradient quantizers, against FP32 and BF16.

    python scripts/fp8_lab.py                 # every cell, 5 seeds (make fp8-lab), then the table and figures
    python scripts/fp8_lab.py --report-only   # rebuild the table and figures from the finished runs
    python scripts/fp8_lab.py --smoke --out /tmp/fp8   # seconds: two tiny runs per cell of a few cells

Runs go to ``results/fp8/runs_<model>.jsonl`` (resumable), the report to ``results/fp8/fp8_lab.{md,csv,json}``
and ``fp8_gap.png`` / ``fp8_layers.png``. The lab itself, what it runs and how it counts, is
:mod:`adaloss.lab.fp8`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("ADALOSS_ROOT", str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import _common  # noqa: E402, F401  (puts src/ on sys.path)
from adaloss.lab.fp8 import cli  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    """:func:`adaloss.lab.fp8.cli.main`, its default paths in this checkout."""
    return cli.main(argv, root=ROOT)


if __name__ == "__main__":
    main()
