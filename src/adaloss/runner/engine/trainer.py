"""``train(cfg)``: build every part of a run from the composed config, train, evaluate, record.

A run goes through named phases, in this order: the config checked and the precision and scaler built
(:func:`adaloss.runner.engine.config.validate_config`); a finished run answered and the folder locked
(:class:`adaloss.runner.engine.admission.Admission`); the build
(:func:`adaloss.runner.engine.compose.build_run`: data, task, model, optimizer, schedule; writes nothing);
:func:`_resume` (the admission's checks, then the folder is the run's and the logs open); :func:`_loop` (the
iterations; what is due after each: telemetry, a log line, :func:`_evaluate`, a checkpoint, a stop on a
signal) and :func:`_finish` (``metrics.json``, then the ``done`` marker). They share one
:class:`~adaloss.runner.engine.compose.Run`.

The loop reads top to bottom (the step shape of ``docs/architecture.md``): forward and loss under the
precision context, backward through the loss scaler, optional unscale + clip, step, update, and the lr
schedule only after an applied update. Host-device syncs per iteration: one in ``scaler.step`` (the Inf/NaN
flag); plus one on logging steps (loss and accuracy, and the iterations' losses for ``scalars.csv``), one on
telemetry steps (underflow counts), one per evaluation, and for the adaptive scaler one on the steps that
recompute its per-layer scales (``scalars.csv`` records their range every iteration).

Checkpoints (``trainer.checkpoint_every``) and ``resume=`` are described in
:mod:`adaloss.runner.engine.checkpoint`: a resumed run continues bitwise as the uninterrupted run would have
(on the CPU, with ``num_workers=0``).

``trainer.compile=true`` (:mod:`adaloss.runner.engine.compiling`): the loop calls a ``torch.compile``d wrapper
of the module (DDP around it), eagerly on telemetry steps and for the CPU emulation; everything else (state
dicts, evaluation, callbacks) uses the uncompiled module, which shares its parameters.

Data parallel (``torchrun --nproc_per_node=N train.py ...``; :mod:`adaloss.distributed`): one process per
device, DistributedDataParallel over NCCL (CUDA) or gloo (CPU). What a run means does not depend on ``N``:

* ``trainer.batch_size`` is the global batch. Every rank draws the same shuffled global batches and takes its
  contiguous ``1/N`` of each (:mod:`adaloss.runner.data.loaders`), so one iteration's samples over all ranks
  are exactly those of a one-process run, and the schedule, the data position and ``images_per_s`` count
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
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from tqdm.contrib.logging import logging_redirect_tqdm

from adaloss.distributed import DistInfo, destroy
from adaloss.precision import Precision
from adaloss.runner.engine.admission import Admission
from adaloss.runner.engine.checkpoint import (
    CheckpointManager,
    Resume,
    save_atomic,
)
from adaloss.runner.engine.compose import Launch, Run, build_run, launch_device
from adaloss.runner.engine.config import validate_config
from adaloss.runner.engine.faults import SkippedStepReport, TrainingDiverged
from adaloss.runner.engine.run_folder import (
    RunFolder,
    RunFolderError,
    resume_command,
    writing,
)
from adaloss.runner.engine.signals import RunInterrupted, StopRequests
from adaloss.runner.engine.tasks import Evaluation
from adaloss.runner.logging import NullLogger, ProgressBar, TelemetryLog, write_json_atomic
from adaloss.runner.logging.run_log import ScalarLog, progress_line, run_name_on_log_lines
from adaloss.runner.utils.allocator import tune_cpu_allocator
from adaloss.scalers import LossScaler
from adaloss.telemetry import UnderflowMonitor

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
    ``resume=auto`` or ``resume=<file>`` continues from a checkpoint
    (:mod:`adaloss.runner.engine.checkpoint`); ``resume=auto`` on a finished run (``done`` exists) prints one
    line, returns its recorded metrics and changes nothing. ``callbacks`` are called after every iteration
    (see :data:`StepCallback`).

    Returns a dict with the task's test metric (classification: ``test_accuracy`` and
    ``best_test_accuracy``, top-1 %; detection: ``map`` and ``best_map``, VOC07 mAP %, and
    ``ap_per_class``; language models: ``val_loss``, ``best_val_loss`` (the lowest), ``perplexity`` and
    ``best_perplexity``), ``diverged``, ``steps``, ``skipped_steps``, ``overflow_count``, ``loss_scale`` (a
    float, or ``{layer: alpha}``), ``underflow_rate`` (``{layer: rate}`` at the last iteration, which is
    always a telemetry step), ``mean_underflow_rate``, ``wall_time_s``, ``images_per_s`` (global),
    ``world_size`` (processes), ``provenance`` (:func:`adaloss.runner.provenance.collect_provenance`: commit,
    versions, device, TF32), ``data`` (a text corpus: what it was) and ``config`` (the resolved config).

    Under ``torchrun`` every rank calls this and gets the same metrics; only rank 0 writes. The process
    group is joined here and destroyed on return, unless it existed before or a sweep's jobs share it.

    The run folder holds one run (:mod:`adaloss.runner.engine.run_folder`): ``train`` takes its lock first and
    writes nothing there (``run_key.json``, Hydra's ``.hydra/``, trimmed logs) until every check passed.
    SIGTERM, SIGINT, SIGUSR2 and SIGHUP stop the run after the current iteration with a checkpoint
    (:mod:`adaloss.runner.engine.signals`). Every ``trainer.log_every`` iterations a line is logged and
    ``scalars.csv`` gets the iterations' rows (:mod:`adaloss.runner.logging.run_log`).

    Raises:
        ConfigError: for any invalid setting or missing data, an unknown ``faults.inject`` layer, a
            ``resume=<file>`` that cannot be read or a checkpoint of a different run (or layer shapes), a
            run folder another live process holds or another run's record fills, before training starts.
        RunInterrupted: a signal stopped the run after a checkpoint; the message says how to resume.
        RunFolderError: a write into the run folder failed (disk full, read-only, folder deleted); the
            message says which checkpoints are intact and how to continue.
        TrainingDiverged: the loss is not finite or ``trainer.max_consecutive_overflows`` steps in a row
            were skipped; with ``trainer.on_divergence=record`` the run instead ends there, recorded with
            ``diverged: true`` and a null test metric (what the paper's tables print as "diverged").
    """
    started = time.perf_counter()
    device = launch_device(cfg)  # the one setting needed before the config is checked: the group's
    owns_group = not (dist.is_available() and dist.is_initialized())  # else a test's or a sweep's: keep it
    adaloss_log = logging.getLogger("adaloss")
    level, keep_group = adaloss_log.level, False
    stop = StopRequests().install()  # SIGTERM, SIGINT, SIGUSR2, SIGHUP: stop after the iteration, saved
    folder: RunFolder | None = None
    try:
        ranks = DistInfo.join(device)  # torchrun's environment: join the process group; else one process
        keep_group = ranks.is_distributed and owns_group and _in_sweep()
        if keep_group:
            # A process group cannot be created twice in one process under torchrun (the rendezvous keys
            # of the first are still in its store): the jobs of a sweep (-m) share it; it ends at exit.
            atexit.register(destroy)
        if not ranks.is_main:
            adaloss_log.setLevel(max(logging.WARNING, level))  # one voice: rank 0 logs progress
        numerics = validate_config(cfg, ranks.device)  # every check; the run's (precision, scaler)
        launch = Launch.of(cfg)  # the folder, the resolved config, the resume setting
        if device.type == "cpu":
            tune_cpu_allocator()  # no page faults per step from malloc handing memory back
        # under torchrun: the folder rank 0's Hydra chose (an unset hydra.run.dir holds a timestamp)
        run_dir = Path(ranks.broadcast(str(launch.run_dir))) if ranks.is_distributed else launch.run_dir
        admission = Admission(launch.resume, run_dir, launch.config, ranks)
        if (finished := admission.finished(launch.known_key)) is not None:
            return finished  # resume=auto on a finished run: nothing to do
        folder = RunFolder(run_dir, enabled=ranks.is_main)
        admission.lock(folder)  # first: a refused start must not write or log anything
        with run_name_on_log_lines(_sweep_tag(launch.name)):
            metrics = _train(cfg, callbacks, started, admission, folder, stop, numerics)
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
    admission: Admission,
    folder: RunFolder,
    stop: StopRequests,
    numerics: tuple[Precision, LossScaler],
) -> dict[str, Any]:
    """The phases of a run, in order: build every part, resume (or start fresh), train, finish."""
    run = build_run(cfg, admission.run_dir, dict(admission.config), admission.ranks, started, numerics)
    _resume(run, admission, folder)
    diverged = _loop(run, callbacks, stop)
    return _finish(run, folder, diverged)


