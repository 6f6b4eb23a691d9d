"""Checks on the composed config before anything else is built.

``validate_config`` is called by ``train(cfg)`` before anything is read or written, so a typo fails with one
line that names the problem and the fix (a :class:`ConfigError`) rather than deep inside the loop or with a
traceback:

* every group and section against its schema (:func:`adaloss.runner.schemas.check_config`: keys it does not
  declare, and every range; the types were checked by OmegaConf when Hydra composed the config), which also
  resolves every ``${...}`` it reads;
* what no single schema can see: the model and the dataset suit each other (a detector needs a detection
  dataset, a classifier images, a language model text), the ``_target_`` of the optimizer and schedule can
  be imported, the device exists, and the precision and scaler can be built (their classes check the
  combinations, such as ``precision.backend=autocast`` with an FP8 format). They are built once, here, on
  the run's device, and returned: the run uses these two objects.

Data on disk is checked by the dataset builders, which read it.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from adaloss.errors import ConfigError
from adaloss.precision import Precision
from adaloss.runner.data import DATASET_NAMES, DETECTION_DATASET_NAMES, TEXT_DATASET_NAMES
from adaloss.runner.engine.compose import build_numerics, schedule_length
from adaloss.runner.engine.tasks import check_model_and_dataset
from adaloss.runner.schemas import check_config
from adaloss.runner.utils.targets import locate_target
from adaloss.scalers import LossScaler


def validate_config(cfg: DictConfig, device: str | torch.device = "cpu") -> tuple[Precision, LossScaler]:
    """Raise ``ConfigError`` naming the first invalid value and its fix; else return the run's precision
    and loss scaler, built once on ``device`` (the run's: ``train`` passes the process's device; the CPU
    suffices to check a config). Writes nothing; costs one walk over the config, one CUDA availability
    query, the imports of the model, data, precision and scaler modules (which the run needs anyway) and
    the two constructors (:func:`adaloss.runner.engine.compose.build_numerics`)."""
    _check_model_and_dataset(cfg)  # names before resolving: a mismatched pair may leave ${...} dangling
    check_config(cfg)
    _check_targets(cfg)
    return build_numerics(cfg, device)


def _check_model_and_dataset(cfg: DictConfig) -> None:
    """A model and the task the dataset selects that agree (classification, detection or language
    modelling). Reads the names, the model's schema and the task's class; imports no model."""
    _name(cfg.model, "model")
    dataset = _name(cfg.dataset, "dataset")
    if dataset not in DATASET_NAMES + DETECTION_DATASET_NAMES + TEXT_DATASET_NAMES:
        if cfg.dataset.get("_target_") is None or str(cfg.dataset._target_).startswith("adaloss."):
            known = ", ".join(DATASET_NAMES + DETECTION_DATASET_NAMES + TEXT_DATASET_NAMES)
            raise ConfigError(f"unknown dataset '{dataset}' (dataset.name): choose dataset= one of {known}")
        return  # a dataset of the user's own: its task is known once it is built
    check_model_and_dataset(cfg)


def _name(node: Any, section: str) -> str:
    try:
        name = node.get("name")
    except OmegaConfBaseException as error:
        raise ConfigError(
            f"{section}.name cannot be resolved ({_first_line(error)}): give it a plain value"
        ) from None
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"{section}.name must be a name, got {name!r}: choose a config with {section}=<option>"
        )
    return name


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _check_targets(cfg: DictConfig) -> None:
    """The optimizer's and the schedule's ``_target_`` can be imported (they are built last, after the
    data and the model)."""
    locate_target("optimizer", cfg.optimizer.get("_target_"), "optimizer=adamw")
    locate_target("schedule", cfg.schedule.get("_target_"), "schedule=cosine")


def resolved_config(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain containers with every interpolation resolved, without Hydra's own node.

    This is what W&B and ``metrics.json`` record, so a result can be traced to the exact values that made
    it. Cost: one walk over the config.
    """
    # Hydra's node (present with compose(return_hydra_config=True)) is dropped before resolving: parts of
    # it (hydra.job.num) exist only inside a launched job.
    own = OmegaConf.masked_copy(cfg, [key for key in cfg.keys() if key != "hydra"])
    container = OmegaConf.to_container(own, resolve=True, throw_on_missing=False)
    assert isinstance(container, dict)
    return container


__all__ = ["resolved_config", "schedule_length", "validate_config"]
