"""Bad input: each invalid invocation fails with one ``error:`` line that names the problem and the fix.

Three tables. ``CLI_CASES`` run ``python train.py ...`` as real subprocesses: the errors Hydra raises while
composing (unknown group option or key, malformed override), and a few value errors that reach the run
folder Hydra made, to check it is removed again. They assert exit status 2, a last stderr line
``error: ...`` with the expected text, no traceback, no Hydra hint, no ``metrics.json`` and no run folder
left under the (temporary) results folder. ``VALUE_CASES`` compose the same config in-process (as
``conftest.compose_train`` does) and call ``train(cfg)``, the function ``train.py`` runs, which must raise
a one-line ``ConfigError`` before training: a subprocess costs seconds of imports, a compose milliseconds.
``FOLDER_CASES`` run ``python train.py`` against a run folder: one holding a finished run (a fresh start
into it, a resume with other settings or other layer shapes; the folder must come out byte for byte as it
was, ``.hydra/`` and ``train.log`` included), one another live process holds, one the run may not write,
and a disk that fills or a ``checkpoints/`` folder deleted in the middle of a run (simulated in the child
process by replacing ``torch.save``; the earlier checkpoint must stay intact).

Every row starts from a 2-iteration CPU run (``conftest.TINY``, where the row does not set the key), so a
check that went missing makes the row fail fast: the run trains, exits 0 and writes ``metrics.json``.
``docs/reliability.md`` describes these guarantees; the rows here are what holds them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from hydra.errors import HydraException
from omegaconf import DictConfig, open_dict

from adaloss.errors import ConfigError
from adaloss.runner.engine import train
from adaloss.runner.engine.checkpoint import load_checkpoint
from adaloss.runner.engine.run_folder import RunLock
from conftest import FINISHED_RUN, ROOT, TINY, compose_train

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
    # train() rejects this: Hydra has made the run folder by then, and it must be gone afterwards (the
    # other values train() rejects after Hydra made the folder: CLEANUP_CASES, in-process)
    pytest.param(
        ["scaler=fixed", "scaler.scale=-1"],
        ["scaler.scale must be a number > 0, got -1", "e.g. scaler.scale=128"],
        True,
        id="negative-scale+cleanup",
    ),
]

_NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: device=cuda is valid")

#: ``(overrides, expected substrings)``: values ``train()`` rejects once Hydra has made the run folder. The
#: command line's row ``negative-scale+cleanup`` checks that ``train.py`` prints the line and removes a
#: folder holding only Hydra's files; these rows check, in-process, each value's line and that the failed
#: ``train()`` left the folder so (a subprocess each would cost seconds of imports for the same wrapper).
CLEANUP_CASES: list = [
    pytest.param(
        ["model=ssd512", "dataset=cifar10", "paths.data_dir={tmp}/data"],
        ["model=ssd512 is a detector but dataset=cifar10", "dataset=shapes"],
        id="detector-on-cifar10",
    ),
    pytest.param(
        ["dataset=cifar10", "paths.data_dir={tmp}/nonexistent"],
        ["CIFAR-10 not found under", "nonexistent", "dataset.download=true"],
        id="missing-data-dir",
    ),
    pytest.param(
        ["model._target_=no_such_pkg.Net", "model.name=net"],
        ["model._target_=no_such_pkg.Net cannot be imported", "No module named 'no_such_pkg'"],
        id="unimportable-model-target",
    ),
    pytest.param(["resume={tmp}/garbage.pt"], ["garbage.pt", "checkpoint"], id="unreadable-checkpoint"),
]

VALUE_CASES: list = [
    # fixed scaler
    pytest.param(
        ["scaler=fixed", "scaler.scale=0"], ["scaler.scale must be a number > 0, got 0"], id="scale-0"
    ),
    pytest.param(
        ["scaler=fixed", "scaler.scale=abc"],
        ["scaler.scale must be a finite number, got 'abc'", "scaler.scale=128"],
        id="scale-not-a-number",
    ),
    pytest.param(["scaler=fixed", "scaler.scale=inf"], ["scaler.scale", "got inf"], id="scale-inf"),
    pytest.param(["scaler=fixed", "scaler.scale=nan"], ["scaler.scale", "got nan"], id="scale-nan"),
    # dynamic scaler
    pytest.param(
        ["scaler=dynamic", "scaler.init_scale=-1"],
        ["scaler.init_scale must be a number > 0, got -1"],
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
    pytest.param(
        ["scaler=adaptive", "scaler.rule=bogus"],
        ["scaler.rule must be one of reference, paper", "scaler.rule=reference"],
        id="rule-unknown",
    ),
    pytest.param(
        ["scaler=adaptive", "scaler.scale_upper_bound=-3"],
        ["scaler.scale_upper_bound must be a positive number, null (no bound) or auto", "got -3"],
        id="scale-bound-negative",
    ),
    pytest.param(
        ["scaler=adaptive", "scaler.accum_upper_bound=inf"],
        ["scaler.accum_upper_bound must be a positive number", "got inf"],
        id="accum-bound-inf",
    ),
    pytest.param(
        ["scaler=adaptive", "scaler.allow_below_one=true"],
        ["scaler.allow_below_one=true applies to scaler.rule=paper only", "scaler.rule=paper"],
        id="allow-below-one-under-reference",
    ),
    # precision backends
    pytest.param(
        ["precision.backend=gpu"],
        ["precision.backend must be one of auto, autocast, emulate, got 'gpu'"],
        id="backend-unknown",
    ),
    pytest.param(
        ["precision=fp8_e5m2", "precision.backend=autocast"],
        ["precision=fp8_e5m2 has no autocast", "precision.backend=emulate"],
        id="backend-fp8-autocast",
    ),
    pytest.param(
        ["precision=fp32", "precision.backend=autocast"],
        ["precision.backend=autocast needs a half format", "precision=fp16 or bf16"],
        id="backend-fp32-autocast",
    ),
    # names set by key rather than by group option (Hydra cannot check these)
    pytest.param(["scaler.name=adaptve"], ["unknown scaler 'adaptve'", "scaler= one of"], id="scaler-name"),
    pytest.param(
        ["precision.name=fp12"],
        ["precision.name must be one of fp32, fp16", "got 'fp12'"],
        id="precision-name",
    ),
    pytest.param(["model.name=resnet21"], ["unknown model 'resnet21'", "model= one of"], id="model-name"),
    pytest.param(
        ["dataset.name=cifar11"], ["unknown dataset 'cifar11'", "dataset= one of"], id="dataset-name"
    ),
    pytest.param(
        ["telemetry.format=fp12"],
        ["telemetry.format must be one of fp16, bf16", "got 'fp12'"],
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
    pytest.param(["seed=1.5"], ["seed must be an integer", "got '1.5'"], id="seed-float"),
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
        ["recipe/shapes sets model.image_size", "model=ssd300"],
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
    # booleans take true/false (and YAML's yes/no/on/off), nothing else: bool("maybe") would be True
    *(
        pytest.param(
            [*select, f"{key}={value}"],
            [f"{key.lstrip('+')} must be true or false, got {shown}"],
            id=f"bool-{key.split('.')[-1]}-{value}",
        )
        for select, key, value, shown in [
            ([], "trainer.save_final", "maybe", "'maybe'"),
            ([], "trainer.progress_bar", "maybe", "'maybe'"),
            ([], "optimizer.nesterov", "maybe", "'maybe'"),
            ([], "telemetry.expected_loss_scale", "maybe", "'maybe'"),
            (["scaler=adaptive"], "scaler.allow_below_one", "maybe", "'maybe'"),
            (["scaler=adaptive"], "scaler.product_betas", "maybe", "'maybe'"),
            (["scaler=dynamic"], "scaler.consecutive_hysteresis", "maybe", "'maybe'"),
            (["model=mlp"], "model.shared_hidden", "maybe", "'maybe'"),
            (["dataset=digits"], "dataset.augment", "maybe", "'maybe'"),
            ([], "trainer.save_final", "yess", "'yess'"),
        ]
    ),
    # numbers are finite where inf or nan mean nothing
    pytest.param(["optimizer.lr=inf"], ["optimizer.lr must be a finite number, got inf"], id="lr-inf"),
    pytest.param(["optimizer.lr=nan"], ["optimizer.lr must be a finite number, got nan"], id="lr-nan"),
    pytest.param(
        ["optimizer.weight_decay=inf"], ["optimizer.weight_decay must be a finite number"], id="wd-inf"
    ),
    pytest.param(["optimizer.momentum=nan"], ["optimizer.momentum must be a finite number"], id="mom-nan"),
    pytest.param(["schedule.gamma=inf"], ["schedule.gamma must be a finite number"], id="gamma-inf"),
    pytest.param(
        ["schedule.warmup_factor=inf"], ["schedule.warmup_factor must be a finite number"], id="warmup-inf"
    ),
    pytest.param(["trainer.grad_clip=inf"], ["trainer.grad_clip must be a finite number"], id="clip-inf"),
    pytest.param(
        ["model=mlp", "model.hidden=[256,inf]"],
        ["model.hidden[1] must be an integer, got 'inf'"],
        id="hidden-inf",
    ),
    pytest.param(
        ["dataset=cifar10", "dataset.std=[nan,0.2,0.2]"],
        ["dataset.std entries must be a finite number, got nan"],
        id="std-nan",
    ),
    pytest.param(
        ["scaler=adaptive", "+scaler.u_min=nan"], ["scaler.u_min must be a finite number"], id="u_min-nan"
    ),
    # resume= pointing at something that is not a checkpoint, said as it is
    pytest.param(
        ["resume={tmp}/random.pt"],
        ["random.pt: the file cannot be read: it is corrupt or not a checkpoint"],
        id="resume-random-bytes",
    ),
    pytest.param(
        ["resume={tmp}/empty"], ["resume=", "empty is a directory, not a checkpoint file"], id="resume-dir"
    ),
    pytest.param(
        ["dataset=tokens", "model=gpt", "paths.data_dir={tmp}/empty"],
        ["token files not found", "empty/tokens has no train.bin", "scripts/prepare_tokens.py"],
        id="tokens-missing",
    ),
]

# The run the folder rows start from (FINISHED_RUN, conftest.finished_cli_run): 3 iterations, a checkpoint at
# 2, finished (metrics.json), made through the command line once per test process, so it has Hydra's
# .hydra/ and train.log as a user's run does.
#: A run that writes checkpoints at 2 and 4 of 6 iterations: the faults hit the second one.
TWO_CHECKPOINTS = ("model=mlp", "trainer.max_steps=6", "trainer.checkpoint_every=2")

#: Child-process preludes: the second torch.save (the checkpoint of iteration 4) meets a fault.
_SECOND_SAVE_FAILS = """
import errno, os, shutil, torch
_save, _calls = torch.save, []
def _faulty_save(obj, handle, *args, **kwargs):
    _calls.append(1)
    if len(_calls) == 2:
        {fault}
    return _save(obj, handle, *args, **kwargs)
