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
from adaloss.data.text import TEXT_DATASET_NAMES, TextInfo, build_text_datasets

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


def build_datasets(cfg, data_dir):
    """``adaloss.data.datasets.build_datasets``, plus the detection datasets ``shapes`` and ``voc``
    (``adaloss.data.detection``: samples ``(image, target dict)``, info a ``DetectionInfo``) and the text
    datasets ``pystdlib`` and ``tokens`` (``adaloss.data.text``: samples ``(x, y)`` token windows, info a
    ``TextInfo``)."""
    name = cfg.get("name") if hasattr(cfg, "get") else getattr(cfg, "name", None)
    if name in DETECTION_DATASET_NAMES:
        return build_detection_datasets(cfg, data_dir)
    if name in TEXT_DATASET_NAMES:
        return build_text_datasets(cfg, data_dir)
    return _classification.build_datasets(cfg, data_dir)
