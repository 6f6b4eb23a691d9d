"""Bad input: each invalid invocation fails with one ``error:`` line that names the problem and the fix.

Two tables. ``CLI_CASES`` run ``python train.py ...`` as real subprocesses: the errors Hydra raises while
composing (unknown group option or key, malformed override), and a few value errors that reach the run
folder Hydra made, to check it is removed again. They assert exit status 2, a last stderr line
``error: ...`` with the expected text, no traceback, no Hydra hint, no ``metrics.json`` and no run folder
left under the (temporary) results folder. ``VALUE_CASES`` compose the same config in-process (as
``conftest.compose_train`` does) and call ``train(cfg)``, the function ``train.py`` runs, which must raise
a one-line ``ConfigError`` before training: a subprocess costs seconds of imports, a compose milliseconds.

Every row starts from a 2-iteration CPU run (``conftest.TINY``, where the row does not set the key), so a
check that went missing makes the row fail fast: the run trains, exits 0 and writes ``metrics.json``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from omegaconf import open_dict

from adaloss.engine import train
from adaloss.errors import ConfigError
from conftest import ROOT, TINY, compose_train

TIMEOUT_S = 240  # one subprocess; a bad invocation fails in seconds, a missing check trains 2 iterations

# ---------------------------------------------------------------------------------------------- tables

#: ``(overrides, expected substrings of the error line, whether Hydra made a run folder first)``;
#: ``{tmp}`` is the test's temporary folder.
CLI_CASES: list = [
    # Hydra rejects these while composing, before train.py's main() runs (no torch import, ~1 s each)
    pytest.param(
        ["model=resnet21"],
        ["unknown model 'resnet21'", "choose one of", "resnet20", "configs/model/"],
        False,
        id="unknown-model",
    ),
    pytest.param(
        ["dataset=cifar11"],
        ["unknown dataset 'cifar11'", "cifar10", "configs/dataset/"],
        False,
        id="unknown-dataset",
    ),
    pytest.param(["scaler=adaptve"], ["unknown scaler 'adaptve'", "adaptive"], False, id="unknown-scaler"),
    pytest.param(["precision=fp12"], ["unknown precision 'fp12'", "fp16"], False, id="unknown-precision"),
    pytest.param(
        ["trainer.batch_sise=3"],
        ["unknown key 'trainer.batch_sise'", "did you mean trainer.batch_size"],
        False,
        id="misspelt-key",
    ),
    pytest.param(
        ["batch_size=32"],
        ["unknown key 'batch_size'", "did you mean trainer.batch_size"],
        False,
        id="key-without-section",
    ),
    pytest.param(
        ["scaler.scale=128"],
        ["unknown key 'scaler.scale'", "scaler=fixed scaler.scale=128"],
        False,
        id="scale-without-fixed-scaler",
    ),
    pytest.param(
        ["trainer.batch_size=["],
        ["cannot parse the override 'trainer.batch_size=['", "key=value"],
        False,
        id="malformed-override",
    ),
    pytest.param(
        ["trainer.steps"],
        ["'trainer.steps' is not an override", "trainer.steps=<value>"],
        False,
        id="no-equals",
    ),
    pytest.param(["-m", "model=resnet21"], ["unknown model 'resnet21'"], False, id="multirun-unknown-model"),
    # train() rejects these: Hydra has made the run folder by then, and it must be gone afterwards
    pytest.param(
        ["scaler=fixed", "scaler.scale=-1"],
        ["scaler.scale must be a positive number, got -1", "e.g. scaler.scale=128"],
        True,
        id="negative-scale+cleanup",
    ),
    pytest.param(
        ["model=ssd512", "dataset=cifar10", "paths.data_dir={tmp}/data"],
        ["model=ssd512 is a detector but dataset=cifar10", "dataset=shapes"],
        True,
        id="detector-on-cifar10+cleanup",
    ),
    pytest.param(
        ["dataset=cifar10", "paths.data_dir={tmp}/nonexistent"],
        ["CIFAR-10 not found under", "nonexistent", "dataset.download=true"],
        True,
        id="missing-data-dir+cleanup",
    ),
    pytest.param(
        ["model._target_=no_such_pkg.Net", "model.name=net"],
        ["model._target_=no_such_pkg.Net cannot be imported", "No module named 'no_such_pkg'"],
        True,
        id="unimportable-model-target+cleanup",
    ),
]

_NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: device=cuda is valid")

CLI_CASES.append(
    pytest.param(
        ["resume={tmp}/garbage.pt"], ["garbage.pt", "checkpoint"], True, id="unreadable-checkpoint+cleanup"
    )
)

VALUE_CASES: list = [
    # fixed scaler
    pytest.param(
        ["scaler=fixed", "scaler.scale=0"], ["scaler.scale must be a positive number, got 0"], id="scale-0"
    ),
    pytest.param(
        ["scaler=fixed", "scaler.scale=abc"],
        ["scaler.scale must be a positive number, got 'abc'", "scaler.scale=128"],
        id="scale-not-a-number",
    ),
    pytest.param(["scaler=fixed", "scaler.scale=inf"], ["scaler.scale", "got inf"], id="scale-inf"),
    pytest.param(["scaler=fixed", "scaler.scale=nan"], ["scaler.scale", "got nan"], id="scale-nan"),
    # dynamic scaler
    pytest.param(
        ["scaler=dynamic", "scaler.init_scale=-1"],
        ["scaler.init_scale must be a positive number"],
        id="dyn-init",
    ),
    pytest.param(
        ["scaler=dynamic", "scaler.growth_factor=1"],
        ["scaler.growth_factor must be a number > 1", "scaler.growth_factor=2"],
        id="dyn-growth-factor",
    ),
    pytest.param(
        ["scaler=dynamic", "scaler.backoff_factor=1.5"],
        ["scaler.backoff_factor must be a number between 0 and 1", "scaler.backoff_factor=0.5"],
        id="dyn-backoff-factor",
    ),
    pytest.param(
        ["scaler=dynamic", "scaler.growth_interval=0"],
        ["scaler.growth_interval must be a positive integer", "scaler.growth_interval=2000"],
        id="dyn-growth-interval",
    ),
    # adaptive scaler
    pytest.param(
        ["scaler=adaptive", "scaler.t_uf=0"],
        ["scaler.t_uf must be a number between 0 and 1", "scaler.t_uf=1e-3"],
        id="t_uf-0",
    ),
    pytest.param(["scaler=adaptive", "scaler.t_uf=1.5"], ["scaler.t_uf", "got 1.5"], id="t_uf-above-1"),
    pytest.param(
        ["scaler=adaptive", "scaler.update_every=0"],
        ["scaler.update_every must be a positive integer", "scaler.update_every=100"],
        id="update_every-0",
    ),
    # names set by key rather than by group option (Hydra cannot check these)
    pytest.param(["scaler.name=adaptve"], ["unknown scaler 'adaptve'", "scaler= one of"], id="scaler-name"),
    pytest.param(
        ["precision.name=fp12"], ["unknown precision 'fp12'", "precision= one of"], id="precision-name"
    ),
    pytest.param(["model.name=resnet21"], ["unknown model 'resnet21'", "model= one of"], id="model-name"),
    pytest.param(
        ["dataset.name=cifar11"], ["unknown dataset 'cifar11'", "dataset= one of"], id="dataset-name"
    ),
    pytest.param(
        ["telemetry.format=fp12"],
        ["unknown telemetry.format 'fp12'", "telemetry.format= one of"],
        id="telemetry-fmt",
    ),
    # trainer, telemetry, seed
    pytest.param(
        ["trainer.steps=-5"], ["trainer.steps must be a positive integer", "got -5"], id="steps-negative"
    ),
    pytest.param(["trainer.max_steps=0"], ["trainer.max_steps must be a positive integer"], id="max-steps-0"),
    pytest.param(
        ["trainer.batch_size=0"], ["trainer.batch_size must be a positive integer"], id="batch-size-0"
    ),
    pytest.param(["trainer.batch_size=abc"], ["trainer.batch_size", "got 'abc'"], id="batch-size-text"),
    pytest.param(
        ["telemetry.every=0"], ["telemetry.every must be a positive integer"], id="telemetry-every-0"
    ),
    pytest.param(["seed=abc"], ["seed must be an integer", "seed=0"], id="seed-text"),
    pytest.param(["seed=1.5"], ["seed must be an integer", "got 1.5"], id="seed-float"),
    pytest.param(
        ["trainer=3"], ["replaces the whole trainer section", "trainer.batch_size="], id="section-value"
    ),
    pytest.param(
        ["trainer.batch_size=${oops}"],
        ["trainer.batch_size cannot be resolved", "oops"],
        id="bad-interpolation",
    ),
    # optimizer and schedule
    pytest.param(["optimizer.lr=0"], ["optimizer.lr must be a number > 0", "optimizer.lr=0.1"], id="lr-0"),
    pytest.param(["optimizer.lr=-0.1"], ["optimizer.lr must be a number > 0"], id="lr-negative"),
    pytest.param(
        ["optimizer.momentum=1.5"], ["optimizer.momentum must be a number in [0, 1]"], id="momentum"
    ),
    pytest.param(
        ["schedule.milestones=[0.75,0.5]"],
        ["schedule.milestones must be increasing", "schedule.milestones=[0.5,0.75]"],
        id="milestones-decreasing",
    ),
    # device
    pytest.param(["device=gpu"], ["device=gpu is not a choice", "device=cpu"], id="device-unknown"),
    pytest.param(
        ["device=cuda"],
        ["device=cuda but no CUDA device is available", "device=cpu or device=auto"],
        id="cuda-without-cuda",
        marks=_NO_CUDA,
    ),
    # model and dataset that do not fit together (checked before any data is read)
    pytest.param(
        ["model=ssd300", "dataset=digits"],
        ["model=ssd300 is a detector but dataset=digits is a classification dataset", "dataset=shapes"],
        id="detector-on-digits",
    ),
    pytest.param(
        ["dataset=shapes"],
        ["dataset=shapes is a detection dataset but model=resnet20 is a classifier", "model=ssd300"],
        id="classifier-on-shapes",
    ),
    pytest.param(
        ["model=mlp", "dataset=voc"],
        ["dataset=voc is a detection dataset but model=mlp"],
        id="classifier-on-voc",
    ),
    pytest.param(
        ["model=gpt", "dataset=digits"],
        ["model=gpt is a language model but dataset=digits", "dataset=pystdlib"],
        id="language-model-on-images",
    ),
    pytest.param(
        ["model=vit", "dataset=pystdlib"],
        ["model=vit is an image classifier but dataset=pystdlib is a text dataset", "model=gpt"],
        id="classifier-on-text",
    ),
    pytest.param(
        ["model._target_=torch.nn.Identity"],
        ["model._target_=torch.nn.Identity replaces the network of model=resnet20", "model.name="],
        id="replaced-target-keeps-name",
    ),
    pytest.param(
        ["optimizer._target_=torch.optim.Adamm"],
        ["optimizer._target_=torch.optim.Adamm cannot be imported"],
        id="unimportable-optimizer",
    ),
    # data on disk
    pytest.param(
        ["dataset=cifar10", "paths.data_dir={tmp}/empty"],
        ["CIFAR-10 not found under", "dataset.download=true"],
        id="cifar10-empty-dir",
    ),
    pytest.param(
        ["dataset=imagenet", "model=resnet18", "paths.data_dir={tmp}/nonexistent"],
        ["ImageNet train split not found", "train/<class>/*.JPEG"],
        id="imagenet-missing-dir",
    ),
    pytest.param(
        ["dataset=imagenet", "model=resnet18", "paths.data_dir={tmp}/empty_imagenet"],
        ["ImageNet train split at", "has no images"],
        id="imagenet-empty-dir",
    ),
    pytest.param(
        ["dataset=tokens", "model=gpt", "paths.data_dir={tmp}/empty"],
        ["token files not found", "empty/tokens has no train.bin", "scripts/prepare_tokens.py"],
        id="tokens-missing",
    ),
]

# ------------------------------------------------------------------------------------------- helpers


def _with_tiny(overrides: Sequence[str]) -> list[str]:
    """``TINY`` (a 2-iteration CPU run) minus the keys the row sets, then the row's overrides."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides if not o.startswith("-")}
    own_dataset = "dataset" in keys

    def kept(override: str) -> bool:
        key = override.split("=", 1)[0]
        return key not in keys and not (own_dataset and key.startswith("dataset."))

    return [o for o in TINY if kept(o)] + list(overrides)


