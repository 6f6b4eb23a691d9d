"""The detection path through the runner: ``train(cfg)`` with ``model=ssd512`` on shapes and on a VOC folder.

The runs are tiny (a few iterations of SSD512 at 64x64), so they check wiring, not learning: the metric
keys of ``metrics.json``, every scaler on SSD's branches, per-layer telemetry of backbone, extras and
heads, and the VOC loader end to end. Learning is shown by the longer shapes run in the README (and the
``slow`` test below).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import DictConfig, open_dict

from adaloss.errors import ConfigError
from adaloss.runner.engine import train
from test_detection_data import VOC_IMAGES, make_voc

#: SSD512 at 64x64 on 8 shapes images, 2 iterations of batch 4, one evaluation on 4 images.
DET_TINY: tuple[str, ...] = (
    "model=ssd512",
    "dataset=shapes",
    "model.image_size=64",
    "dataset.train_size=8",
    "dataset.test_size=4",
    "trainer.batch_size=4",
    "trainer.eval_batch_size=4",
    "trainer.max_steps=2",
    "telemetry.every=1",
)


@pytest.fixture
def det_cfg(make_full_cfg: Callable[..., DictConfig]) -> Callable[..., DictConfig]:
    return lambda *overrides: make_full_cfg(*DET_TINY, *overrides)


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.parametrize("scaler", ["none", "fixed", "dynamic", "adaptive"])
def test_ssd_on_shapes_runs_under_every_scaler(
    det_cfg: Callable[..., DictConfig], tmp_path: Path, scaler: str
) -> None:
    metrics = train(det_cfg(f"scaler={scaler}"))
    written = _metrics(tmp_path)
    assert written["steps"] == 2 and written["diverged"] is False
    assert 0.0 <= written["map"] <= 100.0 and written["best_map"] >= written["map"]
    ap = written["ap_per_class"]
    assert list(ap) == ["circle", "square", "triangle"]  # the classes, in label order
    defined = [v for v in ap.values() if v is not None]  # None: a class without ground truth in the test set
    assert defined and all(0.0 <= v <= 100.0 for v in defined)
    assert written["map"] == pytest.approx(sum(defined) / len(defined))  # mAP: the mean of the classes' APs
    assert "test_accuracy" not in written and "train_accuracy" not in written
    assert math.isfinite(written["train_loss"]) and written["train_loss"] > 0
    assert metrics["map"] == pytest.approx(written["map"])
    # telemetry covers the backbone (VGG + extras) and both heads, in network order
    layers = list(written["underflow_rate"])
    assert layers[0] == "backbone.conv1_1"
    assert any(name.startswith("backbone.conv8") for name in layers)
    assert any("classification_head" in name for name in layers)
    assert any("regression_head" in name for name in layers)
    if scaler == "adaptive":
        scales = written["loss_scale"]
        assert isinstance(scales, dict) and "backbone.conv4_3" in scales


def test_telemetry_jsonl_records_every_telemetry_step(
    det_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    train(det_cfg("precision=fp32", "scaler=none", "telemetry.expected_loss_scale=true"))
    lines = (tmp_path / "telemetry.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2]
    first = records[0]
    # layers whose gradient is all zero this step (e.g. a head whose map has no matched box) have no
    # expected scale; the backbone's early layers always have one
    assert set(first["expected_loss_scale"]) <= set(first["underflow_rate"])
    assert {"backbone.conv1_1", "backbone.conv4_3"} <= set(first["expected_loss_scale"])
    assert all(v >= 1.0 for v in first["expected_loss_scale"].values())  # FP32 gradients are tiny: scale up
    assert first["loss_scale"] == 1.0


def test_voc_folder_trains_and_evaluates_end_to_end(
    make_full_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    data = make_voc(tmp_path / "data")
    cfg = make_full_cfg(
        "model=ssd512",
        "dataset=voc",
        "model.image_size=64",
        "dataset.train_sets=[[2007,trainval]]",
        "trainer.batch_size=2",
        "trainer.eval_batch_size=2",
        "trainer.max_steps=2",
        "trainer.num_workers=0",
        "scaler=adaptive",
        f"paths.data_dir={data}",
    )
    train(cfg)
    written = _metrics(tmp_path)
    # the test split holds a cat and a tvmonitor (non-difficult) and a dog plus a difficult person: the
    # classes with non-difficult ground truth have an AP, the rest are None; the person, only difficult,
    # has no AP either
    ap = written["ap_per_class"]
    assert len(ap) == 20
    with_truth = {"cat", "tvmonitor", "dog"}
    assert {c for c, v in ap.items() if v is not None} == with_truth
    assert ap["person"] is None
    assert 0.0 <= written["map"] <= 100.0
    assert written["config"]["dataset"]["image_size"] == 64  # follows model.image_size
    assert set(VOC_IMAGES) >= {"000001", "000003"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("model=ssd512", "dataset=digits"), "ssd512.*digits"),
        (("model=resnet20", "dataset=shapes"), "shapes.*resnet20"),
    ],
)
def test_task_mismatch_is_a_config_error(
    make_full_cfg: Callable[..., DictConfig], overrides: tuple[str, ...], message: str
) -> None:
    """A detector on images is refused by ``train``; a classifier with the shapes recipe (which sets the SSD's
    model.image_size) already while Hydra composes: either way one line, as ``train.py`` prints it."""
    import re

    from hydra.errors import HydraException

    from test_schemas import _load_cli

    try:
        cfg = make_full_cfg(*overrides, "trainer.max_steps=1")
    except HydraException as error:
        line = _load_cli().describe_hydra_error(error)
    else:
        with pytest.raises(ConfigError) as info:
            train(cfg)
        line = str(info.value)
    assert re.search(message, line) and "\n" not in line, line


def test_detection_image_size_mismatch_is_a_config_error(det_cfg: Callable[..., DictConfig]) -> None:
    cfg = det_cfg()
    with open_dict(cfg):
        cfg.dataset.image_size = 96
    with pytest.raises(ConfigError, match="image_size"):
        train(cfg)


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant", [("precision=fp32",), ("scaler=adaptive",)], ids=["fp32", "fp16-adaptive"]
)
def test_shapes_recipe_learns_to_detect(
    make_full_cfg: Callable[..., DictConfig], variant: tuple[str, ...]
) -> None:
    # the README's detection numbers: the full shapes recipe (1500 iterations, ~5-10 min on one core)
    metrics = train(make_full_cfg("model=ssd512", "dataset=shapes", *variant))
    assert metrics["map"] >= 50.0
    assert metrics["skipped_steps"] <= 5
