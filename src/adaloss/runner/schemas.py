"""The typed schema of every config group: dataclasses in Hydra's ConfigStore (structured configs).

Each option of a group (``configs/scaler/fixed.yaml``, ...) starts its defaults list with its schema,
``- /schema/<group>/<schema>@_here_``, then ``_self_``. The dataclass holds the defaults (in one place: an
option's YAML sets only what differs, such as a ResNet's ``depth``) and the types, and its
``__post_init__`` the ranges. What rejects what:

* **a wrong type** (``scaler.scale=abc``, ``trainer.save_final=maybe``) and **an unknown key**
  (``trainer.batch_sise=3``): OmegaConf, while Hydra composes the config; ``train.py`` turns its exception
  into one ``error:`` line (``describe_hydra_error``).
* **an out-of-range value** (``scaler.scale=-1``, ``optimizer.lr=inf``) and a key added with ``+`` that the
  schema does not have: :func:`check_config`, which converts each group to its dataclass (so every
  ``__post_init__`` runs) before anything is built. It raises :class:`~adaloss.errors.ConfigError` naming
  the key and the fix.

A field that is not an argument of the group's ``_target_`` (``name``: what runs and tables call it) is
declared with ``meta()``; :func:`arguments` leaves those out when the part is built. A schema whose
``OPEN`` is true (the ``custom`` options, for a class of the user's) takes keys it does not declare
(``+model.width=64``): the target's own signature decides about those, when it is built.

**Adding a key** is one line in the dataclass of its group below (with its default, and its range in
``__post_init__`` if it has one); no YAML needs to change.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from adaloss.errors import ConfigError
from adaloss.scalers.base import OptionError
from adaloss.scalers.recipe import AdaptiveRecipe

__all__ = ["FieldError", "arguments", "check_config", "compose_train", "group_name", "register", "schema_of"]


class FieldError(ValueError):
    """A field out of range: ``field`` (relative to its dataclass), what is wrong, an example value."""

    def __init__(self, field_name: str, problem: str = "", example: Any = None) -> None:
        super().__init__(f"{field_name} {problem}".strip())
        self.field = field_name
        self.problem = problem
        self.example = example


def meta(default: Any = MISSING, **kwargs: Any) -> Any:
    """A field that is the group's own setting, not an argument of its ``_target_``."""
    if "default_factory" in kwargs:
        return field(default_factory=kwargs["default_factory"], metadata={"argument": False})
    return field(default=default, metadata={"argument": False})


def if_set() -> Any:
    """A field passed to the target only when it is not null (a custom option's settings a recipe sets)."""
    return field(default=None, metadata={"argument": "if set"})


def _unset(value: Any) -> bool:
    """Not a value yet: an interpolation or MISSING (the dataclass default, before Hydra merges a config;
    checked again once resolved)."""
    return isinstance(value, str) and (value.startswith("${") or value == MISSING)


def _fmt(value: float) -> str:
    return f"{value:g}"


def number(
    obj: Any,
    name: str,
    example: Any,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
    integer: bool = False,
) -> None:
    """``obj.<name>`` finite (an integer with ``integer``) and within the bounds; ``None`` if ``optional``."""
    value = getattr(obj, name)
    if (value is None and optional) or _unset(value):
        return
    kind = "an integer" if integer else "a finite number"
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise FieldError(name, f"must be {kind}{' or null' if optional else ''}, got {value!r}", example)
    if integer and value != int(value):
        raise FieldError(name, f"must be an integer, got {value!r}", example)
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if below or above:
        if integer and low == 1 and high == math.inf:
            raise FieldError(
                name, f"must be a positive integer{' or null' if optional else ''}, got {value!r}", example
            )
        if low_open and high_open:
            bounds = f"between {_fmt(low)} and {_fmt(high)} (exclusive)"
        elif high == math.inf:
            bounds = f"> {_fmt(low)}" if low_open else f">= {_fmt(low)}"
        elif low == -math.inf:
            bounds = f"< {_fmt(high)}" if high_open else f"<= {_fmt(high)}"
        else:
            bounds = f"in {'(' if low_open else '['}{_fmt(low)}, {_fmt(high)}{')' if high_open else ']'}"
        what = "an integer" if integer else "a number"
        raise FieldError(name, f"must be {what} {bounds}, got {value!r}", example)


def positive_int(obj: Any, name: str, example: Any, optional: bool = False) -> None:
    number(obj, name, example, 1, integer=True, optional=optional)


def choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value not in choices and not _unset(value):
        raise FieldError(name, f"must be one of {', '.join(choices)}, got {value!r}", choices[0])


def named_after(obj: Any, key: str, pattern: str) -> None:
    """A bundled model's name states ``key`` (``resnet20`` is depth 20, ``ssd300`` the ssd300 variant): a
    value that contradicts it would run, and be recorded, under the wrong name. ``pattern``: the names that
    state it, its group 1 the value they state; a name that does not match states nothing."""
    value, name = getattr(obj, key), getattr(obj, "name", None)
    found = re.fullmatch(pattern, name) if isinstance(name, str) and not _unset(value) else None
    if found is not None and str(value) != found.group(1):
        raise FieldError(
            key, f"={value} contradicts model.name={name} (the model with {key} {found.group(1)}): drop the "
            f"override, pick the model with {key} {value}, or give yours its own model.name",
            found.group(1),
        )  # fmt: skip


def each(obj: Any, name: str, example: Any, **bounds: Any) -> None:
    """Every entry of the list ``obj.<name>`` as :func:`number` checks a single value."""
    values = getattr(obj, name)
    for value in (
        values
        if isinstance(values, list | tuple) or hasattr(values, "__iter__") and not isinstance(values, str)
        else ()
    ):
        holder = type("Entry", (), {name: value})
        try:
            number(holder, name, example, **bounds)
        except FieldError as error:
            raise FieldError(f"{name} entries", error.problem, example) from None


# ------------------------------------------------------------------------------------------- top level

#: The values of ``trainer.compile_mode``: ``torch.compile``'s modes (``default`` passes ``mode=None``).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
#: The values of ``distributed.strategy`` under torchrun: replicate the model (DDP) or shard it (FSDP2).
STRATEGIES = ("ddp", "fsdp2")