# ----------------------------------------------------------------------------------------------- resume


def _resume(run: Run, admission: Admission, folder: RunFolder) -> None:
    """Resume phase: continue from a checkpoint (``resume=auto|<file>``) or start fresh (``resume=null``).
    Every check comes first (:meth:`Admission.admit`); then the run takes its folder (``run_key.json``,
    ``.hydra/``) and opens its logs (:func:`_open_logs`)."""
    ranks = run.ranks
    resumed = admission.admit(folder, run.checkpoints, run.key, run.module)
    if resumed is not None:
        run.parts.load_state_dict(resumed.state, resumed.path)  # fsdp2: every rank reads its shards
        run.done = run.saved = resumed.step
        run.started -= run.progress.elapsed_s  # wall time counts the interrupted part too
        log.info("resuming from %s: iteration %d/%d (epoch %d, batch %d)",
                 resumed.path, run.done, run.steps, run.batches.epoch, run.batches.batch_index)  # fmt: skip
    ranks.barrier()  # every rank has read its checkpoint before rank 0 renames any
    # every check passed: from here on the run writes into its folder
    folder.commit(run.key, run.config_yaml)  # run_key.json and .hydra/
    _open_logs(run, resumed)


def _open_logs(run: Run, resumed: Resume | None) -> None:
    """``telemetry.jsonl`` and ``scalars.csv`` cut back to the iteration the run continues from, the start
    line, W&B (the resumed run's id) and the progress bar."""
    settings, ranks, start = run.settings, run.ranks, run.done
    run.history = TelemetryLog(run.run_dir / "telemetry.jsonl", enabled=ranks.is_main)
    run.scalars = ScalarLog(
        run.run_dir / "scalars.csv", layerwise=_layerwise(run.scaler), enabled=ranks.is_main
    )
    if ranks.is_main:
        run.checkpoints.start(resumed)  # sets aside checkpoints of another history
        # the append-only files hold what the interrupted run logged past its checkpoint (everything, for a
        # fresh start): the run logs those iterations again
        with writing("trimmed log", run.history.path):
            run.history.truncate(after=start)
            run.scalars.trim(after=start)
    info, batch = run.info, settings.batch_size
    log.info(
        "%s: %s on %s (%d train / %d test), %s, scaler %s; %d iterations of batch %d (%s)%s",
        settings.name, settings.model, info.name, info.train_size, info.test_size, run.precision,
        settings.scaler, run.steps, batch, _schedule_note(run.steps, run.full_steps),
        f"; {ranks.world_size} processes ({ranks.backend}), {batch // ranks.world_size} samples each"
        if ranks.is_distributed else "",
    )  # fmt: skip
    # rank 0 alone logs and writes; the other ranks get a logger that records nothing
    run_id = resumed.state.get("wandb_run_id") if resumed else None
    run.logger = run.make_logger(run_id=run_id) if ranks.is_main else NullLogger()
    run.report_skipped = SkippedStepReport(run.logger)
    run.bar = ProgressBar(run.steps, desc=settings.name, enabled=settings.progress_bar and ranks.is_main)
    run.bar.update(start)