torch.save = _faulty_save
"""
DISK_FULL = _SECOND_SAVE_FAILS.format(
    fault="handle.write(bytes(4096)); raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))"
)
CHECKPOINTS_DELETED = _SECOND_SAVE_FAILS.format(  # the folder of the file being written, removed meanwhile
    fault="shutil.rmtree(os.path.dirname(os.readlink(f'/proc/self/fd/{handle.fileno()}')))"
)

#: ``(folder state, overrides, exit status, expected substrings)``. States: ``finished`` (a copy of the
#: finished run, which must come out unchanged; ``-without-checkpoints``: its checkpoints/ removed),
#: ``locked`` (the same, held by this test process),
#: ``read-only`` (the same on a read-only file system, or without write permission), ``disk-full`` and
#: ``checkpoints-deleted`` (a new run whose second checkpoint meets the fault). ``{pid}``: this process.
FOLDER_CASES: list = [
    pytest.param(
        "finished",
        [*FINISHED_RUN],
        2,
        ["already holds a run (metrics.json", "continue that run with resume=auto", "hydra.run.dir=<new"],
        id="fresh-start-into-a-finished-run",
    ),
    pytest.param(
        "finished",
        [*FINISHED_RUN, "resume=auto", "seed=5"],
        2,
        ["belongs to a different run (seed=0; this run has seed=5)", "resume with seed=0"],
        id="resume-with-another-seed",
    ),
    pytest.param(  # the start logs "no checkpoint ... starting a fresh run" before it is refused
        "finished-without-checkpoints",
        [*FINISHED_RUN, "resume=auto", "seed=5"],
        2,
        ["run folder", "belongs to a different run (seed=0; this run has seed=5)"],
        id="resume-with-another-seed-and-no-checkpoint",
    ),
    pytest.param(
        "finished",
        [*FINISHED_RUN, "resume=auto", "model.hidden=[128,128]"],
        2,
        ["holds a model of other layer shapes", "resume with model.hidden=[256,256]"],
        id="resume-with-other-layer-shapes",
    ),
    pytest.param(
        "locked",
        [*FINISHED_RUN, "resume=auto"],
        2,
        ["is in use by another live run (PID {pid} on", "hydra.run.dir=<new folder>"],
        id="folder-held-by-a-live-run",
    ),
    pytest.param(
        "read-only",
        [*FINISHED_RUN, "resume=auto"],
        2,
        ["cannot write to the run folder", "make", "writable, or run in another folder"],
        id="read-only-run-folder",
    ),
    pytest.param(
        "disk-full",
        [*TWO_CHECKPOINTS],
        1,
        ["cannot write the checkpoint", "step_4.pt: the disk is full", "intact (step_2.pt)", "resume=auto"],
        id="disk-full",
    ),
    pytest.param(
        "checkpoints-deleted",
        [*TWO_CHECKPOINTS],
        1,
        ["step_4.pt: its folder disappeared", "no checkpoint to continue from", "resume=auto"],
        id="checkpoints-folder-deleted-during-a-save",
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
    (tmp / "random.pt").write_bytes(random.Random(0).randbytes(4096))
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


def _run_cli(
    args: Sequence[str], prelude: str = "", wrap: Sequence[str] = (), **env: str
) -> subprocess.CompletedProcess[str]:
    """``python train.py <args>``; ``prelude``: Python run first in the child (a simulated fault);
    ``wrap``: a command prefix (a read-only mount)."""
    environ = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    environ.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **env})
    command = [sys.executable, "train.py", *args]
    if prelude:
        start = "import runpy, sys\nsys.argv[0] = 'train.py'\nrunpy.run_path('train.py', run_name='__main__')"
        command = [sys.executable, "-c", f"{prelude}\n{start}", *args]
    return subprocess.run(
        [*wrap, *command], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _one_error_line(proc: subprocess.CompletedProcess[str], status: int) -> str:
    """The single ``error:`` line of a failed run (status ``status``, no traceback)."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == status, (proc.returncode, proc.stderr[-2000:])
    assert lines and lines[-1].startswith("error: "), proc.stderr[-2000:]
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]]
    assert "Traceback" not in proc.stderr + proc.stdout and "HYDRA_FULL_ERROR" not in proc.stderr
    return lines[-1]


