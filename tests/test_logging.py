"""What a run leaves behind: ``metrics.json`` (complete, atomic, last) and offline W&B files in its folder;
and W&B trouble never stops training."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import DictConfig

from adaloss.engine import train
from adaloss.engine.tasks import ClassificationTask
from adaloss.logging import NullLogger, WandbLogger, write_json_atomic
from adaloss.logging.progress import format_scale

METRIC_TYPES = {
    "test_accuracy": float,
    "best_test_accuracy": float,
    "steps": int,
    "skipped_steps": int,
    "overflow_count": int,
    "underflow_rate": dict,
    "mean_underflow_rate": float,
    "wall_time_s": float,
    "images_per_s": float,
    "config": dict,
}


def test_write_json_atomic_leaves_no_temporary_files(tmp_path: Path) -> None:
    path = write_json_atomic(tmp_path / "metrics.json", {"a": 1.5, "inf": float("inf")})
    assert json.loads(path.read_text()) == {"a": 1.5, "inf": None}  # JSON has no Inf
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_write_json_atomic_failure_keeps_the_old_file(tmp_path: Path) -> None:
    path = write_json_atomic(tmp_path / "metrics.json", {"version": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"version": 2, "bad": object()})
    assert json.loads(path.read_text()) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_metrics_json_keys_and_types(cfg_tiny: DictConfig, tmp_path: Path) -> None:
    returned = train(cfg_tiny)
    written = json.loads((tmp_path / "metrics.json").read_text())
    for key, kind in METRIC_TYPES.items():
        assert isinstance(written[key], kind), (key, written[key])
    assert isinstance(written["loss_scale"], float | dict)
    assert written["steps"] == 2
    assert set(written["underflow_rate"]) >= {"conv1", "layer3.2.conv2", "fc"}  # named by module path
    assert written["mean_underflow_rate"] == pytest.approx(
        sum(written["underflow_rate"].values()) / len(written["underflow_rate"])
    )
    assert written["config"]["model"]["name"] == "resnet20"
    assert "${" not in json.dumps(written["config"])  # resolved
    assert written["test_accuracy"] == pytest.approx(returned["test_accuracy"])


def test_layerwise_loss_scale_is_a_dict(make_cfg: Callable[..., DictConfig], tmp_path: Path) -> None:
    train(make_cfg("scaler=adaptive"))
    scale = json.loads((tmp_path / "metrics.json").read_text())["loss_scale"]
    assert isinstance(scale, dict) and scale and all(isinstance(v, float) for v in scale.values())


def test_no_metrics_json_when_the_run_raises(
    cfg_tiny: DictConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_evaluate(*args: object, **kwargs: object) -> float:
        raise RuntimeError("evaluation exploded")

    monkeypatch.setattr(ClassificationTask, "evaluate", broken_evaluate)
    with pytest.raises(RuntimeError, match="evaluation exploded"):
        train(cfg_tiny)
    assert not (tmp_path / "metrics.json").exists()


def test_offline_wandb_files_stay_in_the_run_dir(make_cfg: Callable[..., DictConfig], tmp_path: Path) -> None:
    before = {k: os.environ.get(k) for k in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ERROR_REPORTING")}
    train(make_cfg("logger=wandb"))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("run-*.wandb")), "the offline run's data file"
    assert list(runs[0].glob("files/media/table/underflow_table_*.table.json")), "the per-layer table"
    assert (tmp_path / "metrics.json").exists()
    # the environment W&B was pointed with is restored after the run
    assert {k: os.environ.get(k) for k in before} == before


@pytest.mark.parametrize("failure", ["import", "init"])
def test_wandb_failure_warns_once_and_training_continues(
    make_cfg: Callable[..., DictConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog, failure: str
) -> None:
    if failure == "import":
        monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    else:
        import wandb

        def failing_init(*args: object, **kwargs: object) -> None:
            raise RuntimeError("no W&B today")

        monkeypatch.setattr(wandb, "init", failing_init)
    with caplog.at_level(logging.WARNING):
        metrics = train(make_cfg("logger=wandb"))
    assert metrics["steps"] == 2 and (tmp_path / "metrics.json").exists()
    warnings = [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()]
    assert len(warnings) == 1 and "training continues without W&B" in warnings[0]


def test_wandb_log_failure_disables_logging_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    import wandb

    class FlakyRun:
        dir = str(tmp_path / "wandb" / "run" / "files")
        finished = False

        def log(self, *args: object, **kwargs: object) -> None:
            raise OSError("disk full")

        def finish(self, exit_code: int = 0) -> None:
            self.finished = True

    run = FlakyRun()
    monkeypatch.setattr(wandb, "init", lambda *a, **k: run)
    logger = WandbLogger(project="p", run_dir=tmp_path, config={})
    with caplog.at_level(logging.WARNING):
        logger.log({"loss": 1.0}, step=1)
        logger.log({"loss": 0.5}, step=2)  # already disabled: silent no-op
        logger.log_underflow({"fc": 0.1}, step=2)
        logger.finish()
    assert len([r for r in caplog.records if "W&B" in r.getMessage()]) == 1
    assert run.finished and not logger.active


def test_logger_none_writes_no_wandb_files(cfg_tiny: DictConfig, tmp_path: Path) -> None:
    assert cfg_tiny.logger.wandb is None
    train(cfg_tiny)
    assert not (tmp_path / "wandb").exists()
    NullLogger().log({"x": 1}, step=0)  # the no-op accepts anything


def test_format_scale() -> None:
    assert format_scale(65536.0) == "65536"
    assert format_scale({"fc": 2.0, "conv1": 512.0}) == "2..512"
    assert format_scale(None) == "-"
