"""The model zoo: ``build_model(cfg, ...)`` instantiates the ``model`` config group's ``_target_``.

Each config in ``configs/model/`` names a class or function with ``_target_`` and gives its arguments; the
builder knows no model by name. ``model.name`` is metadata: run folders, tables, figures, checkpoint keys
and the checks below go by it. What depends on the data is filled in by parameter name when the config does
not set it: ``num_classes``, ``in_channels``, ``image_size``, ``in_features`` (channels x height x width),
and for language models ``vocab_size`` and ``block_size``. So a user's own ``nn.Module`` trains unchanged
with ``python train.py model._target_=my_pkg.MyNet model.name=mynet`` (plus ``+model.<arg>=...``).

``BUNDLED_MODELS`` lists the bundled models: for each name its target, the arguments that make it that
model (``resnet20`` is the CIFAR ResNet of depth 20) and the task it serves. A config of a bundled name
without ``_target_`` (``{"name": "resnet20"}``, as scripts and tests write) builds that model.

Every bundled model traces with ``torch.fx.symbolic_trace`` (the adaptive scaler rewrites models with
torch.fx), uses non-in-place activations and has torchvision-like module names (``layer3.2.conv1``,
``h.0.attn.c_attn``) so per-layer telemetry reads naturally.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from adaloss.errors import ConfigError
from adaloss.models.cifar_resnet import CifarResNet, ShortcutA
from adaloss.models.gpt import GPT, GPTConfig
from adaloss.models.mlp import MLP
from adaloss.models.ssd import DETECTION_MODEL_NAMES, SSDDetector, build_detector
from adaloss.models.vgg import VGGNoBN
from adaloss.models.vit import ViT
from adaloss.utils.targets import build_target, config_items

__all__ = [
    "ALL_MODEL_NAMES",
    "BUNDLED_MODELS",
    "DETECTION_MODEL_NAMES",
    "GPT",
    "GPTConfig",
    "LANGUAGE_MODEL_NAMES",
    "MODEL_NAMES",
    "MLP",
    "CifarResNet",
    "SSDDetector",
    "ShortcutA",
    "VGGNoBN",
    "ViT",
    "build_detector",
    "build_model",
    "bundled_model",
]


@dataclass(frozen=True)
class BundledModel:
    """A model this package ships: ``target`` (its ``_target_``), ``fixed`` (the arguments that make it
    this model; a config may repeat them but not change them) and ``task`` (the data it trains on:
    ``classification``, ``detection`` or ``language_model``)."""

    target: str
    task: str = "classification"
    fixed: dict[str, Any] = field(default_factory=dict)


_RESNET = "adaloss.models.cifar_resnet.CifarResNet"
_TV_RESNET = "adaloss.models.torchvision_resnet.torchvision_resnet"
_SSD = "adaloss.models.ssd.ssd_detector"
_GPT = "adaloss.models.gpt.GPT"

#: The bundled models by ``model.name``; ``configs/model/<name>.yaml`` carries the same target and fixed
#: arguments (``tests/test_targets.py`` checks that they agree).
BUNDLED_MODELS: dict[str, BundledModel] = {
    "resnet20": BundledModel(_RESNET, fixed={"depth": 20}),
    "resnet56": BundledModel(_RESNET, fixed={"depth": 56}),
    "resnet110": BundledModel(_RESNET, fixed={"depth": 110}),
    "resnet18": BundledModel(_TV_RESNET, fixed={"arch": "resnet18"}),
    "resnet50": BundledModel(_TV_RESNET, fixed={"arch": "resnet50"}),
    "mlp": BundledModel("adaloss.models.mlp.MLP"),
    "vgg_nobn": BundledModel("adaloss.models.vgg.VGGNoBN"),
    "vit": BundledModel("adaloss.models.vit.ViT"),
    "ssd300": BundledModel(_SSD, "detection", {"variant": "ssd300"}),
    "ssd512": BundledModel(_SSD, "detection", {"variant": "ssd512"}),
    "gpt": BundledModel(_GPT, "language_model"),
    "gpt2_small": BundledModel(_GPT, "language_model", {"n_layer": 12, "n_head": 12, "n_embd": 768}),
}
#: The convolutional and MLP image classifiers (the paper's kind of model).
MODEL_NAMES: tuple[str, ...] = (
    "resnet20",
    "resnet56",
    "resnet110",
    "resnet18",
    "resnet50",
    "mlp",
    "vgg_nobn",
)
LANGUAGE_MODEL_NAMES: tuple[str, ...] = ("gpt", "gpt2_small")
#: Every bundled name, classifiers first (the order error messages list them in).
ALL_MODEL_NAMES: tuple[str, ...] = (*MODEL_NAMES, "vit", *DETECTION_MODEL_NAMES, *LANGUAGE_MODEL_NAMES)
assert set(ALL_MODEL_NAMES) == set(BUNDLED_MODELS)

#: Not arguments of the target: ``name`` (what the run is called) and, for the bundled detectors, ``init``
#: (the detection task's data-dependent initialization, ``model.init=lsuv``).
MODEL_METADATA = ("name",)
DETECTOR_METADATA = ("name", "init")
_EXAMPLE = "model._target_=my_pkg.MyNet model.name=mynet"


def bundled_model(cfg: Any) -> tuple[str, BundledModel | None]:
    """``(model.name, its BundledModel or None for a model of the user's own)``, after the checks that need
    no data: a name, a known name for a bundled target, the fixed arguments unchanged, and a name of the
    user's own for a replaced ``_target_`` (runs, tables and checkpoints would otherwise carry the replaced
    model's name). ``ConfigError`` naming the fix otherwise. No imports of the target, no side effects."""
    items = config_items(cfg)
    name = items.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"model config is missing the field 'name' (got {name!r}): choose a config with "
            "model=<option>, or "
            f"name your own model: {_EXAMPLE}"
        )
    target = items.get("_target_")
    bundled = BUNDLED_MODELS.get(name)
    bundled_targets = {b.target for b in BUNDLED_MODELS.values()}
    if bundled is None:
        if target is None or target in bundled_targets:
            raise ConfigError(
                f"unknown model '{name}': choose one of {', '.join(ALL_MODEL_NAMES)} (on the command line: "
                "model= "
                f"one of them), or name a model of your own: {_EXAMPLE}"
            )
        return name, None
    if target is not None and target != bundled.target:
        raise ConfigError(
            f"model._target_={target} replaces the network of model={name} ({bundled.target}), but "
            "model.name is "
            f"still '{name}': give your model its own name for run folders, tables and checkpoints, e.g. "
            f"model.name={str(target).rsplit('.', 1)[-1].lower()}"
        )
    for key, value in bundled.fixed.items():
        if key in items and items[key] != value:
            raise ConfigError(
                f"model {name} has {key} {value}, but model.{key}={items[key]}: drop the override or pick "
                "the "
                f"model with that {key}"
            )
    return name, bundled