# ------------------------------------------------------------------------------------------------- loop


def _loop(run: Run, callbacks: Sequence[StepCallback], stop: StopRequests) -> TrainingDiverged | None:
    """Train phase: iterations ``run.done + 1`` to ``run.steps``, each a step (forward, backward, step,
    update, schedule) followed by what is due at that iteration: telemetry, a log line, an evaluation, a
    checkpoint, a stop on a signal. Returns the divergence that ended a run recorded as diverged
    (``trainer.on_divergence=record``), else None."""
    settings, task, model, scaler, optimizer = run.settings, run.task, run.model, run.scaler, run.optimizer
    clip = settings.grad_clip
    loss_factor = settings.loss_multiplier * run.ranks.loss_factor  # gradients only
    record_divergence = settings.record_divergence
    log_every, eval_every = settings.log_every, settings.eval_every
    model.train()
    try:
        with logging_redirect_tqdm():
            for step in range(run.done, run.steps):
                tick = time.perf_counter()
                batch = task.to_device(next(run.batches))

                # forward + loss in the training format; a telemetry step also counts underflow
                telemetry_step = run.monitor.due(step, run.steps)  # also the last iteration
                with (
                    run.precision.autocast(monitor=run.monitor if telemetry_step else None),
                    run.compiler.stance(telemetry_step),  # telemetry, emulation: eagerly
                ):
                    loss, outputs = task.loss(model, batch)
                # backward through the loss scale; step unless a gradient is Inf/NaN
                run.faults.arm(step + 1)  # test hook (faults.inject): nothing happens unless configured
                # DDP sums the ranks' gradients: loss / N makes that the global batch's mean gradient
                # trainer.loss_multiplier (default 1): a test knob that shrinks every gradient (train.yaml)
                scaler.scale(loss * loss_factor if loss_factor != 1.0 else loss).backward()
                if clip is not None:
                    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                    nn.utils.clip_grad_norm_(model.parameters(), clip)
                scaler.step(optimizer)  # note: one host sync (reads the Inf/NaN flag)
                scaler.update()
                run.done = done = step + 1  # iterations completed: the x-axis of every logged series
                diverged = _check_divergence(run, loss, record_divergence)
                if diverged is not None:
                    return diverged
                # this iteration's numbers, kept on the device until the next flush (no host sync)
                run.scalars.add(
                    done, loss, optimizer.param_groups[0]["lr"], scaler.loss_scale_metric(),
                    scaler.last_step_skipped, scaler.skipped_steps, scaler.overflow_count,
                )  # fmt: skip
                if not scaler.last_step_skipped:
                    run.scheduler.step()  # the schedule counts applied updates only
                optimizer.zero_grad(set_to_none=True)
                for callback in callbacks:
                    callback(done, run.module, optimizer, scaler)
                run.window.add(loss, outputs, batch)  # on-device sums, no sync
                elapsed = time.perf_counter() - tick  # honest on CUDA too: scaler.step synced
                run.progress.train_time += elapsed
                run.window_time += elapsed
                run.compiler.step_done(telemetry_step, elapsed)  # the first compiled step: logged once

                if telemetry_step:
                    _record_telemetry(run)
                if done % log_every == 0 or done == run.steps:
                    _log_progress(run)
                if done % eval_every == 0 or done == run.steps:
                    _evaluate(run)
                if run.checkpoints.due(
                    done, run.steps
                ):  # after the evaluation, so the best metric includes it
                    run.saved = _save(run, done)
                run.bar.update()
                _stop_if_requested(run, stop, log_every)  # a signal: saved, then stopped
    except RunFolderError as error:  # a write into the run folder failed: one line, with what is left
        run.logger.finish(exit_code=1)
        raise RunFolderError(f"{error}; {_what_is_left(run)}") from error
    except BaseException:
        if not run.ranks.is_distributed:  # the curve up to the failure (e.g. a diverging loss); no collective
            with contextlib.suppress(Exception):
                run.scalars.flush()
        run.logger.finish(exit_code=1)
        raise
    finally:
        run.bar.close()
        run.faults.remove()
    return None


