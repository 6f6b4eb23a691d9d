"""Per-layer activation-gradient underflow with no scaling, fixed scale 128 and adaptive scaling (both rules).

    python scripts/underflow_table.py [--models resnet110 vgg_nobn] [--batch 32] [--quick] [--out-dir DIR]

The README's numerical-effect table: one telemetry step per scaler on one digits batch, at initialization
and after FP32 training, in FP16 and with FP8 e5m2 gradients. Writes
``results/underflow/<model>_<regime>.csv`` and ``results/underflow/underflow.json``; prints the summary
table. What it measures and how: :mod:`adaloss.lab.underflow`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import _common  # noqa: E402, F401  (puts src/ on sys.path)
from adaloss.lab.underflow import cli  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    """:func:`adaloss.lab.underflow.cli.main`, its default paths in this checkout."""
    return cli.main(argv, root=ROOT)


if __name__ == "__main__":
    main()
