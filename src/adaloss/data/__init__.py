"""Datasets and loaders: ``build_datasets(cfg, data_dir)`` and ``make_loader(dataset, ...)``."""

from adaloss.data.datasets import DATASET_NAMES, DatasetInfo, TensorImageDataset, build_datasets
from adaloss.data.loaders import make_loader, seed_worker

__all__ = [
    "DATASET_NAMES",
    "DatasetInfo",
    "TensorImageDataset",
    "build_datasets",
    "make_loader",
    "seed_worker",
]
