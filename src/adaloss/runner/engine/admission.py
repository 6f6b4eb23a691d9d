"""Whether a run may start, and from where: every admission decision of ``train(cfg)``, in its order.

:class:`Admission` is asked twice by the trainer, because the answers need different things:

1. :meth:`Admission.finished`, before the folder is locked and anything is built: ``resume=auto`` into a
   folder whose run finished with these settings returns that run's metrics (one printed line; nothing is
   locked, logged or written). Then :meth:`Admission.lock` takes the folder (a folder a live run holds is
   refused).
2. :meth:`Admission.admit`, once the parts are built and before anything is written:

   * the **resume point**: ``resume=auto`` (the newest readable checkpoint), ``resume=<file>`` or ``null``
     (a fresh start), checked against this run's settings
     (:meth:`adaloss.runner.engine.checkpoint.CheckpointManager.resume_point`); every rank must find the same;
   * the **folder check**: one run per folder (:func:`check_folder`);
   * the **model shapes** against the checkpoint's (:func:`check_model_shapes`), e.g. another
     ``model.hidden``;
   * a **finished run of other settings** (which the other checks let through when only model settings
     of the same layer shapes differ) is refused.

A ``ConfigError`` raised on rank 0 (which alone owns the folder) stops every rank with the same message
(:func:`on_rank0`). This module reads files and writes none; the folder's writes are
:mod:`adaloss.runner.engine.run_folder`'s, once the run is admitted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from adaloss.distributed import DistInfo
from adaloss.errors import ConfigError
from adaloss.runner.engine.checkpoint import CheckpointManager, Resume
from adaloss.runner.engine.run_folder import DONE_FILE, KEY_FILE, RunFolder, RunLock, finished_run
from adaloss.runner.engine.run_key import check_config_key, model_differences

__all__ = ["Admission", "check_folder", "check_model_shapes", "on_rank0"]


@dataclass
class Admission:
    """The admission of one start into ``run_dir``.

    ``setting`` is ``cfg.resume`` (``auto``, a checkpoint file or None); ``config`` the resolved config;
    ``ranks`` this process's place (the checks on the folder run on rank 0 only)."""

    setting: Any
    run_dir: Path
    config: Mapping[str, Any]
    ranks: DistInfo

    @property
    def auto(self) -> bool:
        return str(self.setting).strip() == "auto"

    def finished(self, key: Mapping[str, Any]) -> dict[str, Any] | None:
        """With ``resume=auto``, the recorded metrics of the run that finished in the folder (its ``done``
        marker exists) with this start's settings (``key``: :func:`~adaloss.runner.engine.run_key.config_key`,
        with the run length where the config alone fixes it), after one printed line saying so; else None.
        Nothing is locked, logged to the run's files or written: a finished run stays as it is. A finished
        run of other settings is left to :meth:`admit`, which refuses it."""
        found: dict[str, Any] | None = None
        run_dir, ranks = self.run_dir, self.ranks

        def look() -> None:
            nonlocal found
            finished = finished_run(run_dir) if ranks.is_main and self.auto else None
            if finished is not None and not RunLock(run_dir).busy():  # a live holder: refused as "in use"
                if not finished.differences(key, self.config):
                    found = finished.metrics

        on_rank0(ranks, look)
        found = ranks.broadcast(found)
        if found is not None and ranks.is_main:  # printed, not logged: the run's train.log stays untouched
            print(
                f"run {run_dir} is finished ({run_dir / DONE_FILE} exists): its metrics are in "
                f"{run_dir / 'metrics.json'}; nothing to do (to train again, start a run in another folder)",
                flush=True,
            )
        return found

    def lock(self, folder: RunFolder) -> None:
        """Take the folder's lock on rank 0 (first: a refused start must not write or log anything)."""
        on_rank0(self.ranks, folder.lock)

    def admit(
        self, folder: RunFolder, checkpoints: CheckpointManager, key: Mapping[str, Any], module: nn.Module
    ) -> Resume | None:
        """The checkpoint this run continues from (None: a fresh start), once every check passed; else the
        ``ConfigError`` of the first that failed. ``key`` is this run's ``config_key``, ``module`` the built
        (unwrapped) model. Every rank reads the checkpoint."""
        ranks = self.ranks
        resumed = checkpoints.resume_point(self.setting, key)
        if ranks.is_distributed:
            points = ranks.gather(None if resumed is None else resumed.step)
            if len(set(points)) > 1:
                raise ConfigError(
                    f"the ranks found different checkpoints to resume from (steps {points}); the run folder "
                    f"{self.run_dir} must be the same folder on every rank, or pass resume=<file>"
                )
        # one run per folder: a start that is not a resume of the run recorded there is refused
        on_rank0(ranks, lambda: check_folder(folder, self.setting, key, resumed))
        if resumed is not None:
            check_model_shapes(resumed.state, module, resumed.path, self.config)
        on_rank0(ranks, lambda: self._refuse_finished(key))
        return resumed

    def _refuse_finished(self, key: Mapping[str, Any]) -> None:
        """``ConfigError`` for ``resume=auto`` into a finished run that the other checks let through: one of
        other model settings of the same layer shapes (a finished run of these settings returned earlier).
        """
        finished = finished_run(self.run_dir) if self.ranks.is_main and self.auto else None
        if finished is not None:
            raise finished.refusal(finished.differences(key, self.config) or ["other settings"])


