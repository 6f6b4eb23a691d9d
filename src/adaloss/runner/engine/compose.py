"""The composition root of a run: every part built from its config group, once, in one place.

``train(cfg)`` (:mod:`adaloss.runner.engine.trainer`) reads top-down: check the config and build the numerics
(:func:`adaloss.runner.engine.config.validate_config`, which calls :func:`build_numerics`), read what the
admission needs (:class:`Launch`), admit the start (:mod:`adaloss.runner.engine.admission`),
:func:`build_run`, then the loop and the finish. Each group is built by
:func:`adaloss.runner.utils.targets.build_group` (its schema's check, then its ``_target_``), called by the
group's builder with the group's node:

=============  ==========================================================================================
group          built by
=============  ==========================================================================================
precision      :func:`build_numerics` (:func:`~adaloss.runner.utils.targets.build_precision`, run's device)
scaler         :func:`build_numerics` (:func:`~adaloss.runner.utils.targets.build_scaler`, gradient format)
dataset        :func:`build_run` (:func:`adaloss.runner.data.build_datasets`)
task, model    :func:`build_run` (:func:`adaloss.runner.engine.tasks.build_task`, with the model)
optimizer      :func:`build_run` (:func:`adaloss.runner.engine.optim.build_optimizer`)
schedule       :func:`build_run` (:func:`adaloss.runner.engine.optim.build_schedule`)
logger         :func:`build_run` binds it; the resume phase calls it (W&B needs the resumed run's id)
=============  ==========================================================================================

This module and its check (:mod:`adaloss.runner.engine.config`) are the only readers of the config object
besides the schemas (``tests/test_config_reads.py``): what the start line, the loop and the finish read is
:class:`Settings`, what the admission reads :class:`Launch`, the run key :func:`run_key`; the other modules
get plain values, or their group's node. Nothing here writes into the run folder.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from adaloss.distributed import DistInfo, rank_seed
from adaloss.errors import ConfigError
from adaloss.precision import Precision
from adaloss.runner.data import build_datasets, make_loader
from adaloss.runner.data.loaders import BatchStream
from adaloss.runner.engine.checkpoint import CheckpointManager, CheckpointParts, Progress, config_key
from adaloss.runner.engine.compiling import StepCompiler
from adaloss.runner.engine.faults import DivergenceGuard, GradientFaults, SkippedStepReport, parse_faults
from adaloss.runner.engine.optim import build_optimizer, build_schedule
from adaloss.runner.engine.tasks import Task, build_task
from adaloss.runner.logging import ProgressBar, TelemetryLog, build_logger
from adaloss.runner.logging.run_log import ScalarLog
from adaloss.runner.provenance import collect_provenance
from adaloss.runner.schemas import DistributedConf
from adaloss.runner.utils import seed_everything, select_device
from adaloss.runner.utils.targets import build_precision, build_scaler
from adaloss.scalers import LossScaler
from adaloss.telemetry import UnderflowMonitor

__all__ = [
    "Launch",
    "Run",
    "Settings",
    "build_numerics",
    "build_run",
    "launch_device",
    "resolved_config",
    "run_key",
    "schedule_length",
]


def build_numerics(cfg: DictConfig, device: str | torch.device) -> tuple[Precision, LossScaler]:
    """``device`` checked, then the run's precision and loss scaler (their builders check the combinations,
    such as ``precision.backend=autocast`` with an FP8 format). The scaler guards the gradients, so it
    takes the gradient format (fp8_e5m2 differs from the weight and activation format; None for FP32)."""
    select_device(cfg.device)  # raises for an unknown name, and for cuda without a CUDA device
    precision = build_precision(cfg.precision, device, telemetry_format=str(cfg.telemetry.format))
    return precision, build_scaler(cfg.scaler, getattr(precision, "grad_format", None))


@dataclass(frozen=True)
class Settings:
    """What the start line, the loop and the finish read of the config, read once, here."""

    name: str
    model: str  # model.name, for the start line
    scaler: str  # scaler.name, for the start line
    batch_size: int  # the global batch
    grad_clip: float | None  # unscale and clip to this norm before the step
    loss_multiplier: float  # trainer.loss_multiplier: a test knob that shrinks every gradient
    record_divergence: bool  # trainer.on_divergence=record: a diverged run ends recorded, not raised
    log_every: int
    eval_every: int
    save_final: bool  # model.pt at the end
    progress_bar: bool

    @classmethod
    def of(cls, cfg: DictConfig) -> Settings:
        """From the composed config, checked (``trainer.on_divergence`` is fail or record: its schema,
        :class:`adaloss.runner.schemas.TrainerConf`, says so)."""
        trainer = cfg.trainer
        on_divergence = str(trainer.on_divergence)
        clip = None if trainer.grad_clip is None else float(trainer.grad_clip)
        return cls(
            str(cfg.name), str(cfg.model.name), str(cfg.scaler.name), int(trainer.batch_size), clip,
            float(trainer.loss_multiplier), on_divergence == "record", int(trainer.log_every),
            int(trainer.eval_every), bool(trainer.save_final), bool(trainer.progress_bar),
        )  # fmt: skip


@dataclass
class Run:
    """One run's parts, built from its config, and the loop's running state: what the phases share."""

    config_yaml: str  # the composed config (YAML): .hydra/config.yaml once the folder is the run's
    settings: Settings
    run_dir: Path
    config: dict[str, Any]  # the resolved config: recorded in checkpoints, W&B and metrics.json
    ranks: DistInfo
    started: float  # perf_counter() at the start, moved back by the wall time of an interrupted part
    task: Task
    info: Any  # the dataset's DatasetInfo
    test_loader: Any
    steps: int  # the iterations of this run
    full_steps: int  # the recipe's schedule length (steps < full_steps: squeezed by trainer.max_steps)
    precision: Precision
    provenance: dict[str, Any]
    scaler: LossScaler
    module: nn.Module  # the unwrapped module: state dicts, evaluation, layer names
    model: nn.Module  # what the loop calls: module (trainer.compile: compiled), or that in DDP
    compiler: StepCompiler  # trainer.compile: which steps run compiled, the compile time
    optimizer: torch.optim.Optimizer
    scheduler: Any
    monitor: UnderflowMonitor
    guard: DivergenceGuard
    faults: GradientFaults
    checkpoints: CheckpointManager
    key: dict[str, Any]  # config_key(): the settings a resume must share
    batches: BatchStream  # the training batches, epoch after epoch, from a resumable position
    window: Any  # the task's on-device training sums since the last log line
    progress: Progress
    parts: CheckpointParts
    make_logger: Callable[..., Any]  # build_logger(the logger node, ...): W&B needs the resumed run's id
    # opened by the trainer's resume phase, once the folder is the run's
    history: TelemetryLog | None = None
    scalars: ScalarLog | None = None
    logger: Any = None  # rank 0: W&B (or NullLogger with logger=none); other ranks: NullLogger
    report_skipped: SkippedStepReport | None = None
    bar: ProgressBar | None = None
    done: int = 0  # iterations completed
    saved: int = 0  # the iteration of the newest checkpoint
    window_time: float = 0.0  # seconds in training iterations since the last log line, for images/s

    def mean_over_ranks(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The reduction ``scalars.csv`` applies to the ranks' losses (None for one process)."""
        ranks = self.ranks
        return (lambda t: ranks.sum_(t) / ranks.world_size) if ranks.is_distributed else None


