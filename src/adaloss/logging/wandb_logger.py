"""Experiment tracking with Weights & Biases, offline by default and never fatal.

``build_logger`` returns a :class:`WandbLogger` when ``logger=wandb`` and a :class:`NullLogger` for
``logger=none``. Any W&B failure (the package missing, ``wandb.init`` failing, a ``log`` call raising)
prints one warning and turns the logger into a no-op: tracking is a convenience, the run is the product.

Where files go: ``wandb.init(dir=<run dir>)`` puts the run under ``<run dir>/wandb/``. W&B also writes a
debug log to its cache folder and stages table artifacts in its data folder (``~/.cache/wandb``,
``~/.local/share/wandb``); for the duration of the run those point inside ``<run dir>/wandb/`` too, unless
the user set ``WANDB_CACHE_DIR`` / ``WANDB_DATA_DIR`` / ``WANDB_ARTIFACT_DIR`` themselves.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from adaloss.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["Logger", "NullLogger", "WandbLogger", "build_logger"]


class Logger(Protocol):
    """What the trainer calls. Every method is cheap on the caller's side (values are already host floats)."""

    @property
    def run_id(self) -> str | None: ...

    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def log_underflow(self, rates: Mapping[str, float], step: int) -> None: ...

    def finish(self, exit_code: int = 0) -> None: ...


class NullLogger:
    """``logger=none``: accepts everything, records nothing."""

    run_id: str | None = None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        pass

    def log_underflow(self, rates: Mapping[str, float], step: int) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass


