"""Checkpoints and resume: atomic writes, rotation, safe loading, clear errors (a corrupt file, a directory,
another model's layer shapes, a full disk, a folder deleted during a save), and a run killed with SIGKILL and
resumed ending bitwise where the uninterrupted run ends."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import DictConfig, open_dict
from torch.utils.data import TensorDataset

from adaloss.errors import ConfigError
from adaloss.runner.data.loaders import BatchStream, make_loader
from adaloss.runner.engine import checkpoint as ckpt
from adaloss.runner.engine import train
from adaloss.runner.engine.checkpoint import CheckpointError, CheckpointManager, load_checkpoint
from adaloss.runner.engine.run_folder import RunFolderError
from adaloss.runner.utils.seed import capture_rng_state, restore_rng_state
from conftest import QUIET, compose_train

ROOT = Path(__file__).resolve().parents[1]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"tensors differ: {differ[:5]}"


def _minimal_state(step: int) -> dict:
    """A checkpoint-shaped dict (what load_checkpoint checks), for the manager's own tests."""
    return {key: {} for key in ckpt.REQUIRED_KEYS} | {"format": ckpt.FORMAT_VERSION, "step": step}


def _steps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


# ------------------------------------------------------------------------------------- building blocks


def test_batch_stream_resumes_mid_epoch_with_the_same_order() -> None:
    data = TensorDataset(torch.arange(50))  # 6 batches of 8 per epoch (drop_last), 2 left over
    reference = BatchStream(make_loader(data, 8, train=True, seed=3))
    order = [next(reference)[0].tolist() for _ in range(20)]
    for taken in (0, 1, 5, 6, 7, 13):  # epoch starts, mid-epoch, last batch of an epoch
        stream = BatchStream(make_loader(data, 8, train=True, seed=3))
        for _ in range(taken):
            next(stream)
        state = stream.state_dict()
        resumed = BatchStream(make_loader(data, 8, train=True, seed=3))
        resumed.load_state_dict(state)
        assert (resumed.epoch, resumed.batch_index) == (stream.epoch, stream.batch_index)
        assert [next(resumed)[0].tolist() for _ in range(20 - taken)] == order[taken:], taken


def test_make_loader_keeps_the_shuffle_order_of_a_plain_dataloader() -> None:
    data = TensorDataset(torch.arange(50))
    generator = torch.Generator().manual_seed(5)
    plain = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=generator, drop_last=True)
    ours = make_loader(data, 8, train=True, seed=5)
    assert [b[0].tolist() for _ in range(3) for b in plain] == [b[0].tolist() for _ in range(3) for b in ours]


def test_rng_states_survive_a_weights_only_round_trip(tmp_path: Path) -> None:
    random.gauss(0, 1), np.random.randn(), torch.rand(1)  # noqa: B018 - leave cached gaussians behind
    ckpt.save_atomic(capture_rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(3))
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    again = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(3))
    assert expected[:4] == again[:4] and torch.equal(expected[4], again[4])


def test_keep_k_rotation(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, every=1, keep=2)
    for step in range(1, 6):
        manager.save(_minimal_state(step), step)
    assert _steps(manager.folder) == ["step_4.pt", "step_5.pt"]
    assert load_checkpoint(manager.folder / "step_5.pt")["step"] == 5