# --------------------------------------------------------------------------------------------- tests


def test_the_tables_cover_every_kind_of_bad_input() -> None:
    """Each table keeps its cases: a row lost in an edit would leave its check untested without failing."""
    assert len(CLI_CASES) >= 8 and len(VALUE_CASES) >= 60 and len(FOLDER_CASES) >= 7
    assert len(CLEANUP_CASES) >= 4


@pytest.mark.parametrize(("overrides", "expected", "made_run_folder"), CLI_CASES)
def test_cli_reports_bad_input_in_one_line(
    overrides: list[str], expected: list[str], made_run_folder: bool, tmp_path: Path
) -> None:
    results = tmp_path / "results"
    args = [*_with_tiny(_fill(overrides, tmp_path)), f"paths.results_dir={results}"]
    line = _one_error_line(_run_cli(args), 2)
    for text in expected:
        assert text in line, (text, line)
    assert not list(results.rglob("metrics.json"))
    # Hydra's own errors come before it makes any folder; train()'s after it made results/runs/<name>/<time>/
    assert (results / "runs").is_dir() == made_run_folder
    if results.exists():
        assert _leftovers(results) == []


@pytest.mark.parametrize(("overrides", "expected"), VALUE_CASES)
def test_bad_value_fails_before_training(
    overrides: list[str], expected: list[str], tmp_path: Path, single_thread: None
) -> None:
    try:
        cfg = compose_train(_with_tiny(_fill(overrides, tmp_path)))
    except HydraException as error:  # the schema's types and keys: rejected while Hydra composes
        message = _load_cli().describe_hydra_error(error)  # the line train.py prints
    else:
        message = _train_error(cfg, tmp_path / "run")
    _assert_one_line(message, expected)
    assert not list(tmp_path.rglob("metrics.json"))


