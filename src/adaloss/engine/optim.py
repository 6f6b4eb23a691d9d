"""The optimizer and the learning-rate schedule, from the ``optimizer`` and ``schedule`` config groups.

Both groups name what they build with ``_target_`` and are ``_partial_: true`` configs
(:func:`adaloss.utils.targets.build_target`): the optimizer gets the model's parameters, the schedule the
optimizer and the run's length, when the trainer has them. Bundled: ``torch.optim.SGD`` (``optimizer=sgd``),
``torch.optim.AdamW`` (``optimizer=adamw``), :func:`multistep` and :func:`warmup_cosine`; any
``torch.optim`` optimizer or ``torch.optim.lr_scheduler`` class plugs in the same way.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import Any

import torch
from omegaconf import ListConfig
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from adaloss.errors import ConfigError
from adaloss.utils.targets import build_target, config_items, locate_target

__all__ = [
    "MultiStepWithWarmup",
    "WarmupCosine",
    "build_optimizer",
    "build_schedule",
    "check_optimizer_and_schedule",
    "multistep",
    "parameter_groups",
    "warmup_cosine",
]

#: Keys of the ``optimizer`` group that are ours, not the optimizer's arguments.
OPTIMIZER_METADATA = ("name", "decay_1d")
#: Names under which a schedule's target may take the run's length (ours, OneCycleLR, CosineAnnealingLR).
_LENGTH_PARAMETERS = ("length", "total_steps", "T_max")


def parameter_groups(model: nn.Module, weight_decay: float, decay_1d: bool) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: one group of every parameter (``decay_1d``), or, as nanoGPT does,
    weight decay on parameters with 2 or more dimensions only (matmul, convolution and embedding weights)
    and none on 1-D ones (biases, norm gains). A tied weight is one parameter and appears once."""
    params = [p for p in model.parameters() if p.requires_grad]
    if decay_1d:
        return [{"params": params, "weight_decay": weight_decay}]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_optimizer(cfg: Any, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``cfg._target_`` names, over ``model``'s parameters (see :func:`parameter_groups`).

    Build it after ``precision.prepare`` so it holds the parameters the training model uses. ``SGD`` with
    ``decay_1d: true`` decays every parameter, batch-norm scales and biases included, as in He et al. 2016
    (excluding them is a later refinement the paper's baselines do not use). Cost: no host sync.
    """
    items = config_items(cfg)
    groups = parameter_groups(model, float(items.get("weight_decay", 0.0)), bool(items.get("decay_1d", True)))
    optimizer = build_target(
        "optimizer",
        cfg,
        example="optimizer._target_=torch.optim.AdamW",
        args=(groups,),
        metadata=OPTIMIZER_METADATA,
    )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer._target_={items.get('_target_')} made a {type(optimizer).__name__}, not a "
            "torch.optim.Optimizer: name an optimizer class, e.g. optimizer._target_=torch.optim.AdamW"
        )
    return optimizer


class MultiStepWithWarmup:
    """The lr multiplier after ``update`` applied updates: a warm-up, then step decay.

    Milestones and warm-up are fractions of ``length`` (the iterations this run does), rounded to whole
    updates: with ``length=64000``, milestones ``[0.5, 0.75]`` decay after updates 32000 and 48000. The
    warm-up holds the multiplier at ``warmup_factor`` (``warmup="constant"``, He et al.'s ResNet-110 trick)
    or ramps it linearly from ``warmup_factor`` to 1 (``warmup="linear"``, as detection recipes do). A plain
    class rather than a lambda so ``LambdaLR.state_dict()`` records it.
    """

    def __init__(
        self,
        length: int,
        milestones: list[float],
        gamma: float,
        warmup_fraction: float = 0.0,
        warmup_factor: float = 0.1,
        warmup: str = "constant",
    ) -> None:
        if warmup not in ("constant", "linear"):
            raise ConfigError(f"schedule.warmup must be 'constant' or 'linear', got '{warmup}'")
        self.milestones = [round(float(m) * length) for m in milestones]
        self.gamma = float(gamma)
        self.warmup_steps = round(float(warmup_fraction) * length)
        self.warmup_factor = float(warmup_factor)
        self.linear = warmup == "linear"

    def __call__(self, update: int) -> float:
        if update < self.warmup_steps:
            if self.linear:
                return self.warmup_factor + (1.0 - self.warmup_factor) * update / self.warmup_steps
            return self.warmup_factor
        return self.gamma ** bisect_right(self.milestones, update)


class WarmupCosine:
    """The lr multiplier after ``update`` applied updates: linear warm-up, then cosine decay.

    Over the first ``W = round(warmup_fraction * length)`` updates the multiplier rises as
    ``(update + 1) / (W + 1)`` (nanoGPT's ramp: the first step already moves), then follows half a cosine
    from 1 at update ``W`` to ``final_factor`` at ``length``, and stays there. A plain class so
    ``LambdaLR.state_dict()`` records it.
    """

    def __init__(self, length: int, warmup_fraction: float = 0.05, final_factor: float = 0.1) -> None:
        self.length = int(length)
        self.warmup_steps = round(float(warmup_fraction) * self.length)
        self.final_factor = float(final_factor)

    def __call__(self, update: int) -> float:
        if update < self.warmup_steps:
            return (update + 1) / (self.warmup_steps + 1)
        span = max(self.length - self.warmup_steps, 1)
        progress = min((update - self.warmup_steps) / span, 1.0)
        return self.final_factor + (1.0 - self.final_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def multistep(
    optimizer: torch.optim.Optimizer,
    length: int,
    milestones: list[float],
    gamma: float = 0.1,
    warmup_fraction: float = 0.0,
    warmup_factor: float = 0.1,
    warmup: str = "constant",
) -> LambdaLR:
    """``schedule=multistep``: :class:`MultiStepWithWarmup` over ``length`` updates."""
    rule = MultiStepWithWarmup(length, list(milestones), gamma, warmup_fraction, warmup_factor, warmup)
    return LambdaLR(optimizer, lr_lambda=rule)


def warmup_cosine(
    optimizer: torch.optim.Optimizer, length: int, warmup_fraction: float = 0.05, final_factor: float = 0.1
) -> LambdaLR:
    """``schedule=cosine``: :class:`WarmupCosine` over ``length`` updates."""
    return LambdaLR(optimizer, lr_lambda=WarmupCosine(length, warmup_fraction, final_factor))


def build_schedule(cfg: Any, optimizer: torch.optim.Optimizer, length: int) -> Any:
    """The schedule ``cfg._target_`` names, for ``optimizer``, laid over ``length`` updates.

    Call ``.step()`` after each *applied* update only: a step the loss scaler skipped did not move the
    weights, so it does not move the schedule either (as with ``torch.amp.GradScaler``). No host sync.
    """
    fill = dict.fromkeys(_LENGTH_PARAMETERS, int(length))
    example = "schedule._target_=torch.optim.lr_scheduler.CosineAnnealingLR"
    schedule = build_target("schedule", cfg, example=example, args=(optimizer,), fill=fill)
    if not (callable(getattr(schedule, "step", None)) and callable(getattr(schedule, "state_dict", None))):
        raise ConfigError(
            f"schedule._target_={config_items(cfg).get('_target_')} made a {type(schedule).__name__}, not a "
            "learning-rate schedule (step() and state_dict()): e.g. schedule=cosine"
        )
    return schedule


# ------------------------------------------------------------------------------------------ checks


def check_optimizer_and_schedule(cfg_optimizer: Any, cfg_schedule: Any, number: Any) -> None:
    """``ConfigError`` for a missing or unimportable ``_target_`` and for the values this package gives
    meaning to, where the config has them: ``lr`` > 0, ``momentum`` in [0, 1], ``weight_decay`` >= 0;
    ``milestones`` increasing fractions, ``gamma``, the warm-up fields, ``final_factor``. ``number`` is
    ``adaloss.utils.config._number`` (the shared range check). Before anything is built; no side effects
    but the targets' imports."""
    o = cfg_optimizer
    locate_target("optimizer", o.get("_target_"), "optimizer=sgd or optimizer._target_=torch.optim.AdamW")
    if "lr" in o:
        number(o.lr, "optimizer.lr", 0.1, 0.0, low_open=True)
    if "momentum" in o:
        number(o.momentum, "optimizer.momentum", 0.9, 0.0, 1.0)
    if "weight_decay" in o:
        number(o.weight_decay, "optimizer.weight_decay", 1e-4, 0.0)

    s = cfg_schedule
    locate_target("schedule", s.get("_target_"), "schedule=multistep or schedule=cosine")
    if "milestones" in s:
        if not isinstance(s.milestones, ListConfig):
            raise ConfigError(
                f"schedule.milestones must be a list of fractions of the schedule, got {s.milestones!r}; "
                "e.g. schedule.milestones=[0.5,0.75]"
            )
        milestones = list(s.milestones)
        for m in milestones:
            number(m, "schedule.milestones entries", "[0.5,0.75]", 0.0, 1.0, low_open=True)
        if milestones != sorted(milestones):
            raise ConfigError(
                f"schedule.milestones must be increasing fractions of the schedule, got {milestones}; "
                f"e.g. schedule.milestones=[{','.join(f'{m:g}' for m in sorted(milestones))}]"
            )
    if "gamma" in s:
        number(s.gamma, "schedule.gamma", 0.1, 0.0, low_open=True)
    if "warmup_fraction" in s:
        number(s.warmup_fraction, "schedule.warmup_fraction", 0.0, 0.0, 1.0)
    if "warmup_factor" in s:
        number(s.warmup_factor, "schedule.warmup_factor", 0.1, 0.0, low_open=True)
    if "final_factor" in s:
        number(s.final_factor, "schedule.final_factor", 0.1, 0.0, 1.0)
    warmup = s.get("warmup", "constant")
    if warmup not in ("constant", "linear"):
        raise ConfigError(
            f"schedule.warmup must be 'constant' or 'linear', got {warmup!r}; e.g. schedule.warmup=linear"
        )
