"""The FP8 lab (:mod:`adaloss.lab.fp8`, ``scripts/fp8_lab.py``): the confidence-interval arithmetic of its
table on hand-made runs, the entry point's ``--smoke`` mode end to end (table, CSV, JSON, figures; a second
call resumes and runs nothing), the refusal of a runs file made with other settings, and the docs page
showing the committed table."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from adaloss.lab.fp8 import cells, stats, tables
from adaloss.lab.fp8 import runs as fp8_runs
from conftest import ROOT, load_script


@pytest.fixture(scope="module")
def lab():
    """``scripts/fp8_lab.py``, the entry point itself."""
    return load_script("fp8_lab")


def _row(cell: str, seed: int, value: float | None, **extra) -> dict:
    return {
        "model": "gpt",
        "cell": cell,
        "seed": seed,
        "value": value,
        "diverged": value is None,
        "skipped_steps": 0,
        "underflow_rate": {},
        "saturation_rate": {},
        **extra,
    }


def test_gap_to_fp32_is_paired_by_seed_with_a_t_interval() -> None:
    # FP32 1..5; the cell is FP32 + (0.5, 0.4, 0.6, 0.5, 0.5) seed by seed. Paired differences: mean 0.5,
    # sample sd sqrt((0 + 0.01 + 0.01 + 0 + 0) / 4) = 0.0707107, t(0.975, 4) = 2.776445 (a t table), so the
    # half-width is 2.776445 * 0.0707107 / sqrt(5) = 0.087799. Unpaired, the spread of FP32's own values
    # (sd 1.58) would swamp the gap; with z = 1.96 or sd over n the half-width would be 0.0620 / 0.0785.
    # The cell's own values 1.5, 2.4, 3.6, 4.5, 5.5: mean 3.5, squared deviations summing to 10.22.
    fp32 = [_row("fp32", s, float(s + 1)) for s in range(5)]
    cell = [_row("E4M3/none/global", s, s + 1 + d) for s, d in enumerate((0.5, 0.4, 0.6, 0.5, 0.5))]
    rows = list(reversed(fp32 + cell))  # the order of the file does not matter
    summary = stats.summarize(rows, "gpt", cells.Cell("E4M3/none/global", (), "E4M3", "none", "global"))
    assert summary["gap"] == pytest.approx(0.5) and summary["pairs"] == 5
    assert summary["gap_ci"] == pytest.approx(0.087799, abs=2e-6) and summary["separated"]
    assert summary["mean"] == pytest.approx(3.5) and summary["sd"] == pytest.approx(math.sqrt(10.22 / 4))
    # a seed whose cell run diverged (value None) leaves the pairs; one whose FP32 run is missing too
    rows = [*fp32[1:], *cell[:4], _row("E4M3/none/global", 4, None)]
    summary = stats.summarize(rows, "gpt", cells.Cell("E4M3/none/global", (), "E4M3", "none", "global"))
    assert summary["pairs"] == 3 and summary["diverged"] == 1
    assert summary["gap"] == pytest.approx(0.5)  # seeds 1, 2, 3: 0.4, 0.6, 0.5
    # t(0.975, 2) = 4.302653; sd of (0.4, 0.6, 0.5) = 0.1
    assert summary["gap_ci"] == pytest.approx(4.302653 * 0.1 / math.sqrt(3), abs=1e-6)
    # two seeds either side of zero: the interval contains 0 and the table says it cannot separate them
    mixed = [*fp32[:2], _row("bf16", 0, 1.1), _row("bf16", 1, 1.9)]
    summary = stats.summarize(mixed, "gpt", cells.Cell("bf16", ()))
    assert summary["gap"] == pytest.approx(0.0) and not summary["separated"]
    assert stats.t_interval([2.0]) == (2.0, pytest.approx(math.nan, nan_ok=True), 1)


def test_scaler_effects_pair_the_scalers_under_the_same_quantizer() -> None:
    rows = [
        _row(f"E5M2/{scaler}/tensor_current", s, v + s)
        for s in range(3)
        for scaler, v in (("none", 1.0), ("adaptive", 1.0), ("dynamic", 2.0))
    ]
    effects = {
        e["contrast"]: e for e in stats.scaler_effects(rows, "gpt") if e["quantizer"] == "tensor_current"
    }
    assert effects["adaptive - none"]["diff"] == 0.0 and not effects["adaptive - none"]["separated"]
    assert effects["dynamic - none"]["diff"] == pytest.approx(1.0) and effects["dynamic - none"]["ci"] == 0.0
    table = tables.effects_table(stats.scaler_effects(rows, "gpt"), "gpt")
    assert "| E5M2 | tensor_current | +1.000 ± 0.000 | +0.000 ± 0.000 ~ | -1.000 ± 0.000 |" in table


def test_underflow_columns_are_over_the_layers_every_fp8_cell_measures() -> None:
    # the adaptive runs also measure the attention products they scale (attn.scores here, 50% underflow);
    # the other scalers' runs do not, so the table's mean and worst layer leave it out (it stays per layer)
    rates = {"fc": 0.1, "attn.c_attn": 0.3}
    rows = [
        _row(
            "E4M3/none/global", 0, 1.0, underflow_rate=rates, saturation_rate={"fc": 0.0, "attn.c_attn": 0.0}
        ),
        _row("E4M3/adaptive/global", 0, 1.0, underflow_rate={**rates, "attn.scores": 0.5}),
        _row("fp32", 0, 1.0, underflow_rate={"fc": 0.9}),  # FP16's counterfactual: not an FP8 cell
    ]
    layers = stats.common_layers(rows, "gpt")
    assert layers == {"fc", "attn.c_attn"}
    summary = stats.summarize(
        rows, "gpt", cells.Cell("E4M3/adaptive/global", (), "E4M3", "adaptive", "global"), layers
    )
    assert summary["underflow_mean"] == pytest.approx(0.2) and summary["underflow_max"] == 0.3
    assert (
        summary["underflow_max_layer"] == "attn.c_attn"
        and summary["underflow_by_layer"]["attn.scores"] == 0.5
    )
    fp32 = stats.summarize(rows, "gpt", cells.Cell("fp32", ()), layers)
    assert math.isnan(fp32["underflow_mean"]) and fp32["underflow_by_layer"] == {}


@pytest.mark.slow  # 10 s: make test-full runs it; make test keeps the lab's statistics and table tests
def test_smoke_run_writes_the_table_and_figures_and_resumes(lab, tmp_path: Path, monkeypatch) -> None:
    out, runs = tmp_path / "fp8", tmp_path / "runs"
    lab.main(["--smoke", "--out", str(out), "--runs-dir", str(runs)])
    for model in cells.MODELS:
        rows = [json.loads(line) for line in (out / f"runs_{model}.jsonl").read_text().splitlines()]
        assert sorted((r["cell"], r["seed"]) for r in rows) == sorted(
            (c, s) for c in cells.SMOKE_CELLS for s in (0, 1)
        )
        assert all(r["steps"] == 2 for r in rows)
    fp8 = [r for r in rows if r["cell"] == "E4M3/adaptive/mx_block_ceil"]
    assert fp8[0]["underflow_rate"] and fp8[0]["saturation_rate"].keys() == fp8[0]["underflow_rate"].keys()
    table = (out / "fp8_lab.md").read_text()
    assert "gap to FP32, 95% CI" in table and "| E4M3/none/global | 2 |" in table
    with open(out / "fp8_lab.csv", newline="") as f:
        assert {r["cell"] for r in csv.DictReader(f)} == set(cells.SMOKE_CELLS)
    assert json.loads((out / "fp8_lab.json").read_text())["summary"]
    assert (out / "fp8_gap.png").stat().st_size > 0 and (out / "fp8_layers.png").stat().st_size > 0

    def no_run(*args, **kwargs):
        raise AssertionError("a finished run ran again")

    monkeypatch.setattr(fp8_runs, "run_one", no_run)
    lab.main(["--smoke", "--out", str(out), "--runs-dir", str(runs)])  # every run is there: nothing runs
    again = (out / "fp8_lab.md").read_text()
    assert again.splitlines()[1:] == table.splitlines()[1:]  # the first line: the machine, load and date


def test_a_runs_file_of_other_settings_is_one_error_line(lab, tmp_path: Path, capsys) -> None:
    (tmp_path / "runs_gpt.jsonl").write_text(json.dumps({**_row("fp32", 0, 1.0), "settings": "other"}) + "\n")
    with pytest.raises(SystemExit) as error:
        lab.main(["--models", "gpt", "--out", str(tmp_path), "--report-only"])
    assert str(error.value).startswith("error: ") and "other settings" in str(error.value)
    with pytest.raises(SystemExit) as error:
        lab.main(["--models", "gpt,vit", "--report-only"])
    assert str(error.value).startswith("error: unknown model(s) vit")


def test_the_docs_page_shows_the_committed_table() -> None:
    lab_md = (ROOT / "results" / "fp8" / "fp8_lab.md").read_text(encoding="utf-8")
    page = (ROOT / "docs" / "fp8.md").read_text(encoding="utf-8")
    region = page.split("<!-- fp8-lab: table -->\n", 1)[1].split("<!-- end fp8-lab: table -->", 1)[0]
    assert region == lab_md, (
        "docs/fp8.md is stale: run python scripts/fp8_lab.py --report-only --docs docs/fp8.md"
    )
    for figure in ("fp8_gap.png", "fp8_layers.png"):
        assert (ROOT / "docs" / "assets" / "fp8" / figure).read_bytes() == (
            ROOT / "results" / "fp8" / figure
        ).read_bytes()
