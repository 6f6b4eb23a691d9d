"""A ``torch.compile``d model trains with every scaler, as the same model trains eagerly, and a changing
loss scale does not recompile it: the scales reach the compiled code as tensors (the scalar scalers
multiply the loss outside the model; the adaptive scaler's backward pass reads its alphas and betas at
run time). Compiled with the ``aot_eager`` backend (Dynamo and AOTAutograd, no C++ code generation, so the
test takes seconds) under real CPU FP16 autocast; the emulation's torch-function mode is not meant to be
compiled."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn

from adaloss.scalers import AdaptiveLossScaler, DynamicLossScaler, FixedLossScaler, NoLossScaler

SCALERS = {
    "none": lambda device: NoLossScaler(device),
    "fixed": lambda device: FixedLossScaler(device, scale=128.0),
    "dynamic": lambda device: DynamicLossScaler(device, init_scale=2.0**10, growth_interval=2),
    "adaptive": lambda device: AdaptiveLossScaler(
        device, update_every=2, init_scale=2.0**-10, growth_interval=2
    ),
}
#: steps at which the test sets a new scale (``update(new_scale)``), beyond the scalers' own changes
NEW_SCALE_AT = {4: 2.0**-12, 7: 2.0**-9}
STEPS = 10


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def _run(
    name: str, compiled: bool, device: str = "cpu", backend: str = "aot_eager"
) -> tuple[list[float], list[int], list[torch.Tensor]]:
    """Per step the root scale and Dynamo's count of unique graphs so far; the final weights.
    (``tests/test_cuda.py`` runs it on a GPU with Inductor, the backend GPU users compile with.)"""
    dynamo.reset()
    scaler = SCALERS[name](device)
    model = scaler.attach(_model().to(device))
    forward = torch.compile(model, backend=backend) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    scales, graphs = [], []
    for step in range(STEPS):
        x, y = torch.randn(32, 16, generator=g).to(device), torch.randint(0, 4, (32,), generator=g).to(device)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = nn.functional.cross_entropy(forward(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update(NEW_SCALE_AT.get(step) if name in ("dynamic", "adaptive") else None)
        scales.append(scaler.get_scale())
        graphs.append(dynamo.utils.counters["stats"]["unique_graphs"])
    return scales, graphs, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(SCALERS))
def test_a_compiled_model_trains_as_the_eager_one_without_recompiling(name: str) -> None:
    eager_scales, _, eager_weights = _run(name, compiled=False)
    scales, graphs, weights = _run(name, compiled=True)
    assert scales == eager_scales
    if name in ("dynamic", "adaptive"):
        assert len(set(scales)) >= 3, scales  # the scale changed during the run
    assert all(torch.equal(a, b) for a, b in zip(weights, eager_weights, strict=True))
    # the graphs are built in the first steps (the adaptive scaler's first recompute and reuse passes);
    # none after, whatever the scale does
    assert graphs[1] > 0 and graphs[-1] == graphs[1], graphs
