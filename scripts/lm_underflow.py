"""Per-layer activation-gradient underflow of the tiny GPT under none, fixed, dynamic and adaptive scaling.

    .venv/bin/python scripts/lm_underflow.py [--seed 0] [--steps 400] [--fixed-scale 1024] [--batch N]
        [--out results/lm/underflow] [overrides]

The README's transformer underflow table: one telemetry step per scaler on one training batch, at
initialization and after ``--steps`` FP32 steps, in FP16 and with FP8 e5m2 gradients. Writes
``<out>/underflow.json`` and ``<out>/table.md``; prints the table. What it measures and how:
:mod:`adaloss.lab.underflow` (the tiny GPT's table).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import _common  # noqa: E402, F401  (puts src/ on sys.path)
from adaloss.lab.underflow import lm_cli  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    """:func:`adaloss.lab.underflow.lm_cli.main`, its default paths in this checkout."""
    return lm_cli.main(argv, root=ROOT)


if __name__ == "__main__":
    main()
