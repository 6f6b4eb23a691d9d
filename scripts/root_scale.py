"""The root scale alpha_{N+1} (adaptive scaler): ``scaler.root`` = fixed (the paper's), dynamic or adaptive.

    python scripts/root_scale.py [--seeds 0,1,2,3,4] [--tasks gpt,ssd,resnet20] [--out results/root]
    python scripts/root_scale.py --from-json      # the tables again from results/root/root_scale.json

Short runs of each task under each root, seed by seed, then a cost benchmark, in this process. Writes
``<out>/root_scale.json`` (every run, the benchmark, the machine) and ``<out>/root_scale.md`` (the tables).
The tasks, what is measured and how: :mod:`adaloss.lab.root_scale`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("ADALOSS_ROOT", str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import _common  # noqa: E402, F401  (puts src/ on sys.path)
from adaloss.lab.root_scale import cli  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    """:func:`adaloss.lab.root_scale.cli.main`, its default paths in this checkout."""
    return cli.main(argv, root=ROOT)


if __name__ == "__main__":
    main()