def _check_divergence(run: Run, loss: torch.Tensor, record: bool) -> TrainingDiverged | None:
    """After the update of iteration ``run.done``: report a skipped step and let the divergence guard
    check it. ``TrainingDiverged`` is raised, or with ``record`` logged and returned (the run ends there)."""
    skipped = run.scaler.last_step_skipped
    if skipped:
        run.report_skipped(run.done, run.scaler)  # a log line and W&B metrics
    # on skipped steps only (the same on all ranks): the loss check must agree across ranks
    checked = run.ranks.mean_loss(loss) if skipped else loss
    try:
        run.guard.observe(skipped, checked, run.done, run.module)  # syncs if skipped
    except TrainingDiverged as error:
        if not record:
            raise
        log.warning("%s; recording the run as diverged (trainer.on_divergence=record)", error)
        return error
    return None


def _record_telemetry(run: Run) -> None:
    """A telemetry step: the layers' underflow rates into ``telemetry.jsonl`` and W&B. Note: one host sync;
    under DDP also one all-reduce (the mean over the ranks)."""
    run.progress.rates = rates = run.ranks.mean_rates(run.monitor.underflow_rates())
    with writing("telemetry", run.history.path):
        record = run.history.append(
            run.done, rates, run.scaler, run.monitor.last_expected_loss_scale, run.monitor.last_storage
        )
    run.logger.log_telemetry(record, step=run.done)  # per-layer table and heatmap, summary scalars
    run.logger.log(_scaler_metrics(run.scaler), step=run.done)


