"""``make gpu-check``: the CUDA tests, gradient checks and step times of :mod:`adaloss.gpucheck` on this
machine's GPU, with the torch installed here (one line and exit 0 without CUDA)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without installing adaloss

from adaloss.gpucheck import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
