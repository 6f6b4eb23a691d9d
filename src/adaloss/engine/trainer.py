"""``train(cfg)``: build every part of a run from the composed config, train, evaluate, record.

The loop reads top to bottom (the step shape of ``docs/architecture.md``): forward and loss under the
precision context, backward through the loss scaler, optional unscale + clip, step, update, and the lr
schedule only after an applied update. Host-device syncs per iteration: one in ``scaler.step`` (the Inf/NaN
flag); plus one on logging steps (loss and accuracy, and the iterations' losses for ``scalars.csv``), one on
telemetry steps (underflow counts), one per evaluation, and for the adaptive scaler one on the steps that
recompute its per-layer scales (``scalars.csv`` records their range every iteration).

Checkpoints (``trainer.checkpoint_every``) and ``resume=`` are described in :mod:`adaloss.engine.checkpoint`:
a resumed run continues bitwise as the uninterrupted run would have (on the CPU, with ``num_workers=0``).

Data parallel (``torchrun --nproc_per_node=N train.py ...``; :mod:`adaloss.distributed`): one process per
device, DistributedDataParallel over NCCL (CUDA) or gloo (CPU). What a run means does not depend on ``N``:

* ``trainer.batch_size`` is the global batch. Every rank draws the same shuffled global batches and takes its
  contiguous ``1/N`` of each (:mod:`adaloss.data.loaders`), so one iteration's samples over all ranks are
  exactly those of a one-process run, and the schedule, the data position and ``images_per_s`` count
  global batches.
* Each rank backpropagates ``mean loss over its samples / N`` and DDP *sums* the gradients (a comm hook
  instead of DDP's averaging): the optimizer sees the mean over the global batch, as before, and every
  rank's backward pass carries the same per-sample gradient magnitudes as one process on the global batch.
  Loss scales, overflows and the adaptive scaler's statistics (all-reduced by the scaler) are therefore
  those of a one-process run, not ``N`` times larger.
* The found-Inf flag is all-reduced by the scaler, so every rank skips the same steps; the divergence
  guard's loss check on skipped steps is all-reduced here. Training loss/accuracy and underflow rates are
  averaged over the ranks on log and telemetry steps (the expected loss scale is rank 0's).
* Rank 0 evaluates (the unwrapped module, no collectives inside) and broadcasts the result; it alone logs
  (W&B, progress bar, INFO lines; other ranks log warnings only), writes ``telemetry.jsonl``, checkpoints
  (with every rank's RNG state), ``model.pt`` and ``metrics.json`` (with ``world_size``). Every rank
  returns the same metrics. All ranks read the checkpoint they resume from.
* Seeds are identical on all ranks (identical initial weights; DDP also broadcasts rank 0's); after the
  model is built, ranks ``> 0`` re-seed their global RNGs so their random augmentations are independent.
* Batch-norm statistics are per rank (each normalizes over its own share of the batch), as with plain DDP.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from tqdm.contrib.logging import logging_redirect_tqdm

from adaloss.data import build_datasets, make_loader
from adaloss.data.loaders import BatchStream
from adaloss.distributed import destroy, init_distributed
from adaloss.engine.checkpoint import (
    FORMAT_VERSION,
    CheckpointManager,
    check_model_shapes,
    config_key,
    object_state,
    plain,
    restore_object_state,
    save_atomic,
)
from adaloss.engine.faults import DivergenceGuard, GradientFaults, SkippedStepReport, TrainingDiverged
from adaloss.engine.optim import build_optimizer, build_schedule
from adaloss.engine.run_folder import (
    DONE_FILE,
    RunFolder,
    RunFolderError,
    RunLock,
    finished_run,
    resume_command,
    writing,
)
from adaloss.engine.signals import RunInterrupted, StopRequests
from adaloss.engine.tasks import Evaluation, build_task
from adaloss.errors import ConfigError
from adaloss.logging import NullLogger, ProgressBar, build_logger, write_json_atomic
from adaloss.logging.run_log import ScalarLog, progress_line, run_name_on_log_lines, trim_appended
from adaloss.precision import Precision
from adaloss.provenance import collect_provenance
from adaloss.scalers import LossScaler, build_scaler
from adaloss.telemetry import UnderflowMonitor
from adaloss.utils import resolved_config, schedule_length, seed_everything, select_device, validate_config
from adaloss.utils.allocator import tune_cpu_allocator
from adaloss.utils.seed import capture_rng_state, restore_rng_state

log = logging.getLogger(__name__)

__all__ = ["DEBUG_RANK_FILES_ENV", "StepCallback", "train"]

#: Test hook: when this environment variable is ``1``, every rank of a data-parallel run writes
#: ``<run dir>/debug_rank<r>.pt`` at the end (its ``loss_scale`` metric, ``skipped_steps`` and weights), so a
#: test can check that all ranks hold identical scales and weights. Off by default; nothing else reads it.
DEBUG_RANK_FILES_ENV = "ADALOSS_DEBUG_RANK_FILES"

#: ``callback(step, model, optimizer, scaler)``: called after every completed iteration (``step`` counts
#: iterations completed, as the logs do), once the update was applied or skipped and the gradients cleared.
#: For tests and instrumentation; it must not change the training state.
StepCallback = Callable[[int, nn.Module, torch.optim.Optimizer, LossScaler], None]


def train(cfg: DictConfig, callbacks: Sequence[StepCallback] = ()) -> dict[str, Any]:
    """Train the model ``cfg`` describes and return its metrics (also written to ``metrics.json``).

    ``cfg`` is the composed ``configs/train.yaml`` (from ``@hydra.main`` or ``hydra.compose``; a composed
    config must set ``paths.output_dir``). The run folder receives the W&B files, ``telemetry.jsonl`` (one
    line per telemetry step), ``checkpoints/step_<N>.pt`` every ``trainer.checkpoint_every`` iterations,
    ``model.pt`` (the final weights) with ``trainer.save_final``, then ``metrics.json`` (atomically) and,
    last, the ``done`` marker: a run that raises leaves no ``done`` (and keeps its checkpoints).
    ``resume=auto`` or ``resume=<file>`` continues from a checkpoint (:mod:`adaloss.engine.checkpoint`);
    ``resume=auto`` on a finished run (``done`` exists) prints one line, returns its recorded metrics and
    changes nothing. ``callbacks`` are called after every iteration (see :data:`StepCallback`).

    Returns a dict with the task's test metric (classification: ``test_accuracy`` and
    ``best_test_accuracy``, top-1 %; detection: ``map`` and ``best_map``, VOC07 mAP %, and
    ``ap_per_class``; language models: ``val_loss``, ``best_val_loss`` (the lowest), ``perplexity`` and
    ``best_perplexity``), ``diverged``, ``steps``, ``skipped_steps``, ``overflow_count``, ``loss_scale`` (a
    float, or ``{layer: alpha}``), ``underflow_rate`` (``{layer: rate}`` at the last iteration, which is
    always a telemetry step), ``mean_underflow_rate``, ``wall_time_s``, ``images_per_s`` (global),
    ``world_size`` (processes), ``provenance`` (:func:`adaloss.provenance.collect_provenance`: commit,
    versions, device, TF32), ``data`` (a text corpus: what it was) and ``config`` (the resolved config).

    Under ``torchrun`` (the module docstring) every rank calls this and gets the same metrics; only rank 0
    writes. The process group is joined here and destroyed on return or error, unless it existed before or
    this is a job of a Hydra sweep (``-m``), whose jobs share it until the process exits.

    The run folder holds one run (:mod:`adaloss.engine.run_folder`): ``train`` takes its lock first and
    writes nothing there (``run_key.json``, Hydra's ``.hydra/``, trimmed logs) until every check passed.
    SIGTERM, SIGINT, SIGUSR2 and SIGHUP stop the run after the current iteration with a checkpoint
    (:mod:`adaloss.engine.signals`). Every ``trainer.log_every`` iterations a line is logged and
    ``scalars.csv`` gets the iterations' rows (:mod:`adaloss.logging.run_log`).

    Raises:
        ConfigError: for any invalid setting or missing data, an unknown ``faults.inject`` layer, a
            ``resume=<file>`` that cannot be read or a checkpoint of a different run (or layer shapes), a
            run folder another live process holds or another run's record fills, before training starts.
        RunInterrupted: a signal stopped the run; its checkpoint is written and the message says how to
            resume.
        RunFolderError: a write into the run folder failed (disk full, read-only, folder deleted); the
            message says which checkpoints are intact and how to continue.
        TrainingDiverged: when the loss is not finite or ``trainer.max_consecutive_overflows`` steps in a
            row were skipped, unless ``trainer.on_divergence=record``, which instead ends the run there and
            records it with ``diverged: true`` and a null test metric (what the paper's tables print as
            "diverged").
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
    if device.type == "cpu":
        tune_cpu_allocator()  # no page faults per step from malloc returning memory (utils/allocator.py)
    owns_group = not (dist.is_available() and dist.is_initialized())  # else a test's or a sweep's: keep it
    adaloss_log = logging.getLogger("adaloss")
    level = adaloss_log.level
    keep_group = False
    stop = StopRequests().install()  # SIGTERM, SIGINT, SIGUSR2, SIGHUP: stop after the iteration, saved
    folder: RunFolder | None = None
    try:
        ranks = _Ranks.start(device)  # torchrun's environment: join the process group; else one process
        if ranks.distributed and owns_group and _in_sweep():
            # A process group cannot be created twice in one process under torchrun (the rendezvous keys
            # of the first are still in its store): the jobs of a sweep (-m) share it; it ends at exit.
            keep_group = True
            atexit.register(destroy)
        if not ranks.main:
            adaloss_log.setLevel(max(logging.WARNING, level))  # one voice: rank 0 logs progress
        if ranks.distributed:
            # the folder rank 0's Hydra chose (an unset hydra.run.dir holds a timestamp, which may differ)
            run_dir = Path(ranks.broadcast(str(run_dir)))
        finished = _finished_run(cfg, run_dir, config, ranks)  # resume=auto on a finished run: nothing to do
        if finished is not None:
            return finished
        folder = RunFolder(run_dir, enabled=ranks.main)
        _on_rank0(ranks, folder.lock)  # first: a refused start must not write or log anything
        with run_name_on_log_lines(_sweep_tag(cfg)):
            metrics = _train(cfg, callbacks, started, run_dir, config, ranks, folder, stop)
        ranks.barrier()  # nobody leaves while another rank may still talk to it
        return metrics
    finally:
        if folder is not None:
            folder.release()
        stop.restore()
        adaloss_log.setLevel(level)
        if owns_group and not keep_group:
            destroy()


def _train(
    cfg: DictConfig,
    callbacks: Sequence[StepCallback],
    started: float,
    run_dir: Path,
    config: dict[str, Any],
    ranks: _Ranks,
    folder: RunFolder,
    stop: StopRequests,
) -> dict[str, Any]:
    device = ranks.device
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick the fastest kernels
    seed_everything(int(cfg.seed))  # the same on every rank: the same initial weights

    # ---- data and task (classification or detection: the loss, the batch layout, the test metric)
    train_set, test_set, info = build_datasets(cfg.dataset, cfg.paths.data_dir)
    task = build_task(cfg.model, info, device)
    task.initialize(train_set)  # e.g. model.init=lsuv; the same on every rank (same seed, same samples)
    workers = int(cfg.trainer.num_workers)
    # batch_size is the global batch; under DDP each rank loads its share of every global batch
    pin = device.type == "cuda"  # pinned host memory only helps copies to a GPU
    train_loader = make_loader(
        train_set, cfg.trainer.batch_size, train=True, seed=cfg.seed, num_workers=workers,
        collate_fn=task.collate_fn, rank=ranks.rank, world_size=ranks.world, pin_memory=pin,
    )  # fmt: skip
    test_loader = make_loader(
        test_set, cfg.trainer.eval_batch_size, train=False, seed=cfg.seed, num_workers=workers,
        collate_fn=task.collate_fn, pin_memory=pin,
    )  # fmt: skip
    full_steps, steps = schedule_length(cfg.trainer, len(train_loader))

    # ---- loss scaler, precision (this order: the adaptive scaler returns a transformed model, whose GEMM
    # layers the precision then names for telemetry)
    precision = Precision.from_config(cfg.precision, device, telemetry_format=str(cfg.telemetry.format))
    precision.apply_tf32()  # FP32 stays FP32 on Ampere+ GPUs unless precision.allow_tf32=true
    provenance = collect_provenance(device, precision)  # code, packages, hardware: for metrics.json
    # The scaler guards the gradients, so it needs the gradient format (fp8_e5m2 differs from the
    # weight/activation format); None for an fp32 run.
    scaler = build_scaler(cfg.scaler, precision.grad_format)
    module = scaler.attach(task.model)
    module = precision.prepare(module)
    # DDP last (it must see the transformed module); ``module`` stays the unwrapped one: state dicts,
    # evaluation, layer names. One process: model is module.
    model = ranks.wrap(module)
    optimizer = build_optimizer(cfg.optimizer, module)  # the same parameter objects as model's
    scheduler = build_schedule(cfg.schedule, optimizer, steps)
    if ranks.rank > 0:  # independent random augmentation per rank (after the identical initialization)
        seed_everything(_rank_seed(int(cfg.seed), ranks.rank))
    monitor = UnderflowMonitor(
        every=cfg.telemetry.every,
        fmt=precision.telemetry_format,
        expected_loss_scale=bool(cfg.telemetry.get("expected_loss_scale", False)),
        quantile=cfg.telemetry.get("quantile", 0.01),
    )
    guard = DivergenceGuard(cfg.trainer.get("max_consecutive_overflows", 100))
    on_divergence = str(cfg.trainer.get("on_divergence", "fail"))
    if on_divergence not in ("fail", "record"):
        raise ConfigError(f"trainer.on_divergence must be 'fail' or 'record', got '{on_divergence}'")
    record_divergence = on_divergence == "record"
    clip = cfg.trainer.grad_clip
    loss_factor = float(cfg.trainer.get("loss_multiplier", 1.0)) * ranks.loss_factor  # gradients only
    log_every, eval_every = int(cfg.trainer.log_every), int(cfg.trainer.eval_every)
    save_final = bool(cfg.trainer.get("save_final", False))
    faults = GradientFaults.from_config(cfg.get("faults"), module)  # test hook; no-op unless faults.inject

    # ---- resume: continue from a checkpoint (resume=auto|<file>) or start fresh (resume=null)
    checkpoints = CheckpointManager.from_config(cfg.trainer, run_dir)
    key = config_key(cfg, steps)
    resumed = checkpoints.resume_point(cfg.get("resume"), key)  # every rank reads the checkpoint
    if ranks.distributed:
        points = ranks.gather(None if resumed is None else resumed.step)
        if len(set(points)) > 1:
            raise ConfigError(
                f"the ranks found different checkpoints to resume from (steps {points}); the run folder "
                f"{run_dir} must be the same folder on every rank, or pass resume=<file>"
            )
    # one run per folder: a start that is not a resume of the run recorded there is refused
    _on_rank0(ranks, lambda: folder.check(cfg.get("resume"), key, resumed))
    if resumed is not None:
        check_model_shapes(resumed.state, module, resumed.path, config)  # e.g. another model.hidden
    _on_rank0(ranks, lambda: _refuse_finished(cfg, run_dir, key, config) if ranks.main else None)
    batches = BatchStream(train_loader)  # the training batches, epoch after epoch, from a resumable position
    window = task.new_window()
    progress = _Progress(best_value=task.initial_best)
    parts = _Parts(key, module, optimizer, scheduler, scaler, batches, window, guard, progress, ranks)
    start = 0
    if resumed is not None:
        parts.load_state_dict(resumed.state)
        start = resumed.step
        started -= progress.elapsed_s  # wall time counts the interrupted part too
        log.info("resuming from %s: iteration %d/%d (epoch %d, batch %d)",
                 resumed.path, start, steps, batches.epoch, batches.batch_index)  # fmt: skip
    ranks.barrier()  # every rank has read its checkpoint before rank 0 renames any
    # every check passed: from here on the run writes into its folder
    folder.commit(key, cfg)  # run_key.json and .hydra/
    history = _TelemetryLog(run_dir / "telemetry.jsonl", enabled=ranks.main)
    scalars = ScalarLog(run_dir / "scalars.csv", layerwise=_layerwise(scaler), enabled=ranks.main)
    if ranks.main:
        checkpoints.start(resumed)  # sets aside checkpoints of another history
        # the append-only files hold what the interrupted run logged past its checkpoint (everything, for a
        # fresh start): the run logs those iterations again
        with writing("trimmed log", run_dir / "telemetry.jsonl"):
            history.truncate(after=start)
            scalars.trim(after=start)

    log.info(
        "%s: %s on %s (%d train / %d test), %s, scaler %s; %d iterations of batch %d (%s)%s",
        cfg.name, cfg.model.name, info.name, info.train_size, info.test_size, precision,
        cfg.scaler.name, steps, cfg.trainer.batch_size, _schedule_note(steps, full_steps),
        f"; {ranks.world} processes ({ranks.backend}), {int(cfg.trainer.batch_size) // ranks.world} "
        "samples each" if ranks.distributed else "",
    )  # fmt: skip
    # rank 0 alone logs and writes; the other ranks get a logger that records nothing
    run_id = resumed.state.get("wandb_run_id") if resumed else None
    logger = build_logger(cfg.logger, run_dir, config, run_id=run_id) if ranks.main else NullLogger()
    report_skipped = SkippedStepReport(logger)
    bar = ProgressBar(steps, desc=str(cfg.name), enabled=bool(cfg.trainer.progress_bar) and ranks.main)
    bar.update(start)
    window_time = 0.0  # seconds in training iterations since the last log, for images/s
    diverged: TrainingDiverged | None = None
    done = saved = start  # iterations completed; the iteration of the newest checkpoint
    mean_over_ranks = (lambda t: ranks.sum_(t) / ranks.world) if ranks.distributed else None

    def save(step: int) -> int:
        """Write the checkpoint of iteration ``step`` (every rank calls this: it gathers their states)."""
        with writing("scalars", scalars.path):
            scalars.flush(mean_over_ranks)  # the rows up to the checkpoint are on disk before it is
        progress.elapsed_s = time.perf_counter() - started
        state = parts.state_dict(step, config, logger.run_id)  # every rank: gathers RNG states
        if ranks.main:
            checkpoints.save(state, step)
        return step

    model.train()
    try:
        with logging_redirect_tqdm():
            for step in range(start, steps):
                tick = time.perf_counter()
                batch = task.to_device(next(batches))

                # forward + loss in the training format; a telemetry step also counts underflow
                telemetry_step = monitor.due(step, steps)  # also the last iteration
                with precision.autocast(monitor=monitor if telemetry_step else None):
                    loss, outputs = task.loss(model, batch)
                # backward through the loss scale; step unless a gradient is Inf/NaN
                faults.arm(step + 1)  # test hook (faults.inject): nothing happens unless configured
                # DDP sums the ranks' gradients: loss / N makes that the global batch's mean gradient
                # trainer.loss_multiplier (default 1): a test knob that shrinks every gradient (train.yaml)
                scaler.scale(loss * loss_factor if loss_factor != 1.0 else loss).backward()
                if clip is not None:
                    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                    nn.utils.clip_grad_norm_(model.parameters(), float(clip))
                scaler.step(optimizer)  # note: one host sync (reads the Inf/NaN flag)
                scaler.update()
                done = step + 1  # iterations completed: the x-axis of every logged series
                if scaler.last_step_skipped:
                    report_skipped(done, scaler)  # a log line and W&B metrics
                # on skipped steps only (the same on all ranks): the loss check must agree across ranks
                checked = ranks.mean_loss(loss) if scaler.last_step_skipped else loss
                try:
                    guard.observe(scaler.last_step_skipped, checked, done, module)  # syncs if skipped
                except TrainingDiverged as error:
                    if not record_divergence:
                        raise
                    diverged = error
                    log.warning("%s; recording the run as diverged (trainer.on_divergence=record)", error)
                    break
                # this iteration's numbers, kept on the device until the next flush (no host sync)
                scalars.add(
                    done, loss, optimizer.param_groups[0]["lr"], scaler.loss_scale_metric(),
                    scaler.last_step_skipped, scaler.skipped_steps, scaler.overflow_count,
                )  # fmt: skip
                if not scaler.last_step_skipped:
                    scheduler.step()  # the schedule counts applied updates only
                optimizer.zero_grad(set_to_none=True)
                for callback in callbacks:
                    callback(done, module, optimizer, scaler)
                window.add(loss, outputs, batch)  # on-device sums, no sync
                elapsed = time.perf_counter() - tick  # honest on CUDA too: scaler.step synced
                progress.train_time += elapsed
                window_time += elapsed

                if telemetry_step:
                    # note: one host sync; under DDP also one all-reduce (the mean over the ranks)
                    progress.rates = rates = ranks.mean_rates(monitor.underflow_rates())
                    with writing("telemetry", history.path):
                        record = history.append(done, rates, scaler, monitor.last_expected_loss_scale)
                    logger.log_telemetry(record, step=done)  # per-layer table and heatmap, summary scalars
                    logger.log(_scaler_metrics(scaler), step=done)

                if done % log_every == 0 or done == steps:
                    progress.train_loss, progress.train_accuracy, images = window.read(
                        ranks.sum_ if ranks.distributed else None
                    )  # note: one host sync (and under DDP one all-reduce: the global batches' numbers)
                    images_per_s = images / max(window_time, 1e-9)
                    window_time = 0.0
                    scale = scaler.loss_scale_metric()
                    logger.log(
                        {
                            "train/loss": progress.train_loss,
                            **(
                                {"train/accuracy": progress.train_accuracy}
                                if progress.train_accuracy is not None
                                else {}
                            ),
                            "lr": optimizer.param_groups[0]["lr"],
                            "images_per_s": images_per_s,
                            **_scaler_metrics(scaler, scale),
                        },
                        step=done,
                    )
                    bar.show(progress.train_loss, progress.train_accuracy, scale, images_per_s)
                    log.info(progress_line(
                        done, steps, progress.train_loss, progress.train_accuracy,
                        optimizer.param_groups[0]["lr"], scale, scaler.skipped_steps, images_per_s,
                    ))  # fmt: skip
                    with writing("scalars", scalars.path):
                        scalars.flush(mean_over_ranks)  # note: one host sync (and one all-reduce)

                if done % eval_every == 0 or done == steps:
                    # rank 0 evaluates the unwrapped module (no collectives inside) and tells the others
                    progress.evaluation = ranks.broadcast_evaluation(
                        task.evaluate(module, test_loader, precision) if ranks.main else None
                    )
                    test_value = progress.test_value = progress.evaluation.value
                    best_value = progress.best_value = task.best(progress.best_value, test_value)
                    ap = progress.evaluation.get("ap_per_class") or {}  # detection: AP of each class
                    logger.log(
                        {**task.log_entries(test_value, best_value),
                         **{f"test_ap/{name}": v for name, v in ap.items() if v is not None}},
                        step=done,
                    )  # fmt: skip
                    log.info(
                        "iteration %d/%d: %s, skipped steps %d",
                        done, steps, task.describe(test_value, best_value), scaler.skipped_steps,
                    )  # fmt: skip

                if checkpoints.due(done, steps):  # after the evaluation, so the best metric includes it
                    saved = save(done)
                bar.update()

                # a signal (SIGTERM, SIGINT, SIGUSR2, SIGHUP): stop here, saved, unless the run is done.
                # Under DDP the ranks agree on logging steps (one tiny all-reduce where they sync anyway).
                if ranks.distributed:
                    requested = done % log_every == 0 and ranks.any_(bool(stop.pending))
                else:
                    requested = bool(stop.pending)
                if requested and done < steps:
                    if saved != done:
                        saved = save(done)
                    _stopped_by_signal(stop, done, steps, checkpoints, run_dir)  # raises, or training goes on
    except RunFolderError as error:  # a write into the run folder failed: one line, with what is left
        logger.finish(exit_code=1)
        raise RunFolderError(f"{error}; {_what_is_left(done, steps, checkpoints, run_dir)}") from error
    except BaseException:
        if not ranks.distributed:  # the curve up to the failure (e.g. a diverging loss); no collective here
            with contextlib.suppress(Exception):
                scalars.flush()
        logger.finish(exit_code=1)
        raise
    finally:
        bar.close()
        faults.remove()

    rates, evaluation = progress.rates, progress.evaluation
    metrics: dict[str, Any] = {
        **task.summary(*((math.nan, math.nan) if diverged else (progress.test_value, progress.best_value))),
        **({} if diverged else {k: v for k, v in evaluation.items()}),
        "diverged": diverged is not None,
        **({"diverged_reason": str(diverged), "diverged_at_step": diverged.step} if diverged else {}),
        "steps": done,
        "skipped_steps": scaler.skipped_steps,
        "overflow_count": scaler.overflow_count,
        "loss_scale": scaler.loss_scale_metric(),
        "underflow_rate": rates,
        "mean_underflow_rate": UnderflowMonitor.mean_rate(rates),
        "train_loss": progress.train_loss,
        **({"train_accuracy": progress.train_accuracy} if progress.train_accuracy is not None else {}),
        "lr": optimizer.param_groups[0]["lr"],  # final; unchanged by skipped steps
        "wall_time_s": time.perf_counter() - started,
        "images_per_s": done * int(cfg.trainer.batch_size) / max(progress.train_time, 1e-9),
        "world_size": ranks.world,
        "provenance": provenance,
        **({"data": info.source} if getattr(info, "source", None) else {}),  # a text corpus: what it was
        "config": config,
    }
    if os.environ.get(DEBUG_RANK_FILES_ENV) == "1":  # test hook, see DEBUG_RANK_FILES_ENV
        debug = {"loss_scale": metrics["loss_scale"], "skipped_steps": scaler.skipped_steps}
        save_atomic({**debug, "model": module.state_dict()}, run_dir / f"debug_rank{ranks.rank}.pt")
    try:
        with writing("scalars", scalars.path):
            scalars.flush(mean_over_ranks)
        if not ranks.main:
            return metrics  # the same numbers as rank 0's; rank 0 writes them
        if save_final:
            with writing("final weights", run_dir / "model.pt"):  # read with torch.load(weights_only=True)
                save_atomic(module.state_dict(), run_dir / "model.pt")
        logger.finish()  # W&B files are complete before metrics.json marks the run finished
        with writing("metrics", run_dir / "metrics.json"):
            write_json_atomic(run_dir / "metrics.json", metrics)
        folder.mark_done()  # last: only now is the run finished (a crash before this leaves it unfinished)
    except RunFolderError as error:
        raise RunFolderError(f"{error}; {_what_is_left(done, steps, checkpoints, run_dir)}") from error
    if diverged:
        log.info("run diverged at iteration %d; recorded in %s", diverged.step, run_dir / "metrics.json")
    else:
        log.info("%s; metrics in %s", task.describe(progress.test_value), run_dir / "metrics.json")
    return metrics


@dataclass
class _Progress:
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
        state = dict(state)
        value = state.pop("evaluation_value", None)
        for key in vars(self):
            if key in state:
                setattr(self, key, state[key])
        if value is not None:
            self.evaluation = Evaluation(value, **self.evaluation)


@dataclass
class _Parts:
    """Everything a checkpoint saves and restores, with the layout of the checkpoint file.

    Holds only tensors and plain data (see :mod:`adaloss.engine.checkpoint`): RNG states as tensors, the
    training window's sums as tensors (``_Window`` has no ``state_dict``; its attributes are saved as they
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
    progress: _Progress
    ranks: _Ranks

    def state_dict(self, step: int, config: dict[str, Any], wandb_run_id: str | None) -> dict[str, Any]:
        """The checkpoint. Under DDP every rank must call it (it gathers the ranks' RNG states: ``rng`` is
        rank 0's, ``rng_ranks`` all of them); rank 0 saves it."""
        rng = capture_rng_state()
        extra: dict[str, Any] = {}
        if self.ranks.distributed:
            extra["rng_ranks"] = self.ranks.gather(rng)
            rng = extra["rng_ranks"][0]
        return {
            "format": FORMAT_VERSION,
            "step": step,
            "config_key": self.key,
            "config": plain(config),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": plain(self.scheduler.state_dict()),
            "scaler": plain(self.scaler.state_dict()),
            "rng": rng,
            **extra,
            "world_size": self.ranks.world,
            "data": self.batches.state_dict(),
            "window": object_state(self.window),
            "guard": {"consecutive": self.guard.consecutive},
            "progress": self.progress.state_dict(),
            "wandb_run_id": wandb_run_id,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["schedule"])
        self.scaler.load_state_dict(state["scaler"])
        per_rank = state.get("rng_ranks") or []
        if len(per_rank) == self.ranks.world > 1:
            restore_rng_state(per_rank[self.ranks.rank])  # exact: each rank continues its own streams
        else:
            restore_rng_state(state["rng"])
            if self.ranks.rank > 0:  # saved at another world size: a stream of this rank's own
                seed_everything(_rank_seed(int(self.key["seed"]), self.ranks.rank, int(state["step"])))
        self.batches.load_state_dict(state["data"])
        restore_object_state(self.window, state.get("window", {}))
        self.guard.consecutive = int(state.get("guard", {}).get("consecutive", 0))
        self.progress.load_state_dict(state.get("progress", {}))


class _TelemetryLog:
    """Appends one JSON line per telemetry step to ``telemetry.jsonl`` (the input of make_figures.py).

    Each line: ``step`` (iterations completed), ``underflow_rate`` ``{layer: rate}``, ``loss_scale`` (a
    float, or ``{layer: alpha}`` for the adaptive scaler, which adds ``loss_scale_beta``) and, when
    recorded, ``expected_loss_scale`` ``{layer: scale}``. Appending a line is atomic enough for a reader:
    a run killed mid-write leaves at most one truncated last line, which readers skip. Cost: one small
    write per telemetry step.
    """

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled  # False on data-parallel ranks other than 0: they write nothing

    def append(
        self, step: int, rates: dict[str, float], scaler: LossScaler, expected: dict[str, float]
    ) -> dict[str, Any]:
        """Write the telemetry step's line (rank 0 only) and return it (W&B logs the same record)."""
        record: dict[str, Any] = {
            "step": step,
            "underflow_rate": rates,
            "loss_scale": scaler.loss_scale_metric(),
        }
        layer_betas = getattr(scaler, "layer_betas", None)
        if callable(layer_betas):
            record["loss_scale_beta"] = layer_betas()
        if expected:
            record["expected_loss_scale"] = expected
        if not self.enabled:
            return record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, allow_nan=True) + "\n")
        return record

    def truncate(self, after: int) -> None:
        """Drop the lines of steps after ``after`` (and any unreadable line): what an interrupted run logged
        past the checkpoint a resumed run continues from, which the resumed run logs again. ``after=0`` (a
        fresh start, e.g. after a kill before the first checkpoint) leaves no line. Rewritten atomically."""
        if self.enabled:
            trim_appended(self.path, lambda line: _line_step(line) <= after)


