"""Checks on the composed config before anything else is built.

``validate_config`` is called by ``train(cfg)`` before anything is read or written, so a typo fails with one
line that names the problem and the fix (a :class:`ConfigError`) rather than deep inside the loop or with a
traceback:

* every group and section against its schema (:func:`adaloss.runner.schemas.check_config`: keys it does not
  declare, and every range; the types were checked by OmegaConf when Hydra composed the config), which also
  resolves every ``${...}`` it reads; the model's and dataset's names first
  (:func:`adaloss.runner.schemas.group_name`);
* what no single schema can see: the model and the dataset suit each other (a detector needs a detection
  dataset, a classifier images, a language model text), the ``_target_`` of the optimizer and schedule can
  be imported, the device exists, and the precision and scaler can be built (their classes check the
  combinations, such as ``precision.backend=autocast`` with an FP8 format). They are built once, here, on
  the run's device, and returned: the run uses these two objects.

Data on disk is checked by the dataset builders, which read it.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from adaloss.errors import ConfigError
from adaloss.precision import Precision
from adaloss.runner.data import DATASET_NAMES, DETECTION_DATASET_NAMES, TEXT_DATASET_NAMES
from adaloss.runner.engine.compose import build_numerics, resolved_config, schedule_length
from adaloss.runner.engine.tasks import task_class
from adaloss.runner.models import bundled_model
from adaloss.runner.schemas import bundled_names, check_config, check_node, group_name, schema_of
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
    group_name(cfg.model, "model")
    dataset = group_name(cfg.dataset, "dataset")
    if dataset not in DATASET_NAMES + DETECTION_DATASET_NAMES + TEXT_DATASET_NAMES:
        if cfg.dataset.get("_target_") is None or str(cfg.dataset._target_).startswith("adaloss."):
            check_node(cfg.dataset, "dataset")  # a bundled dataset's schema refuses a name not its own
            known = ", ".join(bundled_names("dataset"))  # else (dataset=custom without a _target_):
            raise ConfigError(f"unknown dataset '{dataset}' (dataset.name): choose dataset= one of {known}")
        return  # a dataset of the user's own: its task is known once it is built
    _check_kinds(cfg)


#: Per kind of data (a task's ``kind``): what its models and its datasets are called in messages, and
#: examples of each.
_KINDS = {
    "classification": (
        "an image classifier",
        "classification",
        "model=resnet20 or model=vit",
        "dataset=digits",
    ),
    "detection": ("a detector", "detection", "model=ssd512 or model=ssd300", "dataset=shapes or dataset=voc"),
    "language_model": ("a language model", "text", "model=gpt", "dataset=pystdlib or dataset=tokens"),
}


def _check_kinds(cfg: DictConfig) -> None:
    """``ConfigError`` unless a bundled model suits the task its dataset selects (``task``: a detector
    needs detection data, a language model text, a classifier images). A model of the user's own
    (``model=custom``) and a task of the user's without a ``kind`` are checked when they are built. Reads
    the names and the model's schema; builds nothing."""
    name, bundled = bundled_model(cfg.model)
    model_kind = getattr(schema_of(bundled), "TASK", None) if bundled is not None else None
    data_kind = task_class(cfg.task).kind
    held = getattr(schema_of(cfg.dataset), "TASK", None)  # what a bundled dataset holds
    if held is not None and data_kind is not None and held != data_kind:
        raise ConfigError(
            f"task={cfg.task.name} trains {data_kind} but dataset={cfg.dataset.name} holds {held} data: "
            f"leave the task to the dataset (task={held}) or choose a {data_kind} dataset"
        )
    if model_kind is None or data_kind is None or model_kind == data_kind:
        return
    dataset = f"{cfg.dataset.name}"
    task = f"(task={cfg.task.name})"
    if "detection" in (model_kind, data_kind) and "language_model" not in (model_kind, data_kind):
        if model_kind == "detection":
            raise ConfigError(
                f"model={name} is a detector but dataset={dataset} is a classification dataset {task}: use "
                "a detection dataset (dataset=shapes or dataset=voc) or a classifier (e.g. model=resnet20)"
            )
        raise ConfigError(
            f"dataset={dataset} is a detection dataset but model={name} is a classifier {task}: use a "
            "detector (model=ssd512 or model=ssd300) or a classification dataset (e.g. dataset=cifar10)"
        )
    what, _, _, model_data = _KINDS[model_kind]
    _, data_what, data_model, _ = _KINDS[data_kind]
    raise ConfigError(
        f"model={name} is {what} but dataset={dataset} is a {data_what} dataset {task}: use {model_data} "
        f"for this model, or {data_model} for this dataset"
    )


def _check_targets(cfg: DictConfig) -> None:
    """The optimizer's and the schedule's ``_target_`` can be imported (they are built last, after the
    data and the model)."""
    locate_target("optimizer", cfg.optimizer.get("_target_"), "optimizer=adamw")
    locate_target("schedule", cfg.schedule.get("_target_"), "schedule=cosine")


__all__ = ["resolved_config", "schedule_length", "validate_config"]
