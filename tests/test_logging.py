"""What a run leaves behind and what it tells W&B.

``metrics.json``: complete, atomic, last, with values that agree with ``telemetry.jsonl`` (whose last line is
the last iteration). W&B: checked by reading the offline run's ``.wandb`` file (``tests/wandb_files.py``), the
bytes ``wandb sync`` would upload: summaries, tags, the per-layer table and heatmap per telemetry step, the
per-layer series only on request; ``mode=online`` without a network falls back to offline within its
timeout and leaves no empty run behind; and W&B trouble never stops training.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from adaloss.errors import ConfigError
from adaloss.runner.engine import train
from adaloss.runner.engine.tasks import ClassificationTask
from adaloss.runner.logging import NullLogger, WandbLogger, build_logger, write_json_atomic
from adaloss.runner.logging.progress import format_scale
from adaloss.runner.logging.wandb_logger import underflow_heatmap
from adaloss.telemetry import UnderflowMonitor
from wandb_files import offline_runs


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _telemetry(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


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


# ---- metrics.json ------------------------------------------------------------------------------------------


def test_metrics_json_values(cfg_tiny: DictConfig, tmp_path: Path) -> None:
    returned = train(cfg_tiny)
    written = _json(tmp_path / "metrics.json")
    assert written["steps"] == 2 and written["diverged"] is False and written["world_size"] == 1
    # 8 test images: accuracy is a multiple of 12.5%; one evaluation, so the best is the final one
    assert written["test_accuracy"] in [12.5 * k for k in range(9)]
    assert (
        written["best_test_accuracy"] == written["test_accuracy"] == pytest.approx(returned["test_accuracy"])
    )
    assert written["skipped_steps"] == returned["skipped_steps"] and 0 <= written["skipped_steps"] <= 2
    assert written["overflow_count"] >= written["skipped_steps"]
    assert written["loss_scale"] == 1.0  # scaler=none
    # the underflow numbers are the last telemetry step's, which is the last iteration
    last = _telemetry(tmp_path)[-1]
    assert last["step"] == 2 and written["underflow_rate"] == last["underflow_rate"]
    assert list(written["underflow_rate"])[:2] == ["conv1", "layer1.0.conv1"]  # module paths, network order
    assert list(written["underflow_rate"])[-1] == "fc"
    assert all(0.0 <= r <= 1.0 for r in written["underflow_rate"].values())
    rates = written["underflow_rate"].values()
    assert written["mean_underflow_rate"] == pytest.approx(sum(rates) / len(rates))
    assert math.isfinite(written["train_loss"]) and written["train_loss"] > 0
    assert written["lr"] == pytest.approx(returned["lr"]) and written["lr"] > 0
    # images/s counts training time only, which is less than the wall time
    assert 0 < written["steps"] * 4 / written["wall_time_s"] <= written["images_per_s"]
    assert written["config"]["model"]["name"] == "resnet20" and written["config"]["trainer"]["max_steps"] == 2
    assert "${" not in json.dumps(written["config"])  # resolved
    assert list(written)[-1] == "config"


def test_layerwise_loss_scale_is_a_dict(make_cfg: Callable[..., DictConfig], tmp_path: Path) -> None:
    train(make_cfg("scaler=adaptive"))
    written = _json(tmp_path / "metrics.json")
    scale = written["loss_scale"]
    assert set(scale) <= set(written["underflow_rate"]) and "conv1" in scale
    assert all(v >= 1.0 and math.log2(v).is_integer() for v in scale.values())  # powers of two, >= 1
    assert _telemetry(tmp_path)[-1]["loss_scale"] == scale  # the last telemetry step is the end


def test_no_metrics_json_when_the_run_raises(
    cfg_tiny: DictConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_evaluate(*args: object, **kwargs: object) -> float:
        raise RuntimeError("evaluation exploded")

    monkeypatch.setattr(ClassificationTask, "evaluate", broken_evaluate)
    with pytest.raises(RuntimeError, match="evaluation exploded"):
        train(cfg_tiny)
    assert not (tmp_path / "metrics.json").exists()


def test_the_last_iteration_is_a_telemetry_step(make_cfg: Callable[..., DictConfig], tmp_path: Path) -> None:
    monitor = UnderflowMonitor(every=100)
    assert [s for s in range(200) if monitor.due(s, steps=200)] == [0, 100, 199]
    assert [s for s in range(200) if monitor.due(s)] == [0, 100]
    assert [s for s in range(201) if monitor.due(s, steps=201)] == [0, 100, 200]  # no sample twice
    train(make_cfg("trainer.max_steps=5", "telemetry.every=3"))
    lines = _telemetry(tmp_path)
    assert [r["step"] for r in lines] == [1, 4, 5]  # iterations 0 and 3, and the last one
    written = _json(tmp_path / "metrics.json")
    assert written["underflow_rate"] == lines[-1]["underflow_rate"] != lines[1]["underflow_rate"]


# ---- W&B: what the offline files hold ----------------------------------------------------------------------


def test_wandb_records_summaries_tags_and_one_table_per_telemetry_step(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    names = ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ERROR_REPORTING", "WANDB_SILENT")
    before = {k: os.environ.get(k) for k in names}
    train(
        make_cfg(
            "logger=wandb", "scaler=fixed", "scaler.scale=128", "trainer.max_steps=3", "telemetry.every=2"
        )
    )
    assert {k: os.environ.get(k) for k in names} == before  # the environment W&B was pointed with is restored
    (run,) = offline_runs(tmp_path)
    written = _json(tmp_path / "metrics.json")
    telemetry = {r["step"]: r for r in _telemetry(tmp_path)}
    assert sorted(telemetry) == [1, 3]
    assert run.exited and run.run.run_group == ""  # a single run: no group
    assert list(run.run.tags) == ["fp16", "fixed", "scale=128"]
    assert run.config["scaler"]["scale"] == 128
    assert run.metrics["test/accuracy"] == {"max", "last"} and run.metrics["train/loss"] == {"min", "last"}
    for step, record in telemetry.items():
        logged = run.history[step]
        rates = record["underflow_rate"]
        assert logged["underflow/mean"] == pytest.approx(sum(rates.values()) / len(rates))
        assert logged["underflow/max"] == pytest.approx(max(rates.values()))
        assert logged["underflow/layers_above_1pct"] == sum(r > 0.01 for r in rates.values())
        rows = run.table(logged["underflow/table"])
        assert [r["layer"] for r in rows] == list(rates)[::-1]  # layer ID 0: nearest the loss
        assert [r["layer_id"] for r in rows] == list(range(len(rates)))
        assert [r["underflow_rate"] for r in rows] == pytest.approx([rates[r["layer"]] for r in rows])
        assert {r["loss_scale"] for r in rows} == {128.0}
        # the heatmap holds every telemetry step so far: one column each, a row per layer, and the colour bar
        heatmap = logged["underflow/heatmap"]
        columns = sorted(s for s in telemetry if s <= step)
        assert f"columns are {len(columns)} telemetry steps" in heatmap["caption"]
        image, _ = underflow_heatmap(list(rates), columns, [[1.0] * len(columns)] * len(rates))
        assert _png_size(run.media(heatmap)) == (image.shape[1], image.shape[0])
        # per-layer series only on request (three panels per layer otherwise)
        assert not any(k.startswith("underflow/") and k.split("/", 1)[1] in rates for k in logged)
    assert run.history[3]["loss_scale"] == 128.0 and run.history[3]["train/loss"] == pytest.approx(
        written["train_loss"]
    )
    assert run.summary["test/accuracy"] == {
        "max": pytest.approx(written["best_test_accuracy"]),
        "last": pytest.approx(written["test_accuracy"]),
    }
    assert run.summary["underflow/mean"]["last"] == pytest.approx(written["mean_underflow_rate"])
    # every W&B file is in the run folder
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["done", "metrics.json", "run_key.json", "scalars.csv", "telemetry.jsonl", "wandb"], names


def test_wandb_per_layer_series_on_request_and_the_adaptive_table(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    train(make_cfg("logger=wandb", "logger.wandb.per_layer_series=true", "scaler=adaptive"))
    (run,) = offline_runs(tmp_path)
    last = _telemetry(tmp_path)[-1]
    logged = run.history[last["step"]]
    rows = {r["layer"]: r for r in run.table(logged["underflow/table"])}
    assert set(rows) == set(last["underflow_rate"])
    for layer, alpha in last["loss_scale"].items():
        assert (
            rows[layer]["loss_scale"] == alpha
            and rows[layer]["loss_scale_beta"] == last["loss_scale_beta"][layer]
        )
        assert logged[f"loss_scale/{layer}"] == alpha
        assert logged[f"loss_scale_beta/{layer}"] == last["loss_scale_beta"][layer]
    for layer, rate in last["underflow_rate"].items():
        assert logged[f"underflow/{layer}"] == pytest.approx(rate)
    alphas = last["loss_scale"].values()
    assert logged["loss_scale/min"] == min(alphas) and logged["loss_scale/max"] == max(alphas)


class _Recorder(NullLogger):
    """Stands in for the W&B logger: keeps what the trainer logs."""

    def __init__(self) -> None:
        self.logged: dict[int, dict[str, Any]] = {}
        self.telemetry: dict[int, Mapping[str, Any]] = {}

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self.logged.setdefault(step, {}).update(metrics)

    def log_telemetry(self, record: Mapping[str, Any], step: int) -> None:
        self.telemetry[step] = record


def test_detection_logs_the_ap_of_each_class(
    make_full_cfg: Callable[..., DictConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = _Recorder()
    monkeypatch.setattr("adaloss.runner.engine.compose.build_logger", lambda *args, **kwargs: recorder)
    det = ("model=ssd512", "dataset=shapes", "model.image_size=64", "model.width_multiplier=0.125")
    small = (
        "dataset.train_size=4",
        "dataset.test_size=4",
        "trainer.batch_size=2",
        "trainer.eval_batch_size=4",
    )
    train(make_full_cfg(*det, *small, "trainer.max_steps=1"))
    ap = _json(tmp_path / "metrics.json")["ap_per_class"]
    assert set(ap) == {"square", "circle", "triangle"} and any(v is not None for v in ap.values())
    logged = recorder.logged[1]
    assert {k: v for k, v in logged.items() if k.startswith("test_ap/")} == {
        f"test_ap/{name}": pytest.approx(v) for name, v in ap.items() if v is not None
    }
    assert logged["test/map"] == pytest.approx(_json(tmp_path / "metrics.json")["map"])
    assert list(recorder.telemetry) == [1]  # iteration 0 is the first and the last


# ---- W&B online without a network --------------------------------------------------------------------------


@pytest.fixture
def wandb_session() -> Iterator[None]:
    """Forget, after the test, the API key an online ``wandb.init`` stored for the process (W&B keeps it
    in a module global), so later tests see the environment they set up."""
    yield
    try:
        from wandb.sdk.lib import wbauth

        wbauth.unauthenticate_session(update_settings=False)
    except Exception:  # noqa: BLE001 - another W&B version: nothing to forget
        pass


def test_online_without_a_network_falls_back_to_offline_within_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, wandb_session: None
) -> None:
    """This machine (and CI) has no route to W&B: a real online ``wandb.init`` fails. With a (fake) API key
    W&B tries the network; ``init_timeout=2`` bounds the attempt."""
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path))
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING):
        logger = WandbLogger(project="p", run_dir=tmp_path, config={"seed": 0}, mode="online", init_timeout=2)
    took = time.perf_counter() - started
    assert took < 2 + 8  # W&B's own default would wait 90 s
    (warning,) = [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()]  # once, one line
    assert "\n" not in warning
    assert "logger.wandb.mode=online: W&B was not reachable within 2 s" in warning
    assert f"logging offline to {tmp_path / 'wandb'} instead" in warning
    assert logger.active and logger.fell_back_offline
    logger.log({"train/loss": 0.5}, step=1)
    logger.log_telemetry({"underflow_rate": {"fc": 0.25}, "loss_scale": 1.0}, step=1)
    logger.finish()
    # no folder of the failed online attempt (a run record and an exit record: an empty finished run)
    assert not list((tmp_path / "wandb").glob("run-*"))
    (run,) = offline_runs(tmp_path)
    assert run.exited and run.history[1]["train/loss"] == 0.5 and run.history[1]["underflow/mean"] == 0.25


def test_online_without_an_api_key_falls_back_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, wandb_session: None
) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for var in ("HOME", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / "netrc"))
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING):
        logger = WandbLogger(project="p", run_dir=tmp_path, config={}, mode="online", init_timeout=60)
    assert time.perf_counter() - started < 30  # no prompt, no 60 s wait
    assert logger.active and logger.fell_back_offline
    logger.log({"train/loss": 1.0}, step=1)
    logger.finish()
    (warning,) = [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()]
    assert "no W&B API key is configured" in warning and "logging offline" in warning
    (run,) = offline_runs(tmp_path)
    assert run.history[1]["train/loss"] == 1.0 and not list((tmp_path / "wandb").glob("run-*"))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("init_timeout", 0, "logger.wandb.init_timeout must be a number > 0, got 0.0"),
        ("init_timeout", float("inf"), "logger.wandb.init_timeout must be a finite number, got inf"),
        (
            "init_timeout",
            "soon",
            "logger.wandb.init_timeout: Value 'soon' of type 'str' could not be converted",
        ),
        ("per_layer_series", "maybe", "logger.wandb.per_layer_series: Value 'maybe' is not a valid bool"),
        ("mode", "sometimes", "logger.wandb.mode must be one of offline, online, disabled, got 'sometimes'"),
    ],
)
def test_bad_wandb_settings_are_config_errors(tmp_path: Path, key: str, value: Any, message: str) -> None:
    cfg = OmegaConf.create({"wandb": {"mode": "offline", key: value}})
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_logger(cfg, tmp_path, {})
    assert not (tmp_path / "wandb").exists()


# ---- W&B trouble never stops training ----------------------------------------------------------------------


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

        def define_metric(self, *args: object, **kwargs: object) -> None:
            pass

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
        logger.log_telemetry({"underflow_rate": {"fc": 0.1}, "loss_scale": 1.0}, step=2)
        logger.finish()
    assert len([r for r in caplog.records if "W&B" in r.getMessage()]) == 1
    assert run.finished and not logger.active


def test_logger_none_writes_no_wandb_files(cfg_tiny: DictConfig, tmp_path: Path) -> None:
    assert cfg_tiny.logger.wandb is None
    train(cfg_tiny)
    assert not (tmp_path / "wandb").exists()
    NullLogger().log({"x": 1}, step=0)  # the no-op accepts anything


def test_underflow_heatmap_pixels() -> None:
    """Row order (ID 0, the last layer in network order, on top), the log colour scale, grey for gaps."""
    image, caption = underflow_heatmap(["first", "last"], [1, 101], [[1.0, 0.0], [1e-3, math.nan]])
    assert image.dtype.name == "uint8" and image.shape[2] == 3
    height = image.shape[0]
    top, bottom = image[0], image[height - 1]  # "last" (ID 0) then "first"
    assert tuple(top[0]) != tuple(bottom[0])  # 1e-3 and 1.0 differ
    assert tuple(top[-20]) == (128, 128, 128)  # "last" has no value at step 101: grey
    assert tuple(bottom[0]) == tuple(image[0, -1])  # rate 1.0 has the colour of the bar's top (1)
    assert tuple(bottom[-20]) == tuple(image[height - 1, -1])  # rate 0 has the bar's bottom colour
    assert "2 layers" in caption and "iterations 1 to 101" in caption


def test_format_scale() -> None:
    assert format_scale(65536.0) == "65536"
    assert format_scale({"fc": 2.0, "conv1": 512.0}) == "2..512"
    assert format_scale(None) == "-"
