"""Step-time ratios of the training configurations, measured interleaved in one process: ``adaloss.bench``.

    python scripts/bench.py                    # make bench: ResNets, the tiny GPT, op counts (~15 min)
    python scripts/bench.py --quick            # seconds: ResNet-20, batch 8, 2 rounds
    python scripts/bench.py --opcounts only    # the dispatched-ops table alone
    python scripts/bench.py --gpt only         # the tiny GPT alone

Results go to ``results/bench/bench.json`` (``opcounts.json``, ``gpt.json`` for the ``only`` runs; ``--out``
elsewhere); ``--help`` lists the options, and :mod:`adaloss.bench`'s docstring says how and why it measures.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # a checkout without `pip install -e`

from adaloss.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
