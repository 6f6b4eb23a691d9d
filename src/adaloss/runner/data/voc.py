"""``dataset=voc``: PASCAL VOC detection through ``torchvision.datasets.VOCDetection``, never downloaded.

The paper's setting (ChainerCV's SSD recipe): train on VOC2007 trainval + VOC2012 trainval (16,551 images),
test on VOC2007 test (4,952 images), 20 classes. The data lives under ``paths.data_dir`` as the archives
unpack: ``VOCdevkit/VOC2007/{JPEGImages,Annotations,ImageSets/Main}`` and ``VOCdevkit/VOC2012/...``.

Targets follow ChainerCV's conventions: VOC's 1-based inclusive pixel boxes become ``(xmin - 1, ymin - 1,
xmax, ymax)`` (continuous coordinates covering the same pixels); training sets leave out objects marked
difficult (``use_difficult: false``), the test set keeps them with ``difficult=True`` so that the VOC2007
metric ignores them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.datasets import VOCDetection

from adaloss.errors import ConfigError
from adaloss.runner.data.detection import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DetectionInfo,
    ssd_eval_transform,
    ssd_train_transform,
)

__all__ = ["VOC_CLASSES", "VOCDetectionSet", "parse_voc_objects", "voc"]

VOC_CLASSES: tuple[str, ...] = (
    "aeroplane",
    "bicycle",
    "bird",
    "boat",
    "bottle",
    "bus",
    "car",
    "cat",
    "chair",
    "cow",
    "diningtable",
    "dog",
    "horse",
    "motorbike",
    "person",
    "pottedplant",
    "sheep",
    "sofa",
    "train",
    "tvmonitor",
)
_LABEL = {name: i + 1 for i, name in enumerate(VOC_CLASSES)}
_ARCHIVES = "VOCtrainval_06-Nov-2007.tar, VOCtest_06-Nov-2007.tar, VOCtrainval_11-May-2012.tar"


def parse_voc_objects(annotation: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
    """``(boxes [K, 4] float32 xyxy, labels [K] int64 in 1..20, difficult [K] bool)`` from the dict that
    ``VOCDetection`` makes of one annotation XML. A missing ``difficult`` tag counts as 0."""
    objects = annotation["annotation"].get("object", [])
    if isinstance(objects, dict):
        objects = [objects]
    boxes, labels, difficult = [], [], []
    for obj in objects:
        name = str(obj["name"]).strip()
        if name not in _LABEL:
            raise ValueError(f"unknown VOC class '{name}'")
        box = obj["bndbox"]
        xmin, ymin, xmax, ymax = (float(box[k]) for k in ("xmin", "ymin", "xmax", "ymax"))
        boxes.append([xmin - 1.0, ymin - 1.0, xmax, ymax])
        labels.append(_LABEL[name])
        difficult.append(str(obj.get("difficult", "0")).strip() == "1")
    return (
        torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
        torch.tensor(labels, dtype=torch.int64),
        torch.tensor(difficult, dtype=torch.bool),
    )


class VOCDetectionSet(Dataset):
    """One or more VOC ``(year, image_set)`` splits as detection samples (see
    ``adaloss.runner.data.detection``).

    Each item: read the JPEG and its XML (``VOCDetection``), parse the objects, drop difficult ones unless
    ``use_difficult``, then ``transform(image, target)`` (an SSD transform from
    ``adaloss.runner.data.detection``). Cost: JPEG decoding plus the transform, several ms per image: use
    DataLoader workers.
    """

    class_names = VOC_CLASSES

    def __init__(self, splits: Sequence[VOCDetection], transform: Any, use_difficult: bool) -> None:
        self.splits = list(splits)
        self.transform = transform
        self.use_difficult = bool(use_difficult)
        self._offsets = np.cumsum([0] + [len(s) for s in self.splits])

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Tensor]]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} images")
        which = int(np.searchsorted(self._offsets, index, side="right")) - 1
        image, annotation = self.splits[which][index - int(self._offsets[which])]
        boxes, labels, difficult = parse_voc_objects(annotation)
        if not self.use_difficult:
            keep = ~difficult
            boxes, labels, difficult = boxes[keep], labels[keep], difficult[keep]
        target = {
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(image.height, image.width)),
            "labels": labels,
            "difficult": difficult,
        }
        return self.transform(image, target)


def _split(value: Any, key: str) -> tuple[str, str]:
    try:
        year, image_set = value
    except (TypeError, ValueError):
        raise ConfigError(
            f"dataset.{key} entries are [year, image_set] pairs, e.g. [2007, trainval]; got {value!r}"
        ) from None
    year, image_set = str(year), str(image_set)
    valid = ("train", "trainval", "val", "test") if year == "2007" else ("train", "trainval", "val")
    if year not in {str(y) for y in range(2007, 2013)} or image_set not in valid:
        raise ConfigError(
            f"dataset.{key}: no VOC split [{year}, {image_set}] (years 2007-2012; train, trainval, val; "
            "test only for 2007)"
        )
    return year, image_set


def _open_split(data_dir: Path, year: str, image_set: str) -> VOCDetection:
    root = data_dir / "VOCdevkit" / f"VOC{year}"
    needed = [root / "ImageSets" / "Main" / f"{image_set}.txt", root / "JPEGImages", root / "Annotations"]
    missing = next((p for p in needed if not p.exists()), None)
    if missing is not None:
        raise ConfigError(
            f"PASCAL VOC {year} {image_set} not found under {data_dir} (no {missing.relative_to(data_dir)}): "
            f"unpack {_ARCHIVES} there (they create VOCdevkit/), or set dataset.train_sets / "
            "dataset.test_set to the splits you have"
        )
    try:
        return VOCDetection(root=str(data_dir), year=year, image_set=image_set, download=False)
    except (OSError, RuntimeError) as exc:
        reason = " ".join(str(exc).split())
        raise ConfigError(f"could not read PASCAL VOC {year} {image_set} under {data_dir}: {reason}") from exc


def voc(
    data_dir: str | os.PathLike[str], *, name: str, num_classes: int, image_size: int | None, train_sets: Any,
    test_set: Any, augment: bool, use_difficult: bool, mean: Any, std: Any,
) -> tuple[VOCDetectionSet, VOCDetectionSet, DetectionInfo]:  # fmt: skip
    """``dataset=voc`` (the config's ``_target_``; every field of its schema, which holds the defaults):
    ``num_classes`` is fixed at 20, ``image_size`` is the model's (the config interpolates it),
    ``train_sets`` / ``test_set`` are ``[year, image set]`` pairs, ``augment`` is SSD's augmentation,
    ``use_difficult`` keeps difficult objects in training, ``mean`` / ``std`` (null: ImageNet's).

    Missing data raises ``ConfigError`` naming the path and the remedy. Cost: reading the split lists (the
    images and XMLs are read per sample).
    """
    if num_classes != len(VOC_CLASSES):
        raise ConfigError(
            f"dataset voc has {len(VOC_CLASSES)} classes, but dataset.num_classes={num_classes}"
        )
    if image_size is None:
        raise ConfigError("dataset.image_size is null: set it to the detector's, e.g. dataset.image_size=512")
    mean = [float(v) for v in (IMAGENET_MEAN if mean is None else mean)]
    std = [float(v) for v in (IMAGENET_STD if std is None else std)]
    if len(mean) != 3 or len(std) != 3:
        raise ConfigError(f"dataset.mean / dataset.std need 3 values, got {mean} / {std}")
    train_sets = [_split(s, "train_sets") for s in train_sets]
    if not train_sets:
        raise ConfigError("dataset.train_sets is empty: list at least one [year, image_set] pair")
    test_year, test_image_set = _split(test_set, "test_set")

    data_dir = Path(data_dir).expanduser().resolve()
    train_transform = (ssd_train_transform if augment else ssd_eval_transform)(image_size, mean, std)
    train = VOCDetectionSet(
        [_open_split(data_dir, y, s) for y, s in train_sets], train_transform, use_difficult
    )
    test = VOCDetectionSet(
        [_open_split(data_dir, test_year, test_image_set)], ssd_eval_transform(image_size, mean, std), True
    )
    info = DetectionInfo("voc", num_classes, image_size, 3, len(train), len(test), class_names=VOC_CLASSES)
    return train, test, info
