"""The command line: ``python train.py [group=option ...] [key=value ...]`` (see configs/train.yaml).

A thin ``@hydra.main`` wrapper around :func:`adaloss.engine.train`: Hydra composes the config, picks the
run folder (``results/runs/...``, or ``results/sweeps/...`` with ``-m``) and logs to it; everything else
happens in ``train(cfg)``. Bad input (an invalid value, missing data) prints ``error: <message>`` on
stderr and exits with status 2, without a traceback and without writing ``metrics.json``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parent
# configs/paths/default.yaml reads the repository root from here, wherever train.py is launched from.
os.environ.setdefault("ADALOSS_ROOT", str(ROOT))


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float:
    """Train one configuration; returns the final test accuracy (for Hydra sweepers that optimize it)."""
    from adaloss.engine import train  # imported here so `--help` and `--cfg` stay fast
    from adaloss.errors import ConfigError

    try:
        metrics = train(cfg)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    return float(metrics["test_accuracy"])


if __name__ == "__main__":
    main()
