"""``train(cfg)``: build every part of a run from the composed config, train, evaluate, record.

The loop reads top to bottom (the step shape of ``docs/architecture.md``): forward and loss under the
precision context, backward through the loss scaler, optional unscale + clip, step, update, and the lr
schedule only after an applied update. Host-device syncs per iteration: one in ``scaler.step`` (the Inf/NaN
flag); plus one on logging steps (loss and accuracy), one on telemetry steps (underflow counts) and one per
evaluation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from tqdm.contrib.logging import logging_redirect_tqdm

from adaloss.data import build_datasets, make_loader
from adaloss.engine.evaluate import evaluate
from adaloss.engine.optim import build_optimizer, build_schedule
from adaloss.errors import ConfigError
from adaloss.logging import ProgressBar, build_logger, write_json_atomic
from adaloss.models import build_model
from adaloss.precision import Precision
from adaloss.scalers import LossScaler, build_scaler
from adaloss.telemetry import UnderflowMonitor
from adaloss.utils import resolved_config, schedule_length, seed_everything, select_device, validate_config

log = logging.getLogger(__name__)

__all__ = ["train"]


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train the model ``cfg`` describes and return its metrics (also written to ``metrics.json``).

    ``cfg`` is the composed ``configs/train.yaml`` (from ``@hydra.main`` or ``hydra.compose``; a composed
    config must set ``paths.output_dir``). The run folder receives the W&B files and, last and atomically,
    ``metrics.json``: a run that raises leaves no ``metrics.json``.

    Returns a dict with ``test_accuracy`` and ``best_test_accuracy`` (top-1, %), ``steps``,
    ``skipped_steps``, ``overflow_count``, ``loss_scale`` (a float, or ``{layer: alpha}``),
    ``underflow_rate`` (``{layer: rate}`` of the last telemetry step), ``mean_underflow_rate``,
    ``wall_time_s``, ``images_per_s`` and ``config`` (the resolved config).

    Raises:
        ConfigError: for any invalid setting or missing data, before training starts.
    """
    started = time.perf_counter()
    validate_config(cfg)
    try:
        run_dir = Path(str(cfg.paths.output_dir))
    except Exception as error:  # the ${hydra:...} default only resolves inside @hydra.main
        raise ConfigError(
            f"paths.output_dir cannot be resolved ({error}); set paths.output_dir=<folder> when composing "
            "the config outside train.py"
        ) from None
    config = resolved_config(cfg)
    device = select_device(cfg.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick the fastest kernels
    seed_everything(int(cfg.seed))

    # ---- data
    train_set, test_set, info = build_datasets(cfg.dataset, cfg.paths.data_dir)
    workers = int(cfg.trainer.num_workers)
    train_loader = make_loader(
        train_set, cfg.trainer.batch_size, train=True, seed=cfg.seed, num_workers=workers
    )
    test_loader = make_loader(
        test_set, cfg.trainer.eval_batch_size, train=False, seed=cfg.seed, num_workers=workers
    )
    full_steps, steps = schedule_length(cfg.trainer, len(train_loader))

    # ---- model, loss scaler, precision (this order: the adaptive scaler returns a transformed model,
    # whose GEMM layers the precision then names for telemetry)
    model = build_model(cfg.model, info.num_classes, input_shape=info.input_shape).to(device)
    precision = Precision(cfg.precision.name, device, telemetry_format=str(cfg.telemetry.format))
    # The scaler guards the gradients, so it needs the gradient format (fp8_e5m2 differs from the
    # weight/activation format); None for an fp32 run.
    scaler = build_scaler(cfg.scaler, precision.grad_format)
    model = scaler.attach(model)
    model = precision.prepare(model)
    optimizer = build_optimizer(cfg.optimizer, model)
    scheduler = build_schedule(cfg.schedule, optimizer, steps)
    monitor = UnderflowMonitor(every=cfg.telemetry.every, fmt=precision.telemetry_format)
    criterion = nn.CrossEntropyLoss()
    clip = cfg.trainer.grad_clip
    log_every, eval_every = int(cfg.trainer.log_every), int(cfg.trainer.eval_every)

    log.info(
        "%s: %s on %s (%d train / %d test), %s, scaler %s; %d iterations of batch %d (schedule %d)",
        cfg.name, cfg.model.name, info.name, info.train_size, info.test_size, precision,
        cfg.scaler.name, steps, cfg.trainer.batch_size, full_steps,
    )  # fmt: skip
    logger = build_logger(cfg.logger, run_dir, config)
    bar = ProgressBar(steps, desc=str(cfg.name), enabled=bool(cfg.trainer.progress_bar))
    window = _Window(device)
    rates: dict[str, float] = {}
    test_accuracy = best_accuracy = 0.0
    train_loss = train_accuracy = float("nan")
    train_time = window_time = 0.0  # seconds in training iterations (evaluation excluded), for images/s

    batches = _endless(train_loader)
    model.train()
    try:
        with logging_redirect_tqdm():
            for step in range(steps):
                tick = time.perf_counter()
                x, y = next(batches)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)

                # forward + loss in the training format; a telemetry step also counts underflow
                telemetry_step = monitor.due(step)
                with precision.autocast(monitor=monitor if telemetry_step else None):
                    logits = model(x)  # (B, num_classes)
                    loss = criterion(logits, y)
                # backward through the loss scale; step unless a gradient is Inf/NaN
                scaler.scale(loss).backward()
                if clip is not None:
                    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                    nn.utils.clip_grad_norm_(model.parameters(), float(clip))
                scaler.step(optimizer)  # note: one host sync (reads the Inf/NaN flag)
                scaler.update()
                if not scaler.last_step_skipped:
                    scheduler.step()  # the schedule counts applied updates only
                optimizer.zero_grad(set_to_none=True)
                window.add(loss, logits, y)  # on-device sums, no sync
                done = step + 1  # iterations completed: the x-axis of every logged series
                elapsed = time.perf_counter() - tick  # honest on CUDA too: scaler.step synced
                train_time += elapsed
                window_time += elapsed

                if telemetry_step:
                    rates = monitor.underflow_rates()  # note: one host sync
                    logger.log(
                        {
                            **{f"underflow/{layer}": r for layer, r in rates.items()},
                            "underflow/mean": UnderflowMonitor.mean_rate(rates),
                            **_scaler_metrics(scaler),
                        },
                        step=done,
                    )

                if done % log_every == 0 or done == steps:
                    train_loss, train_accuracy, images = window.read()  # note: one host sync
                    images_per_s = images / max(window_time, 1e-9)
                    window_time = 0.0
                    scale = scaler.loss_scale_metric()
                    logger.log(
                        {
                            "train/loss": train_loss,
                            "train/accuracy": train_accuracy,
                            "lr": optimizer.param_groups[0]["lr"],
                            "images_per_s": images_per_s,
                            **_scaler_metrics(scaler, scale),
                        },
                        step=done,
                    )
                    bar.show(train_loss, train_accuracy, scale, images_per_s)

                if done % eval_every == 0 or done == steps:
                    test_accuracy = evaluate(model, test_loader, precision, device)
                    best_accuracy = max(best_accuracy, test_accuracy)
                    logger.log(
                        {"test/accuracy": test_accuracy, "test/best_accuracy": best_accuracy}, step=done
                    )
                    logger.log_underflow(rates, step=done)
                    log.info(
                        "iteration %d/%d: test accuracy %.2f%% (best %.2f%%), skipped steps %d",
                        done, steps, test_accuracy, best_accuracy, scaler.skipped_steps,
                    )  # fmt: skip
                bar.update()
    except BaseException:
        logger.finish(exit_code=1)
        raise
    finally:
        bar.close()

    metrics: dict[str, Any] = {
        "test_accuracy": test_accuracy,
        "best_test_accuracy": best_accuracy,
        "steps": steps,
        "skipped_steps": scaler.skipped_steps,
        "overflow_count": scaler.overflow_count,
        "loss_scale": scaler.loss_scale_metric(),
        "underflow_rate": rates,
        "mean_underflow_rate": UnderflowMonitor.mean_rate(rates),
        "train_loss": train_loss,
        "train_accuracy": train_accuracy,
        "lr": optimizer.param_groups[0]["lr"],  # final; unchanged by skipped steps
        "wall_time_s": time.perf_counter() - started,
        "images_per_s": steps * int(cfg.trainer.batch_size) / max(train_time, 1e-9),
        "config": config,
    }
    logger.finish()  # W&B files are complete before metrics.json marks the run finished
    write_json_atomic(run_dir / "metrics.json", metrics)
    log.info("test accuracy %.2f%%; metrics in %s", test_accuracy, run_dir / "metrics.json")
    return metrics


