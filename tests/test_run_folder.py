"""One run per folder: the lock (a second process refused, a killed run's lock taken over), the append-only
files trimmed on every start, and ``.hydra/`` written only once a start is accepted.

(The refusals themselves, each one ``error:`` line with the folder left byte for byte as it was, are rows of
``tests/test_bad_input.py``'s ``FOLDER_CASES``.)
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from omegaconf import DictConfig

from adaloss.errors import ConfigError
from adaloss.runner.engine import run_folder, train
from adaloss.runner.engine import trainer as trainer_module
from adaloss.runner.engine.run_folder import LOCK_FILE, RunFolderBusy, RunLock
from conftest import FINISHED_CLI, slow_train_command

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ lock


def test_a_held_lock_refuses_a_second_holder_and_is_free_after_release(tmp_path: Path) -> None:
    first, second = RunLock(tmp_path), RunLock(tmp_path)
    assert first.acquire() is None  # nobody held it before
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid()
    with pytest.raises(RunFolderBusy) as info:
        second.acquire()  # a second open file description: flock refuses it as it would another process
    message = str(info.value)
    assert f"is in use by another live run (PID {os.getpid()} on " in message and "\n" not in message
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    assert second.acquire() is None and second.held
    second.release()


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    stale = {"pid": int(dead.stdout), "host": os.uname().nodename, "started": "earlier", "process_start": "1"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(stale))  # the file a SIGKILLed run leaves; no flock on it
    lock = RunLock(tmp_path)
    previous = lock.acquire()
    assert previous is not None and previous.pid == stale["pid"]
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_without_flock_the_pid_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some network file systems cannot flock: a live holder on this host still refuses, a dead one not."""

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holder = RunLock(tmp_path)
        holder.acquire()
        lock_text = json.loads((tmp_path / LOCK_FILE).read_text())
        start = Path(f"/proc/{live.pid}/stat").read_text().rsplit(")", 1)[-1].split()[19]
        (tmp_path / LOCK_FILE).write_text(json.dumps({**lock_text, "pid": live.pid, "process_start": start}))
        with pytest.raises(RunFolderBusy, match=f"PID {live.pid} on"):
            RunLock(tmp_path).acquire()
    finally:
        live.kill()
        live.wait()
    taker = RunLock(tmp_path)
    assert taker.acquire().pid == live.pid  # the holder is gone: taken over
    taker.release()


def test_an_unwritable_run_folder_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def read_only(path: str | os.PathLike[str], flags: int, *args: object) -> int:
        if Path(path).name == LOCK_FILE:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ConfigError) as info:
        RunLock(tmp_path).acquire()
    message = str(info.value)
    assert f"cannot write to the run folder {tmp_path}: the file system is read-only" in message
    assert "hydra.run.dir=<folder>" in message


# ------------------------------------------------------------------------------------ two real processes

RUN = ("dataset=digits", "dataset.image_size=8", "trainer.batch_size=32", "trainer.max_steps=150",
       "trainer.eval_every=50", "trainer.checkpoint_every=20", "trainer.log_every=1", "telemetry.every=10",
       "trainer.progress_bar=false", "device=cpu", "logger=none", "model=mlp", "resume=auto")  # fmt: skip