def _line_step(line: str) -> float:
    """The ``step`` of a ``telemetry.jsonl`` line; infinity for an unreadable one (which is dropped)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


def _on_rank0(ranks: _Ranks, check: Callable[[], None]) -> None:
    """Run ``check`` (a no-op on ranks other than 0, which own no folder); a ``ConfigError`` it raises on
    rank 0 stops every rank with the same message (the others would wait for rank 0 forever)."""
    failure: ConfigError | None = None
    try:
        check()
    except ConfigError as error:
        failure = error
    if ranks.distributed:
        message = ranks.broadcast(None if failure is None else str(failure))
        if failure is None and message is not None:
            failure = ConfigError(message)
    if failure is not None:
        raise failure


def _finished_run(
    cfg: DictConfig, run_dir: Path, config: dict[str, Any], ranks: _Ranks
) -> dict[str, Any] | None:
    """With ``resume=auto``, the recorded metrics of the run that finished in ``run_dir`` (its ``done``
    marker exists) with this start's settings, after one printed line saying so; else None. Nothing is
    locked, logged to the run's files or written: a finished run stays as it is. A finished run of other
    settings is left to the start's checks, which refuse it (:func:`_refuse_finished`)."""
    found: dict[str, Any] | None = None

    def look() -> None:
        nonlocal found
        finished = finished_run(run_dir) if ranks.main and _resume_auto(cfg) else None
        if finished is not None and not RunLock(run_dir).busy():  # a live holder: refused as "in use"
            trainer = cfg.trainer  # the run length, where the config alone fixes it (else the data does)
            steps = schedule_length(trainer, 0)[1] if trainer.get("steps") is not None else None
            if not finished.differences(config_key(cfg, steps), config):
                found = finished.metrics

    _on_rank0(ranks, look)
    found = ranks.broadcast(found)
    if found is not None and ranks.main:  # printed, not logged: the run's train.log stays untouched
        print(
            f"run {run_dir} is finished ({run_dir / DONE_FILE} exists): its metrics are in "
            f"{run_dir / 'metrics.json'}; nothing to do (to train again, start a run in another folder)",
            flush=True,
        )
    return found