def test_a_crash_mid_write_leaves_the_old_checkpoint_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = CheckpointManager(tmp_path, every=1, keep=2)
    manager.save(_minimal_state(1), 1)
    before = (manager.folder / "step_1.pt").read_bytes()

    def dies_half_way(obj: object, handle) -> None:  # what a crash mid-write leaves: part of the bytes
        handle.write(before[: len(before) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt.torch, "save", dies_half_way)
    with pytest.raises(RunFolderError) as info:
        manager.save(_minimal_state(2), 2)
    message = str(info.value)
    assert "step_2.pt" in message and "the disk is full" in message and "\n" not in message
    assert _steps(manager.folder) == ["step_1.pt"]  # no partial file under a final name, no temporary
    assert (manager.folder / "step_1.pt").read_bytes() == before
    monkeypatch.undo()
    assert manager.load_latest().step == 1


class _Payload:
    """Unpickling this would run code (create a marker file); weights_only loading must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_loading_refuses_pickled_objects_without_running_them(tmp_path: Path) -> None:
    marker = tmp_path / "code_ran"
    path = tmp_path / "evil.pt"
    torch.save(_minimal_state(3) | {"extra": _Payload(marker)}, path)
    with pytest.raises(CheckpointError, match="Python objects other than tensors"):
        load_checkpoint(path)
    with pytest.raises(ConfigError) as info:
        CheckpointManager(tmp_path / "run").resume_point(str(path), {})
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "does not exist"),
        (b"", "corrupt or not a checkpoint"),
        (b"not a checkpoint", "corrupt or not a checkpoint"),
        ("random", "corrupt or not a checkpoint"),
        ("truncated", "corrupt"),
        ("bytes-in-the-middle", "corrupt"),
    ],
)
def test_resume_from_a_bad_file_is_a_config_error(
    tmp_path: Path, content: bytes | str | None, says: str
) -> None:
    path = tmp_path / "step_7.pt"
    if content in ("truncated", "bytes-in-the-middle"):
        ckpt.save_atomic(_minimal_state(7) | {"model": {"w": torch.arange(2000.0)}}, path)
        data = bytearray(path.read_bytes())
        if content == "truncated":
            data = data[:200]
        else:  # random bytes over the pickled part and the start of the tensor data, the zip index intact
            data[100:900] = random.Random(0).randbytes(800)
        path.write_bytes(bytes(data))
    elif content == "random":
        path.write_bytes(random.Random(1).randbytes(4096))
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        CheckpointManager(tmp_path / "run").resume_point(str(path), {})
    message = str(info.value)
    assert message.startswith(f"resume={path}: the file") and "resume=auto" in message
    assert says in message and "Python objects" not in message  # not mistaken for a refused pickle
    assert "\n" not in message


def test_resume_from_a_directory_says_it_is_one(tmp_path: Path) -> None:
    run = tmp_path / "run"
    CheckpointManager(run, every=1).save(_minimal_state(3), 3)
    for folder in (run, run / "checkpoints", tmp_path):
        with pytest.raises(ConfigError) as info:
            CheckpointManager(tmp_path / "other").resume_point(str(folder), {})
        message = str(info.value)
        assert f"resume={folder} is a directory, not a checkpoint file" in message, message
        assert "does not exist" not in message and "\n" not in message
        if folder != tmp_path:  # a run folder or its checkpoints: the command that continues it
            assert f"resume=auto hydra.run.dir={run}" in message and "step_3.pt" in message


# ----------------------------------------------------------------------------------- through train()


FAST = ("trainer.max_steps=6", "trainer.checkpoint_every=2", "trainer.eval_every=3", "trainer.log_every=1",
        "telemetry.every=2", "dataset.train_size=12", "trainer.save_final=true")  # fmt: skip


def test_in_process_resume_matches_the_uninterrupted_run(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    # 3 batches per epoch: the checkpoint at step 4 is mid-epoch (epoch 1, batch 1)
    full = train(make_cfg(*FAST, "scaler=dynamic"))
    first = _weights(tmp_path / "model.pt")
    assert _steps(tmp_path / "checkpoints") == ["step_2.pt", "step_4.pt"]  # keep 2; none after the last step
    state = load_checkpoint(tmp_path / "checkpoints" / "step_4.pt")
    assert (state["data"]["epoch"], state["data"]["batch_index"]) == (1, 1)
    telemetry = (tmp_path / "telemetry.jsonl").read_text()

    (tmp_path / "model.pt").unlink()
    (tmp_path / "metrics.json").unlink()
    resumed = train(make_cfg(*FAST, "scaler=dynamic", f"resume={tmp_path / 'checkpoints' / 'step_4.pt'}"))
    _assert_bitwise_equal(first, _weights(tmp_path / "model.pt"))
    for key in ("train_loss", "test_accuracy", "best_test_accuracy", "skipped_steps", "loss_scale", "lr"):
        assert resumed[key] == full[key], key
    assert (tmp_path / "telemetry.jsonl").read_text() == telemetry  # no line lost or doubled


def test_resume_from_a_file_starts_at_its_step_and_ends_where_the_uninterrupted_run_ends(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    """``resume=<file>`` of another folder's checkpoint: the run does iterations 5 and 6 only, ends bitwise on
    the uninterrupted run's weights, and not on those of a fresh run of its 2 iterations (what a run that
    ignored ``resume=`` and started over would do, had it the same length)."""

    def run(folder: str, *overrides: str) -> tuple[list[int], dict[str, torch.Tensor]]:
        cfg = make_cfg(*FAST, "scaler=dynamic", *overrides)
        with open_dict(cfg):
            cfg.paths.output_dir = str(tmp_path / folder)
        steps: list[int] = []
        train(cfg, callbacks=[lambda step, *_: steps.append(step)])
        return steps, _weights(tmp_path / folder / "model.pt")

    steps, reference = run("reference")
    assert steps == [1, 2, 3, 4, 5, 6]
    checkpoint = tmp_path / "reference" / "checkpoints" / "step_4.pt"
    steps, resumed = run("resumed", f"resume={checkpoint}")
    assert steps == [5, 6]
    _assert_bitwise_equal(reference, resumed)
    _, fresh = run("fresh", "trainer.max_steps=2")
    assert any(not torch.equal(fresh[k], resumed[k]) for k in resumed if k.endswith("weight"))


@pytest.mark.parametrize(
    ("before", "after", "named"),
    [
        ((), ("seed=1",), "seed=0"),
        ((), ("trainer.batch_size=2",), "trainer.batch_size=4"),
        ((), ("trainer.max_steps=4",), "trainer.max_steps=3"),  # the run length: max_steps caps it
        (
            ("trainer.max_steps=null", "trainer.steps=3"),
            ("trainer.max_steps=null", "trainer.steps=4"),
            "trainer.max_steps=3",
        ),  # or the schedule's length when nothing caps it
    ],  # fmt: skip
    ids=["seed", "batch_size", "max_steps", "steps"],
)
def test_a_checkpoint_of_another_seed_batch_size_or_run_length_is_refused(
    make_cfg: Callable[..., DictConfig], tmp_path: Path, before: tuple, after: tuple, named: str
) -> None:
    run = ("scaler=dynamic", "trainer.max_steps=3", "trainer.checkpoint_every=2")
    train(make_cfg(*run, *before))
    written = (tmp_path / "metrics.json").read_text()
    with pytest.raises(ConfigError) as info:
        train(make_cfg(*run, *after, "resume=auto"))
    message = str(info.value)
    assert "step_2.pt" in message and "belongs to a different run" in message and named in message
    assert "\n" not in message and (tmp_path / "metrics.json").read_text() == written  # nothing overwritten


def test_a_checkpoint_of_another_dataset_is_refused(
    make_cfg: Callable[..., DictConfig], single_thread: None, tmp_path: Path
) -> None:
    # TINY's synthetic data, then the bundled digits at the same batch size and length
    train(make_cfg("trainer.max_steps=3", "trainer.checkpoint_every=2"))
    digits = compose_train(["dataset=digits", *QUIET, "trainer.batch_size=4", "trainer.max_steps=3",
                            f"resume={tmp_path / 'checkpoints' / 'step_2.pt'}"])  # fmt: skip
    with open_dict(digits):
        digits.paths.output_dir = str(tmp_path / "digits")
    with pytest.raises(ConfigError) as info:
        train(digits)
    message = str(info.value)
    assert "belongs to a different run" in message and "dataset=synthetic" in message, message
    assert not (tmp_path / "digits" / "metrics.json").exists()


def test_corrupt_newest_checkpoint_warns_and_the_previous_is_used(
    make_cfg: Callable[..., DictConfig], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    train(make_cfg(*FAST))
    (tmp_path / "done").unlink()  # unfinished, as if killed after its last checkpoint
    first = _weights(tmp_path / "model.pt")
    newest = tmp_path / "checkpoints" / "step_4.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, e.g. by a full disk outside our control
    with caplog.at_level(logging.INFO):
        train(make_cfg(*FAST, "resume=auto"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(newest) in w and "cannot be read" in w for w in warnings), warnings
    assert any("resuming from" in r.getMessage() and "step_2.pt" in r.getMessage() for r in caplog.records)
    _assert_bitwise_equal(first, _weights(tmp_path / "model.pt"))
    # the corrupt file is set aside (not deleted), and the resumed run wrote a fresh step_4.pt
    assert _steps(tmp_path / "checkpoints") == ["step_2.pt", "step_4.pt", "step_4.pt.stale"]
    assert load_checkpoint(newest)["step"] == 4


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("model=mlp", "model=resnet20"),
        ("scaler=fixed", "scaler=dynamic"),
        ("precision=fp32", "precision=fp16"),
    ],
)
def test_a_checkpoint_of_a_different_config_is_a_config_error(
    make_cfg: Callable[..., DictConfig], tmp_path: Path, override: str, named: str
) -> None:
    train(make_cfg("scaler=dynamic", "trainer.max_steps=3", "trainer.checkpoint_every=2"))
    with pytest.raises(ConfigError) as info:
        train(make_cfg("scaler=dynamic", "trainer.max_steps=3", override, "resume=auto"))
    message = str(info.value)
    assert "step_2.pt" in message and "belongs to a different run" in message and named in message
    assert "\n" not in message


def test_resume_auto_without_checkpoints_starts_fresh_and_a_fresh_start_never_mixes_two_runs(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    assert train(make_cfg("trainer.max_steps=3", "trainer.checkpoint_every=2", "resume=auto"))["steps"] == 3
    assert _steps(tmp_path / "checkpoints") == ["step_2.pt"]
    record = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError) as info:  # resume=null into the finished run's folder
        train(make_cfg("trainer.max_steps=3", "trainer.checkpoint_every=2"))
    message = str(info.value)
    assert f"run folder {tmp_path} already holds a run" in message and "metrics.json" in message
    assert "resume=auto" in message and "hydra.run.dir=<new folder>" in message and "\n" not in message
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == record  # not a byte changed


def test_a_resume_with_other_layer_shapes_is_one_error_line(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    train(make_cfg("model=mlp", "trainer.max_steps=3", "trainer.checkpoint_every=2"))
    before = (tmp_path / "checkpoints" / "step_2.pt").read_bytes()
    with pytest.raises(ConfigError) as info:
        train(make_cfg("model=mlp", "model.hidden=[128,128]", "trainer.max_steps=3", "resume=auto"))
    message = str(info.value)
    assert "step_2.pt holds a model of other layer shapes" in message and "\n" not in message
    assert "[256, 768] in the checkpoint, [128, 768] here" in message  # 3x16x16 inputs
    assert "resume with model.hidden=[256,256]" in message  # the override that fits, as it is typed
    assert (tmp_path / "checkpoints" / "step_2.pt").read_bytes() == before


def test_a_checkpoints_folder_deleted_during_a_save_is_one_error_line(
    make_cfg: Callable[..., DictConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save, saves = torch.save, []

    def deleted_meanwhile(obj: object, handle, *args, **kwargs) -> None:
        saves.append(obj["step"])
        if obj["step"] == 4:
            shutil.rmtree(tmp_path / "checkpoints")  # e.g. a clean-up script, while the file is written
        real_save(obj, handle, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", deleted_meanwhile)
    with pytest.raises(RunFolderError) as info:
        train(make_cfg(*FAST))
    message = str(info.value)
    assert "cannot write the checkpoint" in message and "step_4.pt" in message and "\n" not in message
    assert "its folder disappeared" in message and "stopped after iteration 4/6" in message
    assert "no checkpoint to continue from" in message and "resume=auto" in message
    assert saves == [2, 4] and not (tmp_path / "metrics.json").exists()


def test_invalid_settings(make_cfg: Callable[..., DictConfig]) -> None:
    with pytest.raises(ConfigError, match="trainer.checkpoint_every must be a positive integer or null"):
        train(make_cfg("trainer.checkpoint_every=0"))
    with pytest.raises(ConfigError, match="trainer.keep_checkpoints"):
        train(make_cfg("trainer.keep_checkpoints=0"))
    with pytest.raises(ConfigError, match="resume must be auto, null or the path"):
        train(make_cfg("resume=true"))
    with pytest.raises(ConfigError, match="the file does not exist"):
        train(make_cfg("resume=/nonexistent/step_3.pt"))


# ------------------------------------------------------------------- SIGKILL part-way, then resume=auto

# Real digits at 8x8 (the augmentation draws from the torch RNG), 44 batches per epoch: checkpoints every
# 5 iterations, killed once step_10.pt exists (mid-epoch), resumed across the epoch boundary into the
# second epoch (50 iterations; evaluations at 30 and 50). ~1-2 s of training per run on one core, plus the
# interpreter's start-up.
KILL_STEPS = 50
KILL_RUN = ("dataset=digits", "dataset.image_size=8", "trainer.batch_size=32",
            f"trainer.max_steps={KILL_STEPS}", "trainer.eval_every=30", "trainer.checkpoint_every=5",
            "trainer.log_every=5", "telemetry.every=7", "trainer.save_final=true",
            "trainer.progress_bar=false", "device=cpu", "logger=none")  # fmt: skip
SCALER_RUNS = {
    "dynamic": ("model=mlp", "scaler=dynamic", "scaler.growth_interval=8"),  # the scale moves both ways
    "adaptive": ("model=resnet20", "scaler=adaptive", "scaler.update_every=7"),  # resume between recomputes
}


def _cli(run_dir: Path, *overrides: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.Popen(
        [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _finish(proc: subprocess.Popen[str], timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.parametrize(
    "scaler",
    # the dynamic run in make test-full (10 s): make test keeps the adaptive one, whose state is larger
    [pytest.param("dynamic", marks=pytest.mark.slow), "adaptive"],
)
def test_a_run_killed_part_way_and_resumed_ends_bitwise_identical(
    tmp_path: Path, scaler: str, make_full_cfg: Callable[..., DictConfig]
) -> None:
    """The killed run and its resume are real processes (SIGKILL); the uninterrupted run they must end
    equal to trains in this process, through ``train(cfg)`` as ``train.py`` does."""
    overrides = (*KILL_RUN, *SCALER_RUNS[scaler])
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"

    victim = _cli(interrupted, *overrides)
    target = interrupted / "checkpoints" / "step_10.pt"
    deadline = time.monotonic() + 240
    while not target.exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.communicate(timeout=60)
    assert victim.returncode == -signal.SIGKILL, "the run ended before it could be killed part-way"
    assert target.exists() and not (interrupted / "metrics.json").exists()
    killed_at = max(int(p.stem.split("_")[1]) for p in (interrupted / "checkpoints").glob("step_*.pt"))
    assert killed_at < KILL_STEPS

    resumed = _cli(interrupted, *overrides, "resume=auto")
    uninterrupted = make_full_cfg(*overrides)  # trains while the resumed child imports and runs
    uninterrupted.paths.output_dir = str(reference)
    train(uninterrupted)
    out = _finish(resumed)
    assert f"resuming from {interrupted / 'checkpoints'}" in out

    _assert_bitwise_equal(_weights(reference / "model.pt"), _weights(interrupted / "model.pt"))
    ours, theirs = (json.loads((d / "metrics.json").read_text()) for d in (interrupted, reference))
    for key in ("train_loss", "train_accuracy", "test_accuracy", "best_test_accuracy", "skipped_steps",
                "overflow_count", "loss_scale", "underflow_rate", "lr", "steps"):  # fmt: skip
        assert ours[key] == theirs[key], key
    assert (interrupted / "telemetry.jsonl").read_text() == (reference / "telemetry.jsonl").read_text()


def test_fp8_delayed_scaling_resumes_with_its_amax_history(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    """``precision.grad_scaling=tensor_delayed`` keeps an amax history per stored gradient: the checkpoint
    carries it, so a resumed run scales as the uninterrupted run does and ends bitwise on its weights."""
    recipe = ("precision=fp8_e5m2", "precision.grad_scaling={name:tensor_delayed,history_len:4}")
    train(make_cfg(*FAST, *recipe, "scaler=dynamic"))
    first = _weights(tmp_path / "model.pt")
    state = load_checkpoint(tmp_path / "checkpoints" / "step_4.pt")
    assert state["grad_quantizer"], "the checkpoint holds the quantizer's state"
    (tmp_path / "model.pt").unlink()
    (tmp_path / "metrics.json").unlink()
    train(make_cfg(*FAST, *recipe, "scaler=dynamic", f"resume={tmp_path / 'checkpoints' / 'step_4.pt'}"))
    _assert_bitwise_equal(first, _weights(tmp_path / "model.pt"))
