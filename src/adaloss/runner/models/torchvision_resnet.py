"""torchvision's ImageNet ResNet-18/50 (Table 2 of Zhao et al.), randomly initialised.

``weights=None`` always: the experiments train from scratch and nothing may be downloaded at run time.

Two deviations from the stock modules, both for the adaptive scaler's torch.fx rewrite:

* every ``nn.ReLU`` is switched to ``inplace=False``. An in-place ReLU overwrites its input, which breaks
  any autograd function the scaler inserts between BN and ReLU that saves that input for backward. The cost
  is one extra activation buffer per ReLU (torchvision's blocks reuse one ReLU module, so the saving was
  small anyway).
* with ``in_channels != 3`` the stem conv is replaced by one of the same shape taking that many channels.

Note that torchvision's blocks call their single ``relu`` module twice per block (parameter-free, but a
module called more than once all the same).
"""

from __future__ import annotations

from torch import nn
from torchvision import models as tvm

from adaloss.errors import ConfigError

__all__ = ["torchvision_resnet"]

_BUILDERS = {"resnet18": tvm.resnet18, "resnet50": tvm.resnet50}


def torchvision_resnet(arch: str, num_classes: int, in_channels: int = 3) -> nn.Module:
    """Build torchvision's ``arch`` (``resnet18`` or ``resnet50``) with random weights and ``num_classes``.

    Cost: 11.7M / 25.6M parameters (at 1000 classes), 1.8 / 4.1 GFLOPs per 224x224 image.
    """
    if arch not in _BUILDERS:
        raise ConfigError(f"model.arch must be one of {', '.join(_BUILDERS)}, got {arch!r}")
    model = _BUILDERS[arch](weights=None, num_classes=num_classes)
    for m in model.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = False
    if in_channels != 3:
        old = model.conv1
        model.conv1 = nn.Conv2d(
            in_channels,
            old.out_channels,
            kernel_size=old.kernel_size,
            stride=old.stride,
            padding=old.padding,
            bias=False,
        )
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    return model
