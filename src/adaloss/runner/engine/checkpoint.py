"""Checkpoints: saved atomically, rotated, loaded without running code, and the ``resume=`` setting.

A checkpoint is one ``torch.save`` file, ``<run dir>/checkpoints/step_<N>.pt`` (``N``: iterations
completed), holding everything a run needs to continue as if it had never stopped: model, optimizer, lr
schedule, loss scaler (the adaptive scaler's per-layer state included), every RNG state, the data position
(epoch, batch within it, the shuffle generator's state at the epoch's start), the loop's running numbers
(best metric, training-window sums, last underflow rates, the divergence guard's count), the W&B run id and
the key config fields it must be resumed with. :class:`CheckpointParts` lays that dict out from the run's
parts and puts it back; :class:`CheckpointManager` writes, finds, checks and reads it.

* **Atomic**: written to a temporary file in the same folder, fsynced, then ``os.replace``-d to its name
  (and the folder fsynced), so a crash leaves the previous checkpoints intact and never a partial file
  under a checkpoint's name. A checkpoint is never rewritten in place; the oldest beyond
  ``trainer.keep_checkpoints`` are deleted after a new one is complete.
* **Safe to load**: read with ``torch.load(weights_only=True)``; checkpoints hold only tensors, plain
  containers, numbers, strings and ``None`` (RNG states converted to tensors), so loading never runs code
  from the file.
* **Resume**: ``resume=auto`` continues from the newest *valid* checkpoint in the run folder (a truncated or
  corrupt one is skipped with a warning naming the file and the reason), or starts fresh if there is none;
  on a run that finished (its ``done`` marker exists, :mod:`adaloss.runner.engine.run_folder`) it changes
  nothing; ``resume=<file>`` continues from that file (a ``ConfigError`` if it is missing, a directory,
  unreadable or holds a model of other layer shapes); ``resume=null`` starts fresh. Resuming with a different
  model, dataset, scaler, precision, batch size, seed or run length is a ``ConfigError``.
* **Sharded** (``distributed.strategy=fsdp2``): the model's and the optimizer's state stay sharded; every
  rank writes its shards through ``torch.distributed.checkpoint`` into ``step_<N>.dcp/`` (written as
  ``.step_<N>.dcp.tmp/``, renamed when every rank is done), then rank 0 writes ``step_<N>.pt`` with the rest
  (``"sharded": true``, ``model`` holding only rank 0's buffers, ``optimizer`` empty): the ``.pt`` file is
  the commit, so a crash in between leaves the previous checkpoint the newest. A resume reads the shards
  back into the sharded model (tested at the world size they were written with). Rotation removes a
  checkpoint's folder with its file.
* **One history per folder**: checkpoints that do not belong to the run being continued (all of them for a
  fresh run; those after the resumed step otherwise) are renamed ``step_<N>.pt.stale`` before the run
  writes its own, so ``resume=auto`` can never pick them up; nothing is deleted but by rotation.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from adaloss.distributed import DistInfo, rank_seed
from adaloss.errors import ConfigError
from adaloss.runner.engine.run_folder import writing
from adaloss.runner.engine.run_key import check_config_key, config_key, key_differences, model_differences
from adaloss.runner.logging.metrics import write_atomic
from adaloss.runner.utils.seed import capture_rng_state, restore_rng_state, seed_everything

if TYPE_CHECKING:
    from torch import nn

    from adaloss.runner.data.loaders import BatchStream
    from adaloss.runner.engine.faults import DivergenceGuard
    from adaloss.scalers import LossScaler

log = logging.getLogger(__name__)

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointParts",
    "Progress",
    "Resume",
    "check_config_key",
    "config_key",
    "key_differences",
    "load_checkpoint",
    "model_differences",
    "object_state",
    "plain",
    "restore_object_state",
    "save_atomic",
    "shards_of",
]

#: Bumped when the checkpoint layout changes incompatibly; a checkpoint of another version is refused.
FORMAT_VERSION = 1
#: Entries every checkpoint holds (the trainer adds them; ``load_checkpoint`` checks they are there).
REQUIRED_KEYS = ("format", "step", "config_key", "model", "optimizer", "schedule", "scaler", "rng", "data")
_NAME = re.compile(r"^step_(\d+)\.pt$")


class CheckpointError(Exception):
    """A checkpoint file that cannot be used; the message says why (one line)."""


def save_atomic(obj: Any, path: Path) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (:func:`adaloss.runner.logging.metrics.write_atomic`): a
    crash leaves either no file or the complete one under ``path`` (and at most a ``.<name>.*.tmp`` leftover,
    which :meth:`CheckpointManager.clean` removes). Cost: the serialization, one fsync of the file and one of
    the folder."""
    return write_atomic(path, lambda handle: torch.save(obj, handle))


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True`` (onto the CPU) and check its layout.

    Raises:
        CheckpointError: the file is missing, truncated, corrupt, holds objects other than tensors and plain
            data (refused without running them), or is not an adaloss checkpoint of this format.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError("is a directory, not a checkpoint file")
    if not path.is_file():
        raise CheckpointError("does not exist")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; anything else is not a checkpoint
        raise CheckpointError(
            "cannot be read: it is corrupt or not a checkpoint (not the zip archive torch.save writes)"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "unsupported global" in str(error).lower():  # refused before anything in it was run
            raise CheckpointError(
                "cannot be read (it holds Python objects other than tensors and plain data, which "
                "torch.load(weights_only=True) refuses to build)"
            ) from None
        raise CheckpointError(
            f"cannot be read: it is corrupt (UnpicklingError: {_weights_only_reason(error)})"
        ) from None
    except Exception as error:  # noqa: BLE001 - any failure means this file cannot be used
        raise CheckpointError(
            f"cannot be read: it is corrupt or truncated ({type(error).__name__}: {_first_sentence(error)})"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"holds a {type(state).__name__}, not an adaloss checkpoint")
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"is not an adaloss checkpoint (no {', '.join(missing)})")
    if state["format"] != FORMAT_VERSION:
        raise CheckpointError(
            f"has checkpoint format {state['format']!r}; this version reads {FORMAT_VERSION}"
        )
    return state


