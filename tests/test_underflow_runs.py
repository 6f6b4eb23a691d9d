"""scripts/underflow_runs.py: the per-layer underflow of docs/reproducing.md from finished runs' telemetry."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import underflow_runs  # noqa: E402

LAYERS = ["backbone.conv1_1", "backbone.conv4_3", "head.classification_head.module_list.0"]


def _run(folder: Path, scaler: dict, rates_per_step: list[list[float]], precision: str = "fp16") -> None:
    folder.mkdir(parents=True)
    config = {"model": {"name": "ssd512"}, "dataset": {"name": "shapes"}, "precision": {"name": precision},
              "scaler": scaler, "trainer": {"batch_size": 8}, "seed": 0, "name": folder.name}  # fmt: skip
    (folder / "metrics.json").write_text(json.dumps({"map": 10.0, "config": config}))
    (folder / "done").write_text("")  # finished: the trainer's marker
    lines = [
        json.dumps({"step": 10 * (i + 1), "underflow_rate": dict(zip(LAYERS, rates, strict=True))})
        for i, rates in enumerate(rates_per_step)
    ]
    (folder / "telemetry.jsonl").write_text("\n".join(lines) + "\n")


def test_table_averages_the_last_steps_and_counts_wins(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _run(tmp_path / "a_none", {"name": "none"}, [[0.9, 0.9, 0.9], [0.5, 0.4, 0.3], [0.3, 0.2, 0.1]])
    _run(tmp_path / "b_fixed", {"name": "fixed", "scale": 8}, [[0.2, 0.2, 0.0], [0.1, 0.1, 0.0]])
    _run(tmp_path / "c_adaptive", {"name": "adaptive"}, [[0.0, 0.0, 0.0], [0.0, 0.02, 0.01]])
    _run(tmp_path / "d_fp32", {"name": "none"}, [[0.0, 0.0, 0.0]], precision="fp32")  # not an FP16 run
    assert underflow_runs.main([str(tmp_path), "--model", "ssd512", "--last", "2"]) == 0
    out = capsys.readouterr().out
    # none, layer conv1_1: mean of the last two steps (0.5 + 0.3) / 2 = 40%
    row = next(line for line in out.splitlines() if line.startswith("| backbone.conv1_1"))
    assert [c.strip() for c in row.strip("|").split("|")] == ["backbone.conv1_1", "40%", "15%", "0%"]
    assert "adaptive <= none on 3/3 layers" in out
    assert "adaptive <= fixed8 on 2/3 layers" in out  # the head: adaptive 0.5% > fixed 0%


def test_a_missing_method_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _run(tmp_path / "a_none", {"name": "none"}, [[0.1, 0.1, 0.1]])
    assert underflow_runs.main([str(tmp_path), "--model", "ssd512"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "fixed8, adaptive" in err