@dataclass
class TrainerConf:
    batch_size: int = 128
    steps: int | None = 64000
    epochs: int | None = None
    max_steps: int | None = None
    eval_every: int = 2000
    eval_batch_size: int = 500
    log_every: int = 50
    grad_clip: float | None = None
    loss_multiplier: float = 1.0
    num_workers: int = 0
    max_consecutive_overflows: int | None = 100
    on_divergence: str = "fail"
    progress_bar: bool = True
    checkpoint_every: int | None = "${trainer.eval_every}"  # type: ignore[assignment]
    keep_checkpoints: int = 2
    save_final: bool = False
    compile: bool = False
    compile_mode: str = "default"

    def __post_init__(self) -> None:
        for key, example in (("batch_size", 128), ("eval_batch_size", 500), ("eval_every", 2000)):
            positive_int(self, key, example)
        positive_int(self, "log_every", 50)
        positive_int(self, "max_steps", 1000, optional=True)
        if (self.steps is None) == (self.epochs is None) and not _unset(self.steps):
            raise FieldError(
                "steps",
                f": set exactly one of trainer.steps and trainer.epochs (got steps={self.steps}, "
                f"epochs={self.epochs})",
                "null and trainer.epochs=90",
            )  # fmt: skip
        positive_int(self, "steps", 64000, optional=True)
        positive_int(self, "epochs", 90, optional=True)
        number(self, "grad_clip", 1.0, 0.0, low_open=True, optional=True)
        number(self, "loss_multiplier", 1.0, 0.0, low_open=True)
        number(self, "num_workers", 0, 0, integer=True)
        positive_int(self, "max_consecutive_overflows", 100, optional=True)
        choice(self, "on_divergence", ("fail", "record"))
        positive_int(self, "checkpoint_every", 1000, optional=True)
        positive_int(self, "keep_checkpoints", 2)
        choice(self, "compile_mode", COMPILE_MODES)


@dataclass
class TelemetryConf:
    every: int = 100
    format: str = "fp16"
    expected_loss_scale: bool = False
    quantile: float = 0.01
    counterfactual: bool = False

    def __post_init__(self) -> None:
        positive_int(self, "every", 100)
        if self.format != TelemetryConf.format:  # the default is one; the formats' module imports torch
            from adaloss.numerics.formats import FORMATS

            choice(self, "format", tuple(FORMATS))
        number(self, "quantile", 0.01, 0.0, 1.0, low_open=True)


@dataclass
class FaultsConf:
    inject: list[Any] = field(default_factory=list)


@dataclass
class DistributedConf:
    """How the model is spread over torchrun's processes (:mod:`adaloss.distributed`); one process: unused."""

    strategy: str = "ddp"

    def __post_init__(self) -> None:
        choice(self, "strategy", STRATEGIES)


@dataclass
class BoundsConf:
    scale_upper_bound: float | None = None
    accum_upper_bound: float | None = None

    def __post_init__(self) -> None:
        number(self, "scale_upper_bound", 16, 0.0, low_open=True, optional=True)
        number(self, "accum_upper_bound", 1024, 0.0, low_open=True, optional=True)


@dataclass
class AdaptiveRecipeConf:
    """The adaptive scaler's per-task settings (a recipe sets them; ``scaler=adaptive`` reads them)."""

    reference: BoundsConf = field(default_factory=lambda: BoundsConf(16, 1024))  # ada_loss/core.py:21-22
    update_every: int = 100

    def __post_init__(self) -> None:
        positive_int(self, "update_every", 100)


@dataclass
class DynamicRecipeConf:
    """The dynamic scaler's per-experiment settings (Tables 2 and 3 pick Chainer's rule)."""

    rule: str = "torch"
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        choice(self, "rule", ("torch", "chainer"))
        positive_int(self, "growth_interval", 2000)


@dataclass
class PathsConf:
    """Set by configs/paths/default.yaml."""

    root_dir: str = MISSING
    data_dir: str = MISSING
    results_dir: str = MISSING
    output_dir: str = MISSING


@dataclass
class TrainConf:
    """The top level: ``configs/train.yaml``. The groups' own nodes are typed by their options."""

    seed: int = 0
    device: str = "auto"
    resume: Any = None  # null, auto or a checkpoint's path (the run folder's reader checks which)
    name: str = MISSING
    trainer: TrainerConf = field(default_factory=TrainerConf)
    adaptive_recipe: AdaptiveRecipeConf = field(default_factory=AdaptiveRecipeConf)
    dynamic_recipe: DynamicRecipeConf = field(default_factory=DynamicRecipeConf)
    telemetry: TelemetryConf = field(default_factory=TelemetryConf)
    faults: FaultsConf = field(default_factory=FaultsConf)
    distributed: DistributedConf = field(default_factory=DistributedConf)
    paths: PathsConf = field(default_factory=PathsConf)
    model: Any = MISSING
    dataset: Any = MISSING
    scaler: Any = MISSING
    precision: Any = MISSING
    optimizer: Any = MISSING
    schedule: Any = MISSING
    logger: Any = MISSING
    task: Any = MISSING


# ---------------------------------------------------------------------------------------------- groups


@dataclass
class PartConf:
    """What every group's node has: the class or function it builds, and a name for runs and tables."""

    OPEN: ClassVar[bool] = False
    #: For a model: the data it trains on (a task's ``kind``: classification, detection, language_model);
    #: None for a model of the user's (checked when its task is built).
    TASK: ClassVar[str | None] = None
    _target_: str = MISSING
    name: str = meta()


@dataclass
class CustomConf(PartConf):
    """``<group>=custom``: a class of the user's (``_target_``) and the keys it takes (``+<group>.<key>``)."""

    OPEN: ClassVar[bool] = True
    name: str = meta("custom")


# scaler


@dataclass
class NoScalerConf(PartConf):
    _target_: str = "adaloss.scalers.NoLossScaler"
    name: str = meta("none")


@dataclass
class FixedScalerConf(PartConf):
    _target_: str = "adaloss.scalers.FixedLossScaler"
    name: str = meta("fixed")
    scale: Any = 128  # a number (Any: 128 stays 128 in the run name, fixed128, not 128.0)

    def __post_init__(self) -> None:
        number(self, "scale", 128, 0.0, low_open=True)


