"""Injected Inf/NaN gradients: every scaler skips the step (weights and optimizer state bitwise unchanged),
counts it, reports it (a log line and a W&B metric) and trains on; a run that keeps overflowing stops and
keeps its last checkpoint."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import DictConfig
from torch import nn

from adaloss.errors import ConfigError
from adaloss.runner.engine import compose, train
from adaloss.runner.engine.checkpoint import load_checkpoint
from adaloss.runner.engine.faults import TrainingDiverged, parse_faults
from adaloss.runner.logging import NullLogger

LAYER = "layer1.0.conv1"


def _inject(step: int, value: str = "inf", layer: str = LAYER, count: str | int = 1) -> str:
    return f"faults.inject=[{{step:{step},layer:{layer},value:{value},count:{count}}}]"


class _Snapshots:
    """A step callback: copies of the parameters, the optimizer state and the counters after each step."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, Any]] = {}

    def __call__(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
        self.at[step] = {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "optimizer": {
                i: {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
                for i, s in enumerate(optimizer.state_dict()["state"].values())
            },
            "skipped": scaler.last_step_skipped,
            "skipped_steps": scaler.skipped_steps,
            "overflow_count": scaler.overflow_count,
        }


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        _same(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k]) for k in a
    )


class _RecordingLogger(NullLogger):
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def log(self, metrics: Any, step: int) -> None:
        self.logged.append((step, dict(metrics)))


@pytest.mark.parametrize("value", ["inf", "nan"])
@pytest.mark.parametrize("scaler", ["none", "fixed", "dynamic", "adaptive"])
def test_an_injected_non_finite_gradient_skips_exactly_that_step(
    make_cfg: Callable[..., DictConfig],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    scaler: str,
    value: str,
) -> None:
    logger = _RecordingLogger()
    monkeypatch.setattr(compose, "build_logger", lambda *args, **kwargs: logger)
    snapshots = _Snapshots()
    with caplog.at_level(logging.INFO):
        metrics = train(
            make_cfg(f"scaler={scaler}", "trainer.max_steps=4", _inject(3, value)), callbacks=[snapshots]
        )
    before, after, later = snapshots.at[2], snapshots.at[3], snapshots.at[4]
    # the step was skipped: master weights and optimizer state (momentum) are bitwise what they were
    assert after["skipped"]
    assert _same(before["params"], after["params"]) and _same(before["optimizer"], after["optimizer"])
    # counted once (a natural overflow elsewhere, e.g. dynamic's first 2^16, does not matter here)
    assert after["skipped_steps"] == before["skipped_steps"] + 1
    assert after["overflow_count"] == before["overflow_count"] + 1
    # reported: a log line and a W&B metric at that iteration
    assert any("iteration 3: Inf/NaN gradient, update skipped" in r.getMessage() for r in caplog.records)
    assert any(step == 3 and m.get("skipped_step") == 1 for step, m in logger.logged)
    # and training went on
    assert not later["skipped"] and not _same(after["params"], later["params"])
    assert metrics["steps"] == 4 and metrics["skipped_steps"] == later["skipped_steps"]


def test_a_run_that_keeps_overflowing_stops_and_keeps_its_checkpoints(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    # every gradient of one layer is Inf from iteration 5 on: iterations 5, 6, 7 are skipped, then it stops
    cfg = make_cfg("scaler=dynamic", "scaler.init_scale=128", "trainer.max_steps=20",
                   "trainer.checkpoint_every=2", "trainer.max_consecutive_overflows=3",
                   _inject(5, count="null"))  # fmt: skip
    with pytest.raises(TrainingDiverged, match=rf"3 steps in a row .*iterations 5-7.* {LAYER}") as info:
        train(cfg)
    assert info.value.step == 7 and info.value.layers[0] == LAYER
    assert not (tmp_path / "metrics.json").exists()
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step_4.pt", "step_6.pt"]  # step 6 was skipped, yet saved: the weights are step 4's
    assert load_checkpoint(tmp_path / "checkpoints" / "step_4.pt")["step"] == 4


def test_an_unknown_layer_is_a_config_error(make_cfg: Callable[..., DictConfig]) -> None:
    with pytest.raises(ConfigError, match=r"'layer1.0.conv9' is not a layer of the model: did you mean"):
        train(make_cfg(_inject(1, layer="layer1.0.conv9")))
    with pytest.raises(ConfigError, match="has no parameters"):
        train(make_cfg(_inject(1, layer="relu")))


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([{"step": 0, "layer": "fc", "value": "inf"}], "step must be an iteration number"),
        ([{"step": 1, "layer": "fc"}], "needs value"),
        ([{"step": 1, "layer": "fc", "value": "inf", "when": 3}], "has no field"),
        ([{"step": 1, "layer": "fc", "value": "big"}], "value must be a number"),
        ([{"step": 1, "layer": "fc", "value": "inf", "count": 0}], "count must be a positive integer"),
        ("fc", "must be a list"),
    ],
)
def test_malformed_fault_entries(entries: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_faults(entries)
