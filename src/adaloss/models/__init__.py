"""The model zoo: ``build_model(cfg, num_classes)`` turns the ``model`` config group into an ``nn.Module``.

Every model traces with ``torch.fx.symbolic_trace`` (the adaptive scaler rewrites models with torch.fx),
uses non-in-place ReLUs and has torchvision-like module names (``layer3.2.conv1``, ``features.conv4``,
``fc``) so per-layer telemetry reads naturally.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from adaloss.errors import ConfigError
from adaloss.models.cifar_resnet import CifarResNet, ShortcutA, cifar_resnet
from adaloss.models.mlp import MLP
from adaloss.models.ssd import DETECTION_MODEL_NAMES, SSDDetector, build_detector
from adaloss.models.torchvision_resnet import torchvision_resnet
from adaloss.models.vgg import VGGNoBN
from adaloss.utils.fields import MISSING, config_field

__all__ = [
    "DETECTION_MODEL_NAMES",
    "MODEL_NAMES",
    "MLP",
    "CifarResNet",
    "SSDDetector",
    "ShortcutA",
    "VGGNoBN",
    "build_model",
]

_CIFAR_DEPTHS = {"resnet20": 20, "resnet56": 56, "resnet110": 110}
MODEL_NAMES: tuple[str, ...] = (
    "resnet20",
    "resnet56",
    "resnet110",
    "resnet18",
    "resnet50",
    "mlp",
    "vgg_nobn",
)


def _field(cfg: Any, key: str, default: Any = MISSING) -> Any:
    return config_field(cfg, key, default, group="model")


def build_model(cfg: Any, num_classes: int, input_shape: tuple[int, int, int] = (3, 32, 32)) -> nn.Module:
    """Build the model named by ``cfg.name`` with a ``num_classes``-way classifier, on the CPU, in FP32.

    ``input_shape`` is ``(channels, height, width)`` of one sample: conv models take ``channels`` input
    planes, the MLP takes ``channels*height*width`` features and ``vgg_nobn`` checks its pools against the
    size. Raises ``ConfigError`` for an unknown name or invalid fields. Cost: allocation and init only.
    """
    name = str(_field(cfg, "name"))
    channels, height, width = (int(v) for v in input_shape)
    if name in _CIFAR_DEPTHS:
        depth = int(_field(cfg, "depth", _CIFAR_DEPTHS[name]))
        if depth != _CIFAR_DEPTHS[name]:
            raise ConfigError(
                f"model {name} has depth {_CIFAR_DEPTHS[name]}, but model.depth={depth}: drop the override "
                f"or pick the model with that depth"
            )
        return cifar_resnet(depth, num_classes, in_channels=channels)
    if name in ("resnet18", "resnet50"):
        return torchvision_resnet(name, num_classes, in_channels=channels)
    if name == "mlp":
        hidden = [int(h) for h in _field(cfg, "hidden", [])]
        shared = bool(_field(cfg, "shared_hidden", False))
        return MLP(channels * height * width, hidden, num_classes, shared_hidden=shared)
    if name == "vgg_nobn":
        widths = list(_field(cfg, "widths"))
        return VGGNoBN(widths, num_classes, in_channels=channels, image_size=min(height, width))
    if name in DETECTION_MODEL_NAMES:  # an SSDDetector; its input size is model.image_size, not input_shape
        return build_detector(cfg, num_classes)
    raise ConfigError(
        f"unknown model '{name}': choose one of {', '.join(MODEL_NAMES + DETECTION_MODEL_NAMES)}"
    )
