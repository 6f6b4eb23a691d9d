"""One run per folder: the lock a live run holds, the record a start must not mix with, and the files a
start writes once it is allowed to.

A run folder (``paths.output_dir``, Hydra's ``hydra.run.dir``) holds the record of exactly one run:
``metrics.json``, ``model.pt``, ``telemetry.jsonl``, ``scalars.csv``, ``checkpoints/``, the W&B files,
``run_key.json`` (the settings that identify the run, :func:`adaloss.runner.engine.run_key.config_key`),
``.hydra/`` (the composed config) and, written last, the ``done`` marker. :class:`RunFolder` enforces that:

* **Lock.** A live run holds ``<run dir>/.lock`` with ``fcntl.flock``; a second process on the folder is
  refused (:class:`RunFolderBusy`, one line naming the holder's PID, host and start time). The kernel drops a
  flock when its process dies, however it dies (SIGKILL included), so a lock left by a killed run is taken
  over by the next start, which logs whose it was. Where the file system has no flock (some network
  mounts), the PID, host and process start time written in the file decide instead.
* **Record.** A start that is not a resume of the same run never writes into a folder holding another run's
  record: ``resume=null`` into such a folder, or any start whose settings differ from the recorded ones, is
  refused (a ``ConfigError``) before anything is written. That decision is
  :func:`adaloss.runner.engine.admission.check_folder`'s, with the run's other admission checks.
* **Nothing written before the checks pass.** Hydra would write ``.hydra/`` before ``train()`` runs, so a
  refused resume would already have replaced the finished run's config; ``configs/hydra/default.yaml``
  turns that off (``hydra.output_subdir: null``) and :meth:`RunFolder.commit` writes the same three files
  once the start is accepted. The log lines a refused start appended to ``train.log`` are cut off again.

Writes into the folder go through :func:`writing`, which turns an ``OSError`` (disk full, read-only file
system, a folder deleted while the run writes into it) into one :class:`RunFolderError` line.

**Done marker.** As in DomainBed, a run is finished only if its ``done`` file exists: the trainer writes it
after everything else (``metrics.json`` included), so a run that died at any point, however late, has none
and is continued by ``resume=auto``. ``resume=auto`` on a finished run changes nothing
(:func:`finished_run`); a resume from a checkpoint file into a finished folder removes the marker before
it rewrites the record (:meth:`RunFolder.commit`), so the marker never vouches for half a record.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaloss.errors import ConfigError
from adaloss.runner.engine.run_key import key_differences, model_differences
from adaloss.runner.logging.metrics import write_atomic, write_json_atomic

log = logging.getLogger(__name__)

__all__ = [
    "DONE_FILE",
    "KEY_FILE",
    "LOCK_FILE",
    "RECORD_ENTRIES",
    "RunFolder",
    "RunFolderBusy",
    "RunFolderError",
    "RunLock",
    "FinishedRun",
    "finished_run",
    "resume_command",
    "writing",
]

LOCK_FILE = ".lock"
KEY_FILE = "run_key.json"
#: Written last by a run that finished (DomainBed's ``done`` file); its absence means "not finished".
DONE_FILE = "done"
METRICS_FILE = "metrics.json"
#: What makes a folder hold a run's record (``.hydra/`` and ``train.log`` are Hydra's and do not).
RECORD_ENTRIES = (
    METRICS_FILE,
    DONE_FILE,
    "model.pt",
    "telemetry.jsonl",
    "scalars.csv",
    KEY_FILE,
    "checkpoints",
    "wandb",
)


class RunFolderError(RuntimeError):
    """Writing the run's record failed (disk full, read-only, folder gone). One line; ``train.py`` prints it
    as ``error: ...`` and exits with status 1 (the run had started: not bad input)."""


class RunFolderBusy(ConfigError):
    """Another live process holds the run folder's lock."""


# --------------------------------------------------------------------------------------------- writes

_WHY = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOENT: "its folder disappeared while the run was writing (something else removed it)",
}


def describe_os_error(error: OSError, folder: Path) -> str:
    """What went wrong and what to do about it, in a few words (no path repeated but ``folder``)."""
    why = _WHY.get(error.errno or 0) or error.strerror or str(error) or type(error).__name__
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{why}: free space there (df -h {folder})"
    if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"{why}: make {folder} writable, or run in another folder (hydra.run.dir=<folder>)"
    return why


