"""The paper's Figures 1 and 4, and underflow and loss-scale figures of every sweep, from the telemetry of
finished runs: ``adaloss.lab.reports.figures``.

    python scripts/make_figures.py results/sweeps/<time> [more folders ...] [--out results/figures] [--wandb]

``--help`` lists the options; the module's docstring says what each figure shows and which runs it takes.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # a checkout without `pip install -e`

from _env import require_project_python  # noqa: E402 - standard library only; scripts/ is on sys.path

require_project_python()  # a shell without .venv activated: one error: line naming the fix

from adaloss.lab.reports.figures import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