def build_run(
    cfg: DictConfig,
    run_dir: Path,
    config: dict[str, Any],
    ranks: DistInfo,
    started: float,
    numerics: tuple[Precision, LossScaler],
) -> Run:
    """Every part of the run from its config group, once, in the order that fixes the random streams (the
    same on every rank until the model exists), around ``numerics``: the precision and scaler
    :func:`build_numerics` made when the config was checked. Writes nothing."""
    strategy = _strategy(cfg, ranks)  # first: a strategy this launch cannot run is refused before any work
    if ranks.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick the fastest kernels
    seed_everything(int(cfg.seed))  # the same on every rank: the same initial weights
    task, info, train_loader, test_loader = _build_data(cfg, ranks)
    full_steps, steps = schedule_length(cfg.trainer, len(train_loader))

    # ---- loss scaler, precision (this order: the adaptive scaler returns a transformed model, whose GEMM
    # layers the precision then names for telemetry)
    precision, scaler = numerics
    precision.apply_tf32()  # FP32 stays FP32 on Ampere+ GPUs unless precision.allow_tf32=true
    provenance = collect_provenance(ranks.device, precision)  # code, packages, hardware: for metrics.json
    module = precision.prepare(_attach(scaler, task))
    # trainer.compile: a compiled wrapper sharing module's parameters; DDP last, around it (it must see the
    # transformed module); ``module`` stays the unwrapped one: state dicts, evaluation, layer names. One
    # process, not compiled: model is module.
    compiler = StepCompiler(module, bool(cfg.trainer.compile), str(cfg.trainer.compile_mode), precision)
    model = ranks.wrap(compiler.model, strategy)  # fsdp2: shards module in place (model is module)
    optimizer = build_optimizer(cfg.optimizer, module)  # the same parameter objects as model's
    scheduler = build_schedule(cfg.schedule, optimizer, steps)
    if ranks.rank > 0:  # independent random augmentation per rank (after the identical initialization)
        seed_everything(rank_seed(int(cfg.seed), ranks.rank))
    monitor = UnderflowMonitor(
        every=cfg.telemetry.every,
        fmt=precision.telemetry_format,
        expected_loss_scale=cfg.telemetry.expected_loss_scale,
        quantile=cfg.telemetry.quantile,
        counterfactual=cfg.telemetry.counterfactual,  # every recipe on the same gradients
    )
    guard = DivergenceGuard(cfg.trainer.max_consecutive_overflows)
    settings = Settings.of(cfg)
    faults = GradientFaults(module, parse_faults(_plain(OmegaConf.select(cfg, "faults.inject"))))  # test hook
    checkpoints = CheckpointManager(run_dir, cfg.trainer.checkpoint_every, cfg.trainer.keep_checkpoints)
    key = run_key(cfg, steps)
    batches, window = BatchStream(train_loader), task.new_window()
    progress = Progress(best_value=task.initial_best)
    parts = CheckpointParts(
        key, module, optimizer, scheduler, scaler, batches, window, guard, progress, ranks, precision,
        sharded=ranks.is_distributed and strategy == "fsdp2",
    )  # fmt: skip
    make_logger = functools.partial(build_logger, cfg.logger, run_dir, config)
    return Run(
        OmegaConf.to_yaml(cfg), settings, run_dir, config, ranks, started, task, info, test_loader, steps,
        full_steps, precision, provenance, scaler, module, model, compiler, optimizer, scheduler, monitor,
        guard, faults, checkpoints, key, batches, window, progress, parts, make_logger,
    )  # fmt: skip


