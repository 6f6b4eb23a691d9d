"""Do attention's products deserve a beta of their own? Per-layer underflow with and without.

Usage: ``.venv/bin/python scripts/attention_betas.py [--steps 300] [--out results/attention_betas]``

Trains a tiny GPT-style decoder in FP32, then measures every layer's activation-gradient underflow under the
adaptive scaler with ``scaler.product_betas`` off and on (FP16 and FP8 e5m2, both rules). Prints one row per
setting; writes the per-layer rates as CSV under ``--out``. About a minute on one CPU core. The lab itself:
:mod:`adaloss.lab.attention_betas`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from _env import require_project_python  # noqa: E402 - standard library only; scripts/ is on sys.path

require_project_python()  # a shell without .venv activated: one error: line naming the fix

from adaloss.lab.attention_betas import cli  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    """:func:`adaloss.lab.attention_betas.cli.main`, its default paths in this checkout."""
    return cli.main(argv, root=ROOT)


if __name__ == "__main__":
    main()