@dataclass
class DynamicScalerConf(PartConf):
    _target_: str = "adaloss.scalers.DynamicLossScaler"
    name: str = meta("dynamic")
    rule: str = "${dynamic_recipe.rule}"
    init_scale: float | None = None
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = "${dynamic_recipe.growth_interval}"  # type: ignore[assignment]
    min_scale: float | None = 1.0
    max_scale: float | None = None
    hysteresis: int = 1
    consecutive_hysteresis: bool = False

    def __post_init__(self) -> None:
        choice(self, "rule", ("torch", "chainer"))
        number(self, "init_scale", 65536, 0.0, low_open=True, optional=True)
        number(self, "growth_factor", 2, 1.0, low_open=True)
        number(self, "backoff_factor", 0.5, 0.0, 1.0, low_open=True, high_open=True)
        positive_int(self, "growth_interval", 2000)
        number(self, "min_scale", 1, 0.0, low_open=True, optional=True)
        number(self, "max_scale", 65504, 0.0, low_open=True, optional=True)
        positive_int(self, "hysteresis", 1)


#: scaler=adaptive's defaults that a task's recipe sets (``adaptive_recipe``), not the library's
_ADAPTIVE_FROM_RECIPE = {
    "update_every": "${adaptive_recipe.update_every}",
    "scale_upper_bound": "${oc.select:adaptive_recipe.${scaler.rule}.scale_upper_bound,null}",
    "accum_upper_bound": "${oc.select:adaptive_recipe.${scaler.rule}.accum_upper_bound,null}",
}


def _check_adaptive(self: Any) -> None:
    """scaler=adaptive's values, checked by the library's recipe (the messages its constructor gives)."""
    values = {}
    try:
        for name in _ADAPTIVE_OPTIONS:
            if not _unset(value := getattr(self, name)):
                values[name] = AdaptiveRecipe.check(name, value)
        if "rule" in values and "allow_below_one" in values:
            AdaptiveRecipe.check_together(values["rule"], values["allow_below_one"])
    except OptionError as error:
        raise FieldError(error.field.removeprefix("scaler."), error.problem, error.example) from None


#: The options of ``scaler=adaptive``: the library's :class:`~adaloss.scalers.recipe.AdaptiveRecipe` but
#: ``fmt`` (the precision's format, which the builder passes)
_ADAPTIVE_OPTIONS = tuple(f.name for f in dataclasses.fields(AdaptiveRecipe) if f.name != "fmt")
_ADAPTIVE_TYPES = typing.get_type_hints(AdaptiveRecipe)
#: ``scaler=adaptive``'s node, derived from the recipe: its fields, types and defaults (a task's recipe
#: sets three), checked by its checks.
AdaptiveScalerConf = dataclasses.make_dataclass(
    "AdaptiveScalerConf",
    [
        ("_target_", str, field(default="adaloss.scalers.adaptive.AdaptiveLossScaler")),
        ("name", str, meta("adaptive")),
        *(
            (name, _ADAPTIVE_TYPES[name], field(default=_ADAPTIVE_FROM_RECIPE.get(name, f.default)))
            for f in dataclasses.fields(AdaptiveRecipe)
            if (name := f.name) in _ADAPTIVE_OPTIONS
        ),
    ],
    bases=(PartConf,),
    namespace={"__post_init__": _check_adaptive, "__module__": __name__},
)


# precision


@dataclass
class PrecisionConf:
    OPEN: ClassVar[bool] = False
    _target_: str = "adaloss.precision.Precision"
    name: str = MISSING  # an argument: the format
    backend: str = "auto"
    allow_tf32: bool = False
    grad_scaling: Any = "none"
    # precision=nvfp4 / mxfp4 only (adaloss.numerics.fp4_gemm.FP4Recipe; None: the recipe's default)
    stochastic_rounding: Any = None
    hadamard: Any = None
    rounding: Any = None
    operands: Any = None
    keep: Any = None
    keep_first: Any = None
    keep_last: Any = None
    seed: Any = None

    def __post_init__(self) -> None:
        choice(self, "name", ("fp32", "fp16", "bf16", "fp8_e5m2", "fp8_e4m3", "nvfp4", "mxfp4"))
        choice(self, "backend", ("auto", "autocast", "emulate"))


# optimizer


@dataclass
class OptimizerConf(PartConf):
    """Every optimizer: ``_partial_`` (the trainer adds the parameter groups) and our parameter-group
    settings, which are not the optimizer's arguments."""

    _partial_: bool = True
    decay_1d: bool = meta(True)
    decay_bias: bool = meta(True)
    bias_lr_factor: float = meta(1.0)

    def __post_init__(self) -> None:
        number(self, "bias_lr_factor", 1, 0.0, low_open=True)
        for key, example, low, high in (("lr", 0.1, 0.0, math.inf), ("momentum", 0.9, 0.0, 1.0)):
            if hasattr(self, key):
                number(self, key, example, low, high, low_open=key == "lr")
        if hasattr(self, "weight_decay"):
            number(self, "weight_decay", 1e-4, 0.0)


@dataclass
class CustomOptimizerConf(OptimizerConf):
    OPEN: ClassVar[bool] = True
    name: str = meta("custom")
    # what every recipe sets (configs/recipe/): passed to the optimizer when set
    lr: Any = if_set()
    weight_decay: Any = if_set()


@dataclass
class SGDConf(OptimizerConf):
    _target_: str = "torch.optim.SGD"
    name: str = meta("sgd")
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1.0e-4
    nesterov: bool = False


@dataclass
class AdamWConf(OptimizerConf):
    _target_: str = "torch.optim.AdamW"
    name: str = meta("adamw")
    lr: float = 6.0e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1.0e-8
    weight_decay: float = 0.1
    decay_1d: bool = meta(False)

    def __post_init__(self) -> None:
        super().__post_init__()
        each(self, "betas", "[0.9,0.95]", low=0.0, high=1.0, high_open=True)
        number(self, "eps", "1e-8", 0.0, low_open=True)


# schedule


