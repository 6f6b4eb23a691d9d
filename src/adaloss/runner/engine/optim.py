"""The optimizer and the learning-rate schedule, from the ``optimizer`` and ``schedule`` config groups.

Both groups name what they build with ``_target_`` and are ``_partial_: true`` configs
(:func:`adaloss.runner.utils.targets.build_group`): the optimizer gets the model's parameters, the schedule
the optimizer and the run's length, when the trainer has them. Bundled: ``torch.optim.SGD``
(``optimizer=sgd``), ``torch.optim.AdamW`` (``optimizer=adamw``), :func:`multistep` and :func:`warmup_cosine`;
any ``torch.optim`` optimizer or ``torch.optim.lr_scheduler`` class plugs in the same way.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from adaloss.errors import ConfigError
from adaloss.runner.utils.targets import build_group, config_items

__all__ = [
    "MultiStepWithWarmup",
    "WarmupCosine",
    "build_optimizer",
    "build_schedule",
    "multistep",
    "parameter_groups",
    "warmup_cosine",
]

#: Keys of the ``optimizer`` group that are ours, not the optimizer's arguments.
OPTIMIZER_METADATA = ("name", "decay_1d", "decay_bias", "bias_lr_factor")
#: Names under which a schedule's target may take the run's length (ours, OneCycleLR, CosineAnnealingLR).
_LENGTH_PARAMETERS = ("length", "total_steps", "T_max")


def parameter_groups(
    model: nn.Module,
    weight_decay: float,
    decay_1d: bool,
    decay_bias: bool = True,
    bias_lr_factor: float = 1.0,
    lr: float | None = None,
) -> list[dict[str, Any]]:
    """The optimizer's parameter groups. A tied weight is one parameter and appears once.

    * ``decay_1d``: weight decay on every parameter; otherwise, as nanoGPT does, only on parameters with 2 or
      more dimensions (matmul, convolution and embedding weights) and none on 1-D ones (biases, norm gains).
    * ``decay_bias=False``: no weight decay on biases (parameters named ``bias``), whatever their shape;
      other 1-D parameters (an L2Norm's scale) still follow ``decay_1d``. ChainerCV's SSD recipe.
    * ``bias_lr_factor``: the biases' learning rate is ``lr * bias_lr_factor`` (``lr``: the optimizer's).
      For SGD this is exactly ChainerCV's ``GradientScaling(2)`` hook on biases (gradients x2): torch's
      momentum buffer ``b <- momentum * b + g`` is linear in ``g``, so doubling every ``g`` doubles every
      ``b`` and ``lr * 2b == (2 lr) * b``, bit for bit as multiplying by 2 is exact (with ``nesterov`` too,
      as long as the biases are not decayed). For Adam-type optimizers it is not: they ignore a constant
      gradient factor, but not a learning-rate one.

    With the defaults: one group of every parameter (``decay_1d``), or the two nanoGPT groups (decayed
    first). Otherwise the groups are (decayed, plain lr), (not decayed, plain lr), then the biases' group(s)
    at ``lr * bias_lr_factor``; empty groups are left out. Group 0 is always at the plain learning rate (the
    trainer logs its lr). Raises ``ConfigError`` for a ``bias_lr_factor`` other than 1 without ``lr``.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if decay_bias and bias_lr_factor == 1.0:  # the original grouping, unchanged
        params = [p for _, p in named]
        if decay_1d:
            return [{"params": params, "weight_decay": weight_decay}]
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
    if bias_lr_factor != 1.0 and lr is None:
        raise ConfigError(
            "optimizer.bias_lr_factor multiplies optimizer.lr, which the config does not set; "
            "e.g. optimizer.lr=0.001"
        )
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {key: [] for key in _GROUP_ORDER}
    for name, param in named:
        bias = is_bias(name)
        decayed = (decay_1d or param.dim() >= 2) and (decay_bias or not bias)
        groups[(bias and bias_lr_factor != 1.0, decayed)].append(param)
    out = []
    for (scaled, decayed), params in groups.items():
        if not params:
            continue
        group: dict[str, Any] = {"params": params, "weight_decay": weight_decay if decayed else 0.0}
        if scaled:
            group["lr"] = float(lr) * float(bias_lr_factor)  # type: ignore[arg-type]
        out.append(group)
    return out


#: (lr scaled by ``bias_lr_factor``, decayed): the order of :func:`parameter_groups`' groups.
_GROUP_ORDER = ((False, True), (False, False), (True, True), (True, False))