def _train_error(cfg: DictConfig, run_dir: Path) -> str:
    """The message of the ``ConfigError`` that ``train(cfg)`` raises, run folder ``run_dir``."""
    with open_dict(cfg):
        cfg.paths.output_dir = str(run_dir)  # what Hydra's ${hydra:runtime.output_dir} gives in train.py
    with pytest.raises(ConfigError) as info:
        train(cfg)
    return str(info.value)


def _assert_one_line(message: str, expected: list[str]) -> None:
    assert "\n" not in message.strip()
    for text in expected:
        assert text in message, (text, message)


@pytest.mark.parametrize(("overrides", "expected"), CLEANUP_CASES)
def test_a_value_train_rejects_leaves_only_hydras_files(
    overrides: list[str], expected: list[str], tmp_path: Path, single_thread: None
) -> None:
    """The run folder as Hydra makes it (its log), then ``train(cfg)``: one ``ConfigError`` line, and the
    folder still holds only Hydra's files, so ``train.py`` removes it; nothing lands under the results."""
    results = tmp_path / "results"
    cfg = compose_train([*_with_tiny(_fill(overrides, tmp_path)), f"paths.results_dir={results}"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "train.log").write_text("")
    _assert_one_line(_train_error(cfg, run_dir), expected)
    assert _load_cli()._only_hydra_files(run_dir), sorted(p.name for p in run_dir.rglob("*"))
    assert not list(tmp_path.rglob("metrics.json"))
    if results.exists():
        assert _leftovers(results) == []


@pytest.mark.parametrize(("value", "written"), [("no", False), ("yes", True), ("off", False), ("On", True)])
def test_yaml_spellings_of_booleans_mean_what_yaml_reads(
    value: str, written: bool, tmp_path: Path, single_thread: None
) -> None:
    """``trainer.save_final=no`` arrives from Hydra's command line as the string "no" (bool("no") is True);
    a config file's ``save_final: no`` is False: both mean False."""
    cfg = compose_train([*TINY, f"trainer.save_final={value}"])
    cfg.paths.output_dir = str(tmp_path)
    metrics = train(cfg)
    assert (tmp_path / "model.pt").exists() == written
    assert metrics["config"]["trainer"]["save_final"] is written  # recorded as a real boolean


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def _read_only(folder: Path) -> Iterator[list[str]]:
    """A command prefix under which ``folder`` cannot be written: for root (whom permissions do not stop),
    a read-only bind mount in a private mount namespace of the child; for other users, no write bits."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")]}
        for path in modes:
            path.chmod(stat.S_IMODE(modes[path]) & ~0o222)
        try:
            yield []
        finally:
            for path, mode in modes.items():
                path.chmod(stat.S_IMODE(mode))
        return
    unshare = shutil.which("unshare")
    probe = tempfile.mkdtemp()
    script = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"'
    works = (
        unshare
        and subprocess.run(
            [unshare, "--mount", "sh", "-c", script, probe, "true"], capture_output=True
        ).returncode
        == 0
    )
    os.rmdir(probe)
    if not works:
        pytest.skip("running as root, and no private read-only mount is possible here (unshare --mount)")
    yield [unshare, "--mount", "sh", "-c", script, str(folder)]


@pytest.mark.parametrize(("state", "overrides", "status", "expected"), FOLDER_CASES)
def test_run_folder_faults_are_one_error_line(
    state: str, overrides: list[str], status: int, expected: list[str], finished_cli_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    args, prelude, lock = [*_with_tiny(overrides), f"hydra.run.dir={run}"], "", None
    unchanged = state.startswith("finished") or state in ("locked", "read-only")
    if unchanged:
        shutil.copytree(finished_cli_run, run)
    if state == "finished-without-checkpoints":
        shutil.rmtree(run / "checkpoints")
    before = _snapshot(run) if run.exists() else {}
    with contextlib.ExitStack() as stack:
        wrap: list[str] = []
        if state == "locked":
            lock = RunLock(run)
            lock.acquire()
            stack.callback(lock.release)
            before = _snapshot(run)  # with the lock file this process holds
        elif state == "read-only":
            (run / "done").unlink()  # unfinished, as if killed after its last checkpoint: resuming writes
            before = _snapshot(run)
            wrap = stack.enter_context(_read_only(run))
        prelude = {"disk-full": DISK_FULL, "checkpoints-deleted": CHECKPOINTS_DELETED}.get(state, "")
        proc = _run_cli(args, prelude=prelude, wrap=wrap)
        line = _one_error_line(proc, status)
        for text in expected:
            assert text.replace("{pid}", str(os.getpid())) in line, (text, line)
        if unchanged:  # refused before writing a byte (train.log too: the lines it logged are cut off)
            assert _snapshot(run) == before
    assert not (run / "metrics.json").exists() or unchanged
    if state == "disk-full":  # the checkpoint before the fault is intact, and nothing half-written is left
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2.pt"]
        assert load_checkpoint(run / "checkpoints" / "step_2.pt")["step"] == 2


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
