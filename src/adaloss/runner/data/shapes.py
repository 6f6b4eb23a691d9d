"""``dataset=shapes``: a synthetic detection dataset drawn by the code, so SSD trains offline and in tests.

Each image shows 1 to 4 filled shapes (circle, square, triangle: labels 1, 2, 3) of random size (15% to 50%
of the image side), position and colour (one of six, independent of the class, so only the shape tells the
class) on a noisy grey background. Shapes never overlap, and each box is the tight box of the shape's drawn
pixels. Sample ``i`` of a split is drawn from its own generator seeded with ``(seed, split, i)``: the same
config gives the same images in any order, in any DataLoader worker, without storing them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from adaloss.errors import ConfigError
from adaloss.runner.data.detection import DetectionInfo

__all__ = ["SHAPE_CLASSES", "ShapesDetection", "render_shapes", "shapes"]

SHAPE_CLASSES: tuple[str, ...] = ("circle", "square", "triangle")
_PALETTE = np.array(
    [
        [0.90, 0.15, 0.15],  # red
        [0.15, 0.75, 0.20],  # green
        [0.15, 0.30, 0.90],  # blue
        [0.95, 0.85, 0.10],  # yellow
        [0.85, 0.20, 0.85],  # magenta
        [0.10, 0.85, 0.85],  # cyan
    ],
    dtype=np.float32,
)
#: Normalization of the rendered [0, 1] images: about zero mean and unit variance.
SHAPES_MEAN, SHAPES_STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
_SPLITS = {"train": 0, "test": 1}


def _shape_mask(kind: int, side: float, cx: float, cy: float, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Boolean mask of one shape over pixel centres ``xs`` / ``ys`` (broadcastable grids)."""
    half = side / 2
    if kind == 0:  # circle of diameter ``side``
        return (xs - cx) ** 2 + (ys - cy) ** 2 <= half**2
    inside_y = np.abs(ys - cy) <= half
    if kind == 1:  # axis-aligned square
        return inside_y & (np.abs(xs - cx) <= half)
    # isosceles triangle, apex up, base ``side`` wide at the bottom
    return inside_y & (np.abs(xs - cx) <= (ys - (cy - half)) / 2)


def render_shapes(
    rng: np.random.Generator,
    image_size: int,
    min_objects: int = 1,
    max_objects: int = 4,
    min_size: float = 0.15,
    max_size: float = 0.5,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draw one image: ``(image [3, S, S] float32 in [0, 1], boxes [K, 4] xyxy pixels, labels [K] in 1..3)``.

    Object sizes are fractions of ``image_size``. A shape that finds no free place in 30 tries is left out,
    so ``K`` can fall below the drawn count when big shapes crowd the image (rarely: K >= 1 always holds).
    Cost: about 1 ms at 128x128.
    """
    s = image_size
    count = int(rng.integers(min_objects, max_objects + 1))
    grey = rng.uniform(0.3, 0.7)
    image = rng.standard_normal((3, s, s), dtype=np.float32)
    image *= 0.08
    image += grey
    boxes: list[list[float]] = []
    labels: list[int] = []
    for _ in range(count):
        kind = int(rng.integers(len(SHAPE_CLASSES)))
        side = rng.uniform(min_size, max_size) * s
        for _try in range(30):
            x0, y0 = rng.uniform(0, s - side, size=2)
            x1, y1 = x0 + side, y0 + side
            if all(x1 + 1 < b[0] or b[2] + 1 < x0 or y1 + 1 < b[1] or b[3] + 1 < y0 for b in boxes):
                break
        else:
            continue
        lo_x, lo_y = int(np.floor(x0)), int(np.floor(y0))
        hi_x, hi_y = min(int(np.ceil(x1)), s), min(int(np.ceil(y1)), s)
        ys = np.arange(lo_y, hi_y, dtype=np.float32)[:, None] + 0.5
        xs = np.arange(lo_x, hi_x, dtype=np.float32)[None, :] + 0.5
        mask = _shape_mask(kind, side, x0 + side / 2, y0 + side / 2, xs, ys)
        rows, cols = np.nonzero(mask)
        if rows.size == 0:
            continue
        colour = _PALETTE[int(rng.integers(len(_PALETTE)))]
        shade = colour[:, None] + rng.normal(0.0, 0.04, size=(3, rows.size)).astype(np.float32)
        image[:, lo_y + rows, lo_x + cols] = shade
        boxes.append([lo_x + cols.min(), lo_y + rows.min(), lo_x + cols.max() + 1.0, lo_y + rows.max() + 1.0])
        labels.append(kind + 1)
    np.clip(image, 0.0, 1.0, out=image)
    return image, np.asarray(boxes, dtype=np.float32).reshape(-1, 4), np.asarray(labels, dtype=np.int64)


class ShapesDetection(Dataset):
    """``size`` synthetic detection samples of one split, drawn on demand (see the module docstring).

    Items are ``(image [3, S, S] normalized, {"boxes", "labels", "difficult"})``; no difficult objects.
    """

    class_names = SHAPE_CLASSES

    def __init__(
        self,
        size: int,
        image_size: int,
        seed: int = 0,
        split: str = "train",
        min_objects: int = 1,
        max_objects: int = 4,
        mean: Sequence[float] = SHAPES_MEAN,
        std: Sequence[float] = SHAPES_STD,
    ) -> None:
        self.size, self.image_size, self.seed = int(size), int(image_size), int(seed)
        self.split_id = _SPLITS[split]
        self.min_objects, self.max_objects = int(min_objects), int(max_objects)
        # NumPy, not torch: per-sample tensor ops pay torch's intra-op thread start-up (ms on a busy CPU).
        self.mean = np.asarray(mean, dtype=np.float32).reshape(3, 1, 1)
        self.inv_std = 1.0 / np.asarray(std, dtype=np.float32).reshape(3, 1, 1)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Tensor]]:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} samples")
        rng = np.random.default_rng([self.seed, self.split_id, int(index)])
        image, boxes, labels = render_shapes(rng, self.image_size, self.min_objects, self.max_objects)
        target = {
            "boxes": torch.from_numpy(boxes),
            "labels": torch.from_numpy(labels),
            "difficult": torch.zeros(len(labels), dtype=torch.bool),
        }
        image -= self.mean
        image *= self.inv_std
        return torch.from_numpy(image), target


def shapes(
    *, name: str, num_classes: int, image_size: int | None, train_size: int, test_size: int, seed: int,
    min_objects: int, max_objects: int,
) -> tuple[ShapesDetection, ShapesDetection, DetectionInfo]:  # fmt: skip
    """``dataset=shapes`` (the config's ``_target_``; every field of its schema, which holds the defaults
    and ranges): ``num_classes`` is fixed at 3; ``image_size`` is the model's (the config interpolates it).
    Cost: none up front; each sample is rendered when read (about 1 ms at 128x128)."""
    if num_classes != len(SHAPE_CLASSES):
        raise ConfigError(
            f"dataset shapes has {len(SHAPE_CLASSES)} classes, but dataset.num_classes={num_classes}"
        )
    if image_size is None:
        raise ConfigError("dataset.image_size is null: set it to the detector's, e.g. dataset.image_size=128")
    common = {"image_size": image_size, "seed": seed, "min_objects": min_objects, "max_objects": max_objects}
    train = ShapesDetection(train_size, split="train", **common)
    test = ShapesDetection(test_size, split="test", **common)
    info = DetectionInfo(
        "shapes", num_classes, image_size, 3, train_size, test_size, class_names=SHAPE_CLASSES
    )
    return train, test, info