def _refuse_finished(cfg: DictConfig, run_dir: Path, key: dict[str, Any], config: dict[str, Any]) -> None:
    """``ConfigError`` for ``resume=auto`` into a finished run that the other checks let through: one of
    other model settings of the same layer shapes (a finished run of these settings returned earlier)."""
    finished = finished_run(run_dir) if _resume_auto(cfg) else None
    if finished is not None:
        raise finished.refusal(finished.differences(key, config) or ["other settings"])


def _resume_auto(cfg: DictConfig) -> bool:
    return str(cfg.get("resume")).strip() == "auto"


def _layerwise(scaler: LossScaler) -> bool:
    """Whether the scaler has one scale per layer (its ``loss_scale_metric()`` is a dict)."""
    return isinstance(scaler.loss_scale_metric(), dict)


def _schedule_note(steps: int, full_steps: int) -> str:
    """The start line's account of the lr schedule: its length, and whether trainer.max_steps squeezed it."""
    if steps < full_steps:
        return f"schedule squeezed from {full_steps} to {steps} iterations by trainer.max_steps"
    return f"schedule {full_steps}"


def _sweep_tag(cfg: DictConfig) -> str | None:
    """``job <n> <run name>`` for the log lines of a sweep's job (``-m``), else None."""
    if not _in_sweep():
        return None
    from hydra.core.hydra_config import HydraConfig

    try:
        number = HydraConfig.get().job.num
    except Exception:  # noqa: BLE001 - a sweep without job numbers: the name alone
        number = "?"
    return f"job {number} {cfg.name}".replace("%", "%%")


