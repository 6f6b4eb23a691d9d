"""Rerun a sample of every committed result shown on a page and compare it with the committed numbers.

    python scripts/results_check.py            # the quick sample (make results-check, CI): 6 cells, minutes
    python scripts/results_check.py --full     # and the mini reproduction's, the claims' and the demo's cells
    python scripts/results_check.py --list     # the records and the samples; rerun nothing

Bit for bit where the result's recorded kernel path is this machine's, within each sample's stated tolerance
otherwise; a stale result is named with the command that regenerates it (exit 1). What is checked and how:
:mod:`adaloss.lab.results_check`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import _common  # noqa: E402, F401  (puts src/ on sys.path)
from adaloss.lab.results_check import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """:func:`adaloss.lab.results_check.cli.main`, in this checkout."""
    return cli.main(argv, root=ROOT)


if __name__ == "__main__":
    raise SystemExit(main())
