"""``adaloss.lab.reports.tables`` (``scripts/make_tables.py``): a golden-file test on a committed sample of
runs, and the rules it applies.

The sample (``tests/data/tables/runs/``, written once by ``tests/data/tables/make_sample_runs.py``) is a few
dozen ``metrics.json`` records laid out as Hydra sweeps; ``tests/data/tables/expected/`` is the script's
output on it, read and checked by hand. A deliberate change to the output regenerates it with

    .venv/bin/python scripts/make_tables.py tests/data/tables/runs --out tests/data/tables/expected --all

and the diff is reviewed like code. The last test runs a real (tiny) sweep of an experiment config through
``train.py`` and reads it back, so the script is held to what the trainer actually writes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from adaloss.lab.reports import tables as mt
from conftest import ROOT, TINY

DATA = ROOT / "tests" / "data" / "tables"


# ---- building records --------------------------------------------------------------------------------------


def _config(
    model: str = "resnet20",
    dataset: str = "cifar10",
    precision: str = "fp16",
    scaler: str = "fixed",
    scale: float | None = 128,
    seed: int = 0,
    batch_size: int = 128,
    max_steps: int | None = None,
) -> dict[str, Any]:
    scaler_cfg: dict[str, Any] = {"name": scaler}
    if scaler == "fixed":
        scaler_cfg["scale"] = scale
    return {
        "seed": seed,
        "name": "whatever",
        "device": "auto",
        "model": {"name": model},
        "dataset": {"name": dataset},
        "precision": {"name": precision},
        "scaler": scaler_cfg,
        "trainer": {"batch_size": batch_size, "steps": 64000, "max_steps": max_steps, "num_workers": 0},
        "paths": {"output_dir": f"/somewhere/{seed}"},
    }


def _record(value: float | None, metric: str = "test_accuracy", **config: Any) -> dict[str, Any]:
    return {metric: value, "steps": 64000, "skipped_steps": 0, "config": _config(**config)}


def _run(value: float | None, source: str = "x", **config: Any):
    metric = "map" if str(config.get("model", "")).startswith("ssd") else "test_accuracy"
    return mt.run_from_record(_record(value, metric, **config), source)


def _write_run(folder: Path, record: dict[str, Any] | None) -> Path:
    """A Hydra job folder; ``record=None`` is a run that crashed before writing ``metrics.json``."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("- seed=0\n")
    if record is not None:
        (folder / "metrics.json").write_text(json.dumps(record))
        (folder / "done").write_text("")  # finished: the trainer's marker
    return folder


def _table(name: str, runs, found_only: bool = False):
    spec = next(s for s in mt.TABLES if s.name == name)
    return mt.build_table(spec, runs, found_only)


def _cells(table, key) -> dict[str, str]:
    entries = dict(table.rows)[key]
    return {c.label: mt.format_cell(e) for c, e in zip(table.columns, entries, strict=True)}


# ---- the golden file ---------------------------------------------------------------------------------------