def _log_progress(run: Run) -> None:
    """A logging step: the training window's loss and accuracy to W&B, the bar and a log line, and the
    buffered rows to ``scalars.csv``. Note: two host syncs (under DDP each with one all-reduce)."""
    progress, scaler, done = run.progress, run.scaler, run.done
    progress.train_loss, progress.train_accuracy, images = run.window.read(
        run.ranks.sum_ if run.ranks.is_distributed else None
    )  # note: one host sync (and under DDP one all-reduce: the global batches' numbers)
    images_per_s = images / max(run.window_time, 1e-9)
    run.window_time = 0.0
    scale, lr = scaler.loss_scale_metric(), run.optimizer.param_groups[0]["lr"]
    accuracy = {"train/accuracy": progress.train_accuracy} if progress.train_accuracy is not None else {}
    run.logger.log(
        {"train/loss": progress.train_loss, **accuracy, "lr": lr, "images_per_s": images_per_s,
         **_scaler_metrics(scaler, scale)},
        step=done,
    )  # fmt: skip
    run.bar.show(progress.train_loss, progress.train_accuracy, scale, images_per_s)
    log.info(progress_line(
        done, run.steps, progress.train_loss, progress.train_accuracy, lr, scale, scaler.skipped_steps,
        images_per_s,
    ))  # fmt: skip
    with writing("scalars", run.scalars.path):
        run.scalars.flush(run.mean_over_ranks())  # note: one host sync (and one all-reduce)


# --------------------------------------------------------------------------------------------- evaluate


