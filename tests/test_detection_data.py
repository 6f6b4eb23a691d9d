"""Detection data: the synthetic shapes set, a tiny VOC folder through dataset=voc, collation, errors."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from adaloss.errors import ConfigError
from adaloss.runner.data import DetectionInfo, build_datasets, detection_collate
from adaloss.runner.data.voc import VOC_CLASSES
from adaloss.runner.metrics.voc_map import voc07_map

SHAPES = {"name": "shapes", "image_size": 64, "train_size": 40, "test_size": 12, "seed": 3}


# ----------------------------------------------------------------------------------------------- shapes


def _same(a, b):
    return torch.equal(a[0], b[0]) and all(
        torch.equal(a[1][k], b[1][k]) for k in ("boxes", "labels", "difficult")
    )


def test_shapes_is_deterministic_and_seeded():
    train, test, info = build_datasets(SHAPES, "unused")
    assert isinstance(info, DetectionInfo) and info.task == "detection"
    assert (info.num_classes, info.image_size, info.train_size, info.test_size) == (3, 64, 40, 12)
    assert info.class_names == ("circle", "square", "triangle") == train.class_names
    assert (len(train), len(test)) == (40, 12)
    again, _, _ = build_datasets(SHAPES, "unused")
    assert all(_same(train[i], again[i]) for i in (0, 7, 39))
    # an item does not depend on what was read before it: a fresh copy read backwards gives the same items
    backwards, _, _ = build_datasets(SHAPES, "unused")
    assert all(_same(backwards[i], train[i]) for i in (39, 20, 7, 5, 0, 20))
    other, _, _ = build_datasets(SHAPES | {"seed": 4}, "unused")
    assert not torch.equal(train[0][0], other[0][0])
    assert not torch.equal(train[0][0], test[0][0])  # the splits differ
    with pytest.raises(IndexError):
        train[40]


def test_shapes_boxes_are_valid_tight_and_disjoint():
    train, _, _ = build_datasets(SHAPES | {"image_size": 96, "train_size": 60}, "unused")
    counts = []
    for i in range(len(train)):
        image, target = train[i]
        boxes, labels = target["boxes"], target["labels"]
        assert image.shape == (3, 96, 96) and image.dtype == torch.float32
        assert boxes.dtype == torch.float32 and labels.dtype == torch.int64
        assert target["difficult"].dtype == torch.bool and not target["difficult"].any()
        assert 1 <= len(labels) <= 4 and set(labels.tolist()) <= {1, 2, 3}
        assert (boxes[:, :2] >= 0).all() and (boxes[:, 2:] <= 96).all()
        sides = boxes[:, 2:] - boxes[:, :2]
        assert (sides >= 0.15 * 96 - 2).all() and (sides <= 0.5 * 96 + 2).all()
        # every shape is as wide as it is tall (circle, square, isosceles triangle of base = height)
        assert torch.allclose(sides[:, 0], sides[:, 1], atol=2)
        for a in range(len(boxes)):
            for b in range(a):
                lt = torch.maximum(boxes[a, :2], boxes[b, :2])
                rb = torch.minimum(boxes[a, 2:], boxes[b, 2:])
                assert ((rb - lt) <= 0).any(), "shapes overlap"
        # the box is tight: its border rows/columns contain shape pixels, which differ from the background
        x0, y0, x1, y1 = boxes[0].long().tolist()
        inside = image[:, y0:y1, x0:x1]
        assert inside.std() > image.std() * 0.5
        counts.append(len(labels))
    assert len(set(counts)) > 1  # a varying number of objects


def test_detection_collate_and_loader():
    train, _, _ = build_datasets(SHAPES, "unused")
    loader = DataLoader(train, batch_size=4, shuffle=True, collate_fn=detection_collate)
    images, targets = next(iter(loader))
    assert images.shape == (4, 3, 64, 64) and len(targets) == 4
    assert all(set(t) == {"boxes", "labels", "difficult"} for t in targets)
    with pytest.raises(ValueError, match="empty"):
        detection_collate([])


def test_shapes_invalid_fields():
    with pytest.raises(ConfigError, match="3 classes"):
        build_datasets(SHAPES | {"num_classes": 5}, "unused")
    with pytest.raises(ConfigError, match="image_size"):
        build_datasets(SHAPES | {"image_size": 8}, "unused")


# --------------------------------------------------------------------------------------------------- VOC


def _annotation(name, width, height, objects):
    parts = [f"<annotation><filename>{name}.jpg</filename>"]
    parts.append(f"<size><width>{width}</width><height>{height}</height><depth>3</depth></size>")
    for cls, (xmin, ymin, xmax, ymax), difficult in objects:
        parts.append(
            f"<object><name>{cls}</name><pose>Left</pose><truncated>0</truncated>"
            f"<difficult>{int(difficult)}</difficult><bndbox><xmin>{xmin}</xmin><ymin>{ymin}</ymin>"
            f"<xmax>{xmax}</xmax><ymax>{ymax}</ymax></bndbox></object>"
        )
    return "".join(parts) + "</annotation>"


# id: (width, height, [(class, VOC box (1-based, inclusive), difficult)])
VOC_IMAGES = {
    "000001": (80, 60, [("dog", (11, 6, 50, 40), False), ("person", (55, 10, 75, 58), True)]),
    "000002": (64, 96, [("car", (1, 1, 64, 48), False)]),
    "000003": (100, 50, [("cat", (21, 11, 60, 45), False), ("tvmonitor", (70, 5, 95, 30), False)]),
}


def make_voc(root: Path, year="2007", trainval=("000001", "000002"), test=("000003", "000001")):
    """A VOC-format folder written by the test: JPEGs (PIL), annotation XMLs, ImageSets/Main lists."""
    base = root / "VOCdevkit" / f"VOC{year}"
    for sub in ("JPEGImages", "Annotations", "ImageSets/Main"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for image_id, (width, height, objects) in VOC_IMAGES.items():
        pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(base / "JPEGImages" / f"{image_id}.jpg", quality=90)
        (base / "Annotations" / f"{image_id}.xml").write_text(_annotation(image_id, width, height, objects))
    (base / "ImageSets/Main/trainval.txt").write_text("\n".join(trainval) + "\n")
    if test:
        (base / "ImageSets/Main/test.txt").write_text("\n".join(test) + "\n")
    return root


VOC = {"name": "voc", "image_size": 64, "train_sets": [[2007, "trainval"]]}


def test_voc_folder_loads_with_difficult_flags(tmp_path):
    make_voc(tmp_path)
    train, test, info = build_datasets(VOC, tmp_path)
    assert isinstance(info, DetectionInfo) and info.num_classes == 20 and info.class_names == VOC_CLASSES
    assert (len(train), len(test), info.train_size, info.test_size) == (2, 2, 2, 2)

    # test set: resized to 64x64, every object kept, difficult flags from the XML
    image, target = test[1]  # 000001: 80x60
    assert image.shape == (3, 64, 64) and image.dtype == torch.float32
    assert target["labels"].tolist() == [VOC_CLASSES.index("dog") + 1, VOC_CLASSES.index("person") + 1]
    assert target["difficult"].tolist() == [False, True]
    sx, sy = 64 / 80, 64 / 60
    expected = torch.tensor([[10 * sx, 5 * sy, 50 * sx, 40 * sy], [54 * sx, 9 * sy, 75 * sx, 58 * sy]])
    torch.testing.assert_close(target["boxes"], expected)
    assert test[0][1]["difficult"].tolist() == [False, False]

    # training set: SSD augmentation, difficult objects left out
    torch.manual_seed(0)
    for _ in range(5):
        for i in range(len(train)):
            image, target = train[i]
            assert image.shape == (3, 64, 64)
            assert not target["difficult"].any()
            assert VOC_CLASSES.index("person") + 1 not in target["labels"].tolist()
            boxes = target["boxes"]
            assert len(boxes) == len(target["labels"]) == len(target["difficult"])
            assert (boxes[:, 2:] > boxes[:, :2]).all() and (boxes >= 0).all() and (boxes <= 64).all()
    images, targets = detection_collate([train[0], train[1]])
    assert images.shape == (2, 3, 64, 64)

    # without augmentation and with difficult objects, a training item is the test transform's
    plain, _, _ = build_datasets(VOC | {"augment": False, "use_difficult": True}, tmp_path)
    image, target = plain[0]
    assert torch.equal(image, test[1][0]) and target["difficult"].tolist() == [False, True]


def test_voc_targets_feed_the_metric(tmp_path):
    make_voc(tmp_path)
    _, test, info = build_datasets(VOC, tmp_path)
    truths = [test[i][1] for i in range(len(test))]
    perfect = [
        {"boxes": t["boxes"], "labels": t["labels"], "scores": torch.ones(len(t["labels"]))} for t in truths
    ]
    result = voc07_map(perfect, truths, info.num_classes, class_names=info.class_names)
    assert result["map"] == 100.0
    assert result["ap_per_class"]["person"] is None  # only a difficult person: left out of the mean
    assert result["ap_per_class"]["cat"] == 100.0 and result["ap_per_class"]["aeroplane"] is None


def test_missing_voc_is_a_one_line_config_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        build_datasets({"name": "voc", "image_size": 64}, tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert "VOC 2007 trainval" in message and str(tmp_path) in message
    assert (
        "VOCdevkit/VOC2007/ImageSets/Main/trainval.txt" in message
        and "VOCtrainval_06-Nov-2007.tar" in message
    )
    # 2007 present, 2012 (in the default train_sets) absent
    make_voc(tmp_path)
    with pytest.raises(ConfigError, match="VOC 2012 trainval"):
        build_datasets({"name": "voc", "image_size": 64}, tmp_path)
    # the test list missing
    (tmp_path / "VOCdevkit/VOC2007/ImageSets/Main/test.txt").unlink()
    with pytest.raises(ConfigError, match="VOC 2007 test"):
        build_datasets(VOC, tmp_path)


def test_voc_invalid_fields(tmp_path):
    with pytest.raises(ConfigError, match=r"no VOC split \[2012, test\]"):
        build_datasets(VOC | {"test_set": [2012, "test"]}, tmp_path)
    with pytest.raises(ConfigError, match="pairs"):
        build_datasets(VOC | {"train_sets": [2007]}, tmp_path)
    with pytest.raises(ConfigError, match="20 classes"):
        build_datasets(VOC | {"num_classes": 21}, tmp_path)
