"""The paper's Tables 1-5 and a summary of every sweep, from finished runs: ``adaloss.lab.reports.tables``.

    python scripts/make_tables.py results/sweeps/<time> [more folders ...] [--out results/tables] [--all]
    python scripts/make_tables.py --wandb ENTITY/PROJECT          # runs recorded in W&B (needs a network)

``--help`` lists the options; the module's docstring says what every cell means.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # a checkout without `pip install -e`

from _env import require_project_python  # noqa: E402 - standard library only; scripts/ is on sys.path

require_project_python()  # a shell without .venv activated: one error: line naming the fix

from adaloss.lab.reports.tables import main  # noqa: E402

if __name__ == "__main__":
    main()
