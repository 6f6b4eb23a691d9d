"""GEMMs whose weight is computed from parameters (issue 42): weight norm in both APIs, ``parametrize``
parametrizations (orthogonal, spectral norm), weight standardization, a weight times a gain. Each is a
scaling point over the weight it multiplies, on the fx path and the export path, exact in float64, and
``coverage()`` says so, naming the parameters; with the point taken away, it says no."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from adaloss.adaptive.attention import AdaptiveTracer
from adaloss.scalers.adaptive import AdaptiveLossScaler
from adaloss.scalers.exactness import check_gradients


class WSConv(nn.Conv2d):
    """The issue's weight-standardized convolution: the weight minus its mean over the fan-in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight - self.weight.mean((1, 2, 3), keepdim=True)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class StdConv(nn.Conv2d):
    """timm's ``ScaledStdConv2d``: standardized through ``F.batch_norm`` and times a learned gain."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.ones(self.out_channels, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1),
            None,
            None,
            weight=(self.gain * 0.5).view(-1),
            training=True,
            momentum=0.0,
            eps=1e-6,
        ).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class GainLinear(nn.Module):
    """``x @ (g * W)^T``: a weight scaled by a gain vector."""

    def __init__(self, n: int, m: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(m, n) / n**0.5)
        self.g = nn.Parameter(torch.rand(m, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.g * self.weight)


class LoRALinear(nn.Module):
    """``x @ (W + B @ A)^T``: the product of weights is part of the weight's computation, not a point."""

    def __init__(self, n: int, m: int, rank: int = 2) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(m, n) / n**0.5)
        self.lora_b, self.lora_a = (
            nn.Parameter(torch.randn(m, rank) / 2),
            nn.Parameter(torch.randn(rank, n) / 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight + self.lora_b @ self.lora_a)


class LearnedQuery(nn.Module):
    """A learned query projected by ``F.linear`` and attended to by the input's tokens: the projection is a
    GEMM of weights alone inside the computation of the weight ``q`` that the two products multiply."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(3, d))
        self.q_proj = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = F.linear(self.norm(self.query), self.q_proj)  # (3, d), no model input in it
        return torch.softmax(x @ q.t(), -1) @ q


class ProjectedPosition(nn.Module):
    """``x + F.linear(norm(pos), proj)``: a GEMM of weights alone whose result meets the activations, so a
    point of its own (its output gradient carries an alpha)."""

    def __init__(self, tokens: int = 3, d: int = 6) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(tokens, d))
        self.proj = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + F.linear(self.norm(self.pos), self.proj))


class Skew(nn.Module):
    """A parametrization of our own (``parametrize.register_parametrization``): ``X - X^T``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu(1) - x.triu(1).t()


def _ws_net() -> nn.Module:
    """The issue's smallest case."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        WSConv(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(512, 5),
    )


def _std_net() -> nn.Module:
    return nn.Sequential(StdConv(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(256, 5))


def _weight_norm_net(api: str) -> nn.Module:
    """The issue's other smallest case, in both weight-norm APIs (and with dim=None: one g)."""
    norm = {
        "parametrizations": parametrizations.weight_norm,
        "old": nn.utils.weight_norm,
        "parametrizations-dim-none": lambda m: parametrizations.weight_norm(m, dim=None),
    }[api]
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), norm(nn.Linear(16, 16)))


