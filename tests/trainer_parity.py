"""What the trainer-integration tests (test_lightning.py, test_accelerate.py) compare against: our own loop
(the order of ``LossScaler``'s docstring example and src/adaloss/runner/engine/trainer.py) on a small task
made for the scalers to matter.

The loss is multiplied by ``LOSS_FACTOR`` (1e-5), so FP16 gradients underflow unless scaled, and the four
scalers end 20 steps with four different sets of weights (test_lightning.py checks it): a trainer that
ends with our loop's weights, bitwise, handled the scaler as our loop does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from adaloss.precision import Precision
from adaloss.runner.utils.targets import build_scaler
from adaloss.scalers import LossScaler

SCALERS = {
    "none": {"name": "none"},
    "fixed": {"name": "fixed", "scale": 1024},
    "dynamic": {"name": "dynamic", "init_scale": 2.0**16, "growth_interval": 5},
    "adaptive": {"name": "adaptive", "update_every": 3, "root": "adaptive"},
}
STEPS = 20
LOSS_FACTOR = 1e-5  # small gradients: FP16 underflows them unless they are scaled
CLIP = 4e-6  # below most of the task's gradient norms (3.8e-6 to 7.6e-6): clipping acts
LR = 1e3

_g = torch.Generator().manual_seed(1)
X, Y = torch.randn(80, 8, generator=_g), torch.randint(0, 4, (80,), generator=_g)


def loader() -> torch.utils.data.DataLoader:
    """10 batches an epoch, in a fixed order: 20 steps are two epochs, a checkpoint at 10 ends one."""
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)


def batches(epochs: int) -> list[Any]:
    return [batch for _ in range(epochs) for batch in loader()]


def make_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def seeded_net() -> nn.Sequential:
    torch.manual_seed(0)
    return make_net()


def weights(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def our_loop(
    name: str, build: Callable[[], nn.Module] = seeded_net, clip: float | None = None, accumulate: int = 1
) -> tuple[list[torch.Tensor], LossScaler]:
    """``STEPS`` iterations of our own loop under the FP16 emulation: each ``accumulate`` micro-batches of
    loss / accumulate, then unscale and clip (with ``clip``), step, update. Returns the weights and the
    scaler."""
    module = build()
    scaler, precision = build_scaler(SCALERS[name]), Precision("fp16", "cpu")
    model = scaler.attach(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)
    data = batches(STEPS * accumulate // 10)
    clipped = 0
    for i in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        for x, y in data[i * accumulate : (i + 1) * accumulate]:
            with precision.autocast():
                loss = F.cross_entropy(model(x), y) * LOSS_FACTOR
            scaler.scale(loss / accumulate).backward()
        if clip is not None:
            scaler.unscale_(optimizer)
            clipped += int(nn.utils.clip_grad_norm_(model.parameters(), clip) > clip)
        scaler.step(optimizer)
        scaler.update()
    assert clip is None or clipped >= STEPS // 2  # the clipping acted: a wrong order would show
    return weights(module), scaler