def _cli(run_dir: Path, slow: bool = False) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    env.pop("HYDRA_FULL_ERROR", None)
    # each iteration of a slow child sleeps 0.2 s in SGD's step: the run lasts while the others start
    start = slow_train_command(0.2) if slow else [sys.executable, "train.py"]
    return subprocess.Popen(
        [*start, *RUN, f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _steps(path: Path, column: int = 0) -> list[int]:
    lines = path.read_text().splitlines()
    if path.suffix == ".csv":
        return [int(line.split(",")[column]) for line in lines[1:]]
    return [json.loads(line)["step"] for line in lines]


@pytest.mark.slow  # 18 s of subprocesses; make test-full runs it
def test_a_second_process_is_refused_and_a_killed_runs_lock_is_taken_over(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = _cli(run, slow=True)
    deadline = time.monotonic() + 240
    while not (run / "checkpoints" / "step_20.pt").exists() and time.monotonic() < deadline:
        assert first.poll() is None, first.communicate()[1][-3000:]
        time.sleep(0.02)

    second = _cli(run)  # the same command, as a user starting it twice would
    _, err = second.communicate(timeout=240)
    lines = [line for line in err.splitlines() if line.strip()]
    assert second.returncode == 2 and lines[-1].startswith("error: "), err[-3000:]
    assert f"run folder {run} is in use by another live run (PID {first.pid} on" in lines[-1]
    assert "Traceback" not in err and first.poll() is None  # refused while the first one trains on

    first.send_signal(signal.SIGKILL)  # the lock is left behind ...
    first.communicate(timeout=60)
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == first.pid
    third = _cli(run)  # ... and taken over by the next start, which continues the run
    out, err = third.communicate(timeout=300)
    assert third.returncode == 0, err[-3000:]
    assert f"took over the lock of a run that is no longer running (PID {first.pid} on" in out
    assert (run / "metrics.json").exists() and not (run / LOCK_FILE).exists()
    assert _steps(run / "scalars.csv") == list(range(1, 151))  # each iteration once, none twice
    assert _steps(run / "telemetry.jsonl") == [1, *range(11, 151, 10), 150]  # and the last step


# ----------------------------------------------------------------------------- starts trim append-only files

FAST = ("trainer.max_steps=6", "trainer.eval_every=3", "trainer.log_every=1", "telemetry.every=2",
        "dataset.train_size=12", "trainer.checkpoint_every=null")  # fmt: skip


class _Killed(Exception):
    """Stands in for a SIGKILL: the run ends at once, without any of its clean-up."""


def _kill_at(step: int) -> Callable[..., None]:
    def callback(done: int, *_: object) -> None:
        if done == step:
            raise _Killed

    return callback


def test_a_fresh_start_after_a_kill_before_the_first_checkpoint_starts_the_logs_empty(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    reference = make_cfg(*FAST)
    reference.paths.output_dir = str(tmp_path / "reference")
    train(reference)
    for _ in range(2):  # killed twice before any checkpoint: each time the logs hold steps 1..4
        with pytest.raises(_Killed):
            train(make_cfg(*FAST, "resume=auto"), callbacks=[_kill_at(4)])
        assert _steps(tmp_path / "scalars.csv") == [1, 2, 3, 4]
        assert _steps(tmp_path / "telemetry.jsonl") == [1, 3]
    train(make_cfg(*FAST, "resume=auto"))  # no checkpoint: a fresh start of the same run
    for name in ("scalars.csv", "telemetry.jsonl"):  # once each, as in a run never killed
        assert (tmp_path / name).read_text() == (tmp_path / "reference" / name).read_text(), name


# ----------------------------------------------------------------------------------------------- .hydra/


def test_hydra_files_are_written_by_the_run_once_it_is_accepted(finished_cli_run: Path) -> None:
    """configs/hydra/default.yaml turns Hydra's own writing off; the run writes the same three files."""
    run = finished_cli_run  # python train.py <FINISHED_CLI> hydra.run.dir=<run>, finished
    assert yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text()) == list(FINISHED_CLI)
    config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    assert config["model"]["name"] == "mlp" and config["trainer"]["max_steps"] == 3
    hydra = yaml.safe_load((run / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert hydra["runtime"]["output_dir"] == str(run) and hydra["runtime"]["choices"]["model"] == "mlp"


# ------------------------------------------------------------------------- a finished run stays finished


def _snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``folder`` with its modification time (ns) and bytes."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*")
            if p.is_file()}  # fmt: skip


def test_resume_auto_on_a_finished_run_prints_one_line_and_changes_nothing(
    make_cfg: Callable[..., DictConfig], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = ("model=mlp", "trainer.max_steps=3", "trainer.checkpoint_every=2")
    first = train(make_cfg(*overrides))
    assert (tmp_path / "done").is_file() and (tmp_path / "checkpoints" / "step_2.pt").is_file()
    before = _snapshot(tmp_path)
    capsys.readouterr()
    time.sleep(0.01)  # a file rewritten now would get a later mtime
    again = train(make_cfg(*overrides, "resume=auto", "optimizer.lr=0.5"))  # the lr may change on resume
    assert again == json.loads((tmp_path / "metrics.json").read_text())
    assert again["test_accuracy"] == first["test_accuracy"] and again["steps"] == 3
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        f"run {tmp_path} is finished ({tmp_path / 'done'} exists): its metrics are in "
        f"{tmp_path / 'metrics.json'}; nothing to do (to train again, start a run in another folder)"
    ]
    assert _snapshot(tmp_path) == before  # no file written, touched, added or removed


def test_resume_auto_on_a_finished_run_from_the_command_line_exits_0_with_its_folder_untouched(
    tmp_path: Path, finished_cli_run: Path
) -> None:
    """The finished run (``python train.py <FINISHED_CLI>``, shared) copied, then the same command with
    ``resume=auto`` into the copy."""
    run = tmp_path / "run"
    shutil.copytree(finished_cli_run, run)
    before = _snapshot(run)
    assert {"done", "metrics.json", "train.log", "checkpoints/step_2.pt"} <= set(before)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "train.py", *FINISHED_CLI, f"hydra.run.dir={run}", "resume=auto"]
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines() == [
        f"run {run} is finished ({run / 'done'} exists): its metrics are in {run / 'metrics.json'}; "
        "nothing to do (to train again, start a run in another folder)"
    ]
    assert "Traceback" not in again.stderr
    assert _snapshot(run) == before  # train.log included: not a line appended


def test_the_done_marker_is_written_last_and_only_by_a_run_that_finished(
    make_cfg: Callable[..., DictConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = ("model=mlp", "trainer.max_steps=4", "trainer.checkpoint_every=2")
    reference = make_cfg(*overrides)
    reference.paths.output_dir = str(tmp_path / "reference")
    expected = train(reference)
    real_write = run_folder.write_json_atomic

    def dies_after_metrics(path: Path, data: dict) -> Path:  # the process dies right after metrics.json
        written = real_write(path, data)
        if Path(path).name == "metrics.json":
            raise _Killed
        return written

    monkeypatch.setattr(trainer_module, "write_json_atomic", dies_after_metrics)
    with pytest.raises(_Killed):
        train(make_cfg(*overrides))
    monkeypatch.undo()
    assert (tmp_path / "metrics.json").is_file() and not (tmp_path / "done").exists()
    # not finished without its marker: resume=auto continues from the newest checkpoint and finishes
    resumed = train(make_cfg(*overrides, "resume=auto"))
    assert (tmp_path / "done").is_file() and resumed["test_accuracy"] == expected["test_accuracy"]

    # a resume from one of a finished run's checkpoint files rewrites its record: unfinished meanwhile
    seen = []
    train(make_cfg(*overrides, f"resume={tmp_path / 'checkpoints' / 'step_2.pt'}"),
          callbacks=[lambda *_: seen.append((tmp_path / "done").exists())])  # fmt: skip
    assert seen == [False, False] and (tmp_path / "done").is_file()


def test_resume_auto_into_a_finished_run_of_other_model_settings_is_refused(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    overrides = ("model=vit", "trainer.max_steps=3", "trainer.checkpoint_every=2")
    train(make_cfg(*overrides))
    before = _snapshot(tmp_path)
    with pytest.raises(ConfigError) as info:  # the same layer shapes, another dropout
        train(make_cfg(*overrides, "model.dropout=0.1", "resume=auto"))
    message = str(info.value)
    assert f"run folder {tmp_path} holds a finished run made with model.dropout=0.0:" in message, message
    assert "hydra.run.dir=<new folder>" in message and "\n" not in message
    assert {k: v[1] for k, v in _snapshot(tmp_path).items()} == {k: v[1] for k, v in before.items()}
