"""Evaluation metrics beyond accuracy: the PASCAL VOC2007 detection mAP (``voc_map``)."""

from adaloss.runner.metrics.voc_map import (
    ClassMatches,
    interpolated_ap,
    match_detections,
    precision_recall,
    voc07_map,
)

__all__ = ["ClassMatches", "interpolated_ap", "match_detections", "precision_recall", "voc07_map"]