def _stopped_by_signal(
    stop: StopRequests, done: int, steps: int, checkpoints: CheckpointManager, run_dir: Path
) -> None:
    """After the checkpoint of iteration ``done``: one line saying how to resume, then either the handlers
    installed before the run (submitit's) take the signal, or :class:`RunInterrupted` ends the run."""
    line = (
        f"{stop.names()} received: stopped after iteration {done}/{steps}, checkpoint "
        f"{checkpoints.folder / f'step_{done}.pt'}; resume with: {resume_command(run_dir)}"
    )
    chained = dict(stop.chained())
    unchained = [s for s in stop.pending if s not in chained]
    if chained:
        log.warning("%s (passing the signal on to the handler installed before the run, e.g. submitit's, "
                    "which requeues the job)", line)  # fmt: skip
        stop.pass_on()  # may exit: submitit requeues the job and leaves
        if not unchained:
            log.warning("the signal's handler let the run go on: training continues")
            return
    else:
        log.warning("%s", line)
    raise RunInterrupted(line, unchained[0])


def _what_is_left(done: int, steps: int, checkpoints: CheckpointManager, run_dir: Path) -> str:
    """After a failed write: where the run stopped, which checkpoints are intact and how to continue."""
    kept = [path.name for _, path in checkpoints.checkpoints()]
    if kept:
        return (
            f"the run stopped after iteration {done}/{steps}; its checkpoints are intact "
            f"({', '.join(kept)}); once fixed, continue with: {resume_command(run_dir)}"
        )
    return (
        f"the run stopped after iteration {done}/{steps} with no checkpoint to continue from; start it again "
        f"with: {resume_command(run_dir)}"
    )


