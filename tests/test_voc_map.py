"""VOC2007 mAP: hand-made cases with known answers; agreement with torchmetrics where the definitions meet."""

import math

import numpy as np
import pytest
import torch

from adaloss.runner.metrics.voc_map import interpolated_ap, match_detections, precision_recall, voc07_map


def gt(boxes, labels, difficult=None):
    out = {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4), "labels": torch.tensor(labels)}
    if difficult is not None:
        out["difficult"] = torch.tensor(difficult, dtype=torch.bool)
    return out


def det(boxes, scores, labels):
    return {
        "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
        "scores": torch.tensor(scores, dtype=torch.float32),
        "labels": torch.tensor(labels),
    }


A, B, C = [0, 0, 10, 10], [20, 20, 40, 40], [50, 0, 80, 30]


def test_perfect_detections_score_100():
    truths = [gt([A, B], [1, 2]), gt([C], [1])]
    dets = [det([A, B], [0.9, 0.8], [1, 2]), det([C], [0.7], [1])]
    result = voc07_map(dets, truths, num_classes=2, class_names=["cat", "dog"])
    assert result == {"map": 100.0, "ap_per_class": {"cat": 100.0, "dog": 100.0}}


def test_missed_object_caps_recall():
    truths = [gt([A, B, C], [1, 1, 1])]
    dets = [det([A, B], [0.9, 0.8], [1, 1])]  # C missed: recall stops at 2/3
    # precision 1 at recall levels 0, 0.1, ..., 0.6 (7 of 11), nothing beyond
    assert voc07_map(dets, truths, 1)["map"] == pytest.approx(100 * 7 / 11)


def test_recall_levels_are_exact_tenths():
    # 3 of 10 objects found: recall 0.3 reaches the level 0.3 (np.arange(0, 1.1, 0.1)[3] would miss it)
    boxes = [[20 * i, 0, 20 * i + 10, 10] for i in range(10)]
    truths = [gt(boxes, [1] * 10)]
    dets = [det(boxes[:3], [0.9, 0.8, 0.7], [1, 1, 1])]
    assert voc07_map(dets, truths, 1)["map"] == pytest.approx(100 * 4 / 11)


def test_duplicate_detection_is_a_false_positive():
    truths = [gt([A, B], [1, 1])]
    dets = [det([A, A, B], [0.9, 0.8, 0.7], [1, 1, 1])]
    matches = match_detections(dets, truths, 1)[1]
    assert matches.true_positive.tolist() == [True, False, True]
    precision, recall = precision_recall(matches)
    np.testing.assert_allclose(precision, [1, 0.5, 2 / 3])
    np.testing.assert_allclose(recall, [0.5, 0.5, 1.0])
    # levels 0..0.5: precision 1; levels 0.6..1: 2/3
    assert voc07_map(dets, truths, 1)["map"] == pytest.approx(100 * (6 + 5 * 2 / 3) / 11)


def test_duplicate_does_not_look_for_another_box():
    # VOC rule: a detection goes to its best-overlapping box; if that box is taken it is a false positive,
    # even when another box overlaps it enough (COCO would match it to that one).
    g1, g2 = [0, 0, 10, 10], [0, 1, 10, 11]
    second = [0, 0.2, 10, 10.2]  # IoU 0.96 with g1, 0.85 with g2
    matches = match_detections([det([g1, second], [0.9, 0.8], [1, 1])], [gt([g1, g2], [1, 1])], 1)[1]
    assert matches.true_positive.tolist() == [True, False]


def test_difficult_objects_are_ignored():
    difficult_box = B
    truths = [gt([A, difficult_box], [1, 1], difficult=[False, True])]
    # a detection on the difficult box, even the best-scored one, is neither TP nor FP
    dets = [det([difficult_box, A], [0.95, 0.9], [1, 1])]
    matches = match_detections(dets, truths, 1)[1]
    assert matches.num_positives == 1 and matches.true_positive.tolist() == [True]
    assert voc07_map(dets, truths, 1)["map"] == 100.0
    # missing the difficult object does not lower recall either
    assert voc07_map([det([A], [0.9], [1])], truths, 1)["map"] == 100.0
    # without the flag the same miss costs half the recall
    plain = [gt([A, difficult_box], [1, 1])]
    assert voc07_map([det([A], [0.9], [1])], plain, 1)["map"] == pytest.approx(100 * 6 / 11)


def test_class_without_ground_truth_is_left_out_of_the_mean():
    truths = [gt([A, B], [1, 2]), gt([C], [3], difficult=[True])]  # class 3: only a difficult object
    dets = [det([A, C], [0.9, 0.5], [1, 2]), det([C], [0.8], [3])]  # class 2: one FP, its object missed
    result = voc07_map(dets, truths, num_classes=4, class_names=["a", "b", "c", "d"])
    assert result["ap_per_class"] == {"a": 100.0, "b": 0.0, "c": None, "d": None}
    assert result["map"] == 50.0
    assert math.isnan(voc07_map([det([], [], [])], [gt([], [])], 2)["map"])


