"""The command line as users type it: a Hydra multirun sweep, and the error path for bad input.

These spawn ``python train.py`` (a few seconds each, mostly importing torch), so they are few and tiny.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, TINY, slow_train_command

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


def _snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``folder`` with its modification time (ns) and bytes."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*")
            if p.is_file()}  # fmt: skip


@pytest.mark.slow  # about 30 s of subprocesses; make test keeps the sweep and its error lines
def test_a_sweep_relaunched_after_a_crash_reruns_only_its_unfinished_jobs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = ["-m", *TINY_CLI, "trainer.max_steps=6", "trainer.checkpoint_every=2", "seed=0,1,2",
            f"hydra.sweep.dir={sweep}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    # every SGD step sleeps 0.3 s: job 1 is still training when the sweep is killed after its first checkpoint
    first = subprocess.Popen([*slow_train_command(0.3), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 240
    while not list(sweep.glob("1_*/checkpoints/step_2.pt")) and time.monotonic() < deadline:
        assert first.poll() is None, first.communicate()[1][-3000:]
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)  # the machine went down: no clean-up of any kind
    first.communicate(timeout=60)
    jobs = {p.name.split("_")[0]: p for p in sweep.iterdir() if p.is_dir()}
    assert sorted(jobs) == ["0", "1"], sorted(jobs)  # job 2 never started
    assert (jobs["0"] / "done").is_file() and not (jobs["1"] / "done").exists()
    finished = _snapshot(jobs["0"])

    again = _run([*args, "resume=auto"], cwd=ROOT)  # the same sweep, relaunched as it was
    assert again.returncode == 0, again.stderr[-3000:]
    assert _snapshot(jobs["0"]) == finished  # the finished job: not a file touched
    assert f"run {jobs['0']} is finished" in again.stdout
    assert f"resuming from {jobs['1'] / 'checkpoints'}" in again.stdout  # continued, not started over
    jobs = {p.name.split("_")[0]: p for p in sweep.iterdir() if p.is_dir()}
    for job in ("1", "2"):
        assert f"run {jobs[job]} is finished" not in again.stdout
        assert (jobs[job] / "done").is_file(), job
        assert json.loads((jobs[job] / "metrics.json").read_text())["steps"] == 6
        rows = (jobs[job] / "scalars.csv").read_text().splitlines()[1:]
        assert [int(r.split(",")[0]) for r in rows] == [1, 2, 3, 4, 5, 6]  # each iteration once


def test_bad_value_prints_one_error_line_and_exits_2(tmp_path: Path) -> None:
    """``train.py`` started from another folder than the checkout: a bad value is still one ``error:`` line
    and exit status 2. One row: each value's own line is checked in-process and the command line's wrapper
    by a subprocess per kind in ``tests/test_bad_input.py`` (``scaler.scale=-8``: its row
    ``negative-scale+cleanup``)."""
    run_dir, message = tmp_path / "run", "error: trainer.max_steps must be a positive integer"
    proc = _run([*TINY_CLI, "trainer.max_steps=0", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and error_lines[0].startswith(message)
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (run_dir / "metrics.json").exists()
