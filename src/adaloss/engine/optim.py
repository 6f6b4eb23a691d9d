"""The optimizer and the learning-rate schedule, from the ``optimizer`` and ``schedule`` config groups."""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from adaloss.errors import ConfigError


def build_optimizer(cfg: Any, model: nn.Module) -> torch.optim.SGD:
    """SGD with momentum over every parameter of ``model``.

    Weight decay applies to all parameters, batch-norm scales and biases included, as in He et al. 2016
    (excluding them is a later refinement the paper's baselines do not use). Build it after
    ``precision.prepare`` so it holds the parameters the training model uses.
    """
    return torch.optim.SGD(
        model.parameters(),
        lr=float(cfg.lr),
        momentum=float(cfg.momentum),
        weight_decay=float(cfg.weight_decay),
        nesterov=bool(cfg.nesterov),
    )


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


def build_schedule(cfg: Any, optimizer: torch.optim.Optimizer, length: int) -> LambdaLR:
    """The ``multistep`` schedule laid over ``length`` updates.

    Call ``.step()`` after each *applied* update only: a step the loss scaler skipped did not move the
    weights, so it does not move the schedule either (as with ``torch.amp.GradScaler``). No host sync.
    """
    rule = MultiStepWithWarmup(
        length,
        list(cfg.milestones),
        float(cfg.gamma),
        float(cfg.get("warmup_fraction", 0.0)),
        float(cfg.get("warmup_factor", 0.1)),
        str(cfg.get("warmup", "constant")),
    )
    return LambdaLR(optimizer, lr_lambda=rule)