def test_iou_threshold_is_inclusive_and_label_must_match():
    truths = [gt([[0, 0, 10, 10]], [1])]
    half = [0, 0, 10, 20]  # IoU exactly 0.5
    assert voc07_map([det([half], [0.9], [1])], truths, 1)["map"] == 100.0
    assert voc07_map([det([[0, 0, 10, 21]], [0.9], [1])], truths, 1)["map"] == 0.0
    assert voc07_map([det([[0, 0, 10, 10]], [0.9], [2])], truths, 2)["ap_per_class"]["1"] == 0.0


def test_invalid_inputs_raise():
    with pytest.raises(ValueError, match="1..2"):
        voc07_map([det([A], [0.9], [0])], [gt([A], [1])], 2)
    with pytest.raises(ValueError, match="images"):
        voc07_map([], [gt([A], [1])], 1)
    with pytest.raises(ValueError, match="class names"):
        voc07_map([det([A], [0.9], [1])], [gt([A], [1])], 2, class_names=["x"])


# ------------------------------------------------------------------------------------------ torchmetrics


def _random_case(seed, num_classes=3, images=8):
    """Ground-truth boxes in disjoint cells (so no detection reaches IoU 0.5 with two boxes, where the VOC and
    COCO matching rules would differ), jittered detections, duplicates, wrong labels and background FPs.
    Per-class object counts are odd and not multiples of 5, so no recall value k/P lands on one of COCO's
    recall levels (multiples of 0.01), where float rounding of the levels could flip a comparison."""
    rng = np.random.default_rng(seed)
    truths = [{"boxes": [], "labels": []} for _ in range(images)]
    dets = [{"boxes": [], "scores": [], "labels": []} for _ in range(images)]
    free = [list(rng.permutation(16)) for _ in range(images)]
    for c in range(1, num_classes + 1):
        for i in rng.integers(images, size=int(rng.choice([3, 7, 9, 11, 13]))):
            cell = free[i].pop()
            w, h = rng.uniform(30, 90, 2)
            x, y = (cell % 4) * 100 + rng.uniform(0, 100 - w), (cell // 4) * 100 + rng.uniform(0, 100 - h)
            box = np.array([x, y, x + w, y + h])
            truths[i]["boxes"].append(box)
            truths[i]["labels"].append(c)
            for label, p in ((c, 0.75), (c, 0.25), (1 + c % num_classes, 0.1)):  # hit, duplicate, wrong class
                if rng.random() < p:
                    jittered = box + rng.normal(0, 0.12, 4) * np.array([w, h, w, h])
                    jittered[2:] = np.maximum(jittered[2:], jittered[:2] + 1)
                    dets[i]["boxes"].append(jittered)
                    dets[i]["labels"].append(label)
                    dets[i]["scores"].append(rng.random())
    for i in range(images):
        for _ in range(3):
            xy, wh = rng.uniform(0, 350, 2), rng.uniform(10, 80, 2)
            dets[i]["boxes"].append(np.r_[xy, xy + wh])
            dets[i]["labels"].append(int(rng.integers(1, num_classes + 1)))
            dets[i]["scores"].append(rng.random())

    def tensors(d):
        out = {k: torch.tensor(np.array(v), dtype=torch.float32) for k, v in d.items() if k != "labels"}
        out["boxes"] = out["boxes"].reshape(-1, 4)
        out["labels"] = torch.tensor(d["labels"], dtype=torch.int64)
        return out

    return [tensors(d) for d in dets], [tensors(t) for t in truths]


@pytest.mark.parametrize("seed", range(4))
def test_precision_recall_curves_agree_with_torchmetrics(seed):
    detection = pytest.importorskip("torchmetrics.detection")
    pytest.importorskip("pycocotools")
    dets, truths = _random_case(seed)
    reference = detection.MeanAveragePrecision(
        iou_type="bbox", iou_thresholds=[0.5], class_metrics=True, extended_summary=True
    )
    reference.update(dets, truths)
    expected = reference.compute()
    matches = match_detections(dets, truths, 3)
    mine_101 = []
    for k, c in enumerate(expected["classes"].tolist()):
        precision, recall = precision_recall(matches[c])
        # COCO's 101-level interpolated AP from our curve equals torchmetrics' AP at IoU 0.5...
        mine_101.append(interpolated_ap(precision, recall, num_points=101))
        assert mine_101[-1] == pytest.approx(expected["map_per_class"][k].item(), abs=1e-6)
        # ...and its interpolated precision at recall 0, 0.1, ..., 1 averages to our VOC2007 AP
        levels = expected["precision"][0, ::10, k, 0, -1].double()  # IoU 0.5, area "all", 100 detections
        assert interpolated_ap(precision, recall, num_points=11) == pytest.approx(
            levels.mean().item(), abs=1e-6
        )
    assert np.mean(mine_101) == pytest.approx(expected["map"].item(), abs=1e-6)
    assert voc07_map(dets, truths, 3)["map"] > 0
