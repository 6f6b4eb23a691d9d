"""Experiment tracking with Weights & Biases, offline by default and never fatal.

``build_logger`` returns a :class:`WandbLogger` when ``logger=wandb`` and a :class:`NullLogger` for
``logger=none``. Any W&B failure (the package missing, ``wandb.init`` failing, a ``log`` call raising)
prints one warning and turns the logger into a no-op: tracking is a convenience, the run is the product.

**Online without a network.** ``logger.wandb.mode=online`` first checks, without prompting, that an API key
is configured, then gives ``wandb.init`` ``logger.wandb.init_timeout`` seconds (default 10) to reach the
server. If either fails, the run logs offline instead and one warning line says why and how to upload the
files later; the folder the failed online attempt left behind (a run record and an exit record, which
``wandb sync`` would upload as an empty finished run) is deleted first.

**What is logged.** Scalars as the trainer passes them (``train/loss``, ``test/accuracy`` ...), with
``define_metric`` summaries: the run summary of ``test/accuracy`` (``test/map``) holds its ``max`` (the best
evaluation) and ``last`` (the final one), ``train/loss`` its ``min`` and ``last``, and so on
(:data:`SUMMARIES`). Each telemetry step (:meth:`WandbLogger.log_telemetry`) becomes one ``wandb.Table``
(``underflow/table``: a row per layer with its underflow rate and loss scale), one heatmap image of the
underflow of every layer at every telemetry step so far (``underflow/heatmap``) and three scalars:
``underflow/mean``, ``underflow/max`` and ``underflow/layers_above_1pct``; when the record carries the
gradient-storage quantities (``saturation_rate``, ``grad_scale_min``, ``grad_scale_max``, ``sqnr_db``), they
are table columns too, with ``saturation/mean``, ``saturation/max``, ``sqnr_db/min``, ``sqnr_db/mean``,
``grad_scale/min`` and ``grad_scale/max`` over the layers. One W&B series per layer and
quantity (``underflow/<layer>``, ``loss_scale/<layer>`` ...: three panels per layer, about 330 on ResNet-110)
only with ``logger.wandb.per_layer_series=true``.

Where files go: ``wandb.init(dir=<run dir>)`` puts the run under ``<run dir>/wandb/``. W&B also writes a
debug log to its cache folder and stages table artifacts in its data folder (``~/.cache/wandb``,
``~/.local/share/wandb``); for the duration of the run those point inside ``<run dir>/wandb/`` too, unless
the user set ``WANDB_CACHE_DIR`` / ``WANDB_DATA_DIR`` / ``WANDB_ARTIFACT_DIR`` themselves.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

__all__ = ["SUMMARIES", "Logger", "NullLogger", "WandbLogger", "build_logger", "underflow_heatmap"]

#: ``define_metric`` summaries (W&B's default is the last value). The run summary of a key with several
#: aggregations is a dict, e.g. ``{"max": 93.1, "last": 92.8}`` for ``test/accuracy``.
SUMMARIES: dict[str, str] = {
    "test/accuracy": "max,last",
    "test/map": "max,last",
    "test/best_*": "max",
    "test_ap/*": "max,last",  # detection: AP of each class
    "train/loss": "min,last",
    "train/accuracy": "max,last",
    "underflow/mean": "min,max,last",
    "underflow/max": "min,max,last",
    "underflow/layers_above_1pct": "min,max,last",
    "saturation/mean": "min,max,last",
    "saturation/max": "min,max,last",
    "sqnr_db/min": "min,max,last",
    "sqnr_db/mean": "min,max,last",
    "fp4/grad_to_noise_min": "min,last",  # training stalls below about sqrt(3) ("FP4 All the Way")
    "fp4/block_clamped_share_max": "max,last",
    "fp4/block_subnormal_share_max": "max,last",
    "loss_scale": "min,max,last",
    "loss_scale/min": "min,last",
    "loss_scale/max": "max,last",
    "images_per_s": "mean,last",
}

#: The per-layer gradient-storage columns of a telemetry record (``adaloss.telemetry.STORAGE_KEYS``).
STORAGE_COLUMNS = ("saturation_rate", "grad_scale_min", "grad_scale_max", "sqnr_db")
#: The per-layer FP4 block columns of an FP4 run's telemetry record (``adaloss.telemetry.FP4_KEYS``), for
#: its FP4 layers (the others get no value).
FP4_COLUMNS = (
    "fp4_block_clamped_share",
    "fp4_block_subnormal_share",
    "fp4_block_scale_spread_log2",
    "fp4_grad_to_noise",
)

#: A layer counts in ``underflow/layers_above_1pct`` when more than this share of its gradient underflows.
LAYER_ALARM_RATE = 0.01


class Logger(Protocol):
    """What the trainer calls. Every method is cheap on the caller's side (values are already host floats)."""

    @property
    def run_id(self) -> str | None: ...

    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def log_telemetry(self, record: Mapping[str, Any], step: int) -> None: ...

    def finish(self, exit_code: int = 0) -> None: ...


