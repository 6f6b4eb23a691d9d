"""The torch.export capture path (:mod:`adaloss.adaptive.capture`) on models torch.fx also traces: with fx's
trace made to fail, ``attach`` captures them from example inputs and the same rewrite passes run. The
generator's architectures (tests/model_generator.py) stay exact, and batch norm follows ``train()`` /
``eval()`` although export fixed its mode. (Hugging Face models: tests/test_hf_transformers.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from torch import nn

import test_generated_models as generated
from adaloss.adaptive import transform as adaptive_transform
from adaloss.adaptive.attention import AdaptiveTracer
from adaloss.adaptive.capture import CapturedForward, capture
from adaloss.scalers.adaptive import AdaptiveLossScaler
from adaloss.scalers.exactness import check_gradients
from model_generator import GeneratedNet, programs


@pytest.fixture
def no_fx(monkeypatch: pytest.MonkeyPatch) -> None:
    """fx's symbolic trace fails, as on a transformers model: attach() captures with torch.export."""

    def untraceable(self, root, *args, **kwargs):
        raise RuntimeError(f"{type(root).__name__} does not trace here")

    monkeypatch.setattr(AdaptiveTracer, "trace", untraceable)


@pytest.mark.parametrize("case", sorted(generated.REGRESSIONS))
def test_the_generators_regressions_are_exact_through_the_capture(no_fx, monkeypatch, case):
    captured = []

    def counted(*args, **kwargs):
        captured.append(type(args[0]).__name__)
        return capture(*args, **kwargs)

    monkeypatch.setattr(adaptive_transform, "capture", counted)
    program = generated.REGRESSIONS[case]
    torch.manual_seed(0)
    report = check_gradients(GeneratedNet(program), generated._batches(program), generated._loss_fn(program))
    assert report.ok, report.format()
    assert captured == ["GeneratedNet"] * 2  # one attach per rule, each through torch.export


@pytest.mark.slow
def test_generated_models_are_exact_through_the_capture(no_fx):
    """The generator's property (``check_program``: exact, or refused by name) on captured models."""

    @seed(1)
    @settings(
        max_examples=200,
        deadline=None,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(programs())
    def run(program):
        generated.check_program(program)

    run()


def test_batch_norm_follows_train_and_eval_after_the_capture(no_fx):
    """Export records batch norm with ``training=True``; the captured model normalizes by the batch and
    updates the running statistics while training, and uses them in eval mode, as the plain model does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
    plain = copy.deepcopy(model)
    x = torch.randn(4, 3, 6, 6)
    attached = AdaptiveLossScaler().attach(model, x)
    assert attached is model and isinstance(model.__dict__["forward"], CapturedForward)
    torch.testing.assert_close(attached(x), plain(x), rtol=0, atol=0)  # training: batch statistics
    torch.testing.assert_close(model[1].running_mean, plain[1].running_mean, rtol=0, atol=0)
    attached.eval()
    plain.eval()
    torch.testing.assert_close(attached(x), plain(x), rtol=0, atol=0)  # eval: running statistics
    torch.testing.assert_close(model[1].running_mean, plain[1].running_mean, rtol=0, atol=0)
