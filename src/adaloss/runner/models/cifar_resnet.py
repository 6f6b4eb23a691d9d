"""The CIFAR ResNets of He et al. (2016), section 4.2: depth 6n+2 with parameter-free option-A shortcuts.

These are the models of Table 1 in Zhao et al. (ResNet-20/56/110 on CIFAR-10/100). The layout is
``conv1 -> bn1 -> relu -> layer1 -> layer2 -> layer3 -> avgpool -> flatten -> fc`` with ``n`` BasicBlocks per
stage (16, 32 and 64 channels; stride 2 at the start of stages 2 and 3). Module names follow torchvision so
per-layer telemetry reads ``layer3.2.conv1``.

Every activation is its own non-in-place ``nn.ReLU`` module and every block's shortcut is a module
(``shortcut``), so the graph that ``torch.fx.symbolic_trace`` produces has one node per operation and no
in-place mutation for the adaptive scaler to trip over. Parameter counts match the paper's table: 0.27M
(n=3), 0.85M (n=9), 1.7M (n=18).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adaloss.errors import ConfigError

__all__ = ["BasicBlock", "CifarResNet", "ShortcutA", "cifar_resnet", "kaiming_init"]


class ShortcutA(nn.Module):
    """He et al.'s option-A shortcut: subsample space by ``stride``, zero-pad the new channels.

    It has no parameters, so a ResNet-20 keeps its 0.27M weights; the cost is a strided slice and a pad (one
    copy of the block input). The extra channels are split between both sides of the channel dimension, as in
    the reference Torch implementation, so the identity-carried channels sit in the middle.
    """

    def __init__(self, in_planes: int, out_planes: int, stride: int) -> None:
        super().__init__()
        if out_planes < in_planes:
            raise ValueError(f"option-A shortcut cannot shrink channels ({in_planes} -> {out_planes})")
        self.in_planes = in_planes
        self.out_planes = out_planes
        self.stride = stride
        extra = out_planes - in_planes
        self.pad_front = extra // 2
        self.pad_back = extra - self.pad_front

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride != 1:
            x = x[:, :, :: self.stride, :: self.stride]
        # F.pad lists dims from the last one: (W left, W right, H top, H bottom, C front, C back).
        return F.pad(x, (0, 0, 0, 0, self.pad_front, self.pad_back))

    def extra_repr(self) -> str:
        return f"{self.in_planes}->{self.out_planes}, stride={self.stride}"


class BasicBlock(nn.Module):
    """Two 3x3 conv + BN layers with a shortcut: ``relu2(bn2(conv2(relu1(bn1(conv1(x))))) + shortcut(x))``."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module
        if stride != 1 or in_planes != planes:
            self.shortcut = ShortcutA(in_planes, planes, stride)
        else:
            self.shortcut = nn.Identity()
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for small images: three stages of ``n`` BasicBlocks at 16/32/64 channels.

    Cost: for 32x32 inputs, about 41M multiply-adds per image at depth 20 and linear in ``n`` beyond that.
    """

    def __init__(self, depth: int, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6 != 0:
            raise ConfigError(
                f"CIFAR ResNet depth must be 6n+2 with n >= 1 (20, 32, 44, 56, 110), got {depth}"
            )
        if num_classes < 1:
            raise ConfigError(f"num_classes must be positive, got {num_classes}")
        n = (depth - 2) // 6
        self.depth = depth
        self.conv1 = nn.Conv2d(in_channels, 16, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        self._in_planes = 16
        self.layer1 = self._make_stage(16, n, stride=1)
        self.layer2 = self._make_stage(32, n, stride=2)
        self.layer3 = self._make_stage(64, n, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(64, num_classes)
        kaiming_init(self)

    def _make_stage(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = []
        for i in range(blocks):
            layers.append(BasicBlock(self._in_planes, planes, stride if i == 0 else 1))
            self._in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(self.flatten(self.avgpool(x)))


def kaiming_init(model: nn.Module) -> None:
    """He-normal weights: fan-out for convs (as the reference Torch/torchvision code), fan-in for linears.

    Fan-in for the classifier keeps the initial logits O(1); fan-out there would scale them by
    sqrt(in/out) (about 2.5x for 64->10). BN starts at weight 1, bias 0; biases start at 0.
    """
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d | nn.GroupNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def cifar_resnet(depth: int, num_classes: int, in_channels: int = 3) -> CifarResNet:
    """Build a CIFAR ResNet of the given depth (6n+2); raises ``ConfigError`` for an invalid depth."""
    return CifarResNet(depth, num_classes=num_classes, in_channels=in_channels)
