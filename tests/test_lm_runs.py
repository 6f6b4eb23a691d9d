"""``scripts/lm_runs.py --merge``: a variant added to an earlier table keeps the other variants' runs, each
with the machine it was measured on, and refuses a table made with other overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def lm_runs():
    return load_script("lm_runs")


def _machine(load: float) -> dict:
    return {
        "cpu": "AMD EPYC",
        "cores": 2,
        "torch": "2.14.1",
        "threads": 1,
        "load_avg_at_start": [load, load, load],
        "date": "2026-11-24 00:00 UTC",
    }


def _run(variant: str, seed: int) -> dict:
    return {
        "variant": variant,
        "seed": seed,
        "start": 5.4,
        "val_loss": 2.2,
        "best_val_loss": 2.2,
        "perplexity": 9.0,
        "skipped_steps": 0,
        "steps": 400,
        "mean_underflow_rate": 0.05,
        "wall_time_s": 60.0,
    }


def test_merge_keeps_the_other_variants_with_their_machine(lm_runs, tmp_path: Path) -> None:
    path = tmp_path / "lm_runs.json"
    earlier = {"machine": _machine(8.5), "overrides": [], "runs": [_run(v, 0) for v in ("fp32", "adaptive")]}
    path.write_text(json.dumps(earlier))
    kept = lm_runs.kept_runs(path, ["adaptive"], [])
    assert [r["variant"] for r in kept] == ["fp32"] and kept[0]["machine"] == _machine(8.5)
    now = {**_run("adaptive", 0), "machine": _machine(3.9)}
    header = lm_runs.headers([*kept, now])
    assert header.splitlines() == [
        f"fp32: {lm_runs.header_line(_machine(8.5))}",
        f"adaptive: {lm_runs.header_line(_machine(3.9))}",
    ]
    assert lm_runs.headers([now]) == lm_runs.header_line(_machine(3.9))  # one machine: no variant names
    table = lm_runs.table([*kept, now])
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:]] == ["fp32", "adaptive"]
    assert lm_runs.kept_runs(tmp_path / "missing.json", ["adaptive"], []) == []


def test_merge_refuses_a_table_made_with_other_overrides(lm_runs, tmp_path: Path) -> None:
    path = tmp_path / "lm_runs.json"
    path.write_text(json.dumps({"machine": _machine(1), "overrides": [], "runs": [_run("fp32", 0)]}))
    with pytest.raises(
        SystemExit, match=r"^error: .* was made with overrides \[\], not \['model.tie_weights"
    ):
        lm_runs.kept_runs(path, ["adaptive"], ["model.tie_weights=false"])
    path.write_text("not json")
    with pytest.raises(SystemExit, match="is not an lm_runs.json"):
        lm_runs.kept_runs(path, ["adaptive"], [])


def test_an_unknown_variant_is_one_error_line_before_any_run(lm_runs, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="^error: unknown variant"):
        lm_runs.main(["--variants", "adaptive,bogus", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
