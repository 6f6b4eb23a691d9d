"""The ``reference`` scale rule against an independent port of the authors' released code.

``tests/authors_port.py`` is a NumPy port of the scale rule of kumasento/gradient-scaling, written from a
reading of their code and sharing nothing with ``adaloss``. The port was validated against the authors'
own functions: their ``ada_loss`` package, imported in a throwaway virtual environment (Python 3.11,
Chainer 7.8.1, NumPy 1.23.5, SciPy 1.15.3; their package ``__init__`` bypassed, as it needs ChainerCV),
computed ``AdaLossChainer.get_loss_scale`` and ``AdaLossChainer.rescaling`` on every case of
:func:`layer_cases` and :func:`branch_cases` below (FP16 arrays wrapped in ``chainer.Variable``, the
incoming scale as their ``prev_scale``), and the port gave the same scale on every one of them: 70 of 70
layer cases (both bound settings) and 56 of 56 branch cases, one of which raises in their code where the
port returns None. That environment is not part of the project; these tests compare the package with the
port, on the CPU, in every run.

What is compared: each layer's beta (Algorithm 4 with the authors' ``F``, clamp order and bounds, over
linear and conv shapes, gradients from 1e-1 down to below FP16's subnormals, gradients with spikes near
overflow, incoming alphas from 1 to beyond the accumulation bound) under both bound settings of their
scripts (CIFAR: 128 / 4096, ImageNet and SSD: 16 / 1024); the branch rescaling (Algorithm 5 and the halving
fallback); and, end to end, the betas an attached model computes in its backward pass.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import authors_port as port
from adaloss.adaptive import ScaleRule, backward_fan_in, branch_loss_scale, gemm_loss_scale
from adaloss.scalers.adaptive import AdaptiveLossScaler
from reference_cases import branch_cases, layer_cases

#: (scale_upper_bound, accum_upper_bound) of the authors' scripts: cifar/utils.py:47-48; imagenet and ssd
BOUNDS = {"cifar": (128.0, 4096.0), "imagenet_ssd": (16.0, 1024.0)}


def _on_boundary(raw: float) -> bool:
    """Whether a scale before rounding lies within float32 rounding of a power of two (there float32 and
    the port's float64 may legitimately round to different sides)."""
    nearest = 2.0 ** round(math.log2(raw))
    return raw != nearest and abs(raw / nearest - 1.0) < 1e-5  # an exact power of two (a cap, 1) is not


@pytest.mark.parametrize("bounds", sorted(BOUNDS))
def test_layer_betas_equal_the_authors_code(bounds):
    scale_ub, accum_ub = BOUNDS[bounds]
    rule = ScaleRule("reference", port.U_MIN_FP16, port.U_MAX_FP16, 1e-3, False, scale_ub, accum_ub)
    compared, below_one, bounded, boundary = 0, 0, 0, 0
    for case in layer_cases():
        w, g = torch.from_numpy(case["w"]), torch.from_numpy(case["g"])
        fan = backward_fan_in(case["kind"], w.shape)
        assert fan == port.fan_in(case["w"].shape)
        ours = gemm_loss_scale(w, g, rule, fan_in=fan, alpha_in=case["alpha"]).item()
        theirs, raw = port.gemm_scale(case["g"], case["w"], case["alpha"], scale_ub, accum_ub)
        if _on_boundary(raw):
            boundary += 1
            assert ours in (theirs, theirs * 2, theirs / 2)
            continue
        assert ours == theirs, (case["kind"], case["w"].shape, case["alpha"], ours, theirs, raw)
        compared += 1
        below_one += theirs < 1
        bounded += raw in (scale_ub, accum_ub / case["alpha"])
    assert compared >= 30 and boundary <= 2
    assert below_one > 0 and bounded > 0  # the cases reach both ends: overflow bound and the caps


def test_branch_rescaling_equals_the_authors_code():
    compared = rescued = 0
    for alphas, grads in branch_cases():
        maxima = torch.tensor([float(np.abs(g).max()) for g in grads])
        ours = branch_loss_scale(torch.tensor(alphas), maxima, port.U_MAX_FP16, "reference").item()
        theirs = port.branch_scale(alphas, grads)
        if theirs is None:  # their code raises here; ours keeps halving until the gradients fit
            largest = max(m / a for m, a in zip(maxima.tolist(), alphas, strict=True))
            assert ours <= min(alphas) / 2 and ours * largest < port.U_MAX_FP16 <= 2 * ours * largest
            continue
        assert ours == theirs, (alphas, maxima, ours, theirs)
        compared += 1
        rescued += theirs < min(alphas)
    assert compared >= 25 and rescued > 0


class _Net(nn.Module):
    """Conv layers, a residual branch (Algorithm 5) and a linear head, without batch norm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.conv3 = nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x))
        h = torch.relu(self.conv3(torch.relu(self.conv2(h))) + h)
        return self.fc(h.flatten(1))


@pytest.mark.parametrize("bounds", sorted(BOUNDS))
def test_attached_model_computes_the_authors_betas(bounds):
    """End to end: the beta each layer of an attached model computes in its backward pass equals the
    port's beta for the gradient that layer received (captured by a hook), its weight and its alpha."""
    scale_ub, accum_ub = BOUNDS[bounds]
    torch.manual_seed(0)
    model = _Net().double()
    scaler = AdaptiveLossScaler(
        update_every=1,
        rule="reference",
        u_min=port.U_MIN_FP16,
        scale_upper_bound=scale_ub,
        accum_upper_bound=accum_ub,
    )
    attached = scaler.attach(model)
    received: dict[str, torch.Tensor] = {}

    def capture(name):
        def hook(module, args, output):
            output.register_hook(lambda grad: received.__setitem__(name, grad.detach().clone()))

        return hook

    modules = dict(attached.named_modules())
    for name in ("conv1", "conv2", "conv3", "fc"):
        modules[name].register_forward_hook(capture(name))
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    y = torch.arange(4) % 10
    loss = nn.functional.cross_entropy(attached(x), y) * 2.0**-20  # small gradients: betas above 1
    scaler.scale(loss).backward()
    alphas, betas = scaler.layer_scales(), scaler.layer_betas()
    assert set(received) == set(betas) == {"conv1", "conv2", "conv3", "fc"}
    for name, grad in received.items():
        w = modules[name].weight.detach().numpy()
        theirs, raw = port.gemm_scale(grad.numpy(), w, alphas[name], scale_ub, accum_ub)
        if not _on_boundary(raw):
            assert betas[name] == theirs, (name, betas[name], theirs, alphas[name])
    assert len({b for b in betas.values() if b > 1}) >= 2, betas