def test_output_on_the_committed_sample_matches_the_golden_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tables = mt.main([str(DATA / "runs"), "--out", str(tmp_path), "--all"])
    out, err = capsys.readouterr()
    expected = DATA / "expected"
    names = sorted(p.name for p in expected.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    for name in names:
        assert (tmp_path / name).read_text(encoding="utf-8") == (expected / name).read_text(
            encoding="utf-8"
        ), f"{name} differs from tests/data/tables/expected/{name} (regenerate: see this module's docstring)"
    assert out == (expected / "tables.md").read_text(encoding="utf-8")
    assert [t.spec.name for t in tables] == [
        "table1_cifar",
        "table2_imagenet",
        "table3_ssd",
        "table4_fixed_scales",
        "table5_ssd_fixed",
    ]
    # what was passed over is named on stderr: the crashed job, the repeated run, the runs in no table
    assert "unfinished: " in err and "23_dataset=cifar100" in err
    assert "counted once (a later run repeats it): " in err
    assert "precision bf16 is in no paper table" in err
    assert "no table has a fixed column for resnet50" in err


def test_the_golden_sample_covers_what_it_claims() -> None:
    """Guards the sample itself: if it is regenerated, the cases the tests rely on must still be in it."""
    records = [json.loads(p.read_text()) for p in (DATA / "runs").rglob("metrics.json")]
    assert 30 <= len(records) <= 80
    crashed = [p for p in (DATA / "runs").rglob(".hydra") if not (p.parent / "metrics.json").exists()]
    assert len(crashed) == 1
    assert any(r.get("map", 0) is None for r in records)  # a detection run whose mAP was NaN
    assert any(r.get("diverged") is True for r in records)
    expected = (DATA / "expected" / "tables.md").read_text()
    assert "diverged (n=1) · paper diverged" in expected
    assert "93.10 (n=1, 1 diverged)" in expected
    assert "— · paper 93.57" in expected  # ResNet-110 never ran: missing, not zero
    assert "| digits " in expected  # a row the paper does not have


def test_table_names_are_the_experiment_names() -> None:
    experiments = {p.stem for p in (ROOT / "configs" / "experiment").glob("table*.yaml")}
    assert {s.name for s in mt.TABLES} == experiments


# ---- seeds, best/worst, missing vs zero, diverged ----------------------------------------------------------


def test_seeds_aggregate_to_mean_sample_std_and_n() -> None:
    runs = [_run(v, seed=s) for s, v in enumerate((92.1, 92.3, 92.5))]
    stats = mt.Stats.of(runs)
    assert (stats.n, stats.n_diverged) == (3, 0)
    assert stats.mean == pytest.approx(92.3) and stats.std == pytest.approx(0.2)  # ddof=1
    assert mt.format_cell(mt.Entry(stats, 92.26)) == "92.30 ± 0.20 (n=3) · paper 92.26 · Δ +0.04"
    one = mt.Stats.of(runs[:1])
    assert one.std is None and mt.format_cell(mt.Entry(one, None)) == "92.10 (n=1)"


def test_best_and_worst_fixed_scale_are_chosen_by_mean_over_seeds() -> None:
    runs = [
        # scale 16: one great seed, one poor one (mean 92.0); scale 4096: mean 92.2; scale 128: mean 91.9
        _run(92.6, scale=16, seed=0),
        _run(91.4, scale=16, seed=1),
        _run(92.2, scale=4096, seed=0),
        _run(92.2, scale=4096, seed=1),
        _run(91.9, scale=128, seed=0),
        _run(91.9, scale=128, seed=1),
        _run(90.0, scale=1, seed=0),  # lowest of all, but scale 1 is not one of Table 1's candidates
    ]
    cells = _cells(_table("table1_cifar", runs), ("cifar10", "resnet20"))
    assert cells["Fixed (best)"].startswith("92.20 ± 0.00 (n=2, S=4096) · paper 92.24")  # not the best seed's
    assert cells["Fixed (worst)"].startswith("91.90 ± 0.00 (n=2, S=128) · paper 92.16")
    # Table 4 shows every scale, 1 included
    assert _cells(_table("table4_fixed_scales", runs), ("cifar10", "resnet20"))["1"].startswith("90.00 (n=1)")


def test_fixed_ties_go_to_the_smaller_scale_and_diverged_ranks_last() -> None:
    stats = {
        ("fixed", 8192.0): mt.Stats.of([_run(92.24, scale=8192)]),
        ("fixed", 4096.0): mt.Stats.of([_run(92.24, scale=4096)]),
        ("fixed", 16.0): mt.Stats.of([_run(None, scale=16)]),
        ("adaptive", None): mt.Stats.of([_run(99.0, scaler="adaptive")]),  # not a fixed scale: ignored
    }
    best = mt.pick_fixed(stats, best=True)
    worst = mt.pick_fixed(stats, best=False)
    assert best[0] == 4096.0 and best[1].mean == pytest.approx(92.24)
    assert worst[0] == 16.0 and worst[1].all_diverged
    assert mt.pick_fixed({("fp32", None): stats[("adaptive", None)]}, best=True) is None


def test_table3_best_fixed_may_be_any_scale_run() -> None:
    runs = [_run(24.6, model="ssd512", dataset="voc", scale=8, batch_size=8)]
    runs.append(_run(79.1, model="ssd512", dataset="voc", scale=2048, batch_size=8))
    cells = _cells(_table("table3_ssd", runs), ("voc", "ssd512", 8))
    assert cells["Fixed (best)"] == "79.10 (n=1, S=2048) · paper 79.11 · Δ -0.01"


def test_missing_runs_show_as_missing_and_a_real_zero_as_zero() -> None:
    runs = [_run(0.0, scaler="none", dataset="cifar100")]  # a genuine 0% accuracy is a number
    table = _table("table1_cifar", runs)
    assert _cells(table, ("cifar100", "resnet20"))["None"] == "0.00 (n=1) · paper 68.31 · Δ -68.31"
    cifar10 = _cells(table, ("cifar10", "resnet20"))
    assert cifar10["FP32"] == "— · paper 91.25" and cifar10["Fixed (best)"] == "— · paper 92.24"
    csv_rows = mt.table_csv(table).splitlines()
    header = csv_rows[0].split(",")
    cifar10_csv = dict(zip(header, csv_rows[1].split(","), strict=True))
    assert cifar10_csv["FP32 mean"] == "" and cifar10_csv["FP32 n"] == "0" and cifar10_csv["FP32 delta"] == ""
    assert cifar10_csv["FP32 paper"] == "91.25"
    # --found-only keeps only rows with runs
    assert [key for key, _ in _table("table1_cifar", runs, found_only=True).rows] == [
        ("cifar100", "resnet20")
    ]


@pytest.mark.parametrize(
    ("record_changes", "diverged"),
    [
        ({"test_accuracy": None}, True),  # the trainer writes NaN as null
        ({"test_accuracy": float("nan")}, True),
        ({"test_accuracy": 10.0, "diverged": True}, True),  # flagged by the trainer
        ({"test_accuracy": 10.0, "diverged": False}, False),
        ({"test_accuracy": 0.0}, False),
    ],
)
def test_diverged_runs(record_changes: dict[str, Any], diverged: bool) -> None:
    record = {**_record(92.0), **record_changes}
    assert mt.run_from_record(record, "x").diverged is diverged


def test_partly_and_wholly_diverged_cells() -> None:
    partly = mt.Stats.of([_run(93.1, seed=0), _run(None, seed=1)])
    assert mt.format_cell(mt.Entry(partly, 93.19)) == "93.10 (n=1, 1 diverged) · paper 93.19 · Δ -0.09"
    wholly = mt.Stats.of([_run(None, seed=0), _run(None, seed=1)])
    assert mt.format_cell(mt.Entry(wholly, "diverged")) == "diverged (n=2) · paper diverged"
    assert mt.format_cell(mt.Entry(wholly, 79.04, scale=16.0)) == "diverged (n=2, S=16) · paper 79.04"


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"precision": "bf16"}, "precision bf16"),
        ({"model": "mlp"}, "model mlp"),
        ({"precision": "fp32", "scaler": "fixed"}, "FP32 with scaler fixed"),
        ({"scale": None}, "not a positive number"),
    ],
)
def test_runs_outside_the_tables_are_skipped_with_a_reason(config: dict[str, Any], reason: str) -> None:
    with pytest.raises(mt.Skip, match=reason):
        mt.run_from_record(_record(92.0, **config), "x")
    with pytest.raises(mt.Skip, match="no config"):
        mt.run_from_record({"test_accuracy": 92.0}, "x")
    with pytest.raises(mt.Skip, match="no map"):
        mt.run_from_record(_record(79.0, model="ssd512", dataset="voc"), "x")  # test_accuracy, no map