def _fill(overrides: Sequence[str], tmp: Path) -> list[str]:
    (tmp / "empty").mkdir(exist_ok=True)
    (tmp / "garbage.pt").write_bytes(b"not a checkpoint, just bytes")
    for split in ("train", "val"):
        (tmp / "empty_imagenet" / "imagenet" / split).mkdir(parents=True, exist_ok=True)
    return [o.replace("{tmp}", str(tmp)) for o in overrides]


def _leftovers(results: Path) -> list[str]:
    """Files, and folders other than an empty ``runs/``, under the results folder."""
    return sorted(
        str(p.relative_to(results))
        for p in results.rglob("*")
        if p.is_file() or (p.is_dir() and p != results / "runs")
    )


def _load_cli():
    spec = importlib.util.spec_from_file_location("adaloss_train_cli", ROOT / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_cli(args: Sequence[str], **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    environ.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **env})
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


# --------------------------------------------------------------------------------------------- tests


def test_the_tables_cover_the_issue() -> None:
    assert len(CLI_CASES) + len(VALUE_CASES) >= 20
    assert len(CLI_CASES) >= 8


@pytest.mark.parametrize(("overrides", "expected", "made_run_folder"), CLI_CASES)
def test_cli_reports_bad_input_in_one_line(
    overrides: list[str], expected: list[str], made_run_folder: bool, tmp_path: Path
) -> None:
    results = tmp_path / "results"
    args = [*_with_tiny(_fill(overrides, tmp_path)), f"paths.results_dir={results}"]
    proc = _run_cli(args)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert lines and lines[-1].startswith("error: "), proc.stderr[-2000:]
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]]
    for text in expected:
        assert text in lines[-1], (text, lines[-1])
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr
    assert not list(results.rglob("metrics.json"))
    # Hydra's own errors come before it makes any folder; train()'s after it made results/runs/<name>/<time>/
    assert (results / "runs").is_dir() == made_run_folder
    if results.exists():
        assert _leftovers(results) == []