def _evaluate(run: Run) -> None:
    """An evaluation step: rank 0 evaluates the unwrapped module (no collectives inside) and tells the
    others; the best metric so far is updated and logged. A sharded model (fsdp2) needs every rank in each
    forward pass (its all-gathers): every rank evaluates the whole test set, and rank 0's result counts."""
    progress, task, done = run.progress, run.task, run.done
    evaluates = run.ranks.is_main or run.parts.sharded
    evaluation = task.evaluate(run.module, run.test_loader, run.precision) if evaluates else None
    progress.evaluation = _shared_evaluation(run.ranks, evaluation)
    test_value = progress.test_value = progress.evaluation.value
    best_value = progress.best_value = task.best(progress.best_value, test_value)
    ap = progress.evaluation.get("ap_per_class") or {}  # detection: AP of each class
    run.logger.log(
        {**task.log_entries(test_value, best_value),
         **{f"test_ap/{name}": v for name, v in ap.items() if v is not None}},
        step=done,
    )  # fmt: skip
    log.info(
        "iteration %d/%d: %s, skipped steps %d",
        done, run.steps, task.describe(test_value, best_value), run.scaler.skipped_steps,
    )  # fmt: skip


def _shared_evaluation(ranks: DistInfo, evaluation: Evaluation | None) -> Evaluation:
    """Rank 0's evaluation on every rank (the others pass ``None``)."""
    if not ranks.is_distributed:
        assert evaluation is not None
        return evaluation
    value, extra = ranks.broadcast(None if evaluation is None else (evaluation.value, dict(evaluation)))
    return Evaluation(value, **extra)


def _save(run: Run, step: int) -> int:
    """Write the checkpoint of iteration ``step`` (every rank calls this: it gathers their states); returns
    ``step``."""
    with writing("scalars", run.scalars.path):
        run.scalars.flush(run.mean_over_ranks())  # the rows up to the checkpoint are on disk before it is
    run.progress.elapsed_s = time.perf_counter() - run.started
    state = run.parts.state_dict(step, run.config, run.logger.run_id)  # every rank: gathers RNG states
    if run.parts.sharded:
        run.checkpoints.save_shards(run.parts, step)  # every rank: its shards, before rank 0 commits
    if run.ranks.is_main:
        run.checkpoints.save(state, step)
    return step


def _stop_if_requested(run: Run, stop: StopRequests, log_every: int) -> None:
    """A signal (SIGTERM, SIGINT, SIGUSR2, SIGHUP): stop here, saved, unless the run is done. Under DDP the
    ranks agree on logging steps (one tiny all-reduce where they sync anyway)."""
    done, ranks = run.done, run.ranks
    if ranks.is_distributed:
        requested = done % log_every == 0 and ranks.any_(bool(stop.pending))
    else:
        requested = bool(stop.pending)
    if requested and done < run.steps:
        if run.saved != done:
            run.saved = _save(run, done)
        _stopped_by_signal(stop, done, run.steps, run.checkpoints, run.run_dir)  # raises, or training goes on


# ----------------------------------------------------------------------------------------------- finish


def _finish(run: Run, folder: RunFolder, diverged: TrainingDiverged | None) -> dict[str, Any]:
    """Finish phase: the metrics, and (rank 0) the record in this order: the last ``scalars.csv`` rows, the
    final weights (``trainer.save_final``), W&B's files, ``metrics.json`` and, last, the ``done`` marker."""
    metrics = _metrics(run, diverged)
    save_final = run.settings.save_final
    debug_files = os.environ.get(DEBUG_RANK_FILES_ENV) == "1"  # test hook, see DEBUG_RANK_FILES_ENV
    # whole weights; gathered from the shards under fsdp2 (every rank takes part)
    weights = run.parts.full_model_state() if save_final or debug_files else None
    if debug_files:
        debug = {"loss_scale": metrics["loss_scale"], "skipped_steps": run.scaler.skipped_steps}
        save_atomic({**debug, "model": weights}, run.run_dir / f"debug_rank{run.ranks.rank}.pt")
    try:
        with writing("scalars", run.scalars.path):
            run.scalars.flush(run.mean_over_ranks())
        if not run.ranks.is_main:
            return metrics  # the same numbers as rank 0's; rank 0 writes them
        if save_final:
            with writing(
                "final weights", run.run_dir / "model.pt"
            ):  # read with torch.load(weights_only=True)
                save_atomic(weights, run.run_dir / "model.pt")
        run.logger.finish()  # W&B files are complete before metrics.json marks the run finished
        with writing("metrics", run.run_dir / "metrics.json"):
            write_json_atomic(run.run_dir / "metrics.json", metrics)
        folder.mark_done()  # last: only now is the run finished (a crash before this leaves it unfinished)
    except RunFolderError as error:
        raise RunFolderError(f"{error}; {_what_is_left(run)}") from error
    if diverged:
        log.info("run diverged at iteration %d; recorded in %s", diverged.step, run.run_dir / "metrics.json")
    else:
        log.info(
            "%s; metrics in %s", run.task.describe(run.progress.test_value), run.run_dir / "metrics.json"
        )
    return metrics


