"""Reports of any sweep, not only the paper's: ``make tables`` summarizes a sweep whatever it ran and
``make figures`` draws its per-layer underflow and its loss scale.

The sweep is real: ``python train.py -m`` over a plain fixed-scale grid of the MLP (two scales, two seeds,
the conftest's tiny synthetic data, W&B offline), so the reports are held to what the trainer writes. What
the reports say is checked against the runs' own ``metrics.json`` and ``telemetry.jsonl``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from adaloss.lab.reports import figures as mf
from adaloss.lab.reports import tables as mt
from adaloss.lab.reports.runs import read_records
from adaloss.lab.reports.sweeps import summarize, sweeps_markdown
from conftest import ROOT, TINY
from wandb_files import offline_runs

SCALES = (16, 1024)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``train.py -m model=mlp scaler=fixed scaler.scale=16,1024 seed=0,1`` on tiny synthetic data."""
    cwd = tmp_path_factory.mktemp("sweep_cwd")
    folder = cwd / "sweep"
    overrides = [o for o in TINY if not o.startswith(("logger=", "trainer.max_steps="))]
    args = ["-m", *overrides, "model=mlp", "trainer.max_steps=5", "telemetry.every=2", "logger=wandb"]
    args += [
        "scaler=fixed",
        f"scaler.scale={','.join(map(str, SCALES))}",
        "seed=0,1",
        f"hydra.sweep.dir={folder}",
    ]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(folder.glob("*/metrics.json"))) == 4
    return folder


def _jobs(sweep: Path) -> dict[tuple[int, int], Path]:
    """``{(scale, seed): job folder}``."""
    jobs = {}
    for metrics in sweep.glob("*/metrics.json"):
        config = json.loads(metrics.read_text())["config"]
        jobs[(int(config["scaler"]["scale"]), config["seed"])] = metrics.parent
    return jobs


def _metrics(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "metrics.json").read_text())


def _telemetry(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "telemetry.jsonl").read_text().splitlines()]