@dataclass
class ScheduleConf(PartConf):
    _partial_: bool = True


@dataclass
class CustomScheduleConf(ScheduleConf):
    OPEN: ClassVar[bool] = True
    name: str = meta("custom")


@dataclass
class MultiStepConf(ScheduleConf):
    _target_: str = "adaloss.runner.engine.optim.multistep"
    name: str = meta("multistep")
    milestones: list[float] = field(default_factory=lambda: [0.5, 0.75])
    gamma: float = 0.1
    warmup_fraction: float = 0.0
    warmup_factor: float = 0.1
    warmup: str = "constant"
    warmup_unless_batch_size: int | None = None
    batch_size: int | None = None

    def __post_init__(self) -> None:
        each(self, "milestones", "[0.5,0.75]", low=0.0, high=1.0)
        if list(self.milestones) != sorted(self.milestones):
            raise FieldError("milestones", f"must be increasing, got {list(self.milestones)}", "[0.5,0.75]")
        number(self, "gamma", 0.1, 0.0, low_open=True)
        number(self, "warmup_fraction", 0.0, 0.0, 1.0, high_open=True)
        number(self, "warmup_factor", 0.1, 0.0, low_open=True)
        choice(self, "warmup", ("constant", "linear"))
        positive_int(self, "warmup_unless_batch_size", 32, optional=True)
        if self.warmup_unless_batch_size is not None and self.batch_size is None:
            raise FieldError(
                "batch_size", "must be set with schedule.warmup_unless_batch_size", "${trainer.batch_size}"
            )


@dataclass
class CosineConf(ScheduleConf):
    _target_: str = "adaloss.runner.engine.optim.warmup_cosine"
    name: str = meta("cosine")
    warmup_fraction: float = 0.05
    final_factor: float = 0.1

    def __post_init__(self) -> None:
        number(self, "warmup_fraction", 0.05, 0.0, 1.0, high_open=True)
        number(self, "final_factor", 0.1, 0.0, 1.0)


# logger


@dataclass
class WandbConf:
    project: str = "adaloss"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    name: str | None = "${name}"
    mode: str = "offline"
    init_timeout: float = 10.0
    per_layer_series: bool = False

    def __post_init__(self) -> None:
        choice(self, "mode", ("offline", "online", "disabled"))
        number(self, "init_timeout", 10, 0.0, low_open=True)


@dataclass
class WandbLoggerConf:
    OPEN: ClassVar[bool] = False
    _target_: str = "adaloss.runner.logging.wandb_logger.wandb_logger"
    wandb: WandbConf = field(default_factory=WandbConf)


@dataclass
class NoLoggerConf:
    OPEN: ClassVar[bool] = False
    _target_: str = "adaloss.runner.logging.NullLogger"
    wandb: Any = meta(None)  # no W&B settings (kept so that `logger.wandb` reads null)


@dataclass
class CustomLoggerConf:
    OPEN: ClassVar[bool] = True
    _target_: str = MISSING
    wandb: Any = meta(None)


# task


@dataclass
class ClassificationTaskConf(PartConf):
    """``task=classification``: cross-entropy and top-1 accuracy (adaloss.runner.engine.tasks)."""

    _target_: str = "adaloss.runner.engine.tasks.ClassificationTask"
    name: str = meta("classification")


@dataclass
class DetectionTaskConf(PartConf):
    """``task=detection``: SSD's multibox loss and VOC07 mAP; ``init`` follows the detector's config."""

    _target_: str = "adaloss.runner.engine.tasks.DetectionTask"
    name: str = meta("detection")
    init: str = "${oc.select:model.init,default}"

    def __post_init__(self) -> None:
        choice(self, "init", ("default", "lsuv"))


@dataclass
class LanguageModelTaskConf(PartConf):
    """``task=language_model``: next-token cross-entropy, validation loss and perplexity; with ``masking``
    (a masked LM's ``model.masking``) the masked-LM objective on that fraction of the positions."""

    _target_: str = "adaloss.runner.engine.tasks.LanguageModelTask"
    name: str = meta("language_model")
    masking: float = "${oc.select:model.masking,0.0}"  # type: ignore[assignment]  # 0: next-token

    def __post_init__(self) -> None:
        number(self, "masking", 0.15, 0.0, 1.0, high_open=True)


# model


@dataclass
class CifarResNetConf(PartConf):
    TASK: ClassVar[str | None] = "classification"
    _target_: str = "adaloss.runner.models.cifar_resnet.CifarResNet"
    depth: int = MISSING

    def __post_init__(self) -> None:
        positive_int(self, "depth", 20)
        named_after(self, "depth", r"resnet(\d+)")


@dataclass
class TorchvisionResNetConf(PartConf):
    TASK: ClassVar[str | None] = "classification"
    _target_: str = "adaloss.runner.models.torchvision_resnet.torchvision_resnet"
    arch: str = MISSING

    def __post_init__(self) -> None:
        named_after(self, "arch", r"(resnet\d+)")


@dataclass
class MLPConf(PartConf):
    TASK: ClassVar[str | None] = "classification"
    _target_: str = "adaloss.runner.models.mlp.MLP"
    name: str = meta("mlp")
    hidden: list[int] = field(default_factory=lambda: [256, 256])
    shared_hidden: bool = False

    def __post_init__(self) -> None:
        each(self, "hidden", "[256,256]", low=1, integer=True)


@dataclass
class VGGConf(PartConf):
    TASK: ClassVar[str | None] = "classification"
    _target_: str = "adaloss.runner.models.vgg.VGGNoBN"
    name: str = meta("vgg_nobn")
    widths: list[Any] = field(default_factory=lambda: [64, "M", 128, "M", 256, 256, "M", 512, "M"])


@dataclass
class ViTConf(PartConf):
    TASK: ClassVar[str | None] = "classification"
    _target_: str = "adaloss.runner.models.vit.ViT"
    name: str = meta("vit")
    patch: int = 4
    dim: int = 64
    depth: int = 4
    heads: int = 4
    mlp_ratio: int = 2
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for key in ("patch", "dim", "depth", "heads"):
            positive_int(self, key, 4)
        number(self, "mlp_ratio", 2, 0.0, low_open=True)
        number(self, "dropout", 0.0, 0.0, 1.0, high_open=True)


