"""Helpers shared by the scripts: ``src/`` on ``sys.path``, and :mod:`adaloss.lab.reports.measurement`'s
helpers under their old names (the models by name, the machine header, quantiles, JSON output).

The scripts put ``src/`` on ``sys.path`` through this module, so they also run from a checkout without
``pip install -e .``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from _env import require_project_python  # noqa: E402 - standard library only; scripts/ is on sys.path

require_project_python()  # a shell without .venv activated: one error: line naming the fix

from adaloss.lab.reports.measurement import (  # noqa: E402, F401  (the scripts' names for them)
    MODEL_CFGS,
    PRETTY,
    cpu_model,
    header_line,
    machine_info,
    markdown_table,
    median,
    model_cfg,
    quantile,
    write_json,
)