def test_make_tables_summarizes_a_sweep_no_paper_table_takes(
    sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tables"
    out.mkdir()
    (out / "table1_cifar.md").write_text("an earlier call's table\n")
    assert mt.main([str(sweep), "--out", str(out)]) == []  # the MLP is in no paper table: none shown
    stdout = capsys.readouterr().out
    assert "No paper table has a finished run (`--all` shows them empty)." in stdout
    assert "## Table" not in stdout and "| —" not in stdout  # no tables of dashes
    assert sorted(p.name for p in out.iterdir()) == ["sweeps.csv", "sweeps.md", "tables.md"]  # stale one gone
    (summary,) = summarize(read_records([sweep]).records)
    assert summary.name == "sweep" and summary.runs == 4
    assert "scaler=fixed" in summary.common and "model=mlp" in summary.common
    jobs = _jobs(sweep)
    assert [row.label for row in summary.rows] == [f"scaler.scale={s}" for s in SCALES]
    for scale, row in zip(SCALES, summary.rows, strict=True):
        runs = [_metrics(jobs[(scale, seed)]) for seed in (0, 1)]
        accuracies = [m["test_accuracy"] for m in runs]
        assert row.seeds == (0, 1) and row.metric == "test_accuracy"
        assert row.stats.n == 2 and row.stats.mean == pytest.approx(statistics.fmean(accuracies))
        assert row.stats.std == pytest.approx(statistics.stdev(accuracies))
        assert row.skipped_steps == pytest.approx(statistics.fmean(m["skipped_steps"] for m in runs))
        assert row.mean_underflow == pytest.approx(statistics.fmean(m["mean_underflow_rate"] for m in runs))
    markdown = (out / "sweeps.md").read_text()
    assert "### sweep (4 runs)" in markdown and "`scaler.scale=1024`" in markdown
    assert markdown in stdout
    csv_rows = (out / "sweeps.csv").read_text().splitlines()
    assert csv_rows[0].startswith("sweep,configuration,metric,mean,std,n,diverged,seeds")
    assert csv_rows[1].startswith("sweep,scaler.scale=16,test_accuracy,") and ",2,0,0 1," in csv_rows[1]
    # --all: the five paper tables, empty, as before
    assert len(mt.main([str(sweep), "--out", str(out), "--all"])) == 5
    assert (out / "table1_cifar.md").is_file()


def test_make_figures_draws_a_plain_fixed_scale_sweep(
    sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "figures"
    assert mf.main([str(sweep), "--out", str(out)]) == 0
    assert "paper figures not made" in capsys.readouterr().err
    index = json.loads((out / "figures.json").read_text())
    assert sorted(index["sweep_figures"]) == ["sweeps/sweep_loss_scale.png", "sweeps/sweep_underflow.png"]
    for name, entry in index["sweep_figures"].items():
        assert (out / name).stat().st_size > 10_000
        assert entry["configurations"] == [f"scaler.scale={s}" for s in SCALES] and len(entry["runs"]) == 4
    runs, _ = mf.read_runs([sweep])
    (group,) = mf.sweep_groups(runs)
    jobs = _jobs(sweep)
    # underflow: per configuration, the mean over its seeds of each layer's rate at the last iteration
    layers, curves = mf.sweep_underflow_data(group)
    last = {key: _telemetry(folder)[-1] for key, folder in jobs.items()}
    assert all(line["step"] == 5 for line in last.values())  # the last iteration is sampled
    assert layers == list(last[(16, 0)]["underflow_rate"])[::-1]  # ID 0: nearest the loss
    for scale in SCALES:
        want = [
            statistics.fmean(last[(scale, seed)]["underflow_rate"][layer] for seed in (0, 1))
            for layer in layers
        ]
        assert curves[f"scaler.scale={scale}"] == pytest.approx(want)
    # loss scale: the fixed scale at every telemetry step (iterations 0, 2, 4 -> steps 1, 3, 5)
    scales = {c.label: c for c in mf.sweep_scale_data(group)}
    for scale in SCALES:
        curve = scales[f"scaler.scale={scale}"]
        assert curve.steps == [1, 3, 5] and curve.value == [float(scale)] * 3 and curve.low is None


def test_the_sweeps_jobs_share_one_wandb_group_and_carry_their_scale(sweep: Path) -> None:
    for (scale, _seed), folder in _jobs(sweep).items():
        (run,) = offline_runs(folder)
        assert run.run.run_group == "sweep"  # the sweep folder, relative to where train.py ran
        assert list(run.run.tags) == ["fp16", "fixed", f"scale={scale}"]


def _write(folder: Path, value: float | None, scale: float, seed: int, diverged: bool = False) -> None:
    """A hand-made run folder: no ``.hydra/``, so its configuration is read from the config."""
    folder.mkdir(parents=True)
    config = {
        "seed": seed,
        "model": {"name": "mlp"},
        "dataset": {"name": "digits"},
        "precision": {"name": "fp16"},
        "scaler": {"name": "fixed", "scale": scale},
        "paths": {"output_dir": str(folder)},
    }
    record = {"test_accuracy": value, "diverged": diverged, "skipped_steps": seed, "config": config}
    (folder / "metrics.json").write_text(json.dumps(record))
    (folder / "done").write_text("")  # finished: the trainer's marker


def test_runs_without_overrides_are_told_apart_by_their_config(tmp_path: Path) -> None:
    _write(tmp_path / "grid" / "a", 90.0, 16, 0)
    _write(tmp_path / "grid" / "b", 92.0, 16, 1)
    _write(tmp_path / "grid" / "c", None, 1024, 0, diverged=True)
    (summary,) = summarize(read_records([tmp_path]).records)
    assert summary.name == "grid" and summary.common == ()
    assert [(r.label, r.stats.n, r.stats.n_diverged) for r in summary.rows] == [
        ("scaler.scale=16", 2, 0),
        ("scaler.scale=1024", 0, 1),
    ]
    assert summary.rows[0].stats.mean == pytest.approx(91.0) and summary.rows[0].skipped_steps == 0.5
    # a diverged run stopped early: its skipped steps and underflow are not averaged (—, not 0)
    assert summary.rows[1].skipped_steps is None and summary.rows[1].mean_underflow is None
    lines = sweeps_markdown([summary]).splitlines()
    row = next(line for line in lines if line.startswith("| `scaler.scale=1024`"))
    assert [c.strip() for c in row.strip("|").split("|")] == [
        "`scaler.scale=1024`",
        "diverged (n=1)",
        "0",
        "—",
        "—",
    ]


def test_sweep_figures_leave_diverged_runs_out_of_the_end_of_training(tmp_path: Path) -> None:
    """A diverged run stopped early: its last underflow is not the end of training; its loss scale
    history still counts, up to where it stopped."""
    layers = ["fc1", "fc2"]

    def run(name: str, seed: int, steps: list[int], rate: float, diverged: bool) -> None:
        _write(tmp_path / "grid" / name, None if diverged else 90.0, 16, seed, diverged=diverged)
        lines = [
            {"step": s, "underflow_rate": dict.fromkeys(layers, rate), "loss_scale": 16.0} for s in steps
        ]
        (tmp_path / "grid" / name / "telemetry.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in lines)
        )

    run("0_seed=0", 0, [1, 101, 200], 0.25, diverged=False)
    run("1_seed=1", 1, [1, 51], 0.75, diverged=True)
    runs, _ = mf.read_runs([tmp_path])
    (group,) = mf.sweep_groups(runs)
    layers_back, curves = mf.sweep_underflow_data(group)
    assert layers_back == ["fc2", "fc1"] and curves == {"(every run) (1 diverged left out)": [0.25, 0.25]}
    (scale,) = mf.sweep_scale_data(group)
    assert scale.steps == [1, 51, 101, 200] and scale.value == [16.0] * 4
