"""Render the documentation's tables and figures from the committed result files.

    python scripts/render_docs.py            # rewrite the regions and the figures
    python scripts/render_docs.py --check    # exit 1 and list what differs, writing nothing
    python scripts/render_docs.py stamp results/bench/bench.json --command "make bench"

Fills the ``<!-- generated: NAME -->`` regions of ``README.md`` and ``docs/**/*.md`` and copies the mini
reproduction's figures to ``docs/assets/mini/``. The regions, the pages and ``stamp``:
:mod:`adaloss.lab.docgen`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import _common  # noqa: E402, F401  (puts src/ on sys.path)
from adaloss.lab.docgen import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """:func:`adaloss.lab.docgen.cli.main`, its default paths in this checkout."""
    return cli.main(argv, root=ROOT)


if __name__ == "__main__":
    raise SystemExit(main())