# ---- reading folders ---------------------------------------------------------------------------------------


def test_a_crashed_run_without_metrics_json_is_never_counted(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    _write_run(sweep / "0_seed=0", _record(92.0, seed=0))
    crashed = _write_run(sweep / "1_seed=1", None)
    (crashed / "train.log").write_text("Traceback ...\n")
    # the atomic writer's temporary file, left by a crash mid-write, is not metrics.json either
    (crashed / ".metrics.json.abc.tmp").write_text('{"test_accuracy": 0.0')
    collection = mt.read_folders([sweep])
    assert [r.seed for r in collection.runs] == [0]
    assert collection.unfinished == [str(crashed.resolve())]
    cells = _cells(_table("table1_cifar", collection.runs), ("cifar10", "resnet20"))
    assert cells["Fixed (best)"].startswith("92.00 (n=1, S=128)")


def test_a_run_without_the_done_marker_is_never_counted(tmp_path: Path) -> None:
    """``metrics.json`` alone is not a finished run: the trainer writes ``done`` after it (a run killed
    between the two, or a record copied without its marker, is listed as unfinished, not tabulated)."""
    from adaloss.lab.reports.runs import DONE_FILE as READ_MARKER
    from adaloss.runner.engine.run_folder import DONE_FILE

    assert READ_MARKER == DONE_FILE  # the readers look for the file the trainer writes
    sweep = tmp_path / "sweep"
    _write_run(sweep / "0_seed=0", _record(92.0, seed=0))
    half = _write_run(sweep / "1_seed=1", _record(10.0, seed=1))
    (half / "done").unlink()
    collection = mt.read_folders([sweep])
    assert [r.seed for r in collection.runs] == [0]
    assert collection.unfinished == [str(half.resolve())]


def test_a_repeated_configuration_and_seed_counts_once_the_latest_wins(tmp_path: Path) -> None:
    _write_run(tmp_path / "2025-01-01_00-00-00" / "0_a", _record(91.0, seed=0))
    _write_run(tmp_path / "2025-02-01_00-00-00" / "0_a", _record(93.0, seed=0))
    _write_run(tmp_path / "2025-02-01_00-00-00" / "1_a", _record(92.0, seed=1))
    # a shortened run of the same seed is a different configuration, not a repeat
    _write_run(tmp_path / "2025-03-01_00-00-00" / "0_a", _record(80.0, seed=0, max_steps=100))
    collection = mt.read_folders([tmp_path])
    tables, unused = mt.make_tables(collection)
    assert not unused and len(collection.runs) == 3
    assert collection.duplicates == [
        str((tmp_path / "2025-01-01_00-00-00" / "0_a" / "metrics.json").resolve())
    ]
    table1 = tables[0]
    assert _cells(table1, ("cifar10", "resnet20"))["Fixed (best)"].startswith("88.33 ± 7.23 (n=3, S=128)")
    assert table1.notes == [
        "CIFAR-10 ResNet-20: its runs differ in trainer.max_steps (100, null); they are averaged together."
    ]


def test_by_default_only_tables_and_rows_with_runs_are_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for seed, value in enumerate((92.0, 91.0)):
        _write_run(tmp_path / "sweep" / f"{seed}_seed={seed}", _record(value, scale=16, seed=seed))
    out = tmp_path / "out"
    shown = mt.main([str(tmp_path / "sweep"), "--out", str(out)])
    assert [t.spec.name for t in shown] == ["table1_cifar", "table4_fixed_scales"]  # fixed 16 is in both
    assert all([key for key, _ in t.rows] == [("cifar10", "resnet20")] for t in shown)
    stdout = capsys.readouterr().out
    assert "Table 2" not in stdout and "ResNet-56" not in stdout and "CIFAR-100" not in stdout
    assert "91.50 ± 0.71 (n=2, S=16) · paper 92.24" in stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "sweeps.csv",
        "sweeps.md",
        "table1_cifar.csv",
        "table1_cifar.md",
        "table4_fixed_scales.csv",
        "table4_fixed_scales.md",
        "tables.md",
    ]


