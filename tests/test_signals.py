"""Signals: SIGTERM, SIGINT, SIGUSR2 and SIGHUP finish the current iteration, write a checkpoint and stop
with one line saying how to resume (exit status 128 + the signal); the resumed run ends bitwise where the
uninterrupted one ends. Handlers installed before the run (submitit's) still get the signal afterwards.

In-process tests send the signal to the test process itself from a step callback (cheap, exact about
the iteration); the command-line tests send it to a real ``python train.py`` and run the printed command.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from adaloss.runner.engine import train
from adaloss.runner.engine.signals import RunInterrupted
from conftest import slow_train_command

ROOT = Path(__file__).resolve().parents[1]
SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGUSR2, signal.SIGHUP]

# 3 batches per epoch: the signal at iteration 4 stops mid-epoch, between the periodic checkpoints (every 5)
RUN = ("trainer.max_steps=8", "trainer.checkpoint_every=5", "trainer.eval_every=3", "trainer.log_every=2",
       "telemetry.every=3", "dataset.train_size=12", "trainer.save_final=true", "scaler=dynamic")  # fmt: skip


def _send_at(step: int, signum: int) -> Callable[..., None]:
    """A step callback that sends ``signum`` to this process in iteration ``step`` (the callback runs after
    the update, before the iteration's logging, evaluation and checkpoint), which must still complete."""

    def callback(done: int, *_: object) -> None:
        if done == step:
            os.kill(os.getpid(), signum)

    return callback


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _same_weights(a: Path, b: Path) -> bool:
    x, y = _weights(a), _weights(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_stops_after_the_iteration_with_a_checkpoint_and_the_resume_ends_bitwise_equal(
    make_cfg: Callable[..., DictConfig], tmp_path: Path, signum: int, caplog: pytest.LogCaptureFixture
) -> None:
    reference_dir = tmp_path / "reference"
    cfg = make_cfg(*RUN)
    cfg.paths.output_dir = str(reference_dir)
    reference = train(cfg)

    # The signal's default action, whatever this test process inherited (under nohup SIGHUP is ignored,
    # and an ignored signal stays ignored: test_a_signal_the_parent_ignores_stays_ignored).
    inherited = signal.signal(signum, signal.SIG_DFL)
    try:
        with pytest.raises(RunInterrupted) as info:
            train(make_cfg(*RUN), callbacks=[_send_at(4, signum)])
        assert signal.getsignal(signum) is signal.SIG_DFL  # the test process's handler is back
    finally:
        signal.signal(signum, inherited)
    name = signal.Signals(signum).name
    message = str(info.value)
    assert info.value.exit_status == 128 + signum and "\n" not in message
    assert message.startswith(f"{name} received: stopped after iteration 4/8, checkpoint ")
    assert "resume with:" in message and "resume=auto" in message
    assert [r.getMessage() for r in caplog.records if "resume with:" in r.getMessage()] == [message]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_4.pt"]
    assert not (tmp_path / "metrics.json").exists()
    rows = (tmp_path / "scalars.csv").read_text().splitlines()
    assert [int(r.split(",")[0]) for r in rows[1:]] == [1, 2, 3, 4]  # every iteration done, and no more

    resumed = train(make_cfg(*RUN, "resume=auto"))
    assert _same_weights(reference_dir / "model.pt", tmp_path / "model.pt")
    for key in ("train_loss", "test_accuracy", "best_test_accuracy", "loss_scale", "skipped_steps", "lr"):
        assert resumed[key] == reference[key], key
    for name in ("telemetry.jsonl", "scalars.csv"):
        assert (tmp_path / name).read_text() == (reference_dir / name).read_text(), name


def test_a_signal_the_parent_ignores_stays_ignored(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    """``nohup python train.py ...`` ignores SIGHUP: the run installs no handler for it and trains on."""
    inherited = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        metrics = train(make_cfg(*RUN), callbacks=[_send_at(4, signal.SIGHUP)])
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, inherited)
    assert metrics["steps"] == 8 and (tmp_path / "metrics.json").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_5.pt"]  # as uninterrupted


def test_handlers_installed_before_the_run_get_the_signal_after_the_checkpoint(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    """submitit's way: its SIGUSR2 handler requeues and exits, its SIGTERM handler lets the run go on."""
    calls: list[tuple[str, list[str]]] = []

    def requeue(signum: int, frame: object) -> None:
        calls.append(("requeue", sorted(p.name for p in (tmp_path / "checkpoints").iterdir())))
        raise SystemExit(-1)  # what submitit's handler does after `scontrol requeue`

    def bypass(signum: int, frame: object) -> None:
        calls.append(("bypass", sorted(p.name for p in (tmp_path / "checkpoints").iterdir())))

    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    signal.signal(signal.SIGUSR2, requeue)
    signal.signal(signal.SIGTERM, bypass)
    try:
        metrics = train(make_cfg(*RUN), callbacks=[_send_at(2, signal.SIGTERM)])
        assert metrics["steps"] == 8 and (tmp_path / "metrics.json").exists()  # SIGTERM: the run went on
        assert calls == [("bypass", ["step_2.pt"])]  # ... after its checkpoint was written
        (tmp_path / "done").unlink()  # unfinished, as if killed after its last checkpoint
        with pytest.raises(SystemExit):
            train(make_cfg(*RUN, "resume=auto"), callbacks=[_send_at(7, signal.SIGUSR2)])
        assert calls[1] == ("requeue", ["step_5.pt", "step_7.pt"])  # saved, then handed on
        assert signal.getsignal(signal.SIGUSR2) is requeue  # and left installed for whoever owns it
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# --------------------------------------------------------------------------------------- the command line

CLI_RUN = ("dataset=digits", "dataset.image_size=8", "trainer.batch_size=32", "trainer.max_steps=120",
           "trainer.eval_every=50", "trainer.checkpoint_every=40", "trainer.log_every=1", "telemetry.every=7",
           "trainer.save_final=true", "trainer.progress_bar=false", "device=cpu", "logger=none", "model=mlp",
           "scaler=dynamic", "scaler.growth_interval=8")  # fmt: skip


def _cli(
    run_dir: Path, *overrides: str, step_sleep: float = 0.0, hold: Path | None = None
) -> subprocess.Popen[str]:
    """``train.py`` in a child process; ``step_sleep`` > 0 makes each iteration last at least that long
    (SGD's step sleeps first), so that a signal sent after the first logged rows surely arrives mid-run;
    with ``hold``, no iteration ends while that file exists (:func:`conftest.slow_train_command`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    env.pop("HYDRA_FULL_ERROR", None)
    slow = step_sleep or hold is not None
    start = slow_train_command(step_sleep, hold) if slow else [sys.executable, "train.py"]
    command = [*start, *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_default_signals,
    )


def _default_signals() -> None:
    """In the child: the signals' default actions, whatever this test process inherited (a test run started
    in the background of a non-interactive shell ignores SIGINT, and ignored signals stay ignored across
    ``exec``; the run then, rightly, installs no handler for it)."""
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)


def _rows(run_dir: Path) -> int:
    try:
        return len((run_dir / "scalars.csv").read_text().splitlines()) - 1
    except FileNotFoundError:
        return 0


def _wait_for_rows(proc: subprocess.Popen[str], run_dir: Path, rows: int) -> None:
    deadline = time.monotonic() + 240
    while _rows(run_dir) < rows and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the signal"


class _Output:
    """The run's output, read line by line as it comes (a thread), so that a test can wait for a line."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc, self.lines, self.arrived = proc, [], threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.arrived:
                self.lines.append(line)
                self.arrived.notify_all()
        with self.arrived:
            self.lines.append(None)  # the end
            self.arrived.notify_all()

    def wait_for(self, text: str, deadline_s: float = 240) -> str:
        """The first line holding ``text``, once the run printed it. The deadline only bounds a failure
        (the run ended, or hangs, without printing it); success never waits for a time."""
        with self.arrived:
            found = self.arrived.wait_for(
                lambda: None in self.lines or any(line and text in line for line in self.lines), deadline_s
            )
            match = next((line for line in self.lines if line and text in line), None)
        if match is None:
            self.proc.kill()
            shown = "".join(line for line in self.lines if line)[-3000:]
            raise AssertionError(
                f"the run {'ended' if found else 'hangs'} without printing {text!r}: {shown}"
            )
        return match

    def finish(self, timeout: float = 120) -> str:
        """Everything the run printed, once it has ended."""
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=timeout)
        return "".join(line for line in self.lines if line)


def _signal(proc: subprocess.Popen[str], signum: int, run_dir: Path) -> None:
    """Send ``signum`` once the run has logged 10 iterations."""
    _wait_for_rows(proc, run_dir, 10)
    proc.send_signal(signum)


def _stopped(proc: subprocess.Popen[str], signum: int, run_dir: Path) -> list[str]:
    """Check the exit status, the one line and the checkpoint it names; return the resume command."""
    name = signal.Signals(signum).name
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signum, (name, proc.returncode, out[-3000:])
    assert "Traceback" not in out and "error:" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if "resume with:" in line]
    assert len(lines) == 1, (name, out[-3000:])
    pattern = rf"{name} received: stopped after iteration (\d+)/120, checkpoint (\S+);"
    stopped = re.search(pattern, lines[0])
    assert stopped, lines[0]
    step, checkpoint = int(stopped.group(1)), Path(stopped.group(2))
    assert 10 <= step < 120 and checkpoint == run_dir / "checkpoints" / f"step_{step}.pt"
    assert checkpoint.is_file() and not (run_dir / "metrics.json").exists()
    command = shlex.split(lines[0].split("resume with: ", 1)[1])
    assert command[-2:] == ["resume=auto", f"hydra.run.dir={run_dir}"]
    return command


