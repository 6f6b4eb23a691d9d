"""Step-time ratios of the training configurations, measured interleaved in one process:
``adaloss.lab.bench``.

    python scripts/bench.py                    # make bench: ResNets, tiny GPT, host-bound step, op counts
    python scripts/bench.py --quick            # seconds: ResNet-20, batch 8, 2 rounds
    python scripts/bench.py --opcounts only    # the dispatched-ops table alone
    python scripts/bench.py --gpt only         # the tiny GPT alone
    python scripts/bench.py --hostbound only   # the host-bound step alone, eager and compiled (Inductor)

Results go to ``results/bench/bench.json`` (``opcounts.json``, ``gpt.json``, ``hostbound.json`` for the
``only`` runs; ``--out`` elsewhere); ``--help`` lists the options, and :mod:`adaloss.lab.bench`'s docstring
says how and why it measures.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # a checkout without `pip install -e`

from _env import require_project_python  # noqa: E402 - standard library only; scripts/ is on sys.path

require_project_python()  # a shell without .venv activated: one error: line naming the fix

from adaloss.lab.bench import cli  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    """:func:`adaloss.lab.bench.cli.main`, its default ``--out`` in this checkout."""
    return cli.main(argv, root=ROOT)


if __name__ == "__main__":
    main()
