"""Where a run's numbers go: W&B (offline by default), ``metrics.json``, and the progress bar.

The package is named after what it does for the project; Python's standard ``logging`` is still what
``import logging`` gives everywhere (absolute imports).
"""

from adaloss.runner.logging.metrics import write_json_atomic
from adaloss.runner.logging.progress import ProgressBar
from adaloss.runner.logging.telemetry_log import TelemetryLog
from adaloss.runner.logging.wandb_logger import Logger, NullLogger, WandbLogger, build_logger

__all__ = [
    "Logger",
    "NullLogger",
    "ProgressBar",
    "TelemetryLog",
    "WandbLogger",
    "build_logger",
    "write_json_atomic",
]