def _first_sentence(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0].split(". ")[0][:200] if text else ""


def _weights_only_reason(error: BaseException) -> str:
    """The unpickler's own complaint inside torch's long weights-only message (e.g. "Unsupported operand
    155" for bytes that are no pickle at all)."""
    text = str(error)
    after = text.split("WeightsUnpickler error:", 1)[-1].strip()
    return (after.splitlines()[0] if after else _first_sentence(error))[:200]


@dataclass
class Resume:
    """Where a resumed run continues from: the checkpoint's file and its contents."""

    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])


class CheckpointManager:
    """Saves, rotates and finds the checkpoints of one run folder: ``<run_dir>/checkpoints/step_<N>.pt``.

    Example::

        checkpoints = CheckpointManager(run_dir, every=1000, keep=2)
        resumed = checkpoints.resume_point("auto", key)  # a Resume, or None: start fresh
        checkpoints.start(resumed)                      # set aside other histories' checkpoints
        ...
        if checkpoints.due(done, steps):
            checkpoints.save(state, done)

    ``every=None`` turns saving off (resuming still works). Cost of a save: one ``torch.save`` of the model
    and optimizer (about twice the model's size on disk) plus two fsyncs.
    """

    def __init__(self, run_dir: Path, every: int | None = None, keep: int = 2) -> None:
        """``every``: ``trainer.checkpoint_every`` (None: no saving); ``keep``: ``trainer.keep_checkpoints``
        (both checked by their schema, :class:`adaloss.runner.schemas.TrainerConf`)."""
        self.folder = Path(run_dir) / "checkpoints"
        self.every = every
        self.keep = keep

    # ------------------------------------------------------------------ finding

    def checkpoints(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every ``step_<N>.pt`` in the folder, oldest first (not checked)."""
        if not self.folder.is_dir():
            return []
        found = []
        for path in self.folder.iterdir():
            match = _NAME.match(path.name)
            if match and path.is_file():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def load_latest(self) -> Resume | None:
        """The newest checkpoint that loads and is complete, or ``None``. Each newer one that does not is
        skipped with a warning naming the file and the reason."""
        for _, path in reversed(self.checkpoints()):
            try:
                return Resume(path, load_checkpoint(path))
            except CheckpointError as error:
                log.warning("checkpoint %s %s; trying the previous checkpoint", path, error)
        return None

    def resume_point(self, setting: Any, key: Mapping[str, Any]) -> Resume | None:
        """What ``resume=<setting>`` continues from (``None``: start fresh), checked against ``key``.

        Raises:
            ConfigError: an invalid setting; ``resume=<file>`` that is missing or unreadable; a checkpoint
                of a different run (see :func:`config_key`).
        """
        if setting is None:
            return None
        if (
            isinstance(setting, bool)
            or not isinstance(setting, str | os.PathLike)
            or not str(setting).strip()
        ):
            raise ConfigError(
                f"resume must be auto, null or the path of a checkpoint file, got {setting!r}; "
                "e.g. resume=auto"
            )
        if str(setting).strip() == "auto":
            resumed = self.load_latest()
            if resumed is None:
                invalid = " (none of them is readable)" if self.checkpoints() else ""
                log.info("resume=auto: no checkpoint in %s%s; starting a fresh run", self.folder, invalid)
                return None
        else:
            path = Path(str(setting)).expanduser()
            if path.is_dir():
                raise ConfigError(
                    f"resume={setting} is a directory, not a checkpoint file: {_in_folder(path)}"
                )
            try:
                resumed = Resume(path, load_checkpoint(path))
            except CheckpointError as error:
                raise ConfigError(
                    f"resume={setting}: the file {error}; point resume= at a checkpoint file "
                    "(<run dir>/checkpoints/step_<N>.pt, e.g. the previous one) or use resume=auto"
                ) from None
        check_config_key(resumed.state["config_key"], key, resumed.path)
        return resumed

    # ------------------------------------------------------------------ writing

    def start(self, resumed: Resume | None) -> None:
        """Prepare the folder for this run: remove temporary files a killed save left, and rename to
        ``step_<N>.pt.stale`` the checkpoints that are not part of this run's history (all for a fresh run;
        those after the resumed step otherwise), so that ``resume=auto`` cannot pick them up later."""
        if not self.folder.is_dir():
            return
        for leftover in self.folder.glob(".step_*.pt.*.tmp"):
            leftover.unlink(missing_ok=True)
        for leftover in self.folder.glob(".step_*.dcp.tmp"):  # a sharded save that did not finish
            shutil.rmtree(leftover, ignore_errors=True)
        after = resumed.step if resumed is not None else -1
        stale = [path for step, path in self.checkpoints() if step > after]
        for path in stale:
            os.replace(path, path.with_name(path.name + ".stale"))
        if stale:
            why = (
                f"after step {after}, the one resumed" if resumed is not None else "and this run starts fresh"
            )
            log.warning(
                "%s held %d checkpoint(s) of another history (%s); renamed to *.pt.stale: %s",
                self.folder, len(stale), why, ", ".join(p.name for p in stale),
            )  # fmt: skip

    def due(self, done: int, steps: int) -> bool:
        """Whether to save after ``done`` iterations: every ``every`` iterations, not after the last one
        (a finished run records ``metrics.json``, and ``model.pt`` with ``trainer.save_final``)."""
        return self.every is not None and done % self.every == 0 and done < steps

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write ``state`` as ``step_<step>.pt`` atomically, then delete the oldest beyond ``keep``.

        Raises :class:`~adaloss.runner.engine.run_folder.RunFolderError` (one line) when the write fails: a
        full disk, a read-only folder, the folder deleted during the save. The earlier checkpoints stay as
        they were, and no partial file is left."""
        path = self.folder / f"step_{step}.pt"
        with writing("checkpoint", path):
            save_atomic(state, path)
        for _, old in self.checkpoints()[: -self.keep]:
            old.unlink(missing_ok=True)
            shutil.rmtree(shards_of(old), ignore_errors=True)
        log.debug("checkpoint %s written", path)
        return path

    def save_shards(self, parts: CheckpointParts, step: int) -> None:
        """Every rank: write this rank's shards of the model and optimizer state into ``step_<step>.dcp/``
        (see the module docstring); call :meth:`save` on rank 0 afterwards. Collective: every rank calls it
        at the same step. Cost: DCP's planning collectives, one file per rank, two barriers."""
        import torch.distributed.checkpoint as dcp

        final = shards_of(self.folder / f"step_{step}.pt")
        temporary = final.with_name(f".{final.name}.tmp")
        ranks = parts.ranks
        with writing("checkpoint", final):
            if ranks.is_main:
                shutil.rmtree(temporary, ignore_errors=True)
                temporary.mkdir(parents=True)
            ranks.barrier()
            dcp.save(parts.sharded_state(), checkpoint_id=temporary)
            ranks.barrier()
            if ranks.is_main:
                shutil.rmtree(final, ignore_errors=True)  # a set-aside history's shards of the same step
                os.replace(temporary, final)


