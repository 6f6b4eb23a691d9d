"""The command line as users type it: a Hydra multirun sweep, and the error path for bad input.

These spawn ``python train.py`` (a few seconds each, mostly importing torch), so they are few and tiny.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, TINY

TINY_CLI = [*TINY, "model=mlp"]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # one torch thread: the runs are tiny, and spare threads only contend with the test process
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_multirun_sweep_writes_one_folder_per_job(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = _run(["-m", *TINY_CLI, "scaler=fixed", "seed=0,1", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p.parent for p in sweep.glob("*/metrics.json"))
    # job folders: <job number>_<that job's overrides> (hydra.job.override_dirname)
    assert [p.name.split(",")[0].split("_")[0] for p in jobs] == ["0", "1"]
    assert jobs[0].name.endswith("seed=0,trainer.batch_size=4,trainer.eval_batch_size=8,trainer.max_steps=2")
    assert "scaler=fixed,seed=1" in jobs[1].name and "logger" not in jobs[1].name  # logger is excluded
    seeds = [json.loads((job / "metrics.json").read_text())["config"]["seed"] for job in jobs]
    assert seeds == [0, 1]
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_multirun_with_the_joblib_launcher(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = ["-m", *TINY_CLI, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "seed=0,1"]
    proc = _run([*args, f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(sweep.glob("*/metrics.json"))) == 2


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.max_steps=0", "error: trainer.max_steps must be a positive integer"),
        ("scaler=fixed scaler.scale=-8", "error: "),
    ],
    ids=["max_steps", "negative-scale"],
)
def test_bad_value_prints_one_error_line_and_exits_2(tmp_path: Path, override: str, message: str) -> None:
    run_dir = tmp_path / "run"
    proc = _run([*TINY_CLI, *override.split(), f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and error_lines[0].startswith(message)
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (run_dir / "metrics.json").exists()