class NullLogger:
    """``logger=none``: accepts everything, records nothing."""

    run_id: str | None = None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        pass

    def log_telemetry(self, record: Mapping[str, Any], step: int) -> None:
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


def _has_credentials(wandb: Any) -> bool | None:
    """Whether W&B has an API key (environment, settings file, .netrc), asked without prompting and without
    the network; ``None`` when this W&B version does not allow asking (then ``login_timeout`` bounds any
    prompt). An online ``wandb.init`` without a key prompts for one when a terminal is attached: a training
    run must not wait on that."""
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        settings = wandb_setup.singleton().settings
        host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
        auth = wbauth.authenticate_session(
            host=host, source="adaloss", prompt=False, verify=False, update_session=False
        )
        return auth is not None
    except Exception:  # noqa: BLE001 - private API of W&B: another version may not have it
        return None


class WandbLogger:
    """A W&B run: scalars with best/last summaries, and per telemetry step a per-layer table and heatmap.

    Example::

        logger = WandbLogger(project="adaloss", run_dir=run_dir, config=resolved, mode="offline")
        logger.log({"train/loss": 2.3, "lr": 0.1}, step=0)
        logger.log_telemetry({"underflow_rate": {"conv1": 0.02, "fc": 0.0}, "loss_scale": 128.0}, step=1)
        logger.finish()

    Offline runs never touch the network: no git or code capture, no system metrics, no machine info, no
    error reporting; ``wandb sync <run dir>/wandb/offline-run-*`` uploads them later. An online run that
    cannot reach the server within ``init_timeout`` seconds becomes an offline run (see the module
    docstring).

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
        init_timeout (float, optional, default=10): seconds an online ``wandb.init`` may take.
        per_layer_series (bool, optional, default=False): also log one series per layer and quantity.
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
        init_timeout: float = 10.0,
        per_layer_series: bool = False,
    ) -> None:
        self._run: Any = None
        self._wandb: Any = None
        self.run_dir = Path(run_dir)
        self.per_layer_series = per_layer_series
        self.fell_back_offline = False  # mode=online could not reach W&B: logging offline instead
        self._heat: _HeatmapHistory | None = None
        wandb_dir = self.run_dir / "wandb"
        self._env = _EnvOverride(
            {
                "WANDB_CACHE_DIR": str(wandb_dir / "cache"),
                "WANDB_DATA_DIR": str(wandb_dir / "data"),
                "WANDB_ARTIFACT_DIR": str(wandb_dir / "artifacts"),
                "WANDB_ERROR_REPORTING": "false",  # no crash reports to W&B's Sentry
                "WANDB_SILENT": "true",  # no W&B console lines (login, setup, log paths); ours say it
            }
        )
        try:
            import wandb

            wandb_dir.mkdir(parents=True, exist_ok=True)
            self._wandb = wandb
            init = {
                "project": project,
                "entity": entity,
                "name": name,
                "group": group,
                "tags": list(tags) if tags else None,
                "config": dict(config),
                "dir": str(self.run_dir),
                **({"id": run_id, "resume": "allow"} if run_id else {}),
            }
            if mode == "online":
                self._run = self._start_online(wandb, init, wandb_dir, float(init_timeout))
                if self._run is not None:
                    log.info("W&B run online: %s", getattr(self._run, "url", None) or self._run.id)
            if self._run is None:
                self._run = wandb.init(**init, settings=self._settings(wandb, "offline", init_timeout))
            for key, summary in SUMMARIES.items():
                self._run.define_metric(key, summary=summary)
        except Exception as error:  # noqa: BLE001 - any W&B failure must leave training running
            self._disable(f"W&B could not start ({type(error).__name__}: {error})")

    @staticmethod
    def _settings(wandb: Any, mode: str, init_timeout: float) -> Any:
        return wandb.Settings(
            mode=mode,
            silent=True,  # no W&B console lines (a failed online start prints several); the URL is logged
            quiet=True,
            console="off",  # Hydra already tees the console to <run dir>/train.log
            disable_git=True,
            disable_code=True,
            save_code=False,
            init_timeout=float(init_timeout),
            login_timeout=float(init_timeout),  # bounds a login prompt W&B might show (see _has_credentials)
            x_disable_stats=True,
            x_disable_meta=True,
            x_disable_machine_info=True,
            x_save_requirements=False,
        )

    def _start_online(self, wandb: Any, init: dict[str, Any], wandb_dir: Path, timeout: float) -> Any:
        """An online run, or ``None`` after one warning when W&B cannot be reached (the caller then starts
        an offline one). Takes at most about ``timeout`` seconds when the server does not answer."""
        if _has_credentials(wandb) is False:
            reason = "no W&B API key is configured (`wandb login`, or set WANDB_API_KEY)"
        else:
            before = set(wandb_dir.glob("run-*"))
            try:
                return wandb.init(**init, settings=self._settings(wandb, "online", timeout))
            except Exception as error:  # noqa: BLE001 - CommError, UsageError, timeouts: all mean offline
                first_line = (str(error).strip().splitlines() or [""])[0]
                reason = f"W&B was not reachable within {timeout:g} s ({type(error).__name__}: {first_line})"
            # the failed attempt's folder holds a run record and an exit record: `wandb sync` would upload
            # it as an empty finished run
            for leftover in set(wandb_dir.glob("run-*")) - before:
                shutil.rmtree(leftover, ignore_errors=True)
            try:
                wandb.teardown()  # a fresh service for the offline run
            except Exception:  # noqa: BLE001
                pass
        self.fell_back_offline = True
        log.warning(
            "logger.wandb.mode=online: %s; logging offline to %s instead (upload later with `wandb sync "
            "%s/offline-run-*`)",
            reason,
            wandb_dir,
            wandb_dir,
        )
        return None

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

    def log_telemetry(self, record: Mapping[str, Any], step: int) -> None:
        """Log one telemetry step (a ``telemetry.jsonl`` record: ``underflow_rate`` ``{layer: rate}`` in
        network order, ``loss_scale`` a number or ``{layer: alpha}``, optionally ``loss_scale_beta`` and
        ``expected_loss_scale`` ``{layer: value}``).

        Logs ``underflow/table`` (a ``wandb.Table``, a row per layer: ``layer_id``, 0 for the layer nearest
        the loss as in the figures, ``layer``, ``underflow_rate``, ``loss_scale`` and the optional columns),
        ``underflow/heatmap`` (:func:`underflow_heatmap` of all telemetry steps so far), ``underflow/mean``,
        ``underflow/max``, ``underflow/layers_above_1pct`` and, with ``per_layer_series``, one scalar per
        layer and quantity. Cost: one small table and one small PNG per telemetry step; with 110 layers and
        400 earlier telemetry steps, about 5% of one ResNet-20 training step (batch 128, emulated FP16, one
        CPU thread), so about 0.05% of training at ``telemetry.every=100``.
        """
        rates = record.get("underflow_rate") or {}
        if self._run is None or not rates:
            return
        try:
            wandb = self._wandb
            per_layer = {
                key: record[key]
                for key in (
                    "loss_scale",
                    "loss_scale_beta",
                    "expected_loss_scale",
                    *STORAGE_COLUMNS,
                    *FP4_COLUMNS,
                )
                if isinstance(record.get(key), Mapping)
            }
            scale = record.get("loss_scale")
            layers = list(rates)[::-1]  # backpropagation order: ID 0 is the layer nearest the loss
            columns = [
                "layer_id",
                "layer",
                "underflow_rate",
                "loss_scale",
                *(k for k in per_layer if k != "loss_scale"),
            ]
            rows = []
            for i, layer in enumerate(layers):
                layer_scale = per_layer["loss_scale"].get(layer) if "loss_scale" in per_layer else scale
                extra = [per_layer[k].get(layer) for k in columns[4:]]
                rows.append(
                    [i, layer, float(rates[layer]), _float_or_none(layer_scale), *map(_float_or_none, extra)]
                )
            values = [float(r) for r in rates.values()]
            payload: dict[str, Any] = {
                "underflow/table": wandb.Table(columns=columns, data=rows),
                "underflow/mean": sum(values) / len(values),
                "underflow/max": max(values),
                "underflow/layers_above_1pct": sum(v > LAYER_ALARM_RATE for v in values),
                **_storage_summary(per_layer),
            }
            heat = self._heatmap_history(step)
            heat.add(step, rates)
            pixels, caption = underflow_heatmap(heat.layers, heat.steps, heat.rows)
            payload["underflow/heatmap"] = wandb.Image(pixels, caption=caption)
            if self.per_layer_series:
                payload.update({f"underflow/{layer}": float(r) for layer, r in rates.items()})
                for key, values_by_layer in per_layer.items():
                    payload.update({f"{key}/{layer}": float(v) for layer, v in values_by_layer.items()})
            self._run.log(payload, step=step)
        except Exception as error:  # noqa: BLE001
            self._disable(f"W&B telemetry logging failed ({type(error).__name__}: {error})")

    def _heatmap_history(self, step: int) -> _HeatmapHistory:
        """The heatmap's history, started (once) from ``telemetry.jsonl``'s steps before ``step``, so a
        resumed run's heatmap also shows what the interrupted run recorded."""
        if self._heat is None:
            self._heat = _HeatmapHistory()
            for row in _read_jsonl(self.run_dir / "telemetry.jsonl"):
                if isinstance(row.get("step"), int) and row["step"] < step:
                    self._heat.add(row["step"], row.get("underflow_rate") or {})
        return self._heat

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