def test_command_line_errors_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        ([], "error: give at least one results folder"),
        ([str(tmp_path / "nope")], "error: no such folder"),
        ([str(tmp_path)], "error: no finished run (metrics.json)"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            mt.main([*argv, "--out", str(tmp_path / "out")])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1


# ---- W&B ---------------------------------------------------------------------------------------------------


class _FakeRun:
    def __init__(self, run_id: str, state: str, summary: dict[str, Any], config: dict[str, Any]) -> None:
        self.id, self.state, self.config = run_id, state, config
        self.path = ["me", "adaloss", run_id]
        self.summary_metrics = summary


class _FakeApi:
    def __init__(self, runs: list[_FakeRun]) -> None:
        self._runs = runs
        self.asked: list[str] = []

    def runs(self, path: str) -> list[_FakeRun]:
        self.asked.append(path)
        return self._runs


def test_wandb_runs_are_read_from_summary_and_config() -> None:
    api = _FakeApi(
        [
            _FakeRun("b", "finished", {"test/accuracy": 92.5, "_step": 64000}, _config(seed=1)),
            _FakeRun("a", "finished", {"test_accuracy": 92.1}, _config(seed=0)),
            _FakeRun("c", "crashed", {"test/accuracy": 12.0}, _config(seed=2)),
            _FakeRun("d", "finished", {"test/map": None}, _config("ssd512", "voc", scaler="none")),
        ]
    )
    collection = mt.read_wandb("me/adaloss", api=api)
    assert api.asked == ["me/adaloss"]
    assert [(r.source, r.seed, r.value) for r in collection.runs] == [
        ("wandb:me/adaloss/a", 0, 92.1),
        ("wandb:me/adaloss/b", 1, 92.5),
        ("wandb:me/adaloss/d", 0, None),  # NaN mAP: diverged
    ]
    assert collection.unfinished == ["wandb:me/adaloss/c"]


def test_wandb_without_a_network_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("Max retries exceeded with url: https://api.wandb.ai/graphql")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(Api=unreachable))
    with pytest.raises(
        mt.ReportError, match=r"could not read the W&B runs of 'me/adaloss' \(ConnectionError"
    ):
        mt.read_wandb("me/adaloss")