def check_folder(folder: RunFolder, setting: Any, key: Mapping[str, Any], resumed: Resume | None) -> None:
    """Refuse a start that would write into another run's record (``ConfigError``).

    ``setting`` is ``cfg.resume``; ``key`` this run's :func:`~adaloss.runner.engine.run_key.config_key`;
    ``resumed`` the checkpoint it continues from, or None. An empty folder takes any start. A folder with a
    record takes only a resume (``resume=auto`` or a file) whose settings equal the recorded ones. A no-op
    for a folder that is not this rank's (``folder.enabled`` false).
    """
    if not folder.enabled:
        return
    record = folder.record()
    if not record:
        return
    held = f"run folder {folder.path} already holds a run ({', '.join(record)})"
    if setting is None:
        raise ConfigError(
            f"{held}; a fresh start (resume=null) would mix two runs' files: continue that run with "
            "resume=auto and its overrides, or start this one in another folder (hydra.run.dir=<new "
            "folder>, or leave hydra.run.dir unset for a new dated one)"
        )
    recorded = folder.recorded_key()
    if recorded is not None:
        check_config_key(recorded, key, where=f"run folder {folder.path}")
        return
    inside = resumed is not None and folder.path.resolve() in Path(resumed.path).resolve().parents
    if not inside:  # the checkpoint resumed from this folder has been checked against key already
        raise ConfigError(
            f"{held}, without {KEY_FILE} to tell which settings made it: start this run in another "
            "folder (hydra.run.dir=<new folder>)"
        )


def check_model_shapes(state: Mapping[str, Any], model: Any, path: Path, config: Mapping[str, Any]) -> None:
    """``ConfigError`` if the checkpoint's model weights do not fit ``model`` (another ``model.hidden``,
    width, ...), naming the first differing tensors and the model settings that differ; ``config`` is this
    run's resolved config. Cost: one pass over the state dict's shapes, no copy. A sharded checkpoint's
    shapes are checked by ``torch.distributed.checkpoint`` when its shards are read."""
    if state.get("sharded"):
        return
    saved = state["model"]
    ours = model.state_dict()
    missing = [k for k in ours if k not in saved]
    extra = [k for k in saved if k not in ours]
    differ = [k for k in ours if k in saved and tuple(saved[k].shape) != tuple(ours[k].shape)]
    if not (missing or extra or differ):
        return
    what = [f"{k}: {list(saved[k].shape)} in the checkpoint, {list(ours[k].shape)} here" for k in differ[:2]]
    what += [f"{k} only in this model" for k in missing[:1]]
    what += [f"{k} only in the checkpoint" for k in extra[:1]]
    settings = model_differences((state.get("config") or {}).get("model") or {}, config.get("model") or {})
    fix = f"resume with {' '.join(settings)}" if settings else "resume with the model it was made with"
    raise ConfigError(
        f"checkpoint {path} holds a model of other layer shapes ({'; '.join(what)}): {fix}, or start a "
        "fresh run in a new folder"
    )


def on_rank0(ranks: DistInfo, check: Callable[[], None]) -> None:
    """Run ``check`` (a no-op on ranks other than 0, which own no folder); a ``ConfigError`` it raises on
    rank 0 stops every rank with the same message (the others would wait for rank 0 forever)."""
    failure: ConfigError | None = None
    try:
        check()
    except ConfigError as error:
        failure = error
    if ranks.is_distributed:
        message = ranks.broadcast(None if failure is None else str(failure))
        if failure is None and message is not None:
            failure = ConfigError(message)
    if failure is not None:
        raise failure
