"""A plain multilayer perceptron, the network of Figure 3 in Zhao et al.

``flatten -> hidden.0 -> act.0 -> hidden.1 -> act.1 -> ... -> fc``. With ``shared_hidden`` a square
``shared`` Linear(h, h) (h = last hidden width) is inserted before ``fc`` and applied twice in a row, each
call followed by its own ReLU: the same module object is called twice in one forward. That is the case the
adaptive scaler must handle when one module's weights receive gradients from two places in the graph, and
this model exists to test it. Cost: one extra h x h GEMM per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from adaloss.errors import ConfigError

__all__ = ["MLP"]


class MLP(nn.Module):
    """Fully connected ReLU network over flattened inputs; He-normal weights, zero biases."""

    def __init__(
        self, in_features: int, hidden: Sequence[int], num_classes: int, shared_hidden: bool = False
    ) -> None:
        super().__init__()
        widths = [int(h) for h in hidden]
        if any(h < 1 for h in widths):
            raise ConfigError(f"mlp hidden widths must be positive integers, got {list(hidden)}")
        if shared_hidden and not widths:
            raise ConfigError("mlp shared_hidden=true needs at least one hidden layer (model.hidden=[...])")
        if in_features < 1 or num_classes < 1:
            raise ConfigError(
                f"mlp needs positive in_features and num_classes, got {in_features}, {num_classes}"
            )
        self.flatten = nn.Flatten(1)
        dims = [in_features, *widths]
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True))
        self.act = nn.ModuleList(nn.ReLU() for _ in widths)
        self.shared: nn.Linear | None = None
        self.shared_act: nn.ModuleList | None = None
        if shared_hidden:
            self.shared = nn.Linear(dims[-1], dims[-1])
            self.shared_act = nn.ModuleList([nn.ReLU(), nn.ReLU()])
        self.fc = nn.Linear(dims[-1], num_classes)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.flatten(x)
        for linear, act in zip(self.hidden, self.act, strict=True):
            x = act(linear(x))
        if self.shared is not None and self.shared_act is not None:
            x = self.shared_act[0](self.shared(x))
            x = self.shared_act[1](self.shared(x))
        return self.fc(x)
