"""Stopping on a signal at a step boundary, with a checkpoint, instead of dying mid-step.

SLURM sends SIGTERM (preemption, ``scancel``) and, with ``--signal``, SIGUSR2 before a time limit; submitit
uses SIGUSR2 to requeue; Ctrl-C is SIGINT; a closed terminal sends SIGHUP. During ``train()``
:class:`StopRequests` catches them: the current iteration finishes, the trainer writes a checkpoint and
stops with one line saying how to resume (:class:`RunInterrupted`; ``train.py`` exits with status
``128 + signal number``, the shell's convention for "terminated by a signal", so schedulers and wrappers
see an interrupted run, not a finished or failed one).

Handlers that were installed before the run are kept in the chain. submitit's (in a job launched by
``cluster=slurm`` or ``hydra/launcher=submitit_*``) requeues the job on SIGUSR2 and ignores SIGTERM: after
the checkpoint the trainer calls it, so submitit still requeues (and exits) on SIGUSR2, and on SIGTERM the
run goes on, as submitit intends. A signal the parent set to be ignored (``nohup`` ignores SIGHUP) stays
ignored. A second Ctrl-C stops at once, without the checkpoint (``KeyboardInterrupt``).

Each signal is acknowledged at once with one line on stderr (``SIGINT received: stopping after this
iteration, with a checkpoint; Ctrl-C again stops at once``), so a user, or a test, sees that it arrived
before the iteration ends.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["STOP_SIGNALS", "RunInterrupted", "StopRequests"]

STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR2", "SIGHUP") if hasattr(signal, name)
)


class RunInterrupted(Exception):
    """The run stopped on a signal after writing a checkpoint. The message is the one line already logged
    (what stopped it, the checkpoint, the command that resumes it); ``exit_status`` is ``128 + signum``."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopRequests:
    """Turns :data:`STOP_SIGNALS` into a request that the training loop reads between iterations.

    Example::

        stop = StopRequests().install()
        try:
            for step in ...:
                ...                      # one iteration
                if stop.pending:
                    ...                  # checkpoint, then stop.pass_on() or raise RunInterrupted
        finally:
            stop.restore()

    ``install`` does nothing outside the main thread (Python delivers signals only there). Cost: nothing
    per iteration but reading a list.
    """

    def __init__(self) -> None:
        self.pending: list[int] = []  # signals received and not yet acted on, in order
        self._previous: dict[int, Any] = {}

    def install(self) -> StopRequests:
        if threading.current_thread() is not threading.main_thread():
            log.debug("not in the main thread: signals are left to their current handlers")
            return self
        for signum in STOP_SIGNALS:
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:  # e.g. SIGHUP under nohup: the user asked not to stop on it
                continue
            self._previous[signum] = previous
            signal.signal(signum, self._receive)
        return self

    def restore(self) -> None:
        """Put the previous handlers back."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _receive(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and signal.SIGINT in self.pending:
            raise KeyboardInterrupt  # Ctrl-C twice: the user does not want to wait for the step
        if signum not in self.pending:
            self.pending.append(signum)
            _acknowledge(signum)

    def names(self) -> str:
        return " and ".join(signal.Signals(s).name for s in self.pending)

    def chained(self) -> list[tuple[int, Callable[[int, Any], Any]]]:
        """The pending signals' handlers that were installed before the run by someone else (submitit's),
        in the order the signals came. Python's own Ctrl-C handler and the defaults are not among them."""
        out = []
        for signum in self.pending:
            previous = self._previous.get(signum)
            if callable(previous) and previous is not signal.default_int_handler:
                out.append((signum, previous))
        return out

    def pass_on(self) -> None:
        """Call the chained handlers of the pending signals (they may exit the process, as submitit's
        does after requeueing) and forget the requests."""
        chained, self.pending = self.chained(), []
        for signum, handler in chained:
            handler(signum, None)


def _acknowledge(signum: int) -> None:
    """One line on stderr saying what the signal will do. Written with ``os.write``, not ``print`` or the
    logger: a signal handler may run in the middle of a write to ``sys.stderr``, whose buffer refuses a
    reentrant call."""
    line = f"{signal.Signals(signum).name} received: stopping after this iteration, with a checkpoint"
    if signum == signal.SIGINT:
        line += "; Ctrl-C again stops at once"
    try:
        os.write(2, (line + "\n").encode())
    except OSError:  # stderr closed: the stop itself still happens
        pass
