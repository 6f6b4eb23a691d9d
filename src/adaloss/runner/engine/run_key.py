"""The settings that identify a run: what a checkpoint, a run folder's ``run_key.json`` and a finished run's
record are compared with before a start may write there (:mod:`adaloss.runner.engine.checkpoint` and
:mod:`adaloss.runner.engine.run_folder` both read them; neither imports the other's internals for it)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from adaloss.errors import ConfigError

__all__ = ["check_config_key", "config_key", "key_differences", "model_differences"]


def config_key(
    model: str, dataset: str, scaler: str, precision: str, batch_size: int, seed: int, steps: int | None
) -> dict[str, Any]:
    """The settings a checkpoint must be resumed with: the groups' names (``model.name``, ...),
    ``trainer.batch_size``, ``seed`` and ``steps``, the iterations of the run (None leaves that field out,
    for a comparison made before the data fixes the run length). The composition root reads them from the
    config (:func:`adaloss.runner.engine.compose.run_key`).

    Everything else (learning rate, scaler hyperparameters, logging cadence, ...) may change on resume.
    """
    key: dict[str, Any] = {
        "model": str(model),
        "dataset": str(dataset),
        "scaler": str(scaler),
        "precision": str(precision),
        "batch_size": int(batch_size),
        "seed": int(seed),
    }
    if steps is not None:
        key["steps"] = int(steps)
    return key


# Config keys behind each config_key field, for the error message's fix.
_KEY_SETTINGS = {
    "model": "model",
    "dataset": "dataset",
    "scaler": "scaler",
    "precision": "precision",
    "batch_size": "trainer.batch_size",
    "seed": "seed",
    "steps": "trainer.max_steps",
}


def key_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The saved run's :func:`config_key` fields that differ from ``current``'s, as overrides
    (``seed=0``); only the fields both hold are compared."""
    return [f"{_KEY_SETTINGS[k]}={saved[k]}" for k in current if k in saved and saved[k] != current[k]]


def model_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The saved run's ``model`` settings that differ from ``current``'s, as overrides
    (``model.hidden=[256,256]``); only the settings both hold are compared."""
    return [f"model.{k}={_value(saved[k])}" for k in sorted(saved) if k in current and saved[k] != current[k]]


def check_config_key(
    saved: Mapping[str, Any], current: Mapping[str, Any], path: Path | None = None, where: str | None = None
) -> None:
    """``ConfigError`` naming every field in which the saved run (checkpoint ``path``, or ``where``)
    differs from this one."""
    differ = [k for k in current if k in saved and saved[k] != current[k]]
    if not differ:
        return
    theirs = " ".join(f"{_KEY_SETTINGS[k]}={saved[k]}" for k in differ)
    ours = ", ".join(f"{_KEY_SETTINGS[k]}={current[k]}" for k in differ)
    raise ConfigError(
        f"{where or f'checkpoint {path}'} belongs to a different run ({theirs}; this run has {ours}): "
        f"resume with {theirs}, or start a fresh run in a new folder (hydra.run.dir=<new folder>)"
    )


def _value(value: Any) -> str:
    """A config value as an override writes it: ``[256,256]``, ``true``, ``null``, ``0.1``."""
    if isinstance(value, list | tuple):
        return "[" + ",".join(_value(v) for v in value) + "]"
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)