def _resumed_equals_reference(command: list[str], run_dir: Path, reference_dir: Path) -> None:
    """Run the printed command; the run it finishes matches the uninterrupted one bit for bit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _same_weights(reference_dir / "model.pt", run_dir / "model.pt")
    ours, theirs = (json.loads((d / "metrics.json").read_text()) for d in (run_dir, reference_dir))
    for key in ("train_loss", "test_accuracy", "best_test_accuracy", "loss_scale", "underflow_rate"):
        assert ours[key] == theirs[key], key
    for log in ("telemetry.jsonl", "scalars.csv"):
        assert (run_dir / log).read_text() == (reference_dir / log).read_text(), log


def test_sigterm_on_the_command_line_saves_prints_one_line_and_the_printed_command_resumes(
    tmp_path: Path, make_full_cfg: Callable[..., DictConfig]
) -> None:
    """The stopped run and the printed command are real processes; the uninterrupted run they must end
    equal to trains in this process (``train(cfg)``, what ``train.py`` runs: nothing about it is the
    command line's, and a third interpreter costs seconds of imports)."""
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    victim = _cli(run_dir, *CLI_RUN, step_sleep=0.02)
    _signal(victim, signal.SIGTERM, run_dir)
    command = _stopped(victim, signal.SIGTERM, run_dir)
    reference = make_full_cfg(*CLI_RUN)
    reference.paths.output_dir = str(reference_dir)
    train(reference)
    _resumed_equals_reference(command, run_dir, reference_dir)


@pytest.mark.slow
def test_every_stop_signal_on_the_command_line(tmp_path: Path) -> None:
    """SIGINT, SIGUSR2 and SIGHUP as SIGTERM above (the in-process test covers each one's resume too)."""
    reference_dir = tmp_path / "reference"
    reference = _cli(reference_dir, *CLI_RUN)
    others = [signal.SIGINT, signal.SIGUSR2, signal.SIGHUP]
    victims = {s: _cli(tmp_path / signal.Signals(s).name, *CLI_RUN, step_sleep=0.02) for s in others}
    for signum, proc in victims.items():
        _signal(proc, signum, tmp_path / signal.Signals(signum).name)
    commands = {s: _stopped(p, s, tmp_path / signal.Signals(s).name) for s, p in victims.items()}
    out, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, out[-3000:]
    for signum, command in commands.items():
        _resumed_equals_reference(command, tmp_path / signal.Signals(signum).name, reference_dir)


def test_a_second_ctrl_c_stops_at_once_with_one_line(tmp_path: Path) -> None:
    """No timing: the run cannot finish its iteration (the hold file), and the second Ctrl-C is sent only
    once the run has said it received the first (two signals sent before the handler runs are one)."""
    run_dir, hold = tmp_path / "run", tmp_path / "hold"
    hold.touch()
    proc = _cli(run_dir, *CLI_RUN, hold=hold)
    output = _Output(proc)
    output.wait_for("trainer][INFO] - ")  # training has begun: the run's handlers are installed
    proc.send_signal(signal.SIGINT)
    acknowledged = output.wait_for("SIGINT received: stopping after this iteration")
    assert acknowledged.endswith("with a checkpoint; Ctrl-C again stops at once\n"), acknowledged
    proc.send_signal(signal.SIGINT)
    out = output.finish()
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if line.startswith("interrupted: stopped at once")]
    assert len(lines) == 1 and f"hydra.run.dir={run_dir}" in lines[0], out[-3000:]
    assert not list((run_dir / "checkpoints").glob("*.tmp")) if (run_dir / "checkpoints").exists() else True
    assert not (run_dir / ".lock").exists()  # released on the way out