@pytest.mark.parametrize(("overrides", "expected"), VALUE_CASES)
def test_bad_value_fails_before_training(
    overrides: list[str], expected: list[str], tmp_path: Path, single_thread: None
) -> None:
    cfg = compose_train(_with_tiny(_fill(overrides, tmp_path)))
    run_dir = tmp_path / "run"
    with open_dict(cfg):
        cfg.paths.output_dir = str(run_dir)  # what Hydra's ${hydra:runtime.output_dir} gives in train.py
    with pytest.raises(ConfigError) as info:
        train(cfg)
    message = str(info.value)
    assert "\n" not in message.strip()
    for text in expected:
        assert text in message, (text, message)
    assert not list(tmp_path.rglob("metrics.json"))


def test_valid_invocations_are_unchanged(tmp_path: Path) -> None:
    shown = _run_cli(["scaler=fixed", "scaler.scale=16", "logger=none", "--cfg", "job"])
    assert shown.returncode == 0, shown.stderr
    assert "scale: 16" in shown.stdout and not shown.stderr.strip()
    helped = _run_cli(["--help"])
    assert helped.returncode == 0 and "train" in helped.stdout
    # HYDRA_FULL_ERROR=1 still asks Hydra for the full report (the exception and its traceback)
    full = _run_cli(["model=resnet21", "--cfg", "job"], HYDRA_FULL_ERROR="1")
    assert full.returncode != 0 and "MissingConfigException" in full.stderr


def test_only_untouched_run_folders_are_removed(tmp_path: Path) -> None:
    cli = _load_cli()
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run / ".hydra" / name).write_text("{}\n")
    (run / "train.log").write_text("")
    assert cli._only_hydra_files(run)
    for extra in ("metrics.json", "wandb/run.wandb", ".hydra/notes.txt"):
        path = run / extra
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
        assert not cli._only_hydra_files(run), extra
        path.unlink()
        if path.parent.name == "wandb":
            path.parent.rmdir()
    assert cli._only_hydra_files(run)
