"""Datasets and loaders: ``build_datasets(cfg, data_dir)`` and ``make_loader(dataset, ...)``."""

from adaloss.data import datasets as _classification
from adaloss.data.datasets import DATASET_NAMES, DatasetInfo, TensorImageDataset
from adaloss.data.detection import (
    DETECTION_DATASET_NAMES,
    DetectionInfo,
    build_detection_datasets,
    detection_collate,
)
from adaloss.data.loaders import make_loader, seed_worker

__all__ = [
    "DATASET_NAMES",
    "DETECTION_DATASET_NAMES",
    "DatasetInfo",
    "DetectionInfo",
    "TensorImageDataset",
    "build_datasets",
    "detection_collate",
    "make_loader",
    "seed_worker",
]


def build_datasets(cfg, data_dir):
    """``adaloss.data.datasets.build_datasets``, plus the detection datasets ``shapes`` and ``voc``
    (``adaloss.data.detection``: samples ``(image, target dict)``, info a ``DetectionInfo``)."""
    name = cfg.get("name") if hasattr(cfg, "get") else getattr(cfg, "name", None)
    if name in DETECTION_DATASET_NAMES:
        return build_detection_datasets(cfg, data_dir)
    return _classification.build_datasets(cfg, data_dir)