def _endless(loader: Any) -> Iterator[Any]:
    """Batches from ``loader``, epoch after epoch (each pass reshuffles with the loader's generator)."""
    while True:
        yield from loader


def _scaler_metrics(scaler: LossScaler, scale: float | dict[str, float] | None = None) -> dict[str, float]:
    """Loss scale (``loss_scale`` or ``loss_scale/<layer>``, ``loss_scale_beta/<layer>``) and counters."""
    if scale is None:
        scale = scaler.loss_scale_metric()
    if isinstance(scale, dict):
        out = {f"loss_scale/{layer}": float(a) for layer, a in scale.items()}
    else:
        out = {"loss_scale": float(scale)}
    layer_betas = getattr(scaler, "layer_betas", None)
    if callable(layer_betas):
        out.update({f"loss_scale_beta/{layer}": float(b) for layer, b in layer_betas().items()})
    out["skipped_steps"] = scaler.skipped_steps
    out["overflow_count"] = scaler.overflow_count
    return out


class _Window:
    """Running train loss and accuracy since the last read, kept on the device so adding never syncs."""

    def __init__(self, device: torch.device) -> None:
        self._loss = torch.zeros((), dtype=torch.float64, device=device)
        self._correct = torch.zeros((), dtype=torch.long, device=device)
        self._seen = 0

    def add(self, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        n = y.numel()
        self._loss += loss.detach().double() * n
        self._correct += (logits.detach().argmax(dim=1) == y).sum()
        self._seen += n

    def read(self) -> tuple[float, float, int]:
        """``(mean loss, accuracy %, images)`` since the last read, then reset. One host sync."""
        loss, correct = torch.stack([self._loss, self._correct.double()]).tolist()
        seen = max(self._seen, 1)
        result = (loss / seen, 100.0 * correct / seen, self._seen)
        self._loss.zero_()
        self._correct.zero_()
        self._seen = 0
        return result