@contextlib.contextmanager
def writing(what: str, path: Path) -> Iterator[None]:
    """Turn an ``OSError`` raised while writing ``what`` (e.g. ``"checkpoint"``) at ``path`` into a
    one-line :class:`RunFolderError`. Wrap only writes: an ``OSError`` while reading data is not this."""
    try:
        yield
    except OSError as error:
        reason = describe_os_error(error, Path(path).parent)
        raise RunFolderError(f"cannot write the {what} {path}: {reason}") from error


# ---------------------------------------------------------------------------------------------- lock


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux ``/proc``), or None: with the PID
    it names a process uniquely, as PIDs are reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22; the name in parentheses may hold spaces


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or held) a run folder's lock, as written in the lock file."""

    pid: int
    host: str
    started: str  # local time, for people
    process_start: str | None  # /proc start ticks, for the no-flock fallback

    @classmethod
    def me(cls) -> LockHolder:
        pid = os.getpid()
        return cls(pid, socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S"), _process_start(pid))

    @classmethod
    def parse(cls, text: str) -> LockHolder | None:
        try:
            data = json.loads(text)
            return cls(int(data["pid"]), str(data["host"]), str(data["started"]), data.get("process_start"))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        return f"PID {self.pid} on {self.host}, started {self.started}"

    def alive(self) -> bool:
        """Whether the holder still runs: certain on this host; assumed on another (it cannot be asked)."""
        if self.host != socket.gethostname():
            return True
        start = _process_start(self.pid)
        if start is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return self.process_start is None  # alive, but without /proc we cannot tell a reused PID
        return self.process_start is None or start == self.process_start


#: flock errors that mean "this file system cannot lock", not "someone else holds it".
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


class RunLock:
    """An exclusive claim on a run folder for one live process: ``flock`` on ``<folder>/.lock``.

    ``acquire()`` returns the previous holder when it took over a lock left by a process that died, else
    None; it raises :class:`RunFolderBusy` when a live process holds it, and ``ConfigError`` when the
    folder cannot be written. ``release()`` deletes the file and drops the lock. Cost: a few system calls.

    The file is deleted while still locked, and a new holder checks after locking that the file it locked is
    still the one at the path (else it locks again), so two processes can never both hold the folder.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> LockHolder | None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise self._unwritable(error) from None
        for _ in range(100):  # another process may delete the file between our open and our lock
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as error:
                raise self._unwritable(error) from None
            try:
                _flock(fd)
            except BlockingIOError:
                holder = LockHolder.parse(_read_fd(fd))
                os.close(fd)
                raise self._busy(holder) from None
            except OSError as error:
                if error.errno not in _NO_FLOCK:
                    os.close(fd)
                    raise
                previous = LockHolder.parse(_read_fd(fd))
                if previous is not None and previous.alive() and previous.pid != os.getpid():
                    os.close(fd)
                    raise self._busy(previous) from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            previous = LockHolder.parse(_read_fd(fd))
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(vars(LockHolder.me())).encode(), 0)
            except OSError as error:
                os.close(fd)
                raise self._unwritable(error) from None
            self._fd = fd
            return previous
        raise RuntimeError(f"could not lock {self.path}: it kept being replaced")

    def busy(self) -> bool:
        """Whether another live process holds the lock now; creates and writes nothing (an existing lock
        file is opened read-only and locked for an instant). Cost: a few system calls."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return False  # no lock file: nobody holds the folder
        try:
            try:
                _flock(fd)
            except BlockingIOError:
                return True
            except OSError as error:
                if error.errno not in _NO_FLOCK:
                    raise
                holder = LockHolder.parse(_read_fd(fd))
                return holder is not None and holder.alive() and holder.pid != os.getpid()
            return False
        finally:
            os.close(fd)  # drops the instant's flock

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still locked: see the class docstring
        os.close(self._fd)  # drops the flock
        self._fd = None

    def _busy(self, holder: LockHolder | None) -> RunFolderBusy:
        who = f" ({holder.describe()})" if holder else ""
        return RunFolderBusy(
            f"run folder {self.folder} is in use by another live run{who}: two processes would overwrite "
            "each other's checkpoints and logs; wait for it to finish or stop it, or start this run in "
            "another folder (hydra.run.dir=<new folder>)"
        )

    def _unwritable(self, error: OSError) -> ConfigError:
        return ConfigError(
            f"cannot write to the run folder {self.folder}: {describe_os_error(error, self.folder)}"
        )


def _flock(fd: int) -> None:
    """An exclusive, non-blocking ``flock`` on ``fd`` (``BlockingIOError`` if another holds it); without
    the ``fcntl`` module an ``OSError`` that makes :class:`RunLock` fall back to the PID check."""
    try:
        import fcntl
    except ImportError:
        raise OSError(errno.ENOSYS, "no fcntl.flock on this platform") from None
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _read_fd(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------ the folder


class RunFolder:
    """The run folder of one training run, from the first check to the last write.

    Example (what ``train()`` does; ``enabled=False`` on data-parallel ranks other than 0 makes every
    method a no-op)::

        folder = RunFolder(run_dir)
        folder.lock()                                   # refuses a folder a live run holds
        try:
            ...                                         # build; admission.check_folder(folder, ...)
            folder.commit(key, config_yaml)             # run_key.json and .hydra/
            ...                                         # train; metrics.json
            folder.mark_done()                          # last: the run is finished
        finally:
            folder.release()                            # a start refused before commit() leaves no trace

    A start refused before :meth:`commit` (any exception) leaves the folder as it found it: ``*.log`` files
    are cut back to their length at :meth:`lock`, as the lines the refused start logged there belong to no
    run.
    """

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self._lock = RunLock(self.path)
        self._log_sizes: dict[Path, int] = {}
        self.committed = False

    def lock(self) -> None:
        """Take the folder's lock (see :class:`RunLock`)."""
        if not self.enabled:
            return
        previous = self._lock.acquire()
        self._log_sizes = {p: p.stat().st_size for p in self.path.glob("*.log") if p.is_file()}
        if previous is not None and previous.pid != os.getpid():
            log.warning(
                "%s: took over the lock of a run that is no longer running (%s)",
                self.path, previous.describe(),
            )  # fmt: skip

    def record(self) -> list[str]:
        """The entries of :data:`RECORD_ENTRIES` present (folders only if not empty)."""
        found = []
        for name in RECORD_ENTRIES:
            entry = self.path / name
            if entry.is_dir():
                if any(entry.iterdir()):
                    found.append(f"{name}/")
            elif entry.exists():
                found.append(name)
        return found

    def recorded_key(self) -> dict[str, Any] | None:
        """The settings of the run recorded here (``run_key.json``), or None."""
        try:
            key = json.loads((self.path / KEY_FILE).read_text(encoding="utf-8")).get("config_key")
        except (OSError, ValueError, AttributeError):
            return None
        return key if isinstance(key, dict) else None

    def commit(self, key: Mapping[str, Any], config_yaml: str) -> None:
        """The start is accepted: record ``key`` in ``run_key.json`` and write Hydra's ``.hydra/`` files
        (``config.yaml``: ``config_yaml``, the composed config; ``hydra.yaml``, ``overrides.yaml``, as Hydra
        would have) when Hydra launched this run in this folder. A ``done`` marker already there (a finished
        run resumed from one of its checkpoint files) is removed first: the record is about to be rewritten.
        Cost: four small atomic writes."""
        self.committed = True
        if not self.enabled:
            return
        with writing("done marker", self.path / DONE_FILE):
            _remove_durably(self.path / DONE_FILE)
        with writing("run key", self.path / KEY_FILE):
            write_json_atomic(self.path / KEY_FILE, {"config_key": dict(key)})
        hydra = _hydra_node(self.path)
        if hydra is None or hydra.hydra.output_subdir is not None:  # not launched here, or Hydra wrote them
            return
        from omegaconf import OmegaConf

        files = {
            "config.yaml": config_yaml,
            "hydra.yaml": OmegaConf.to_yaml(hydra),
            "overrides.yaml": OmegaConf.to_yaml(hydra.hydra.overrides.task),
        }
        for name, text in files.items():
            path = self.path / ".hydra" / name
            with writing("Hydra record", path):
                write_atomic(path, lambda handle, text=text: handle.write(text.encode("utf-8")))

    def mark_done(self) -> None:
        """Write the ``done`` marker: the run is finished. Call it after every other write of the run, so
        that the marker exists only beside a complete record. Cost: one small atomic write."""
        if not self.enabled:
            return
        path = self.path / DONE_FILE
        with writing("done marker", path):
            write_atomic(path, lambda handle: handle.write(f"done: {METRICS_FILE} is complete\n".encode()))

    def release(self) -> None:
        """Drop the lock; before :meth:`commit`, first cut the ``*.log`` files back (see the class)."""
        if not self.enabled:
            return
        if not self.committed:
            for path, size in self._log_sizes.items():
                with contextlib.suppress(OSError):
                    if path.stat().st_size > size:
                        os.truncate(path, size)
        self._lock.release()


def _remove_durably(path: Path) -> None:
    """Delete ``path`` if it exists and make the deletion durable (fsync of its folder)."""
    if not path.exists():
        return
    path.unlink()
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class FinishedRun:
    """The run that finished in a folder (its ``done`` marker exists): its record, read without writing."""

    path: Path
    metrics: dict[str, Any]  # metrics.json
    key: dict[str, Any] | None  # run_key.json's settings, None if unreadable

    def differences(self, key: Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
        """The finished run's settings that differ from this start's, as overrides (``seed=0``,
        ``model.hidden=[256,256]``): the fields of ``key`` (:func:`adaloss.runner.engine.run_key.config_key`)
        and the ``model`` section of the resolved ``config``. Empty: this start is that run."""
        if self.key is None:
            return [f"{KEY_FILE} unreadable"]
        theirs = (self.metrics.get("config") or {}).get("model") or {}
        return key_differences(self.key, key) + model_differences(theirs, config.get("model") or {})

    def refusal(self, differences: list[str]) -> ConfigError:
        """The error for ``resume=auto`` into this finished run with other settings."""
        return ConfigError(
            f"run folder {self.path} holds a finished run made with {' '.join(differences)}: resume=auto "
            f"with those settings reports its metrics ({self.path / METRICS_FILE}); to train with these, "
            "start a run in another folder (hydra.run.dir=<new folder>)"
        )


def finished_run(path: Path) -> FinishedRun | None:
    """The run that finished in ``path`` (its ``done`` marker exists), else None. Reads two small files and
    writes nothing. ``ConfigError`` when the marker exists but ``metrics.json`` cannot be read."""
    folder = Path(path)
    if not (folder / DONE_FILE).is_file():
        return None
    try:
        metrics = json.loads((folder / METRICS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        metrics = error
    if not isinstance(metrics, dict):
        why = type(metrics).__name__ if isinstance(metrics, Exception) else "it holds no metrics"
        raise ConfigError(
            f"run folder {folder} is marked finished ({DONE_FILE}) but its {METRICS_FILE} cannot be read "
            f"({why}); restore it, or delete {folder / DONE_FILE} to let resume=auto finish the run again "
            "from its newest checkpoint"
        )
    return FinishedRun(folder, metrics, RunFolder(folder).recorded_key())


def _hydra_node(run_dir: Path) -> Any:
    """Hydra's own config (``{"hydra": ...}``) if Hydra launched the current job in ``run_dir``, else None."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return None
        node = HydraConfig.instance().cfg
        output_dir = Path(str(node.hydra.runtime.output_dir))
    except Exception:  # noqa: BLE001 - not inside a launched job (a composed config in a test)
        return None
    return node if output_dir.resolve() == Path(run_dir).resolve() else None


def resume_command(run_dir: Path) -> str:
    """The command that continues the run in ``run_dir``: this job's overrides (Hydra's
    ``hydra.overrides.task``, without ``resume=``) plus ``resume=auto hydra.run.dir=<run_dir>``, for the
    Python and the ``train.py`` this process runs. Outside a Hydra job: ``<same overrides>``."""
    hydra = _hydra_node(run_dir)
    if hydra is not None:
        overrides = [str(o) for o in hydra.hydra.overrides.task if not str(o).startswith("resume=")]
        args = [shlex.quote(o) for o in overrides]
    else:
        args = ["<same overrides>"]
    root = os.environ.get("ADALOSS_ROOT")
    script = Path(root) / "train.py" if root else Path("train.py")
    words = [_short(Path(sys.executable)), _short(script), *args, "resume=auto"]
    return " ".join([*words, shlex.quote(f"hydra.run.dir={_short(Path(run_dir))}")])


def _short(path: Path) -> str:
    """``path`` relative to the working directory when inside it (``.venv/bin/python``), else absolute."""
    try:
        return str(path.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path.absolute())