@dataclass
class GPTConf(PartConf):
    TASK: ClassVar[str | None] = "language_model"
    _target_: str = "adaloss.runner.models.gpt.GPT"
    n_layer: int = MISSING  # set by configs/model/gpt.yaml (4) and gpt2_small.yaml (12)
    n_head: int = MISSING
    n_embd: int = MISSING
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    vocab_size: int | None = if_set()  # null: the dataset's
    block_size: int | None = if_set()  # null: the dataset's

    def __post_init__(self) -> None:
        for key in ("n_layer", "n_head", "n_embd"):
            positive_int(self, key, 4)
        positive_int(self, "vocab_size", 256, optional=True)
        positive_int(self, "block_size", 64, optional=True)
        number(self, "dropout", 0.0, 0.0, 1.0, high_open=True)


@dataclass
class HFCausalLMConf(PartConf):
    """A Hugging Face transformers causal LM from a bundled config file (``adaloss.runner.models.hf``)."""

    TASK: ClassVar[str | None] = "language_model"
    _target_: str = "adaloss.runner.models.hf.causal_lm"
    config: str = MISSING  # a file of configs/model/hf/ (gpt2_tiny.json) or a path
    attn_implementation: str = "sdpa"  # eager | sdpa
    vocab_size: int | None = if_set()  # null: the dataset's
    block_size: int | None = if_set()  # null: the dataset's

    def __post_init__(self) -> None:
        positive_int(self, "vocab_size", 256, optional=True)
        positive_int(self, "block_size", 64, optional=True)


@dataclass
class HFMaskedLMConf(PartConf):
    """A Hugging Face transformers masked LM from a bundled config file
    (``adaloss.runner.models.hf.masked_lm``), trained by the language-model task with ``masking`` of the
    positions masked."""

    TASK: ClassVar[str | None] = "language_model"
    _target_: str = "adaloss.runner.models.hf.masked_lm"
    config: str = MISSING  # a file of configs/model/hf/ (bert_tiny.json) or a path
    attn_implementation: str = "sdpa"  # eager | sdpa
    vocab_size: int | None = if_set()  # null: the dataset's (the model adds [MASK])
    block_size: int | None = if_set()  # null: the dataset's
    masking: float = meta(0.15)  # the fraction of positions masked: the task's setting (task.masking)

    def __post_init__(self) -> None:
        positive_int(self, "vocab_size", 256, optional=True)
        positive_int(self, "block_size", 64, optional=True)
        number(self, "masking", 0.15, 0.0, 1.0, low_open=True, high_open=True)


@dataclass
class SSDConf(PartConf):
    TASK: ClassVar[str | None] = "detection"
    _target_: str = "adaloss.runner.models.ssd.ssd_detector"
    variant: str = MISSING
    image_size: int = MISSING
    backbone_weights: str | None = None
    width_multiplier: float = 1.0
    background_prior: float | None = None
    init: str = meta("default")  # the detection task's initialization, not the detector's argument

    def __post_init__(self) -> None:
        choice(self, "variant", ("ssd300", "ssd512"))
        named_after(self, "variant", r"(ssd\d+)")
        number(self, "image_size", 512, 32, integer=True)
        number(self, "width_multiplier", 1.0, 0.0, low_open=True)
        number(self, "background_prior", 0.99, 0.0, 1.0, low_open=True, high_open=True, optional=True)
        choice(self, "init", ("default", "lsuv"))


# dataset


@dataclass
class DatasetConf:
    """Every dataset: its builder (``_target_``, called with ``data_dir`` if it takes one, returning
    ``(train_set, test_set, info)``) and its ``name``, an argument (cifar10 and cifar100 share a builder).
    A bundled builder takes every field of its schema and has no defaults of its own: they are here.
    ``TASK``: the kind of data it holds (the task its config selects), None where it is the user's."""

    OPEN: ClassVar[bool] = False
    TASK: ClassVar[str | None] = None
    _target_: str = MISSING
    name: str = MISSING


@dataclass
class CustomDatasetConf(DatasetConf):
    OPEN: ClassVar[bool] = True
    name: str = meta("custom")  # what runs and tables call it; not an argument of the user's target


@dataclass
class ImageDatasetConf(DatasetConf):
    TASK: ClassVar[str | None] = "classification"
    num_classes: int | None = None  # null: the dataset's own (10 for CIFAR-10, ...)
    image_size: int | None = None  # null: the dataset's own
    mean: list[float] | None = None
    std: list[float] | None = None

    def __post_init__(self) -> None:
        positive_int(self, "num_classes", 10, optional=True)
        positive_int(self, "image_size", 32, optional=True)
        each(self, "mean", "[0.5,0.5,0.5]")
        each(self, "std", "[0.5,0.5,0.5]", low=0.0, low_open=True)


@dataclass
class CifarConf(ImageDatasetConf):
    _target_: str = "adaloss.runner.data.datasets.cifar"
    download: bool = False
    augment: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _unset(self.name) and self.name not in ("cifar10", "cifar100"):  # the builder's two datasets
            names = ", ".join(bundled_names("dataset"))
            raise ConfigError(f"unknown dataset '{self.name}' (dataset.name): choose dataset= one of {names}")


@dataclass
class ImageNetConf(ImageDatasetConf):
    _target_: str = "adaloss.runner.data.datasets.imagenet"
    name: str = "imagenet"


@dataclass
class DigitsConf(ImageDatasetConf):
    _target_: str = "adaloss.runner.data.datasets.digits"
    name: str = "digits"
    test_fraction: float = 0.2
    split_seed: int = 0
    augment: bool = False
    translate: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        number(self, "test_fraction", 0.2, 0.0, 1.0, low_open=True, high_open=True)
        number(self, "split_seed", 0, 0, integer=True)
        number(self, "translate", 2, 0, integer=True)


@dataclass
class SyntheticConf(ImageDatasetConf):
    _target_: str = "adaloss.runner.data.datasets.synthetic"
    name: str = "synthetic"
    channels: int = 3
    train_size: int = 1024
    test_size: int = 256
    seed: int = 0
    noise: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("channels", "train_size", "test_size"):
            positive_int(self, key, 3 if key == "channels" else 128)
        number(self, "seed", 0, 0, integer=True)
        number(self, "noise", 1.0, 0.0)