def launch_device(cfg: DictConfig) -> torch.device:
    """The process's device (``device``): the one setting read before the config is checked (joining the
    process group needs it)."""
    return select_device(cfg.device)


@dataclass(frozen=True)
class Launch:
    """What ``train`` reads of a checked config before the build: where the run lives and from where it
    starts."""

    run_dir: Path  # paths.output_dir
    config: dict[str, Any]  # the resolved config: recorded in checkpoints, W&B and metrics.json
    resume: Any  # resume: auto, a checkpoint file, or None
    name: str  # the run's name, for a sweep job's log lines
    known_key: dict[str, Any]  # run_key() with the length where the config alone fixes it

    @classmethod
    def of(cls, cfg: DictConfig) -> Launch:
        """From the checked config; ``ConfigError`` when ``paths.output_dir`` cannot be resolved."""
        try:
            run_dir = Path(str(cfg.paths.output_dir))
        except Exception as error:  # the ${hydra:...} default only resolves inside @hydra.main
            raise ConfigError(
                f"paths.output_dir cannot be resolved ({error}); set paths.output_dir=<folder> when "
                "composing the config outside train.py"
            ) from None
        # the run length where the config alone fixes it (trainer.steps; else the data does, and the
        # length is left out): what a finished run's record is compared with before the build
        steps = schedule_length(cfg.trainer, 0)[1] if cfg.trainer.get("steps") is not None else None
        return cls(run_dir, resolved_config(cfg), cfg.get("resume"), str(cfg.name), run_key(cfg, steps))


