"""A VGG-style conv net without batch normalization, for 32x32 inputs.

The paper's hardest case is SSD's VGG-16 backbone: with no BN between layers nothing renormalises the
activation gradients, so their magnitude drifts layer by layer and the layers near the input underflow in
FP16 first (Figure 1 of Zhao et al.). This model reproduces that property at CIFAR scale:

``features`` (``conv<i>`` 3x3 + ``relu<i>``, ``pool<k>`` 2x2 max-pool at each ``'M'``) -> ``avgpool`` ->
``flatten`` -> ``fc``. Convs have biases (there is no BN to absorb them); weights are He-normal.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from adaloss.errors import ConfigError
from adaloss.runner.models.cifar_resnet import kaiming_init

__all__ = ["VGGNoBN"]


class VGGNoBN(nn.Module):
    """Conv3x3+ReLU stacks separated by max-pools, global average pool, one linear classifier.

    ``widths`` mixes positive ints (conv output channels) and ``'M'`` (max-pool, halves H and W).
    Cost: for ``[64, 'M', 128, 'M', 256, 256, 'M', 512, 'M']`` on 32x32, about 2.1M parameters and
    0.1G multiply-adds per image.
    """

    def __init__(
        self, widths: Sequence[int | str], num_classes: int, in_channels: int = 3, image_size: int = 32
    ) -> None:
        super().__init__()
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        channels = in_channels
        size = image_size
        n_conv = n_pool = 0
        for w in widths:
            if isinstance(w, str):
                if w != "M":
                    raise ConfigError(f"vgg_nobn widths entries must be positive ints or 'M', got {w!r}")
                if size < 2:
                    raise ConfigError(
                        f"vgg_nobn widths {list(widths)} pool a {image_size}x{image_size} input below 1x1: "
                        "remove an 'M'"
                    )
                n_pool += 1
                layers[f"pool{n_pool}"] = nn.MaxPool2d(kernel_size=2, stride=2)
                size //= 2
            else:
                if isinstance(w, bool) or int(w) != w or int(w) < 1:
                    raise ConfigError(f"vgg_nobn widths entries must be positive ints or 'M', got {w!r}")
                n_conv += 1
                layers[f"conv{n_conv}"] = nn.Conv2d(channels, int(w), kernel_size=3, padding=1)
                layers[f"relu{n_conv}"] = nn.ReLU()
                channels = int(w)
        if n_conv == 0:
            raise ConfigError(f"vgg_nobn widths need at least one conv width, got {list(widths)}")
        self.features = nn.Sequential(layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(channels, num_classes)
        kaiming_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(self.avgpool(self.features(x))))
