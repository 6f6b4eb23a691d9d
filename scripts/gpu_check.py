"""``make gpu-check``: the CUDA tests, gradient checks and step times of :mod:`adaloss.lab.gpucheck` on this
machine's GPU, with the torch installed here (one line and exit 0 without CUDA)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without installing adaloss

try:
    import hydra  # noqa: F401  - the CUDA tests run train()'s config path: the runner extra, not the library
    import omegaconf  # noqa: F401
    import torch  # noqa: F401

    from adaloss.lab.gpucheck import main
except ImportError as exc:  # the python make chose (GPU_PYTHON) lacks torch or this project's dependencies
    needs = "the python of your CUDA torch: make gpu-check GPU_PYTHON=/path/to/it"
    if getattr(exc, "name", None) != "torch":
        needs = (
            "hydra-core, omegaconf and antlr4-python3-runtime beside torch: pip install -e '.[runner]' "
            "(it keeps the installed torch), or put their wheels on PYTHONPATH (docs/performance.md)"
        )
    missing = getattr(exc, "name", None) or exc
    sys.exit(f"error: gpu-check: {sys.executable} cannot import {missing}; it needs {needs}")

if __name__ == "__main__":
    raise SystemExit(main())