def build_model(
    cfg: Any,
    num_classes: int | None = None,
    input_shape: tuple[int, int, int] | None = None,
    **data: Any,
) -> nn.Module:
    """Instantiate the model ``cfg`` describes, on the CPU, in FP32.

    ``cfg``: a ``model`` config (``_target_``, ``name`` and the target's arguments) or, for a bundled model,
    just ``name`` and arguments. Data-dependent arguments are filled in by parameter name where the config
    leaves them out: ``num_classes``; from ``input_shape = (channels, height, width)`` of one sample
    ``in_channels``, ``image_size`` (the smaller side) and ``in_features`` (their product); and every
    keyword in ``data`` (``vocab_size``, ``block_size``). Without ``input_shape`` a 3x32x32 sample fills only
    the parameters that have no default (an MLP's ``in_features``); a detector keeps its native size.

    Raises ``ConfigError`` for an unknown name, a bad target or invalid arguments; a target that does not
    return an ``nn.Module`` is one too. Cost: the target's import, allocation and init.
    """
    name, bundled = bundled_model(cfg)
    defaults = {"_target_": bundled.target, **bundled.fixed} if bundled else {}
    fill: dict[str, Any] = {k: v for k, v in data.items() if v is not None}
    if num_classes is not None:
        fill["num_classes"] = int(num_classes)
    shape = (3, 32, 32) if input_shape is None else tuple(int(v) for v in input_shape)
    from_shape = {
        "in_channels": shape[0],
        "image_size": min(shape[1:]),
        "in_features": shape[0] * shape[1] * shape[2],
    }
    if input_shape is not None:
        fill.update({k: v for k, v in from_shape.items() if k not in fill})
    else:
        fill.update(_required_only(cfg, defaults, from_shape))
    metadata = DETECTOR_METADATA if bundled is not None and bundled.task == "detection" else MODEL_METADATA
    model = build_target("model", cfg, example=_EXAMPLE, fill=fill, metadata=metadata, defaults=defaults)
    if not isinstance(model, nn.Module):
        target = config_items(cfg).get("_target_", defaults.get("_target_"))
        raise ConfigError(
            f"model._target_={target} returned a {type(model).__name__}, not a torch.nn.Module: name the "
            "module's "
            f"class (or a function that returns one), e.g. {_EXAMPLE}"
        )
    return model


def _required_only(cfg: Any, defaults: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` whose parameter in the target has no default."""
    from adaloss.utils.targets import locate_target, target_parameters

    target = config_items(cfg).get("_target_", defaults.get("_target_"))
    signature = target_parameters(locate_target("model", target, _EXAMPLE))
    if signature is None:
        return {}
    params = signature[0]
    return {k: v for k, v in values.items() if k in params and params[k].default is params[k].empty}