@dataclass
class ShapesConf(DatasetConf):
    TASK: ClassVar[str | None] = "detection"
    _target_: str = "adaloss.runner.data.shapes.shapes"
    name: str = "shapes"
    num_classes: int = 3
    image_size: int | None = "${model.image_size}"  # type: ignore[assignment]
    train_size: int = 4096
    test_size: int = 256
    seed: int = 0
    min_objects: int = 1
    max_objects: int = 4

    def __post_init__(self) -> None:
        for key in ("num_classes", "train_size", "test_size", "min_objects", "max_objects"):
            positive_int(self, key, 4)
        number(self, "image_size", 128, 32, integer=True, optional=True)
        if not _unset(self.image_size) and self.max_objects < self.min_objects:
            raise FieldError("max_objects", f"must be >= dataset.min_objects ({self.min_objects})", 4)


@dataclass
class VOCConf(DatasetConf):
    TASK: ClassVar[str | None] = "detection"
    _target_: str = "adaloss.runner.data.voc.voc"
    name: str = "voc"
    num_classes: int = 20
    image_size: int | None = "${model.image_size}"  # type: ignore[assignment]
    # [year, image set] pairs (the builder checks their shape and names the fix)
    train_sets: Any = field(default_factory=lambda: [[2007, "trainval"], [2012, "trainval"]])
    test_set: Any = field(default_factory=lambda: [2007, "test"])
    augment: bool = True
    use_difficult: bool = False
    mean: list[float] | None = None  # null: ImageNet's
    std: list[float] | None = None

    def __post_init__(self) -> None:
        number(self, "num_classes", 20, 1, integer=True)
        number(self, "image_size", 512, 32, integer=True, optional=True)
        each(self, "mean", "[0.485,0.456,0.406]")
        each(self, "std", "[0.229,0.224,0.225]", low=0.0, low_open=True)


@dataclass
class TextDatasetConf(DatasetConf):
    TASK: ClassVar[str | None] = "language_model"
    block_size: int = 128
    stride: int | None = 1
    val_windows: int | None = 256

    def __post_init__(self) -> None:
        positive_int(self, "block_size", 64)
        positive_int(self, "stride", 1, optional=True)
        positive_int(self, "val_windows", 256, optional=True)


@dataclass
class PystdlibConf(TextDatasetConf):
    _target_: str = "adaloss.runner.data.text.pystdlib"
    name: str = "pystdlib"
    holdout_every: int = 10
    stdlib: str | None = None  # another folder of .py files (tests); null: this Python's standard library

    def __post_init__(self) -> None:
        super().__post_init__()
        number(self, "holdout_every", 10, 2, integer=True)


@dataclass
class TokensConf(TextDatasetConf):
    _target_: str = "adaloss.runner.data.text.tokens"
    name: str = "tokens"
    folder: str = "tokens"
    vocab_size: int | None = None
    block_size: int = 1024
    stride: int | None = None  # null: block_size (non-overlapping windows)

    def __post_init__(self) -> None:
        super().__post_init__()
        positive_int(self, "vocab_size", 50304, optional=True)


#: ``(group, schema name, dataclass)``: stored as ``schema/<group>/<name>``; an option's YAML names it.
SCHEMAS: tuple[tuple[str, str, type], ...] = (
    ("scaler", "none", NoScalerConf),
    ("scaler", "fixed", FixedScalerConf),
    ("scaler", "dynamic", DynamicScalerConf),
    ("scaler", "adaptive", AdaptiveScalerConf),
    ("scaler", "custom", CustomConf),
    ("precision", "precision", PrecisionConf),
    ("optimizer", "sgd", SGDConf),
    ("optimizer", "adamw", AdamWConf),
    ("optimizer", "custom", CustomOptimizerConf),
    ("schedule", "multistep", MultiStepConf),
    ("schedule", "cosine", CosineConf),
    ("schedule", "custom", CustomScheduleConf),
    ("logger", "wandb", WandbLoggerConf),
    ("logger", "none", NoLoggerConf),
    ("logger", "custom", CustomLoggerConf),
    ("task", "classification", ClassificationTaskConf),
    ("task", "detection", DetectionTaskConf),
    ("task", "language_model", LanguageModelTaskConf),
    ("task", "custom", CustomConf),
    ("model", "cifar_resnet", CifarResNetConf),
    ("model", "torchvision_resnet", TorchvisionResNetConf),
    ("model", "mlp", MLPConf),
    ("model", "vgg", VGGConf),
    ("model", "vit", ViTConf),
    ("model", "gpt", GPTConf),
    ("model", "hf_causal_lm", HFCausalLMConf),
    ("model", "hf_masked_lm", HFMaskedLMConf),
    ("model", "ssd", SSDConf),
    ("model", "custom", CustomConf),
    ("dataset", "cifar", CifarConf),
    ("dataset", "imagenet", ImageNetConf),
    ("dataset", "digits", DigitsConf),
    ("dataset", "synthetic", SyntheticConf),
    ("dataset", "shapes", ShapesConf),
    ("dataset", "voc", VOCConf),
    ("dataset", "pystdlib", PystdlibConf),
    ("dataset", "tokens", TokensConf),
    ("dataset", "custom", CustomDatasetConf),
)