def _vocoder_net() -> nn.Module:
    """A HiFi-GAN-style stack: weight-normed Conv1d and ConvTranspose1d with leaky ReLUs and a residual."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = parametrizations.weight_norm(nn.ConvTranspose1d(6, 4, 4, stride=2, padding=1))
            self.res = parametrizations.weight_norm(nn.Conv1d(4, 4, 3, padding=2, dilation=2))
            self.post = nn.utils.weight_norm(nn.Conv1d(4, 1, 7, padding=3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.up(F.leaky_relu(x, 0.1))
            h = h + self.res(F.leaky_relu(h, 0.1))
            return torch.tanh(self.post(F.leaky_relu(h, 0.1)))

    return nn.Sequential(parametrizations.weight_norm(nn.Conv1d(3, 6, 7, padding=3)), Block())


def _parametrized_net(kind: str) -> nn.Module:
    layer = nn.Linear(6, 6)
    if kind == "orthogonal":
        parametrizations.orthogonal(layer)
    elif kind == "spectral":
        parametrizations.spectral_norm(layer)
    else:
        parametrize.register_parametrization(layer, "weight", Skew())
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), layer, nn.Tanh(), nn.Linear(6, 3))


CASES = {
    "weight-standardized conv (issue)": (_ws_net, (2, 3, 8, 8), 3),
    "scaled std conv with a gain": (_std_net, (2, 3, 8, 8), 2),
    "weight times a gain": (lambda: nn.Sequential(nn.Linear(5, 6), nn.ReLU(), GainLinear(6, 4)), (4, 5), 2),
    "weight norm (parametrizations, issue)": (lambda: _weight_norm_net("parametrizations"), (4, 8), 2),
    "weight norm (nn.utils.weight_norm, issue)": (lambda: _weight_norm_net("old"), (4, 8), 2),
    "weight norm with dim=None": (lambda: _weight_norm_net("parametrizations-dim-none"), (4, 8), 2),
    "weight-normed vocoder": (_vocoder_net, (2, 3, 16), 4),
    "orthogonal": (lambda: _parametrized_net("orthogonal"), (4, 4), 3),
    "spectral norm": (lambda: _parametrized_net("spectral"), (4, 4), 3),
    "own parametrization": (lambda: _parametrized_net("skew"), (4, 4), 3),
    "LoRA (weight plus a product of weights)": (
        lambda: nn.Sequential(nn.Linear(5, 6), LoRALinear(6, 4)),
        (4, 5),
        2,
    ),
    "learned query": (lambda: nn.Sequential(nn.Linear(4, 6), LearnedQuery()), (5, 4), 3),
    "projected position": (lambda: nn.Sequential(nn.Linear(4, 6), ProjectedPosition()), (2, 3, 4), 2),
}


@pytest.fixture(params=["fx", "export"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways ``attach`` reads a model: fx's symbolic trace, and torch.export's capture (fx made to
    fail, as on a transformers model)."""
    if request.param == "export":

        def untraceable(self, root, *args, **kwargs):
            raise RuntimeError(f"{type(root).__name__} does not trace here")

        monkeypatch.setattr(AdaptiveTracer, "trace", untraceable)
    return request.param


def _batches(shape: tuple[int, ...]) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(*shape, generator=g, dtype=torch.float64),) for _ in range(2)]


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean() * 1e-6


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_computed_weight_is_exact_under_a_point(path, case):
    """Exact in float64 against plain backprop on a recompute and a reuse step, both rules."""
    factory, shape, _ = CASES[case]
    torch.manual_seed(0)
    report = check_gradients(factory(), _batches(shape), _loss)
    assert report.ok, report.format()
    assert all(report.outputs_equal.values())


@pytest.mark.parametrize("case", sorted(CASES))
def test_coverage_counts_a_computed_weight_as_its_parameters(path, case):
    """Every GEMM of the model is a point, each named by the parameters its weight is computed from, and
    every GEMM call of a forward pass ran inside one."""
    factory, shape, gemms = CASES[case]
    torch.manual_seed(0)
    model = factory().double()
    x = _batches(shape)[0][0]
    scaler = AdaptiveLossScaler(update_every=1)
    attached = scaler.attach(model, x)
    report = scaler.coverage(x)
    assert report.every_gemm_weight_has_a_point, report.format()
    assert len([p for p in report.points if p.kind == "layer"]) == gemms
    assert not report.unscaled and not report.outside
    assert len({c.point for c in report.calls}) == gemms  # each point's GEMM seen at dispatch
    assert sorted(attached.state_dict()) == sorted(factory().state_dict())


def test_the_weight_norm_crash_is_gone():
    """The issue's second case: ``KeyError: 'weight'`` at the first forward pass."""
    torch.manual_seed(0)
    net = _weight_norm_net("parametrizations").double()
    plain = copy.deepcopy(net)
    x = torch.randn(4, 8, dtype=torch.float64)
    attached = AdaptiveLossScaler().attach(net)
    torch.testing.assert_close(attached(x), plain(x), rtol=0, atol=0)


def test_spectral_norm_keeps_its_power_iteration():
    """A parametrization with state (spectral norm's ``_u``, ``_v``) updates it as the plain model does,
    and attach itself leaves it as it was."""
    torch.manual_seed(0)
    net = _parametrized_net("spectral").double()
    plain = copy.deepcopy(net)
    u = net[2].parametrizations.weight[0]._u.clone()
    attached = AdaptiveLossScaler().attach(net)
    torch.testing.assert_close(net[2].parametrizations.weight[0]._u, u, rtol=0, atol=0)
    x = torch.randn(4, 4, dtype=torch.float64)
    for _ in range(2):
        torch.testing.assert_close(attached(x), plain(x), rtol=0, atol=0)
    torch.testing.assert_close(
        net[2].parametrizations.weight[0]._u, plain[2].parametrizations.weight[0]._u, rtol=0, atol=0
    )