def is_bias(name: str) -> bool:
    """Whether the parameter called ``name`` (as in ``named_parameters()``) is a bias: its last component is
    ``bias`` (``nn.Linear``, ``nn.Conv2d``, norms), as Chainer names every bias ``b``."""
    return name.rsplit(".", 1)[-1] == "bias"


def build_optimizer(cfg: Any, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``cfg._target_`` names, over ``model``'s parameters (see :func:`parameter_groups`).

    Build it after ``precision.prepare`` so it holds the parameters the training model uses. ``SGD`` with
    ``decay_1d: true`` decays every parameter, batch-norm scales and biases included, as in He et al. 2016
    (excluding them is a later refinement the paper's baselines do not use). ``decay_bias`` and
    ``bias_lr_factor`` (ours, not the optimizer's arguments) select ChainerCV's SSD treatment of biases.
    Cost: no host sync.
    """
    items = config_items(cfg)
    groups = parameter_groups(
        model,
        float(items.get("weight_decay", 0.0)),
        bool(items.get("decay_1d", True)),
        decay_bias=bool(items.get("decay_bias", True)),
        bias_lr_factor=float(items.get("bias_lr_factor", 1.0)),
        lr=float(items["lr"]) if items.get("lr") is not None else None,
    )
    return build_group(
        "optimizer", cfg, example="optimizer._target_=torch.optim.AdamW", args=(groups,),
        metadata=OPTIMIZER_METADATA,
        expect=(
            lambda made: isinstance(made, torch.optim.Optimizer),
            "made a {made}, not a torch.optim.Optimizer: name an optimizer class, e.g. "
            "optimizer._target_=torch.optim.AdamW",
        ),
    )  # fmt: skip


class MultiStepWithWarmup:
    """The lr multiplier after ``update`` applied updates: a warm-up, then step decay.

    Milestones and warm-up are fractions of ``length`` (the iterations this run does), rounded to whole
    updates: with ``length=64000``, milestones ``[0.5, 0.75]`` decay after updates 32000 and 48000. The
    warm-up holds the multiplier at ``warmup_factor`` (``warmup="constant"``, He et al.'s ResNet-110 trick)
    or ramps it linearly from ``warmup_factor`` to 1 (``warmup="linear"``, as detection recipes do). With
    ``warmup_unless_batch_size`` and ``batch_size`` equal there is no warm-up: the authors' SSD script warms
    up only when it trains at another batch than its recipe's 32. A plain class rather than a lambda so
    ``LambdaLR.state_dict()`` records it.
    """

    def __init__(
        self,
        length: int,
        milestones: list[float],
        gamma: float,
        warmup_fraction: float = 0.0,
        warmup_factor: float = 0.1,
        warmup: str = "constant",
        warmup_unless_batch_size: int | None = None,
        batch_size: int | None = None,
    ) -> None:
        if warmup not in ("constant", "linear"):
            raise ConfigError(f"schedule.warmup must be 'constant' or 'linear', got '{warmup}'")
        if warmup_unless_batch_size is not None and batch_size is None:
            raise ConfigError(
                "schedule.warmup_unless_batch_size needs the run's batch size; "
                "e.g. schedule.batch_size=${trainer.batch_size}"
            )
        self.milestones = [round(float(m) * length) for m in milestones]
        self.gamma = float(gamma)
        skip = warmup_unless_batch_size is not None and int(batch_size) == int(warmup_unless_batch_size)  # type: ignore[arg-type]
        self.warmup_steps = 0 if skip else round(float(warmup_fraction) * length)
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
    warmup_unless_batch_size: int | None = None,
    batch_size: int | None = None,
) -> LambdaLR:
    """``schedule=multistep``: :class:`MultiStepWithWarmup` over ``length`` updates."""
    rule = MultiStepWithWarmup(
        length,
        list(milestones),
        gamma,
        warmup_fraction,
        warmup_factor,
        warmup,
        warmup_unless_batch_size=warmup_unless_batch_size,
        batch_size=batch_size,
    )
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
    return build_group(
        "schedule", cfg, example=example, args=(optimizer,), fill=fill,
        expect=(
            lambda made: all(callable(getattr(made, m, None)) for m in ("step", "state_dict")),
            "made a {made}, not a learning-rate schedule (step() and state_dict()): e.g. schedule=cosine",
        ),
    )  # fmt: skip