def register() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent): ``train_schema`` for ``configs/train.yaml``
    and ``schema/<group>/<name>`` for the options. The runner's entry points call it before Hydra composes
    (``train.py``, :func:`compose_train`, the tests' ``conftest.py``); ``import adaloss`` does not, so the
    library imports without Hydra."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConf)
    for group, name, node in SCHEMAS:
        store.store(group=f"schema/{group}", name=name, node=node)


def compose_train(config_dir: str | Path, overrides: Sequence[str] = ()) -> DictConfig:
    """``configs/train.yaml`` composed with ``overrides`` in this process (Hydra's compose API), as
    ``python train.py <overrides>`` would compose it, the schemas registered first."""
    register()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


# --------------------------------------------------------------------------------------------- checking

#: The groups whose node is typed by its option's schema, with an example of choosing an option.
GROUPS = ("model", "dataset", "task", "scaler", "precision", "optimizer", "schedule", "logger")
#: Top-level sections with a schema of their own.
SECTIONS = ("trainer", "adaptive_recipe", "dynamic_recipe", "telemetry", "faults", "paths")


def schema_of(node: Any) -> type | None:
    """The dataclass behind a config node, or None for an untyped node."""
    if not isinstance(node, DictConfig):
        return None
    kind = OmegaConf.get_type(node)
    return kind if kind is not None and dataclasses.is_dataclass(kind) else None


def _fields(kind: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(kind)}


def arguments(node: Any) -> dict[str, Any]:
    """The keys of a group's node that are arguments of its ``_target_`` (plus ``_target_``/``_partial_``),
    resolved to plain values: the schema's ``meta()`` fields are left out."""
    kind = schema_of(node)
    specs = _fields(kind) if kind else {}
    skip = {n for n, f in specs.items() if f.metadata.get("argument") is False} if kind else {"name"}
    optional = {n for n, f in specs.items() if f.metadata.get("argument") == "if set"}
    items = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    assert isinstance(items, dict)
    return {str(k): v for k, v in items.items() if k not in skip and not (k in optional and v is None)}


def typed(group: str, cfg: Any) -> Any:
    """``cfg`` as its schema types it, for building: a composed node already is; a plain mapping with a
    ``name`` and no ``_target_`` (a library call, ``build_scaler({"name": "fixed", "scale": 8})``) gets the
    schema of that name, ``schema/<group>/<name>``; a mapping with its own ``_target_`` stays as it is (the
    target's signature checks it). The result is checked (:func:`check_node`). ``ConfigError`` for an
    unknown name, a key the schema lacks, a wrong type or a value out of range."""
    if schema_of(cfg) is not None:
        check_node(cfg, group)
        return cfg
    if not isinstance(cfg, DictConfig | dict):
        raise ConfigError(f"{group} must be a config group with a name, got {cfg!r}; e.g. {group}=<option>")
    items = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    assert isinstance(items, dict)
    if "_target_" in items:
        return OmegaConf.create(items)
    name = str(items.get("name") or "").strip().lower()
    options = (
        _schema_names(group) if group not in _SINGLE else dict.fromkeys(_SINGLE_NAMES[group], _SINGLE[group])
    )
    if name not in options:
        shown = items.get("name")
        names = [n for n in options if n in _option_names(group, named=True)] or list(options)
        raise ConfigError(f"unknown {group} {shown!r}; choose {group}= one of {', '.join(names)}")
    kind = options[name]
    if "name" not in _fields(kind):
        items.pop("name", None)
    unknown = sorted(str(k) for k in items if k not in _fields(kind))
    if unknown:
        known = ", ".join(k for k in _fields(kind) if not k.startswith("_") and k != "name") or "none"
        raise ConfigError(f"{group}={name} has no field(s) {', '.join(unknown)}; its fields are: {known}")
    if "name" in _fields(kind):
        items["name"] = name
    items = {**_standalone_defaults(kind, items), **items}
    try:
        node = OmegaConf.merge(OmegaConf.structured(kind), items)
        _drop_dangling(node)
    except Exception as error:  # noqa: BLE001 - OmegaConf's type errors: one line naming the key
        key = getattr(error, "full_key", "") or group
        raise ConfigError(f"{group}.{key}: {str(error).splitlines()[0]}") from None
    check_node(node, group)
    return node


def _drop_dangling(node: DictConfig) -> None:
    """Outside a composed config, a schema default that points elsewhere in it (``${model.image_size}``,
    ``${name}``) becomes null: the builder's own default."""
    for key in list(node.keys()):
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _drop_dangling(child)
        elif OmegaConf.is_interpolation(node, key):
            try:
                node[key]
            except Exception:  # noqa: BLE001 - does not resolve here
                node[key] = None


def _standalone_defaults(kind: type, items: dict[str, Any]) -> dict[str, Any]:
    """For a node outside a composed config: the target's own defaults of the fields whose schema default
    points elsewhere in the config (``update_every: ${adaptive_recipe.update_every}``)."""
    import inspect

    from hydra.utils import get_object

    interpolated = [f for f in dataclasses.fields(kind) if _unset(f.default) and f.default != MISSING]
    if not interpolated or not isinstance(items.get("_target_", _fields(kind)["_target_"].default), str):
        return {}
    try:
        params = inspect.signature(
            get_object(items.get("_target_", _fields(kind)["_target_"].default))
        ).parameters
    except Exception:  # noqa: BLE001 - not importable: building it says so
        return {}
    return {
        f.name: params[f.name].default
        for f in interpolated
        if f.name not in items and f.name in params and params[f.name].default is not inspect.Parameter.empty
    }


def _schema_names(group: str) -> dict[str, type]:
    """``name -> schema`` of the group's options that a name alone selects (their ``name`` default), and
    the schema names themselves."""
    found: dict[str, type] = {}
    for g, schema_name, kind in SCHEMAS:
        if g != group or getattr(kind, "OPEN", False):
            continue
        found.setdefault(schema_name, kind)
        default = next((f.default for f in dataclasses.fields(kind) if f.name == "name"), MISSING)
        if isinstance(default, str) and default != MISSING:
            found.setdefault(default, kind)
    found.update({alias: found[target] for alias, target in _ALIASES.get(group, {}).items()})
    return found


def bundled_names(group: str) -> tuple[str, ...]:
    """The names the group's bundled options go by, in :data:`SCHEMAS`' order (``cifar10, cifar100,
    imagenet, ...`` for ``dataset``): each schema's aliases, then its fixed name."""
    names: list[str] = []
    for g, schema_name, kind in SCHEMAS:
        if g == group:
            names += [alias for alias, target in _ALIASES.get(group, {}).items() if target == schema_name]
            spec = _fields(kind).get("name")
            names += [fixed] if spec is not None and (fixed := _fixed_name(spec)) else []
    return tuple(names)


#: Groups with one schema for every option, and their options' names (an argument: the format).
_SINGLE = {"precision": PrecisionConf}
_SINGLE_NAMES = {"precision": ("fp32", "fp16", "bf16", "fp8_e5m2", "fp8_e4m3", "nvfp4", "mxfp4")}
#: Names that share a schema with another (CIFAR-100 is built as CIFAR-10 is).
_ALIASES = {"dataset": {"cifar10": "cifar", "cifar100": "cifar"}}


def _fixed_name(spec: dataclasses.Field) -> str | None:
    """The name a schema gives its one option (``none`` for NoScalerConf), or None where the option's
    YAML names it (``resnet20``, ``resnet56``, ...) or the user does (``custom``)."""
    default = spec.default
    named = isinstance(default, str) and default not in (MISSING, "custom") and not _unset(default)
    return default if named else None


def _option_names(group: str, named: bool = False) -> set[str]:
    """The schema names of ``group`` (``named``: the names its options go by instead: each schema's ``name``
    default, and the aliases)."""
    if not named:
        return {name for g, name, _ in SCHEMAS if g == group} | set(_ALIASES.get(group, {}))
    found = set(_ALIASES.get(group, {}))
    for g, _, kind in SCHEMAS:
        default = _fields(kind)["name"].default if g == group and "name" in _fields(kind) else None
        if isinstance(default, str) and default not in (MISSING, "custom"):
            found.add(default)
    return found


def group_name(node: Any, section: str) -> str:
    """The ``name`` of a group's node (``model``, ``dataset``): a plain, non-empty string, read before the
    rest of the config resolves; ``ConfigError`` naming the fix otherwise."""
    try:
        name = node.get("name")
    except OmegaConfBaseException as error:
        raise ConfigError(
            f"{section}.name cannot be resolved ({_first_line(error)}): give it a plain value"
        ) from None
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"{section}.name must be a name, got {name!r}: choose a config with {section}=<option>"
        )
    return name


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def check_node(node: DictConfig, group: str) -> None:
    """One group's node against its schema (:func:`check_config` for a whole config)."""
    kind = schema_of(node)
    if kind is not None:
        _check_keys(node, kind, group)
        _check_ranges(node, kind, group)