def _in_folder(folder: Path) -> str:
    """How to resume from what ``folder`` holds: a run folder, a checkpoints folder, or neither."""
    run_marks = ("checkpoints", "run_key.json", "metrics.json", ".hydra")
    is_run = any((folder / mark).exists() for mark in run_marks)
    if not is_run and folder.name != "checkpoints":
        return "point resume= at a checkpoint file (<run dir>/checkpoints/step_<N>.pt) or use resume=auto"
    run = folder if is_run else folder.parent
    newest = CheckpointManager(run).checkpoints()
    pick = f"resume={newest[-1][1]}, or " if newest else ""
    return f"use {pick}resume=auto hydra.run.dir={run} to continue that run from its newest checkpoint"


def shards_of(path: Path) -> Path:
    """The folder of a sharded checkpoint's shards: ``step_<N>.dcp`` beside ``step_<N>.pt``."""
    return Path(path).with_suffix(".dcp")


# ------------------------------------------------------------------------------ the checkpoint's layout


@dataclass
class Progress:
    """What the run has measured so far: saved in checkpoints, so a resumed run reports the same numbers."""

    test_value: float = 0.0
    best_value: float = 0.0
    evaluation: dict[str, Any] = field(default_factory=dict)  # the last evaluation's metrics.json entries
    rates: dict[str, float] = field(default_factory=dict)  # underflow rates of the last telemetry step
    train_loss: float = math.nan
    train_accuracy: float | None = None
    train_time: float = 0.0  # seconds in training iterations (evaluation excluded), for images/s
    elapsed_s: float = 0.0  # wall time up to the last checkpoint

    def state_dict(self) -> dict[str, Any]:
        state = plain(vars(self))
        state["evaluation_value"] = getattr(self.evaluation, "value", None)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from adaloss.runner.engine.tasks import Evaluation  # the tasks import the models: only when resuming

        state = dict(state)
        value = state.pop("evaluation_value", None)
        for key in vars(self):
            if key in state:
                setattr(self, key, state[key])
        if value is not None:
            self.evaluation = Evaluation(value, **self.evaluation)


