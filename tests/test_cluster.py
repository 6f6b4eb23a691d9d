"""Where sweeps run: ``cluster=slurm`` (Hydra's submitit launcher) and ``cluster=local`` (joblib).

No SLURM here, so the SLURM config is checked by composition (launcher, requeue, resume), and the submitit
code path itself runs through submitit's local executor (``hydra/launcher=submitit_local``), which starts
each run in its own process exactly as a SLURM job would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, compose_train


def test_slurm_cluster_config_requeues_and_resumes() -> None:
    cfg = compose_train(["cluster=slurm", "experiment=table1_cifar"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert launcher.max_num_timeout > 0  # preempted / timed-out jobs are requeued ...
    assert cfg.resume == "auto"  # ... and continue from their newest checkpoint
    assert 0 < cfg.trainer.checkpoint_every <= 1000
    assert launcher.gpus_per_node == 1 and launcher.tasks_per_node == 1
    assert launcher.signal_delay_s >= 60
    # the experiment's grid is untouched: the cluster only decides where runs go
    assert "variant" in cfg.hydra.sweeper.params


def test_local_cluster_config_uses_joblib() -> None:
    cfg = compose_train(["cluster=local"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("joblib_launcher.JoblibLauncher")
    assert cfg.hydra.launcher.n_jobs >= 1
    assert cfg.resume is None  # local sweeps start fresh unless asked


def test_cluster_choice_stays_out_of_run_folder_names() -> None:
    cfg = compose_train(["cluster=slurm"], return_hydra_config=True)
    excluded = set(cfg.hydra.job.config.override_dirname.exclude_keys)
    assert {"cluster", "resume"} <= excluded


@pytest.mark.slow
def test_a_sweep_runs_through_the_submitit_launcher(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = [
        "-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={sweep}",
        "dataset=synthetic", "dataset.image_size=16", "dataset.train_size=16", "dataset.test_size=8",
        "trainer.batch_size=4", "trainer.eval_batch_size=8", "trainer.max_steps=2", "model=mlp",
        "device=cpu", "logger=none", "trainer.progress_bar=false", "resume=auto", "seed=0,1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    finished = sorted(sweep.rglob("metrics.json"))
    assert len(finished) == 2
    assert {json.loads(p.read_text())["config"]["seed"] for p in finished} == {0, 1}
    assert any((sweep / ".submitit").iterdir())  # submitit's job folders: it really went through submitit