def _scaler_metrics(scaler: LossScaler, scale: float | dict[str, float] | None = None) -> dict[str, float]:
    """Loss scale (``loss_scale``; a layer-wise scaler's range as ``loss_scale/min`` and ``/max``: its
    per-layer values go to the telemetry record) and counters."""
    if scale is None:
        scale = scaler.loss_scale_metric()
    if isinstance(scale, dict):
        values = [float(a) for a in scale.values()] or [math.nan]
        out = {"loss_scale/min": min(values), "loss_scale/max": max(values)}
    else:
        out = {"loss_scale": float(scale)}
    out["skipped_steps"] = scaler.skipped_steps
    out["overflow_count"] = scaler.overflow_count
    return out


def _in_sweep() -> bool:
    """Whether this process runs the jobs of a Hydra sweep (``train.py -m``) one after the other."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # noqa: BLE001 - not inside Hydra (a test, a script): a single run
        return False


def _rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The seed of data-parallel rank ``rank > 0``'s global RNGs (its random augmentation), distinct from
    every other rank's and, with ``step``, from the stream of an earlier start."""
    return ((seed * 1_000_003 + rank) * 1_000_033 + step) % 2**63


def _sum_gradients(process_group, bucket):  # no annotations: DDP checks them, and ours would be strings
    """DDP comm hook ``(process group or None, dist.GradBucket) -> Future[Tensor]``: all-reduce SUM of a
    gradient bucket (DDP's default hook divides by the world size; the trainer divides the loss by it
    instead, see :class:`_Ranks`)."""
    group = process_group if process_group is not None else dist.group.WORLD
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


