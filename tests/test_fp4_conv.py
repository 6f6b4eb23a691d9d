"""FP4 convolutions (issue 37): a 2-D conv's three GEMMs over its im2col columns, through the linear layer's
FP4 code, in the emulation and under the adaptive scaler."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from adaloss.numerics.fp4_gemm import FP4Conv2d, FP4Gemm, FP4Linear, FP4Recipe, conv_geometry

# (stride, padding, dilation): stride 2 with padding, and a dilated conv
GEOMETRIES = [(2, 1, 1), (1, 2, 2)]


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_fp4_conv_is_bitwise_the_fp4_linear_path_on_the_unfolded_columns(recipe, geometry) -> None:
    # K = 5 * 3 * 3 = 45 (not a multiple of 16 or 32); SR and Hadamard on, so the generator's draws must also
    # come in the same order (dgrad, then wgrad)
    stride, padding, dilation = geometry
    gen = torch.Generator().manual_seed(37)
    x = torch.randn(2, 5, 9, 9, generator=gen, requires_grad=True)
    w = torch.randn(24, 5, 3, 3, generator=gen, requires_grad=True)
    b = torch.randn(24, generator=gen, requires_grad=True)
    fp4 = FP4Recipe(name=recipe, stochastic_rounding=True, hadamard=True, seed=5)
    y = FP4Conv2d.apply(x, w, b, FP4Gemm(fp4), conv_geometry(w, stride, padding, dilation), None)
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy)
    # by hand: autograd's unfold (its backward is col2im), FP4Linear on (N * L, K) rows, W as (out, K)
    xh, wh, bh = (t.detach().clone().requires_grad_() for t in (x, w, b))
    cols = F.unfold(xh, 3, dilation=dilation, padding=padding, stride=stride)
    rows = cols.transpose(1, 2).reshape(-1, 45)
    yh = FP4Linear.apply(rows, wh.reshape(24, 45), bh, FP4Gemm(fp4), None)
    yh = yh.reshape(2, -1, 24).transpose(1, 2).reshape(y.shape)
    yh.backward(dy)
    assert torch.equal(y, yh)
    assert torch.equal(x.grad, xh.grad)
    assert torch.equal(w.grad, wh.grad)
    assert torch.equal(b.grad, bh.grad)
    # and FP4 did quantize: the conv's output is not F.conv2d's
    exact = F.conv2d(x.detach(), w.detach(), b.detach(), stride, padding, dilation)
    assert not torch.allclose(y, exact, rtol=1e-3, atol=1e-3)


class _Unquantized(FP4Gemm):
    """FP4Gemm with quantization switched off: every operand passes through unchanged."""

    def quantize(self, x, tile=1, gradient=False, stats=False):  # noqa: ANN001, ANN201
        return SimpleNamespace(dequantized=x, stats=None)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_unquantized_conv_gemms_are_conv2d_and_its_gradients(geometry) -> None:
    # quantization off, FP32 against float64's F.conv2d: FP32 rounding is ~1e-6 here, FP4's error ~1e-1, and
    # any wiring error (row order, transposes, fold) O(1)
    stride, padding, dilation = geometry
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 10, 7, generator=gen, requires_grad=True)
    w = torch.randn(6, 4, 3, 2, generator=gen, requires_grad=True)
    b = torch.randn(6, generator=gen, requires_grad=True)
    gemm = _Unquantized(FP4Recipe(hadamard=True))  # the Hadamard transform cancels in the wgrad GEMM
    y = FP4Conv2d.apply(x, w, b, gemm, conv_geometry(w, stride, padding, dilation), None)
    dy = torch.randn(y.shape, generator=gen)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = F.conv2d(x64, w64, b64, stride, padding, dilation)
    ref_grads = torch.autograd.grad(ref, (x64, w64, b64), dy.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_conv_geometry_pads_same_symmetrically_and_refuses_uneven_padding() -> None:
    w3, w2 = torch.zeros(1, 1, 3, 3), torch.zeros(1, 1, 2, 2)
    assert conv_geometry(w3, 1, "same", 2)["padding"] == (2, 2)
    assert conv_geometry(w3, 1, "valid")["padding"] == (0, 0)
    assert conv_geometry(w2, 1, "same") is None  # 1 pixel of padding on one side only: stays BF16


def _tiny_resnet_step(precision, scaler_name: str, monitor=None):  # noqa: ANN001, ANN202
    """One ResNet-8 step on 8x8 images: the parameters' gradients after the scaler's ``unscale_``."""
    from adaloss.runner.models.cifar_resnet import CifarResNet
    from adaloss.runner.utils.targets import build_scaler

    torch.manual_seed(0)
    # the adaptive scaler with u_min raised to 1e-3: betas above 1 (BF16 alone would need none), and a root
    # scale of 8: every conv node scales its gradient and brings its weight gradient to the root scale
    options = {"u_min": 1e-3, "init_scale": 8.0} if scaler_name == "adaptive" else {}
    scaler = build_scaler({"name": scaler_name, **options}, None)
    model = CifarResNet(depth=8, num_classes=10)
    model = precision.prepare(scaler.attach(model) or model)
    gen = torch.Generator().manual_seed(1)
    images, labels = torch.randn(8, 3, 8, 8, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with precision.autocast(monitor):
        loss = F.cross_entropy(model(images).float(), labels)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_resnet_convs_are_fp4_layers_by_the_block_rule() -> None:
    from adaloss.precision import Precision
    from adaloss.runner.models.cifar_resnet import CifarResNet

    precision = Precision("nvfp4", "cpu")
    precision.prepare(CifarResNet(depth=20, num_classes=10))
    inner = {f"layer{s}.{i}.conv{c}" for s in (1, 2, 3) for i in range(3) for c in (1, 2)}
    # the stem conv1 is outside every block and matches no keep pattern; fc is kept; so are layer1.0, layer3.2
    edges = {f"layer{b}.conv{c}" for b in ("1.0", "3.2") for c in (1, 2)}
    assert precision.fp4.layers == {"conv1"} | (inner - edges)
    precision = Precision("nvfp4", "cpu", keep_first=0, keep_last=0)
    precision.prepare(CifarResNet(depth=20, num_classes=10))
    assert precision.fp4.layers == {"conv1"} | inner


def test_fp4_convs_under_the_adaptive_scaler_carry_the_root_scale() -> None:
    # nearest rounding: NVFP4's per-tensor scale absorbs a power-of-two scale exactly, so after unscale_ the
    # adaptive scaler's gradients are the unscaled run's up to BF16 underflow; a conv weight gradient left at
    # its own alpha_j (not brought to the root scale) is off by powers of two
    from adaloss.precision import Precision
    from adaloss.telemetry import UnderflowMonitor

    options = {"keep_first": 0, "keep_last": 0}
    monitor = UnderflowMonitor(every=1, fmt="bf16")
    precision = Precision("nvfp4", "cpu", **options)
    adaptive = _tiny_resnet_step(precision, "adaptive", monitor)
    monitor.underflow_rates()
    plain = _tiny_resnet_step(Precision("nvfp4", "cpu", **options), "none")
    bf16 = _tiny_resnet_step(Precision("bf16", "cpu"), "adaptive")
    convs = sorted(precision.fp4.layers - {"conv1"})
    assert convs == [f"layer{s}.0.conv{c}" for s in (1, 2, 3) for c in (1, 2)]
    for name in [f"{c}.weight" for c in ["conv1", *convs]]:
        torch.testing.assert_close(adaptive[name], plain[name], rtol=0.02, atol=1e-6)
        assert not torch.allclose(adaptive[name], bf16[name], rtol=0.02, atol=1e-6)  # FP4 ran there
    # the FP4 convs' telemetry: FP4-stored output gradients (BF16 gives about 50 dB) and their wgrad noise
    storage = monitor.last_storage
    assert sorted(storage["fp4_grad_to_noise"]) == convs
    assert all(storage["sqnr_db"][c] < 25.0 for c in convs)
    assert all(1.0 < v < math.inf for v in storage["fp4_grad_to_noise"].values())


def test_train_resnet20_nvfp4_adaptive_records_fp4_telemetry_of_its_convs(make_full_cfg) -> None:
    # python train.py model=resnet20 dataset=digits precision=nvfp4 scaler=adaptive, shrunk: the FP4 block
    # telemetry of metrics.json has the conv layers (all but the kept edge blocks and fc; the stem conv has no
    # dgrad, so no dgrad operand to probe)
    from adaloss.runner.engine import train

    fp4 = ("precision=nvfp4", "precision.stochastic_rounding=true", "precision.hadamard=true")
    run = ("model=resnet20", "dataset=digits", "dataset.image_size=8", *fp4, "scaler=adaptive")
    run += ("trainer.batch_size=4", "trainer.max_steps=2", "trainer.eval_every=2", "telemetry.every=1")
    metrics = train(make_full_cfg(*run, "adaptive_recipe.update_every=1"))
    assert not metrics["diverged"] and math.isfinite(metrics["test_accuracy"])
    convs = {f"layer{s}.{i}.conv{c}" for s in (1, 2, 3) for i in range(3) for c in (1, 2)}
    convs -= {f"layer{b}.conv{c}" for b in ("1.0", "3.2") for c in (1, 2)}
    for key in ("fp4_block_clamped_share", "fp4_block_subnormal_share", "fp4_block_scale_spread_log2"):
        assert set(metrics[key]) == convs
    assert set(metrics["fp4_grad_to_noise"]) == convs
    assert all(math.sqrt(3) < v < math.inf for v in metrics["fp4_grad_to_noise"].values())
    assert all(metrics["sqnr_db"][c] < 25.0 < metrics["sqnr_db"]["layer1.0.conv1"] for c in convs)