def _metrics(run: Run, diverged: TrainingDiverged | None) -> dict[str, Any]:
    """What ``train`` returns and ``metrics.json`` records (see :func:`train`)."""
    progress, scaler, rates = run.progress, run.scaler, run.progress.rates
    tested = (math.nan, math.nan) if diverged else (progress.test_value, progress.best_value)
    return {
        **run.task.summary(*tested),
        **({} if diverged else {k: v for k, v in progress.evaluation.items()}),
        "diverged": diverged is not None,
        **({"diverged_reason": str(diverged), "diverged_at_step": diverged.step} if diverged else {}),
        "steps": run.done,
        "skipped_steps": scaler.skipped_steps,
        "overflow_count": scaler.overflow_count,
        "loss_scale": scaler.loss_scale_metric(),
        "underflow_rate": rates,
        "mean_underflow_rate": UnderflowMonitor.mean_rate(rates),
        **run.monitor.last_storage,  # saturation_rate, grad_scale_min/max, sqnr_db of the last telemetry step
        "train_loss": progress.train_loss,
        **({"train_accuracy": progress.train_accuracy} if progress.train_accuracy is not None else {}),
        "lr": run.optimizer.param_groups[0]["lr"],  # final; unchanged by skipped steps
        "wall_time_s": time.perf_counter() - run.started,
        "images_per_s": run.done * run.settings.batch_size / max(progress.train_time, 1e-9),
        "world_size": run.ranks.world_size,
        **run.compiler.metrics(),  # trainer.compile: mode, the first compiled step's time
        "provenance": run.provenance,
        **(
            {"data": run.info.source} if getattr(run.info, "source", None) else {}
        ),  # a text corpus: what it was
        "config": run.config,
    }


# ---------------------------------------------------------------------------------------------- helpers


def _layerwise(scaler: LossScaler) -> bool:
    """Whether the scaler has one scale per layer (its ``loss_scale_metric()`` is a dict)."""
    return isinstance(scaler.loss_scale_metric(), dict)


def _schedule_note(steps: int, full_steps: int) -> str:
    """The start line's account of the lr schedule: its length, and whether trainer.max_steps squeezed it."""
    if steps < full_steps:
        return f"schedule squeezed from {full_steps} to {steps} iterations by trainer.max_steps"
    return f"schedule {full_steps}"


def _sweep_tag(name: str) -> str | None:
    """``job <n> <run name>`` for the log lines of a sweep's job (``-m``), else None."""
    if not _in_sweep():
        return None
    from hydra.core.hydra_config import HydraConfig

    try:
        number = HydraConfig.get().job.num
    except Exception:  # noqa: BLE001 - a sweep without job numbers: the name alone
        number = "?"
    return f"job {number} {name}".replace("%", "%%")


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


def _what_is_left(run: Run) -> str:
    """After a failed write: where the run stopped, which checkpoints are intact and how to continue."""
    kept = [path.name for _, path in run.checkpoints.checkpoints()]
    where = f"the run stopped after iteration {run.done}/{run.steps}"
    if kept:
        return (
            f"{where}; its checkpoints are intact ({', '.join(kept)}); once fixed, continue with: "
            f"{resume_command(run.run_dir)}"
        )
    return f"{where} with no checkpoint to continue from; start it again with: {resume_command(run.run_dir)}"


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