def _float_or_none(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of ``path``, one per line; unreadable lines (a truncated last one) are skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class _HeatmapHistory:
    """Underflow rates of every layer at every telemetry step so far (layers in network order of first
    appearance; a step that did not record a layer holds NaN there)."""

    def __init__(self) -> None:
        self.layers: list[str] = []
        self.steps: list[int] = []
        self.rows: list[list[float]] = []  # rows[i][j]: layer i at steps[j]

    def add(self, step: int, rates: Mapping[str, float]) -> None:
        for layer in rates:
            if layer not in self.layers:
                self.layers.append(layer)
                self.rows.append([math.nan] * len(self.steps))
        self.steps.append(step)
        for layer, row in zip(self.layers, self.rows, strict=True):
            value = _float_or_none(rates.get(layer))
            row.append(math.nan if value is None else value)


#: The heatmap's colour range: log10 of the underflow rate, from 1e-6 (or zero) to 1.
_HEAT_LOG10_RANGE = (-6.0, 0.0)


def underflow_heatmap(
    layers: list[str], steps: list[int], rows: list[list[float]], max_width: int = 800
) -> tuple[Any, str]:
    """A heatmap of underflow rates as an RGB ``uint8`` array ``(height, width, 3)`` and its caption.

    Rows are layers in backpropagation order (layer ID 0, the layer nearest the loss, at the top), columns
    telemetry steps left to right (at most ``max_width`` columns: a longer history keeps an evenly spread
    selection, the first and last included). Colour is ``log10(rate)`` on viridis from ``1e-6`` or less
    (dark purple, zero included) to 1 (yellow); grey marks a step that did not record the layer. A bar at the
    right edge shows the colour scale, 1 at the top. Drawn with numpy alone (no figure, no fonts), so it costs
    a small part of what a matplotlib figure would (see :meth:`WandbLogger.log_telemetry`).
    """
    import numpy as np
    from matplotlib import colormaps

    ids = list(range(len(layers)))[::-1]  # network order reversed: ID 0 first
    columns = list(range(len(steps)))
    if len(columns) > max_width:
        columns = sorted({round(i * (len(steps) - 1) / (max_width - 1)) for i in range(max_width)})
    data = np.array([[rows[i][j] for j in columns] for i in ids], dtype=np.float64).reshape(len(ids), -1)
    lo, hi = _HEAT_LOG10_RANGE
    with np.errstate(divide="ignore", invalid="ignore"):
        level = (np.log10(np.clip(data, 10.0**lo, 1.0)) - lo) / (hi - lo)
    lut = (np.asarray(colormaps["viridis"](np.linspace(0.0, 1.0, 256)))[:, :3] * 255).astype(np.uint8)
    image = lut[np.clip(np.nan_to_num(level, nan=0.0) * 255, 0, 255).astype(np.int64)]
    image[np.isnan(data)] = (128, 128, 128)
    cell_h = max(1, min(12, 360 // max(1, len(ids))))
    cell_w = max(1, min(24, max_width // max(1, len(columns))))
    image = np.repeat(np.repeat(image, cell_h, axis=0), cell_w, axis=1)
    height = image.shape[0]
    scale = lut[np.linspace(255, 0, height).astype(np.int64)]  # the colour bar, 1 at the top
    gap = np.full((height, 4, 3), 255, dtype=np.uint8)
    bar = np.repeat(scale[:, None, :], 10, axis=1)
    image = np.concatenate([image, gap, bar], axis=1)
    shown = [steps[j] for j in columns]
    first_last = f"{shown[0]:,} to {shown[-1]:,}" if shown else "none"
    caption = (
        f"Activation-gradient underflow rate: rows are the {len(layers)} layers, layer ID 0 (nearest the "
        f"loss) at the top; columns are {len(shown)} telemetry steps, iterations {first_last}, left to "
        "right; colour log10(rate) from 1e-6 or less (dark) to 1 (yellow), grey = not recorded; the bar on "
        "the right is the colour scale."
    )
    return image, caption


def _sweep_group(run_dir: Path) -> str | None:
    """The W&B group of a Hydra sweep's job: its sweep folder (the run folder's parent), as a path relative
    to the working directory when it is below it; ``None`` outside a sweep."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN):
            return None
    except Exception:  # noqa: BLE001 - not inside Hydra (a test, a script): a single run
        return None
    sweep = Path(run_dir).resolve().parent
    try:
        sweep = sweep.relative_to(Path.cwd())
    except ValueError:
        pass
    return str(sweep)[-128:]  # W&B's limit on a group name


def _auto_tags(config: Mapping[str, Any]) -> list[str]:
    """``[precision, scaler, "scale=<S>" for a fixed scale]`` from the resolved config."""
    precision = config.get("precision") or {}
    scaler = config.get("scaler") or {}
    tags = [str(v) for v in (precision.get("name"), scaler.get("name")) if v]
    scale = _float_or_none(scaler.get("scale")) if scaler.get("name") == "fixed" else None
    if scale is not None:
        tags.append(f"scale={int(scale) if scale.is_integer() else scale:g}")
    return tags


def _storage_summary(per_layer: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Scalars over the layers of the gradient-storage columns present: saturation mean/max, SQNR min/mean
    (finite layers), the smallest and largest quantizer scale; in an FP4 run, the smallest gradient-to-noise
    ratio and the largest shares of clamped and subnormal block scales over the FP4 layers."""

    def finite(key: str) -> list[float]:
        values = (_float_or_none(v) for v in (per_layer.get(key) or {}).values())
        return [v for v in values if v is not None and math.isfinite(v)]

    out: dict[str, float] = {}
    if saturation := finite("saturation_rate"):
        out.update({"saturation/mean": sum(saturation) / len(saturation), "saturation/max": max(saturation)})
    if sqnr := finite("sqnr_db"):
        out.update({"sqnr_db/min": min(sqnr), "sqnr_db/mean": sum(sqnr) / len(sqnr)})
    if low := finite("grad_scale_min"):
        out["grad_scale/min"] = min(low)
    if high := finite("grad_scale_max"):
        out["grad_scale/max"] = max(high)
    if ratio := finite("fp4_grad_to_noise"):
        out["fp4/grad_to_noise_min"] = min(ratio)
    for share in ("clamped", "subnormal"):
        if values := finite(f"fp4_block_{share}_share"):
            out[f"fp4/block_{share}_share_max"] = max(values)
    return out


def build_logger(logger: Any, run_dir: Path, config: Mapping[str, Any], run_id: str | None = None) -> Logger:
    """The logger of a ``logger`` config: ``hydra.utils.instantiate`` on its ``_target_``
    (:func:`wandb_logger`, :class:`NullLogger` or a class of the user's), with ``run_dir``, ``config`` (the
    resolved run config) and ``run_id`` (an earlier W&B run to continue) where the target takes them.

    A plain mapping without ``_target_`` is typed by the schema its ``wandb`` key implies (set: W&B, null:
    none; :mod:`adaloss.runner.schemas`). ``ConfigError`` for an unknown key, a wrong type or a value out of
    range.
    """
    from adaloss.runner.schemas import schema_of
    from adaloss.runner.utils.targets import build_group

    node: Any = {"name": "none"} if logger is None else logger
    if schema_of(node) is None and "_target_" not in node:
        items = dict(node)
        node = {**items, "name": "wandb" if items.get("wandb") else "none"}
    fill = {"run_dir": run_dir, "config": config, "run_id": run_id}
    return build_group("logger", node, example="logger=custom logger._target_=my_pkg.MyLogger", fill=fill)


def wandb_logger(
    wandb: Mapping[str, Any], run_dir: Path, config: Mapping[str, Any], run_id: str | None = None
) -> Logger:
    """``logger=wandb``'s target: a :class:`WandbLogger` with ``wandb``'s settings (``logger.wandb.*``),
    or a :class:`NullLogger` for ``mode=disabled``. The group is ``logger.wandb.group`` or, when that is
    null, the sweep folder of a Hydra sweep's job (no group for a single run); the tags are the precision,
    the scaler and a fixed scale (``scale=128``) plus ``logger.wandb.tags``. Never raises for W&B trouble;
    see the module docstring."""
    if wandb["mode"] == "disabled":
        return NullLogger()
    tags = [*_auto_tags(config), *(str(t) for t in (wandb.get("tags") or []))]
    return WandbLogger(
        project=str(wandb["project"]),
        run_dir=run_dir,
        config=config,
        mode=wandb["mode"],
        name=wandb.get("name"),
        group=wandb.get("group") or _sweep_group(run_dir),
        tags=list(dict.fromkeys(tags)),
        entity=wandb.get("entity"),
        run_id=run_id,
        init_timeout=float(wandb["init_timeout"]),
        per_layer_series=bool(wandb["per_layer_series"]),
    )