def _submitit_job(sweep: Path) -> int | None:
    """The PID of the process submitit's local executor runs the sweep's job in, if it runs yet."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"submitit.core._submit" in cmdline and any(str(sweep).encode() in arg for arg in cmdline):
            return int(proc.name)
    return None


@pytest.mark.slow
def test_submitit_requeues_a_job_stopped_by_its_preemption_signal(tmp_path: Path) -> None:
    """The submitit path end to end (its local executor stands in for SLURM): SIGUSR2 to the job, our
    checkpoint, then submitit's handler requeues it, and the requeued job resumes and finishes bitwise as an
    uninterrupted run."""
    overrides = [*(o for o in CLI_RUN if not o.startswith("trainer.max_steps")), "trainer.max_steps=2000",
                 "resume=auto"]  # fmt: skip
    reference_dir, sweep = tmp_path / "reference", tmp_path / "sweep"
    reference = _cli(reference_dir, *overrides)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(
        [sys.executable, "train.py", "-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=20",
         f"hydra.sweep.dir={sweep}", *overrides],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    job = None
    while time.monotonic() < deadline and launcher.poll() is None:
        job = _submitit_job(sweep)
        runs = list(sweep.glob("0_*"))
        if job is not None and runs and _rows(runs[0]) >= 10:
            break
        time.sleep(0.05)
    assert job is not None and launcher.poll() is None, "the job ended before the signal"
    os.kill(job, signal.SIGUSR2)
    out, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, out[-3000:]
    (run_dir,) = sweep.glob("0_*")
    logs = "".join(p.read_text() for p in (sweep / ".submitit").rglob("*_log.*"))
    assert "SIGUSR2 received: stopped after iteration" in logs, logs[-3000:]
    assert "passing the signal on" in logs and "Traceback" not in logs, logs[-3000:]
    assert "Requeued job" in logs and "resuming from" in logs, logs[-3000:]
    out, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, out[-3000:]
    assert _same_weights(reference_dir / "model.pt", run_dir / "model.pt")
    assert (run_dir / "scalars.csv").read_text() == (reference_dir / "scalars.csv").read_text()
