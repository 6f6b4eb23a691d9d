"""The run's own log: a line every ``trainer.log_every`` iterations in ``train.log`` with no terminal,
``scalars.csv`` with every iteration, a start line that states the schedule actually run, a progress bar
that stays readable at 80 columns, and the run name on the log lines of a sweep."""

from __future__ import annotations

import csv
import io
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import DictConfig

from adaloss.runner.engine import train
from adaloss.runner.logging.progress import MIN_BAR, ProgressBar

ROOT = Path(__file__).resolve().parents[1]


def _records(caplog: pytest.LogCaptureFixture, pattern: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if re.search(pattern, r.getMessage())]


def test_a_line_every_log_every_iterations_and_every_iteration_in_scalars_csv(
    make_cfg: Callable[..., DictConfig], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    inject = "faults.inject=[{step:3,layer:fc,value:inf}]"  # iteration 3 is skipped
    with caplog.at_level(logging.INFO, logger="adaloss"):
        metrics = train(make_cfg("trainer.max_steps=6", "trainer.log_every=2", "scaler=fixed", inject))
    lines = _records(caplog, r"^iteration \d+/6: loss")
    assert [int(re.match(r"iteration (\d+)", line).group(1)) for line in lines] == [2, 4, 6]
    pattern = r"loss \d+\.\d{4}, acc \d+\.\d%, lr [\d.e-]+, scale 128, skipped N, \d+ img/s$"
    for line, skipped in zip(lines, "011", strict=True):
        assert re.search(pattern.replace("N", skipped), line), line

    with open(tmp_path / "scalars.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert list(rows[0]) == ["step", "loss", "lr", "loss_scale", "skipped", "skipped_steps", "overflow_count"]
    assert [r["skipped"] for r in rows] == ["0", "0", "1", "0", "0", "0"]
    assert [r["skipped_steps"] for r in rows] == ["0", "0", "1", "1", "1", "1"]
    assert all(r["loss_scale"] == "128" for r in rows)
    assert [float(r["lr"]) for r in rows] == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.01, 0.001])
    # the last log line's loss is the mean of the last two iterations' losses (the training window)
    assert (float(rows[4]["loss"]) + float(rows[5]["loss"])) / 2 == pytest.approx(metrics["train_loss"], 1e-5)


def test_a_layer_wise_scaler_logs_its_smallest_and_largest_scale(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    train(make_cfg("scaler=adaptive", "model=mlp", "trainer.max_steps=3"))
    with open(tmp_path / "scalars.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 3 and "loss_scale_min" in rows[0] and "loss_scale_max" in rows[0]
    assert all(0 < float(r["loss_scale_min"]) <= float(r["loss_scale_max"]) for r in rows)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["trainer.max_steps=2"], "(schedule squeezed from 50 to 2 iterations by trainer.max_steps)"),
        (["trainer.steps=3", "trainer.max_steps=null"], "3 iterations of batch 4 (schedule 3)"),
    ],
)
def test_the_start_line_states_the_schedule_run(
    make_cfg: Callable[..., DictConfig], caplog: pytest.LogCaptureFixture, overrides: list[str], says: str
) -> None:
    with caplog.at_level(logging.INFO, logger="adaloss"):
        train(make_cfg(*overrides))
    assert len(_records(caplog, re.escape(says))) == 1, [r.getMessage() for r in caplog.records][:3]


@pytest.mark.parametrize("scale", [65536.0, {"conv1": 0.00390625, "fc": 16384.0}], ids=["global", "layers"])
def test_the_progress_bar_stays_readable_at_80_columns(scale: float | dict[str, float]) -> None:
    out = io.StringIO()
    bar = ProgressBar(64000, "resnet110_cifar100_fp16_adaptive_seed3", file=out, ncols=80)
    bar.update(1234)
    bar.show(0.53211, 84.43, scale, 1234.5)
    line = bar.render()
    bar.close()
    assert len(line) <= 80, line
    drawn = re.search(r"\|(.*)\|", line)
    assert drawn and len(drawn.group(1)) >= MIN_BAR, line  # the bar itself, not one character
    assert "1234/64000" in line and "loss 0.532" in line and "acc 84.4%" in line, line  # the postfix is whole
    wide = ProgressBar(64000, "resnet110_cifar100_fp16_adaptive_seed3", file=io.StringIO(), ncols=200)
    wide.update(1234)
    wide.show(0.53211, 84.43, scale, 1234.5)
    assert wide.render().startswith("resnet110_cifar100_fp16_adaptive_seed3:")  # room for everything
    assert "1234 img/s" in wide.render()
    wide.close()


def test_a_sweep_without_a_terminal_logs_each_jobs_lines_with_its_name(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = ["-m", "dataset=synthetic", "dataset.image_size=16", "dataset.train_size=16",
            "dataset.test_size=8", "trainer.batch_size=4", "trainer.max_steps=4", "trainer.log_every=2",
            "model=mlp", "device=cpu", "logger=none", "seed=0,1", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )  # stdout and stderr are pipes: no terminal, so no progress bar
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job, seed in ((0, 0), (1, 1)):
        tag = f"[job {job} mlp_synthetic_fp16_none_seed{seed}] "
        console = [line for line in proc.stdout.splitlines() if tag in line]
        assert any("iteration 2/4: loss" in line for line in console), proc.stdout[-3000:]
        assert any("iteration 4/4: loss" in line for line in console)
        (folder,) = sweep.glob(f"{job}_*")
        log = (folder / "train.log").read_text()
        assert f"{tag}iteration 2/4: loss" in log and f"{tag}iteration 4/4: loss" in log
        assert "(schedule squeezed from 50 to 4 iterations by trainer.max_steps)" in log
