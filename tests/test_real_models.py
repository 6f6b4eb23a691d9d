"""Today's models with computed weights, from small configs (issue 42): timm's NF-ResNet-26 and NFNet-F0
(weight-standardized convolutions with gains), MobileViT-v2 (unfold/fold patch attention, captured with
torch.export), Wav2Vec2 (a weight-normed positional convolution, captured) and SpeechT5's HiFi-GAN vocoder
with weight norm on every convolution. Each is exact in float64 with every weight GEMM under a point.
(Mixtral and Qwen2-MoE: tests/test_moe.py.)"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from adaloss.scalers.adaptive import AdaptiveLossScaler
from adaloss.scalers.exactness import check_gradients

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def nf_model(name: str) -> torch.nn.Module:
    """timm's config of ``name`` with fewer and narrower stages (the block types, standardized convs,
    gains and attention kept)."""
    from timm.models.nfnet import NormFreeNet, model_cfgs

    small = {
        "nf_resnet26": dict(channels=(16, 32, 48, 64)),
        "nfnet_f0": dict(depths=(1, 1, 2, 1), channels=(16, 32, 48, 48), group_size=8),
    }[name]
    return NormFreeNet(dataclasses.replace(model_cfgs[name], **small), num_classes=5)


def wav2vec2() -> torch.nn.Module:
    config = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
        conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
        vocab_size=12, layerdrop=0.0, apply_spec_augment=False,
    )  # fmt: skip
    return transformers.Wav2Vec2ForCTC(config)


def hifigan() -> torch.nn.Module:
    config = transformers.SpeechT5HifiGanConfig(
        model_in_dim=8, upsample_initial_channel=16, upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4],
        resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]],
    )  # fmt: skip
    model = transformers.SpeechT5HifiGan(config)
    model.apply_weight_norm()
    return model


def _images(n: int, size: int = 32) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(b, 3, size, size, generator=g),) for b in (2, 3)[:n]]


MODELS = {
    "nf_resnet26": (lambda: nf_model("nf_resnet26"), _images(2), lambda o: o),
    "nfnet_f0": (lambda: nf_model("nfnet_f0"), _images(2), lambda o: o),
    "hifigan": (hifigan, [(torch.randn(2, 10, 8),), (torch.randn(3, 7, 8),)], lambda o: o),
    "wav2vec2": (wav2vec2, [(torch.randn(2, 400),), (torch.randn(3, 360),)], lambda o: o.logits),
}


def _covered(model: torch.nn.Module, batch: tuple) -> None:
    scaler = AdaptiveLossScaler()
    scaler.attach(model.double(), *(t.double() for t in batch))
    report = scaler.coverage(*(t.double() for t in batch))
    assert report.every_gemm_weight_has_a_point and not report.unscaled and not report.outside, (
        report.format()
    )


SLOW = {"wav2vec2"}  # about 20 s on the shared 2-core machine


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(MODELS)]
)
def test_exact_with_every_weight_gemm_under_a_point(name):
    factory, batches, output = MODELS[name]
    torch.manual_seed(0)
    report = check_gradients(factory(), batches, lambda out: output(out).square().mean() * 1e-6)
    assert report.ok, report.format()
    _covered(factory(), batches[0])


def test_weight_standardized_convs_are_points_named_by_their_weights():
    """NF-ResNet's ScaledStdConv2d: the point's weight is the parameter and its gain."""
    scaler = AdaptiveLossScaler()
    scaler.attach(nf_model("nf_resnet26"))
    report = scaler.coverage(*_images(1)[0])
    assert ("stem.conv", "stem.conv.weight, stem.conv.gain") in [(p.name, p.weight) for p in report.points]


@pytest.mark.slow  # about 60 s on the shared 2-core machine
def test_mobilevitv2_attaches_in_seconds_and_is_exact():
    """MobileViT-v2's three unfold/fold blocks: captured with only the batch size dynamic (not in 400 s
    with every dimension dynamic), under 30 s; exact; every weight GEMM a point."""
    torch.manual_seed(0)
    model = timm.create_model("mobilevitv2_050", num_classes=5)
    x = torch.randn(2, 3, 64, 64)
    start = time.perf_counter()
    AdaptiveLossScaler().attach(model, x)
    assert time.perf_counter() - start < 30
    torch.manual_seed(0)
    fresh = timm.create_model("mobilevitv2_050", num_classes=5)
    batches = [(x,), (torch.randn(3, 3, 64, 64),)]
    report = check_gradients(fresh, batches, lambda out: out.square().mean() * 1e-6, rules=("reference",))
    assert report.ok, report.format()
    _covered(fresh, batches[0])


def test_an_image_capture_takes_other_batch_sizes_and_names_another_image_size(monkeypatch):
    """Captured images keep their sizes but the batch size; another size gets one message saying what to
    do (fx made to fail, as on MobileViT)."""
    from adaloss.adaptive.attention import AdaptiveTracer
    from adaloss.adaptive.capture import CaptureError

    monkeypatch.setattr(AdaptiveTracer, "trace", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no fx")))
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 2)
    )
    attached = AdaptiveLossScaler().attach(model, torch.randn(2, 3, 8, 8))
    assert attached(torch.randn(5, 3, 8, 8)).shape == (5, 2)
    with pytest.raises(CaptureError, match="keeps its captured sizes but the batch size: attach a fresh"):
        attached(torch.randn(2, 3, 10, 10))