def resolved_config(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain containers with every interpolation resolved, without Hydra's own node.

    This is what W&B and ``metrics.json`` record, so a result can be traced to the exact values that made
    it. Cost: one walk over the config.
    """
    # Hydra's node (present with compose(return_hydra_config=True)) is dropped before resolving: parts of
    # it (hydra.job.num) exist only inside a launched job.
    own = OmegaConf.masked_copy(cfg, [key for key in cfg.keys() if key != "hydra"])
    container = OmegaConf.to_container(own, resolve=True, throw_on_missing=False)
    assert isinstance(container, dict)
    return container


def run_key(cfg: DictConfig, steps: int | None) -> dict[str, Any]:
    """:func:`~adaloss.runner.engine.run_key.config_key` of the config's settings: the groups' names,
    ``trainer.batch_size`` and ``seed``, with the run's ``steps`` (None: left out)."""
    return config_key(
        cfg.model.name, cfg.dataset.name, cfg.scaler.name, cfg.precision.name, cfg.trainer.batch_size,
        cfg.seed, steps,
    )  # fmt: skip


def _plain(value: Any) -> Any:
    """A config value as plain lists and dicts (resolved); other values as they are."""
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _strategy(cfg: DictConfig, ranks: DistInfo) -> str:
    """``distributed.strategy`` (the schema's default where a config has no ``distributed`` node), checked
    against the launch and the settings FSDP2 does not support here."""
    strategy = str(OmegaConf.select(cfg, "distributed.strategy", default=DistributedConf.strategy))
    if strategy != "fsdp2":
        return strategy
    if not ranks.is_distributed:
        raise ConfigError(
            "distributed.strategy=fsdp2 shards the model over torchrun's processes, but this is one process: "
            "launch with python -m torch.distributed.run --nproc_per_node 2 train.py ... (2 or more), or "
            "drop distributed.strategy=fsdp2"
        )
    unsupported = {
        "trainer.compile=true": bool(cfg.trainer.compile),
        "faults.inject (gradient hooks on the sharded parameters)": bool(cfg.get("faults", {}).get("inject")),
    }
    for setting, used in unsupported.items():
        if used:
            raise ConfigError(
                f"distributed.strategy=fsdp2 does not support {setting}; drop it, or use "
                "distributed.strategy=ddp"
            )
    return strategy


def _attach(scaler: Any, task: Task) -> nn.Module:
    """``scaler.attach(task.model)``, with the task's example inputs where the scaler takes them (the adaptive
    scaler captures a model torch.fx cannot trace, a transformers model, with ``torch.export`` on them)."""
    example = task.example_inputs()
    params = inspect.signature(scaler.attach).parameters.values()
    if example and any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return scaler.attach(task.model, *example)
    return scaler.attach(task.model)


def _build_data(cfg: DictConfig, ranks: DistInfo) -> tuple[Task, Any, DataLoader, DataLoader]:
    """The task (classification, detection or language model: the loss, the batch layout, the test metric),
    the dataset's info and the training and test loaders."""
    device = ranks.device
    train_set, test_set, info = build_datasets(cfg.dataset, cfg.paths.data_dir)
    task = build_task(cfg.task, cfg.model, info, device)
    task.initialize(train_set)  # e.g. model.init=lsuv; the same on every rank (same seed, same samples)
    workers = int(cfg.trainer.num_workers)
    # batch_size is the global batch; under DDP each rank loads its share of every global batch
    pin = device.type == "cuda"  # pinned host memory only helps copies to a GPU
    train_loader = make_loader(
        train_set, cfg.trainer.batch_size, train=True, seed=cfg.seed, num_workers=workers,
        collate_fn=task.collate_fn, rank=ranks.rank, world_size=ranks.world_size, pin_memory=pin,
    )  # fmt: skip
    test_loader = make_loader(
        test_set, cfg.trainer.eval_batch_size, train=False, seed=cfg.seed, num_workers=workers,
        collate_fn=task.collate_fn, pin_memory=pin,
    )  # fmt: skip
    return task, info, train_loader, test_loader


def schedule_length(trainer: DictConfig, iters_per_epoch: int) -> tuple[int, int]:
    """``(full, run)``: the recipe's schedule length in iterations, and the iterations this run does.

    ``full`` is ``trainer.steps`` or ``trainer.epochs * iters_per_epoch``; ``run`` is ``full`` capped by
    ``trainer.max_steps``. The lr schedule is laid over ``run``, so a capped run keeps the decay shape.
    """
    full = int(trainer.steps) if trainer.steps is not None else int(trainer.epochs) * iters_per_epoch
    run = min(full, int(trainer.max_steps)) if trainer.max_steps is not None else full
    return full, run
