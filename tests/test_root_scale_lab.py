"""The root-scale lab (:mod:`adaloss.lab.root_scale`, ``scripts/root_scale.py``): its t-intervals, the
entry point rebuilding the committed tables from the committed JSON, one tiny run of every root end to end,
and bad input as one ``error:`` line."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from adaloss.lab.root_scale import tables, tasks
from conftest import ROOT, load_script


@pytest.fixture(scope="module")
def script():
    """``scripts/root_scale.py``, the entry point itself."""
    return load_script("root_scale")


def test_t_interval_uses_students_t_of_n_minus_1_degrees_of_freedom() -> None:
    # t(0.975, 1) = 12.706, t(0.975, 4) = 2.776 (a t table); sd of (1, 2) = 0.7071, of (1..5) = 1.5811
    mean, half = tables.t_interval([1.0, 2.0])
    assert mean == 1.5 and half == pytest.approx(12.706 * math.sqrt(0.5) / math.sqrt(2), rel=1e-6)
    mean, half = tables.t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3.0 and half == pytest.approx(2.776 * math.sqrt(2.5) / math.sqrt(5), rel=1e-6)
    assert math.isnan(tables.t_interval([4.0])[1])


def test_from_json_rebuilds_the_committed_tables(script, tmp_path: Path, capsys) -> None:
    shutil.copyfile(ROOT / "results" / "root" / "root_scale.json", tmp_path / "root_scale.json")
    script.main(["--from-json", "--out", str(tmp_path)])
    committed = (ROOT / "results" / "root" / "root_scale.md").read_text(encoding="utf-8")
    assert (tmp_path / "root_scale.md").read_text(encoding="utf-8") == committed
    assert committed in capsys.readouterr().out


def test_a_tiny_run_of_every_root_writes_runs_bench_and_tables(script, tmp_path: Path, monkeypatch) -> None:
    """ResNet-20 on 8x8 digits, 2 steps at batch 4, one seed: each root's run and cost, then the tables."""
    overrides, key, higher, label, outputs = tasks.TASKS["resnet20"]
    tiny = ("model=resnet20", "dataset=digits", "dataset.image_size=8", "trainer.batch_size=4")
    tiny += ("trainer.max_steps=2", "trainer.eval_every=2", "scaler.update_every=1")
    monkeypatch.setitem(tasks.TASKS, "resnet20", (tiny, key, higher, label, outputs))
    script.main(["--tasks", "resnet20", "--seeds", "0", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "root_scale.json").read_text(encoding="utf-8"))
    assert [(r["task"], r["root"], r["seed"]) for r in summary["runs"]] == [
        ("resnet20", root, 0) for root in tasks.ROOTS
    ]
    for run in summary["runs"]:
        assert run["recomputes"] >= 1 and run["underflow_rate"] and math.isfinite(run["metric"]), run
    assert next(r for r in summary["runs"] if r["root"] == "dynamic")["root_scale_max"] <= 65536
    assert set(summary["bench"][0]["median_s"]) == set(tasks.ROOTS)
    text = (tmp_path / "root_scale.md").read_text(encoding="utf-8")
    assert "| ResNet-20, digits (test accuracy (%))" in text and "adaptive / fixed" in text


def test_merge_reruns_one_task_and_keeps_the_others(script, tmp_path: Path, monkeypatch) -> None:
    """``--tasks resnet20 --merge``: ResNet-20's runs and cost replaced (a tiny ResNet-20 here), the GPT's
    and SSD512's kept as committed, and the tables say which machine the rerun task ran on."""
    shutil.copyfile(ROOT / "results" / "root" / "root_scale.json", tmp_path / "root_scale.json")
    committed = json.loads((tmp_path / "root_scale.json").read_text(encoding="utf-8"))
    overrides, key, higher, label, outputs = tasks.TASKS["resnet20"]
    tiny = ("model=resnet20", "dataset=digits", "dataset.image_size=8", "trainer.batch_size=4")
    tiny += ("trainer.max_steps=2", "trainer.eval_every=2", "scaler.update_every=1")
    monkeypatch.setitem(tasks.TASKS, "resnet20", (tiny, key, higher, label, outputs))
    script.main(
        ["--tasks", "resnet20", "--seeds", "0", "--merge", "--bench-rounds", "1", "--out", str(tmp_path)]
    )
    merged = json.loads((tmp_path / "root_scale.json").read_text(encoding="utf-8"))
    kept = [r for r in committed["runs"] if r["task"] != "resnet20"]
    assert merged["runs"][: len(kept)] == kept and merged["machine"] == committed["machine"]
    assert [(r["task"], r["seed"]) for r in merged["runs"][len(kept) :]] == [("resnet20", 0)] * 3
    assert [b["task"] for b in merged["bench"]] == ["gpt", "ssd", "resnet20"]
    assert merged["bench"][:2] == committed["bench"][:2] and set(merged["merged"]) == {"resnet20"}
    text = (tmp_path / "root_scale.md").read_text(encoding="utf-8")
    assert "ResNet-20, digits: rerun (`--merge`) on Machine:" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "vit"], "error: unknown task(s) vit: choose from gpt, ssd, resnet20"),
        (["--seeds", "0,x"], "error: --seeds takes integers separated by commas, got '0,x'"),
        (["--from-json"], "does not exist; run scripts/root_scale.py without --from-json first"),
        (["--merge"], "root_scale.json does not exist; run without --merge first"),
    ],
)
def test_bad_input_is_one_error_line(script, tmp_path: Path, argv, message) -> None:
    with pytest.raises(SystemExit) as error:
        script.main([*argv, "--out", str(tmp_path / "out")])
    assert str(error.value).startswith("error: ") and message in str(error.value)
    assert not (tmp_path / "out").exists()