class _EnvOverride:
    """Set environment variables that are not already set; restore the previous state on ``restore()``."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self._saved: dict[str, str | None] = {}
        for key, value in values.items():
            if key not in os.environ:
                self._saved[key] = None
                os.environ[key] = value

    def restore(self) -> None:
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved.clear()


class WandbLogger:
    """A W&B run that logs scalars every call and a per-layer underflow table and bar chart on request.

    Example::

        logger = WandbLogger(project="adaloss", run_dir=run_dir, config=resolved, mode="offline")
        logger.log({"train/loss": 2.3, "lr": 0.1}, step=0)
        logger.log_underflow({"conv1": 0.02, "fc": 0.0}, step=0)
        logger.finish()

    Offline runs never touch the network: no git or code capture, no system metrics, no machine info, no
    error reporting; ``wandb sync <run dir>/wandb/offline-run-*`` uploads them later.

    Args:
        project (str): W&B project.
        run_dir (Path): the run folder; W&B files go to ``run_dir/wandb``.
        config (dict): the resolved config, stored with the run.
        mode (str, optional, default="offline"): ``offline``, ``online`` or ``disabled``.
        name, group, entity (str, optional): run name, group (runs of one comparison), team/user.
        tags (list of str, optional): run tags.
        run_id (str, optional): continue the W&B run with this id (``wandb.init(id=..., resume="allow")``),
            as a run resumed from a checkpoint does; the checkpoint stores :attr:`run_id`. Steps logged again
            (those between the checkpoint and the interruption) are below the W&B run's current step, so
            W&B drops them with a warning and keeps the values the interrupted run logged.
    """

    def __init__(
        self,
        project: str,
        run_dir: Path,
        config: Mapping[str, Any],
        mode: str = "offline",
        name: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        entity: str | None = None,
        run_id: str | None = None,
    ) -> None:
        self._run: Any = None
        self._wandb: Any = None
        wandb_dir = Path(run_dir) / "wandb"
        self._env = _EnvOverride(
            {
                "WANDB_CACHE_DIR": str(wandb_dir / "cache"),
                "WANDB_DATA_DIR": str(wandb_dir / "data"),
                "WANDB_ARTIFACT_DIR": str(wandb_dir / "artifacts"),
                "WANDB_ERROR_REPORTING": "false",  # no crash reports to W&B's Sentry
            }
        )
        try:
            import wandb

            wandb_dir.mkdir(parents=True, exist_ok=True)
            offline = mode != "online"
            settings = wandb.Settings(
                mode=mode,
                silent=offline,  # online runs print their URL
                quiet=True,
                console="off",  # Hydra already tees the console to <run dir>/train.log
                disable_git=True,
                disable_code=True,
                save_code=False,
                x_disable_stats=True,
                x_disable_meta=True,
                x_disable_machine_info=True,
                x_save_requirements=False,
            )
            self._run = wandb.init(
                project=project,
                entity=entity,
                name=name,
                group=group,
                tags=list(tags) if tags else None,
                config=dict(config),
                dir=str(run_dir),
                settings=settings,
                **({"id": run_id, "resume": "allow"} if run_id else {}),
            )
            self._wandb = wandb
        except Exception as error:  # noqa: BLE001 - any W&B failure must leave training running
            self._disable(f"W&B could not start ({type(error).__name__}: {error})")

    @property
    def active(self) -> bool:
        """Whether a W&B run is recording (False after a failure)."""
        return self._run is not None

    @property
    def run_id(self) -> str | None:
        """The W&B run's id (stored in checkpoints, so a resumed run continues this run), if recording."""
        return None if self._run is None else str(self._run.id)

    @property
    def run_path(self) -> Path | None:
        """The folder of this run's W&B files (``<run dir>/wandb/offline-run-*``), if one is recording."""
        if self._run is None:
            return None
        return Path(self._run.dir).parent

    def _disable(self, reason: str) -> None:
        log.warning("%s; training continues without W&B logging", reason)
        run, self._run = self._run, None
        if run is not None:
            try:
                run.finish(exit_code=1)
            except Exception:  # noqa: BLE001
                pass
        self._env.restore()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log scalars at iteration ``step`` (steps must not decrease). No host sync: values are floats."""
        if self._run is None:
            return
        try:
            self._run.log(dict(metrics), step=step)
        except Exception as error:  # noqa: BLE001
            self._disable(f"W&B log failed ({type(error).__name__}: {error})")

    def log_underflow(self, rates: Mapping[str, float], step: int) -> None:
        """Log the per-layer underflow rates as a ``wandb.Table`` and a bar chart (layers in network order).

        Cost: one small table artifact per call; the trainer calls it at evaluations only.
        """
        if self._run is None or not rates:
            return
        try:
            wandb = self._wandb
            table = wandb.Table(
                columns=["layer", "underflow_rate"], data=[[k, float(v)] for k, v in rates.items()]
            )
            chart = wandb.plot.bar(
                table, "layer", "underflow_rate", title="activation-gradient underflow rate"
            )
            self._run.log({"underflow_table": table, "underflow_chart": chart}, step=step)
        except Exception as error:  # noqa: BLE001
            self._disable(f"W&B table logging failed ({type(error).__name__}: {error})")

    def finish(self, exit_code: int = 0) -> None:
        """Close the run (flushes the offline files), stop W&B's service and restore the environment.

        Stopping the service (``wandb.teardown``) means the next run in this process starts a fresh one,
        which writes its debug log into that run's folder rather than this one's. Cost: well under a second
        offline; online it waits for the upload. Safe to call twice.
        """
        run, self._run = self._run, None
        try:
            if run is not None:
                run.finish(exit_code=exit_code)
                self._wandb.teardown()
        except Exception as error:  # noqa: BLE001
            log.warning(
                "W&B finish failed (%s: %s); the run's files may be incomplete", type(error).__name__, error
            )
        finally:
            self._env.restore()


def build_logger(
    cfg_logger: Any, run_dir: Path, config: Mapping[str, Any], run_id: str | None = None
) -> Logger:
    """The logger the ``logger`` config group asks for: W&B when ``logger.wandb`` is set, else a no-op.

    ``config`` is the resolved run config W&B stores with the run; ``run_id`` continues an earlier W&B run
    (a resumed training run). Never raises for W&B trouble; see the module docstring. Raises
    ``ConfigError`` for an unknown ``logger.wandb.mode``.
    """
    wb = cfg_logger.get("wandb") if cfg_logger is not None else None
    if not wb:
        return NullLogger()
    mode = str(wb.get("mode", "offline"))
    if mode not in ("offline", "online", "disabled"):
        raise ConfigError(f"logger.wandb.mode={mode} is not a choice: use offline, online or disabled")
    if mode == "disabled":
        return NullLogger()
    return WandbLogger(
        project=str(wb.get("project", "adaloss")),
        run_dir=run_dir,
        config=config,
        mode=mode,
        name=wb.get("name"),
        group=wb.get("group"),
        tags=[str(t) for t in (wb.get("tags") or [])],
        entity=wb.get("entity"),
        run_id=run_id,
    )
