"""Datasets and loaders: ``build_datasets(cfg, data_dir)`` and ``make_loader(dataset, ...)``."""

import os
from typing import Any

from adaloss.runner.data.datasets import DATASET_NAMES, DatasetInfo, TensorImageDataset
from adaloss.runner.data.detection import (
    DETECTION_DATASET_NAMES,
    DetectionInfo,
    detection_collate,
)
from adaloss.runner.data.loaders import make_loader, seed_worker
from adaloss.runner.data.text import TEXT_DATASET_NAMES, TextInfo

__all__ = [
    "DATASET_NAMES",
    "DETECTION_DATASET_NAMES",
    "DatasetInfo",
    "DetectionInfo",
    "TEXT_DATASET_NAMES",
    "TensorImageDataset",
    "TextInfo",
    "build_datasets",
    "detection_collate",
    "make_loader",
    "seed_worker",
]


def build_datasets(cfg: Any, data_dir: str | os.PathLike[str]) -> tuple[Any, Any, Any]:
    """``(train_set, test_set, info)`` of a ``dataset`` config: ``hydra.utils.instantiate`` on its
    ``_target_`` (``adaloss.runner.data.datasets.cifar``, ..., or a function of the user's), with ``data_dir``
    if the target takes it. Classification samples are ``(image, label)`` and ``info`` a ``DatasetInfo``;
    detection (``shapes``, ``voc``) ``(image, target dict)`` and a ``DetectionInfo``; text (``pystdlib``,
    ``tokens``) ``(x, y)`` token windows and a ``TextInfo``.

    ``cfg``: the composed ``dataset`` node, or a plain mapping (``{"name": "digits"}`` takes the schema of
    that name, :mod:`adaloss.runner.schemas`). ``ConfigError`` for an unknown name or key, a wrong type, a
    value out of range or missing data.
    """
    from adaloss.runner.utils.targets import build_group

    return build_group(
        "dataset", cfg, example="dataset=custom dataset._target_=my_pkg.my_data", fill={"data_dir": data_dir},
        expect=(
            lambda made: isinstance(made, tuple) and len(made) == 3,
            "returned a {made}, not (train_set, test_set, info): return the two datasets and an "
            "adaloss.runner.data.DatasetInfo",
        ),
    )  # fmt: skip