def check_config(cfg: DictConfig) -> None:
    """Every group and section against its schema: keys it does not declare (``+scaler.bogus=1``; the
    ``custom`` options excepted) and every ``__post_init__`` range check. ``ConfigError`` naming the key
    and the fix. Resolves the interpolations it reads."""
    for section in ("", *SECTIONS, *GROUPS):
        node = cfg if not section else cfg.get(section)
        if section and node is None:
            continue
        kind = schema_of(node)
        if kind is None:
            if section in GROUPS:
                raise ConfigError(
                    f"{section} has no schema (its option's defaults list must start with "
                    f"/schema/{section}/<schema>@_here_): see configs/README.md"
                )
            continue
        _check_keys(node, kind, section)
        if section != "paths":  # nothing to range-check; output_dir resolves only in a launched job
            _check_ranges(node, kind, section)


def _check_keys(node: DictConfig, kind: type, prefix: str) -> None:
    declared = _fields(kind)
    if not getattr(kind, "OPEN", False):
        unknown = [str(k) for k in node.keys() if k not in declared and k != "hydra"]
        if unknown:
            where = f"{prefix}." if prefix else ""
            fields = ", ".join(k for k in declared if not k.startswith("_"))
            own = (
                f"; a class of your own with other arguments: {prefix}=custom {prefix}._target_=<your class> "
                f"+{prefix}.<key>=<value>"
                if prefix in GROUPS
                else ""
            )
            raise ConfigError(
                f"unknown key '{where}{unknown[0]}': {prefix or 'the config'} has the fields {fields}{own}"
            )
    for key in node.keys():
        child = node._get_node(key)
        if not prefix and key in (*GROUPS, *SECTIONS, "hydra"):
            continue  # checked on their own (and Hydra's own node by Hydra)
        if isinstance(child, DictConfig) and schema_of(child) is not None:
            _check_keys(child, schema_of(child), f"{prefix}.{key}" if prefix else str(key))


def _check_ranges(node: DictConfig, kind: type, prefix: str) -> None:
    if prefix:  # nested schemas first, so that a message names the full key (logger.wandb.mode)
        for key in node.keys():
            child = node._get_node(key)
            if isinstance(child, DictConfig) and schema_of(child) is not None and key != "hydra":
                _check_ranges(child, schema_of(child), f"{prefix}.{key}")
    try:
        if not prefix:  # the top level's own fields; the groups and sections are checked on their own
            seed = node.seed
            if not -(2**63) <= seed < 2**64:
                raise FieldError("seed", f"must be a 64-bit integer, got {seed}", 0)
        elif (
            prefix in GROUPS
            and (fixed := _fields(kind).get("name"))
            and _fixed_name(fixed) not in (None, node.name)
        ):
            options = ", ".join(n for n in _schema_names(prefix) if n in _option_names(prefix))
            raise ConfigError(
                f"unknown {prefix} '{node.name}' ({prefix}.name names the option; this one is "
                f"{_fixed_name(fixed)}): choose {prefix}= one of {options or _fixed_name(fixed)}"
            )
        elif getattr(kind, "OPEN", False):  # keys beyond the schema go to the target: its signature decides
            values = OmegaConf.to_container(node, resolve=True)
            assert isinstance(values, dict)
            kind(**{k: values[k] for k in _fields(kind) if k in values})
        else:
            OmegaConf.to_object(node)
    except FieldError as error:
        key = f"{prefix}.{error.field}" if prefix else error.field
        fix_key = key.removesuffix(" entries")
        sep = "" if error.problem.startswith(("=", ":")) else " "
        raise ConfigError(f"{key}{sep}{error.problem}; e.g. {fix_key}={error.example}") from None
    except ConfigError:
        raise
    except Exception as error:  # an interpolation that does not resolve, a value of the wrong type
        where = str(getattr(error, "full_key", None) or prefix or "the config")
        full = f"{prefix}.{where}" if prefix and not where.startswith(prefix) else where
        first = _first_line(error)
        raise ConfigError(
            f"{full} cannot be resolved: {first}; give {full} a plain value or point its ${{...}} at a key "
            "that exists"
        ) from None
