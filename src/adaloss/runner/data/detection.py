"""Shared by the detection datasets: sample format, ``detection_collate``, SSD transforms, entry point.

A detection sample is ``(image, target)``: ``image`` a normalized float tensor ``[3, S, S]``, ``target`` a
dict with ``boxes`` ``[K, 4]`` float32 ``(x1, y1, x2, y2)`` in pixels of that image, ``labels`` ``[K]`` int64
in ``1..C`` (0 is the detector's background) and ``difficult`` ``[K]`` bool (VOC's flag; objects the metric
ignores). ``detection_collate`` stacks the images and keeps the targets as a list, because ``K`` varies.

Datasets: ``shapes`` (synthetic, :func:`adaloss.runner.data.shapes.shapes`) and ``voc`` (PASCAL VOC,
:func:`adaloss.runner.data.voc.voc`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torchvision import tv_tensors
from torchvision.transforms import v2 as T

from adaloss.runner.data.datasets import DatasetInfo

__all__ = [
    "DETECTION_DATASET_NAMES",
    "DetectionInfo",
    "detection_collate",
    "ssd_eval_transform",
    "ssd_train_transform",
]

DETECTION_DATASET_NAMES: tuple[str, ...] = ("shapes", "voc")

#: ImageNet statistics (0-1 scale): what a VGG-16 file trained on ImageNet expects, and fine from scratch.
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class DetectionInfo(DatasetInfo):
    """``DatasetInfo`` of a detection dataset: ``num_classes`` counts object classes (no background).

    ``class_names[i]`` names label ``i + 1`` (the ``class_names`` argument of
    ``adaloss.runner.metrics.voc_map.voc07_map``); ``task`` tells a trainer which loop and metric to use.
    """

    class_names: tuple[str, ...] = ()
    task: str = "detection"


def detection_collate(
    batch: Sequence[tuple[Tensor, dict[str, Tensor]]],
) -> tuple[Tensor, list[dict[str, Tensor]]]:
    """``[(image, target), ...] -> (images [N, 3, S, S], [target, ...])``: the DataLoader's ``collate_fn``.

    Images must share one size (every detection transform here resizes to ``image_size``). Cost: one copy of
    the batch's images.
    """
    if not batch:
        raise ValueError("detection_collate got an empty batch")
    images = torch.stack([image for image, _ in batch])
    return images, [target for _, target in batch]


def _labels_and_flags(inputs: Any) -> tuple[Tensor, Tensor]:
    """What ``SanitizeBoundingBoxes`` filters along with the boxes: the labels and the difficult flags."""
    target = inputs[1]
    return target["labels"], target["difficult"]


def _finish(image: Tensor, target: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
    """Drop the tv_tensors wrappers: plain tensors collate, pin and move like any other."""
    return image.as_subclass(Tensor), {
        "boxes": target["boxes"].as_subclass(Tensor).float(),
        "labels": target["labels"],
        "difficult": target["difficult"],
    }


class _DetectionTransform:
    """A ``transforms.v2`` pipeline applied to ``(image, target)`` whose output is plain tensors."""

    def __init__(self, pipeline: T.Compose) -> None:
        self.pipeline = pipeline

    def __call__(self, image: Any, target: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        return _finish(*self.pipeline(image, target))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.pipeline})"


def ssd_train_transform(
    image_size: int, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD
) -> _DetectionTransform:
    """SSD's training augmentation (Liu et al. 2016, section 2.2), from ``torchvision.transforms.v2``.

    Photometric distortion (brightness, contrast, saturation, hue, channel order; each with p=0.5), zoom out
    (p=0.5, canvas up to 4x, filled with the mean colour), an IoU-constrained random crop (minimum IoU drawn
    from {0, 0.1, 0.3, 0.5, 0.7, 0.9, none}), horizontal flip, resize to ``image_size`` squared, removal of
    boxes left degenerate (with their labels and flags), then float + ``Normalize(mean, std)``. Input: a PIL
    image or uint8 tensor and a target whose ``boxes`` are ``tv_tensors.BoundingBoxes``. Cost: a few ms per
    VOC image on one core (the crop search and the resize dominate); run it in DataLoader workers.
    """
    fill = tuple(round(255 * m) for m in mean)
    return _DetectionTransform(
        T.Compose(
            [
                T.ToImage(),
                T.RandomPhotometricDistort(p=0.5),
                T.RandomZoomOut(fill={tv_tensors.Image: fill, "others": 0}, side_range=(1.0, 4.0), p=0.5),
                T.RandomIoUCrop(),
                T.RandomHorizontalFlip(p=0.5),
                T.Resize((image_size, image_size), antialias=True),
                T.SanitizeBoundingBoxes(labels_getter=_labels_and_flags),
                T.ToDtype(torch.float32, scale=True),
                T.Normalize(list(mean), list(std)),
            ]
        )
    )


def ssd_eval_transform(
    image_size: int, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD
) -> _DetectionTransform:
    """Resize to ``image_size`` squared (boxes with it), float + ``Normalize(mean, std)``. Keeps every box.

    The metric is then computed in resized coordinates: IoU is invariant under scaling each axis, so the
    mAP equals the one in original-image coordinates.
    """
    return _DetectionTransform(
        T.Compose(
            [
                T.ToImage(),
                T.Resize((image_size, image_size), antialias=True),
                T.ToDtype(torch.float32, scale=True),
                T.Normalize(list(mean), list(std)),
            ]
        )
    )