# ---- end to end: a real sweep of an experiment config ------------------------------------------------------


def test_a_real_experiment_sweep_feeds_the_tables(tmp_path: Path) -> None:
    """``python train.py -m experiment=table4_fixed_scales`` shrunk to two 2-iteration jobs on synthetic data;
    what the trainer writes is what the script reads."""
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        "experiment=table4_fixed_scales",
        "model=resnet20",
        "variant=fixed1,fixed16",  # replaces the grid's 7 scales; seed=0 replaces its 4 seeds
        "seed=0",
        *TINY,
        f"hydra.sweep.dir={sweep}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(sweep.glob("*/metrics.json"))) == 2
    collection = mt.read_folders([sweep])
    assert not collection.skipped and not collection.unfinished
    assert sorted((r.model, r.dataset, r.method, r.scale, r.seed) for r in collection.runs) == [
        ("resnet20", "synthetic", "fixed", 1.0, 0),
        ("resnet20", "synthetic", "fixed", 16.0, 0),
    ]
    tables, unused = mt.make_tables(collection, found_only=True)
    assert not unused
    table4 = next(t for t in tables if t.spec.name == "table4_fixed_scales")
    cells = _cells(table4, ("synthetic", "resnet20"))
    for scale in ("1", "16"):
        value = float(cells[scale].split(" ")[0])
        assert 0.0 <= value <= 100.0 and math.isfinite(value) and cells[scale].endswith("(n=1)")
