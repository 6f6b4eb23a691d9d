"""Checks on the composed config that no single module owns, and the schedule length they imply.

The group builders (models, data, scalers, precision) validate their own fields; what is left here is the
``trainer``, ``optimizer`` and ``schedule`` values the engine reads, so a typo fails with one line before
any data is loaded rather than deep inside the loop.
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, OmegaConf

from adaloss.errors import ConfigError


def _positive_int(value: Any, key: str, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = " or null" if allow_none else ""
        raise ConfigError(f"{key} must be a positive integer{hint}, got {value!r}")
    return value


def _number(value: Any, key: str, low: float, high: float = math.inf, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        bracket = "(" if low_open else "["
        raise ConfigError(f"{key} must be in {bracket}{low}, {high}], got {value!r}")
    return float(value)


def validate_config(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` naming the first invalid trainer/optimizer/schedule value. No side effects."""
    t = cfg.trainer
    _positive_int(t.batch_size, "trainer.batch_size")
    _positive_int(t.eval_batch_size, "trainer.eval_batch_size")
    _positive_int(t.eval_every, "trainer.eval_every")
    _positive_int(t.log_every, "trainer.log_every")
    _positive_int(t.max_steps, "trainer.max_steps", allow_none=True)
    if (t.steps is None) == (t.epochs is None):
        raise ConfigError(
            f"set exactly one of trainer.steps and trainer.epochs (got steps={t.steps}, epochs={t.epochs}); "
            "e.g. trainer.epochs=null"
        )
    _positive_int(t.steps, "trainer.steps", allow_none=True)
    _positive_int(t.epochs, "trainer.epochs", allow_none=True)
    if t.grad_clip is not None:
        _number(t.grad_clip, "trainer.grad_clip", 0.0, low_open=True)
    if isinstance(t.num_workers, bool) or not isinstance(t.num_workers, int) or t.num_workers < 0:
        raise ConfigError(f"trainer.num_workers must be an integer >= 0, got {t.num_workers!r}")

    if cfg.optimizer.name != "sgd":
        raise ConfigError(f"unknown optimizer '{cfg.optimizer.name}': the only choice is optimizer=sgd")
    _number(cfg.optimizer.lr, "optimizer.lr", 0.0, low_open=True)
    _number(cfg.optimizer.momentum, "optimizer.momentum", 0.0, 1.0)
    _number(cfg.optimizer.weight_decay, "optimizer.weight_decay", 0.0)

    s = cfg.schedule
    if s.name != "multistep":
        raise ConfigError(f"unknown schedule '{s.name}': the only choice is schedule=multistep")
    milestones = list(s.milestones)
    for m in milestones:
        _number(m, "schedule.milestones entries", 0.0, 1.0, low_open=True)
    if milestones != sorted(milestones):
        raise ConfigError(
            f"schedule.milestones must be increasing fractions of the schedule, got {milestones}"
        )
    _number(s.gamma, "schedule.gamma", 0.0, low_open=True)
    _number(s.warmup_fraction, "schedule.warmup_fraction", 0.0, 1.0)
    _number(s.warmup_factor, "schedule.warmup_factor", 0.0, low_open=True)


def schedule_length(trainer: DictConfig, iters_per_epoch: int) -> tuple[int, int]:
    """``(full, run)``: the recipe's schedule length in iterations, and the iterations this run does.

    ``full`` is ``trainer.steps`` or ``trainer.epochs * iters_per_epoch``; ``run`` is ``full`` capped by
    ``trainer.max_steps``. The lr schedule is laid over ``run``, so a capped run keeps the decay shape.
    """
    full = int(trainer.steps) if trainer.steps is not None else int(trainer.epochs) * iters_per_epoch
    run = min(full, int(trainer.max_steps)) if trainer.max_steps is not None else full
    return full, run


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