@dataclass(frozen=True)
class _Ranks:
    """This process's place in a data-parallel run and the few collectives the loop needs.

    With one process (``world == 1``) every method is a no-op that returns its input, so the loop has one
    shape. Every collective here is called by all ranks at the same point of the loop (on steps that are the
    same on all ranks: logging, telemetry, evaluation, checkpoint and skipped steps).
    """

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @classmethod
    def start(cls, device: torch.device) -> _Ranks:
        """Join torchrun's process group (NCCL for CUDA, gloo for the CPU) or stay a single process.

        ``device`` is the validated ``cfg.device``; under torchrun the device becomes ``cuda:LOCAL_RANK``.
        ``ConfigError`` for an inconsistent torchrun environment or a group whose backend does not fit it.
        """
        info = init_distributed(device.type)
        if not info.is_distributed:
            return cls(device=device)
        backend = str(dist.get_backend())
        if (device.type == "cuda") != (backend == "nccl"):
            raise ConfigError(
                f"device={device.type} but the process group uses {backend}: a CUDA run needs nccl and a "
                "CPU run gloo; set device= to match the group"
            )
        return cls(info.rank, info.world_size, info.device, backend)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def loss_factor(self) -> float:
        """What each rank multiplies its mean loss by before the backward pass (gradients are summed)."""
        return 1.0 / self.world

    def wrap(self, module: nn.Module) -> nn.Module:
        """``module`` in DDP with gradients summed over the ranks (:func:`_sum_gradients`), or as it is."""
        if not self.distributed:
            return module
        from adaloss.distributed import DistInfo, wrap_model

        model = wrap_model(module, DistInfo(self.rank, self.world, self.rank, self.device))
        model.register_comm_hook(None, _sum_gradients)
        return model

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def any_(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (one tiny all-reduce under DDP)."""
        if not self.distributed:
            return flag
        tensor = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return bool(tensor.item())

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce (SUM) ``tensor`` in place over the ranks; returns it."""
        if self.distributed:
            dist.all_reduce(tensor)
        return tensor

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean over the ranks of their (local) losses, in float64: not finite iff any rank's is not."""
        if not self.distributed:
            return loss
        return self.sum_(loss.detach().double().reshape(()).clone()) / self.world

    def mean_rates(self, rates: dict[str, float]) -> dict[str, float]:
        """Per-layer underflow rates averaged over the ranks (every rank counts as many elements)."""
        if not self.distributed or not rates:
            return rates
        names = list(rates)  # the same layers in the same order on every rank
        values = torch.tensor([rates[n] for n in names], dtype=torch.float64, device=self.device)
        return dict(zip(names, (self.sum_(values) / self.world).tolist(), strict=True))

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (picklable), on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast_evaluation(self, evaluation: Evaluation | None) -> Evaluation:
        """Rank 0's evaluation on every rank (the others pass ``None``)."""
        if not self.distributed:
            assert evaluation is not None
            return evaluation
        value, extra = self.broadcast(None if evaluation is None else (evaluation.value, dict(evaluation)))
        return Evaluation(value, **extra)