@dataclass
class CheckpointParts:
    """Everything a checkpoint saves and restores, with the layout of the checkpoint file.

    Holds only tensors and plain data (see the module docstring): RNG states as tensors, the training
    window's sums as tensors (the task's window has no ``state_dict``; its attributes are saved as they
    are).
    """

    key: dict[str, Any]  # config_key(): the settings a resumed run must share
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: LossScaler
    batches: BatchStream
    window: Any
    guard: DivergenceGuard
    progress: Progress
    ranks: DistInfo
    precision: Any = None  # its gradient quantizer's state (FP8 delayed scaling's amax histories)
    sharded: bool = False  # distributed.strategy=fsdp2: model and optimizer state in step_<N>.dcp/

    def state_dict(self, step: int, config: dict[str, Any], wandb_run_id: str | None) -> dict[str, Any]:
        """The checkpoint. Under DDP every rank must call it (it gathers the ranks' RNG states: ``rng`` is
        rank 0's, ``rng_ranks`` all of them); rank 0 saves it."""
        rng, window = capture_rng_state(), object_state(self.window)
        extra: dict[str, Any] = {}
        if self.ranks.is_distributed:  # per rank: RNG streams, training-window sums (each rank's own batches)
            extra["rng_ranks"] = self.ranks.gather(rng)
            extra["window_ranks"] = self.ranks.gather(window)
            rng, window = extra["rng_ranks"][0], extra["window_ranks"][0]
        return {
            "format": FORMAT_VERSION,
            "step": step,
            "config_key": self.key,
            "config": plain(config),
            "model": self.replicated_model_state() if self.sharded else self.model.state_dict(),
            "optimizer": {} if self.sharded else self.optimizer.state_dict(),
            "sharded": self.sharded,
            "schedule": plain(self.scheduler.state_dict()),
            "scaler": plain(self.scaler.state_dict()),
            "rng": rng,
            **extra,
            "world_size": self.ranks.world_size,
            "data": self.batches.state_dict(),
            "window": window,
            "guard": {"consecutive": self.guard.consecutive},
            "progress": self.progress.state_dict(),
            "grad_quantizer": self.precision.state_dict() if self.precision is not None else {},
            "wandb_run_id": wandb_run_id,
        }

    def load_state_dict(self, state: dict[str, Any], path: Path | None = None) -> None:
        """Put a checkpoint back; ``path``: its file, where a sharded checkpoint's shards lie beside it.
        Sharded: a collective (every rank calls it)."""
        if bool(state.get("sharded")) != self.sharded:
            wrote, runs = ("fsdp2", "ddp") if state.get("sharded") else ("ddp", "fsdp2")
            raise ConfigError(
                f"checkpoint {path} was written with distributed.strategy={wrote} but this run uses {runs}: "
                f"resume with distributed.strategy={wrote} (under torchrun), or start a fresh run"
            )
        if self.sharded:
            self.load_shards(shards_of(Path(path)), state["model"])
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["schedule"])
        self.scaler.load_state_dict(state["scaler"])
        per_rank = state.get("rng_ranks") or []
        if len(per_rank) == self.ranks.world_size > 1:
            restore_rng_state(per_rank[self.ranks.rank])  # exact: each rank continues its own streams
        else:
            restore_rng_state(state["rng"])
            if self.ranks.rank > 0:  # saved at another world size: a stream of this rank's own
                seed_everything(rank_seed(int(self.key["seed"]), self.ranks.rank, int(state["step"])))
        self.batches.load_state_dict(state["data"])
        restore_object_state(self.window, self._window_state(state))
        self.guard.consecutive = int(state.get("guard", {}).get("consecutive", 0))
        self.progress.load_state_dict(state.get("progress", {}))
        if self.precision is not None:  # an older checkpoint has none: the quantizer starts afresh
            self.precision.load_state_dict(state.get("grad_quantizer", {}))

    def _window_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's training window from a checkpoint: its own sums when saved at this world size; else
        rank 0 takes the sums of every saved rank (the all-reduced read is the same) and the others start
        empty. Before checkpoints held every rank's window, only rank 0's was saved: rank 0 takes it."""
        per_rank = state.get("window_ranks") or [state.get("window", {})]
        if len(per_rank) == self.ranks.world_size:
            return per_rank[self.ranks.rank]
        if self.ranks.rank > 0 or not per_rank[0]:
            return {}
        return self.window.combined(per_rank)

    def sharded_state(self) -> dict[str, Any]:
        """The model's parameters and the optimizer's state as this rank's shards (``DTensor`` values,
        parameter names as keys), what ``torch.distributed.checkpoint`` writes and reads. The model's buffers
        are not in it (:meth:`replicated_model_state`). Collective under FSDP2."""
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.tensor import DTensor

        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": {k: v for k, v in model.items() if isinstance(v, DTensor)}, "optimizer": optimizer}

    def replicated_model_state(self) -> dict[str, Any]:
        """The model's entries FSDP2 does not shard (buffers: batch norm's running statistics), as this rank
        holds them; rank 0's go into ``step_<N>.pt``. They are per rank (FSDP2 does not broadcast buffers as
        DDP does), and ``torch.distributed.checkpoint`` would keep one rank's copy, not necessarily rank
        0's: a resume gives every rank rank 0's, the ones that evaluate and are saved."""
        from torch.distributed.tensor import DTensor

        return {k: plain(v) for k, v in self.model.state_dict().items() if not isinstance(v, DTensor)}

    def load_shards(self, folder: Path, replicated: Mapping[str, Any]) -> None:
        """Read ``folder``'s shards (:meth:`CheckpointManager.save_shards`) and the ``replicated`` entries
        (:meth:`replicated_model_state`) into the sharded model and optimizer. Collective; ``ConfigError``
        when the folder is missing."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if not (folder / ".metadata").is_file():
            raise ConfigError(
                f"sharded checkpoint: {folder} (its model and optimizer shards) is missing or incomplete; "
                "resume from another checkpoint (resume=<file>) or start a fresh run"
            )
        state = self.sharded_state()
        dcp.load(state, checkpoint_id=folder)
        model, optimizer = {**state["model"], **replicated}, state["optimizer"]
        set_state_dict(self.model, self.optimizer, model_state_dict=model, optim_state_dict=optimizer)

    def full_model_state(self) -> dict[str, Any]:
        """The model's state dict with whole tensors on the CPU: gathered from the shards under FSDP2 (a
        collective: every rank calls it, every rank gets it), else ``model.state_dict()``."""
        if not self.sharded:
            return self.model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))


# ------------------------------------------------------------------------------ plain-data conversion


def plain(value: Any) -> Any:
    """``value`` with NumPy scalars and arrays, tuples and mappings turned into Python numbers, lists and
    dicts, so that ``torch.load(weights_only=True)`` accepts it. Tensors are kept (moved to the CPU)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {str(k) if not isinstance(k, int) else k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def object_state(obj: Any) -> dict[str, Any]:
    """A copy of ``obj``'s attributes (tensors cloned to the CPU), for small helper objects without a
    ``state_dict`` whose attributes are all tensors and plain values (the trainer's training window)."""
    return {
        k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else plain(v) for k, v in vars(obj).items()
    }


def restore_object_state(obj: Any, state: Mapping[str, Any]) -> None:
    """Put back what :func:`object_state` saved: tensors are copied into the existing ones (their device
    and dtype kept), other attributes replaced."""
    for key, value in state.items():
        current = getattr(obj, key, None)
        if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
            current.copy_(value)
        else:
            setattr(obj, key, value)
