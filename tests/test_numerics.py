"""Number formats, rounding, the CPU emulation of FP16 autocast, and underflow telemetry."""

import copy
import math

import pytest
import torch
from torch import nn

from adaloss.errors import ConfigError
from adaloss.numerics import FORMATS, get_format, round_generic, round_to_format
from adaloss.precision import Precision
from adaloss.telemetry import UnderflowMonitor

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


def _values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(50_000, generator=g) * 10 ** torch.empty(50_000).uniform_(-12, 6, generator=g)
    edges = torch.tensor(
        [
            2**-24,
            2**-25,
            1.5 * 2**-25,
            3 * 2**-25,
            65504.0,
            65519.0,
            65520.0,
            1e9,
            -1e9,
            0.0,
            -0.0,
            math.inf,
            -math.inf,
            2**-16,
            2**-17,
            57344.0,
            61439.0,
            61440.0,
            448.0,
            464.0,
            2**-133,
            2**-134,
        ]
    )
    return torch.cat([spread, edges])


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_generic_rounding_matches_native_casts(name):
    fmt = FORMATS[name]
    x = _values()
    native, generic = round_to_format(x, fmt), round_generic(x, fmt)
    assert torch.equal(native.isnan(), generic.isnan())
    ok = ~native.isnan()
    assert torch.equal(native[ok], generic[ok])


def test_fp16_range_matches_the_paper():
    fp16 = get_format("fp16")
    assert fp16.u_min == 2.0**-24
    assert fp16.u_max == 65504.0
    x = torch.tensor([2**-24, 2**-25, 3 * 2**-26, 65504.0, 65519.0, 65520.0, -70000.0])
    r = round_to_format(x, fp16)
    assert r[0] == 2**-24  # smallest subnormal survives
    assert r[1] == 0  # half of it ties to even: zero
    assert r[2] == 2**-24  # above half rounds up
    assert r[3] == 65504 and r[4] == 65504
    assert math.isinf(r[5]) and r[6] == -math.inf


def test_format_constants():
    assert get_format("fp8_e5m2").u_min == 2.0**-16 and get_format("fp8_e5m2").u_max == 57344.0
    assert get_format("bf16").u_min == 2.0**-133
    assert get_format("fp8_e4m3").u_max == 448.0
    with pytest.raises(ConfigError, match="unknown number format 'fp12'"):
        get_format("fp12")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _capture_output_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, grad_input, grad_output):
            grads[name] = grad_output[0].detach().float().clone()

        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.register_full_backward_hook(keep(name))
    return grads


@pytest.mark.parametrize("loss_scale", [1.0, 2.0**-14])
def test_emulated_step_matches_real_half_tensors(loss_scale):
    """One emulated FP16 training step equals the same step computed with real ``.half()`` tensors.

    The tiny loss scale drives many activation gradients below 2**-24, so the test also checks that exactly
    the same values are flushed to zero. (The CPU's real-FP16 *convolution* backward kernels flush part of
    the subnormal range themselves, unlike CUDA; linear layers are faithful, so the reference uses an MLP.)
    """
    x = torch.randn(32, 20, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(2))

    emulated = _mlp()
    emu_grads = _capture_output_grads(emulated)
    precision = Precision("fp16", "cpu")
    emulated = precision.prepare(emulated)
    with precision.autocast():
        loss = nn.functional.cross_entropy(emulated(x), y)
    (loss * loss_scale).backward()

    real = copy.deepcopy(_mlp()).half()
    real_grads = _capture_output_grads(real)
    real_loss = nn.functional.cross_entropy(real(x.half()).float(), y)
    (real_loss * loss_scale).backward()

    assert abs(loss.item() - real_loss.item()) < 1e-3
    flushed = 0
    for name in real_grads:
        # hooks see the emulated gradient just before it is stored (rounded) in FP16
        emu = round_to_format(emu_grads[name], get_format("fp16"))
        ref = real_grads[name]
        assert torch.equal(emu == 0, ref == 0), f"different values flushed to zero at layer {name}"
        assert (emu - ref).abs().max() <= 2e-3 * ref.abs().max()
        flushed += int(((emu_grads[name] != 0) & (emu == 0)).sum())
    for (name, p_emu), p_ref in zip(emulated.named_parameters(), real.parameters(), strict=True):
        g_ref = p_ref.grad.float()
        assert torch.equal(p_emu.grad == 0, g_ref == 0), name
        assert (p_emu.grad - g_ref).abs().max() <= 2e-3 * g_ref.abs().max() + 1e-30, name
        # weight gradients reach the FP32 master copy as FP16 values
        assert torch.equal(p_emu.grad, p_emu.grad.half().float()), name
        assert p_emu.dtype == torch.float32
    if loss_scale < 1:
        assert flushed > 0, "the small loss scale should have flushed some gradients to zero"


def test_emulation_rounds_activations_and_keeps_fp32_ops():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x):
            out = self.bn(self.conv(x))
            self.after_bn = out
            out = out + 0.1 * torch.ones_like(out)  # an FP16 op on an FP16 value
            out += out  # in-place addition
            self.after_add = out
            self.softmax = torch.softmax(out.flatten(1), dim=1)  # FP32 op: not rounded
            return out

    torch.manual_seed(0)
    block = Block()
    precision = Precision("fp16", "cpu")
    block = precision.prepare(block)
    x = torch.randn(2, 3, 5, 5) * 1.2345
    with precision.autocast():
        out = block(x)
    out.sum().backward()
    fp16 = get_format("fp16")
    for t in (block.after_bn, block.after_add):
        assert torch.equal(t, round_to_format(t, fp16))
    assert not torch.equal(block.softmax, round_to_format(block.softmax, fp16))
    assert torch.equal(block.conv.weight.grad, round_to_format(block.conv.weight.grad, fp16))
    assert block.conv.weight.dtype == torch.float32


@pytest.mark.parametrize("pool", ["avg_pool2d", "adaptive_avg_pool2d"])
def test_average_pooling_rounds_after_pooling_and_rounds_its_gradient(pool):
    """The emulation section's promise for pooling, an op autocast runs in FP16: the mean of FP16 values is
    rounded once, after pooling (the conv's rounded output averaged in FP32, then rounded), and the gradient
    with respect to the pooled output is rounded in the backward pass before pooling spreads it."""

    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 1)

        def forward(self, x):
            self.h = self.conv(x)  # a GEMM output: FP16 values
            self.h.retain_grad()
            if pool == "avg_pool2d":
                self.pooled = nn.functional.avg_pool2d(self.h, 2)
            else:
                self.pooled = nn.functional.adaptive_avg_pool2d(self.h, 1)
            return self.pooled

    fp16 = get_format("fp16")
    torch.manual_seed(0)
    block = Pooled()
    precision = Precision("fp16", "cpu")
    block = precision.prepare(block)
    x = torch.randn(3, 2, 2, 2)
    with precision.autocast():
        out = block(x)
    mean = block.h.mean(dim=(2, 3), keepdim=True)  # pooled in FP32 from the FP16 values
    assert torch.equal(block.h, round_to_format(block.h, fp16))
    assert torch.equal(out, round_to_format(mean, fp16))  # rounded once, after pooling
    assert not torch.equal(out, mean)  # (these means are not all FP16 values: the rounding did something)
    # the gradient arriving at the pooled output: 1 + 2^-12 rounds to 1 and 2^-26 to 0 in FP16; pooling
    # spreads the rounded value over the 2 x 2 window
    arriving = torch.tensor([1 + 2.0**-12, 2.0**-26, -3.0]).view(3, 1, 1, 1).expand(3, 2, 1, 1)
    (out * arriving).sum().backward()
    expected = round_to_format(arriving, fp16).expand(3, 2, 2, 2) / 4
    assert torch.equal(block.h.grad, expected)
    assert (block.h.grad[1] == 0).all() and (block.h.grad[0] == 0.25).all()


def test_bf16_and_fp8_gradients_are_in_their_formats():
    x = torch.randn(16, 20)
    y = torch.randint(0, 10, (16,))
    for name, grad_fmt in [("bf16", "bf16"), ("fp8_e5m2", "fp8_e5m2")]:
        model = _mlp()
        precision = Precision(name, "cpu")
        model = precision.prepare(model)
        with precision.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        fmt = get_format(grad_fmt)
        for p in model.parameters():
            assert torch.equal(p.grad, round_to_format(p.grad, fmt)), name


def test_underflow_monitor_counts_exactly():
    model = _mlp()
    precision = Precision("fp16", "cpu")
    model = precision.prepare(model)
    grads = _capture_output_grads(model)
    monitor = UnderflowMonitor(every=10, fmt=precision.telemetry_format)
    assert monitor.due(0) and not monitor.due(3) and monitor.due(20)
    x, y = torch.randn(32, 20), torch.randint(0, 10, (32,))
    with precision.autocast(monitor=monitor):
        loss = nn.functional.cross_entropy(model(x), y)
    (loss * 2.0**-16).backward()
    rates = monitor.underflow_rates()
    assert list(rates) == ["0", "2", "4"]  # network order
    fp16 = get_format("fp16")
    for name, g in grads.items():
        expected = ((g != 0) & (round_to_format(g, fp16) == 0)).sum().item() / g.numel()
        assert rates[name] == pytest.approx(expected)
    assert rates["0"] > rates["4"]  # gradients shrink towards the input
    assert monitor.underflow_rates() == {}  # counts reset after reading


def test_fp32_telemetry_measures_without_changing_numerics():
    x, y = torch.randn(32, 20), torch.randint(0, 10, (32,))
    plain = _mlp()
    nn.functional.cross_entropy(plain(x), y).mul(2.0**-20).backward()

    probed = _mlp()
    precision = Precision("fp32", "cpu")
    probed = precision.prepare(probed)
    monitor = UnderflowMonitor(every=1, fmt=precision.telemetry_format)
    with precision.autocast(monitor=monitor):
        loss = nn.functional.cross_entropy(probed(x), y)
    loss.mul(2.0**-20).backward()
    for a, b in zip(plain.parameters(), probed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    rates = monitor.underflow_rates()
    assert set(rates) == {"0", "2", "4"} and max(rates.values()) > 0


def test_precision_validation():
    with pytest.raises(ConfigError, match="unknown precision 'fp17'"):
        Precision("fp17", "cpu")
    p = Precision("fp16", "cpu")
    assert p.emulated and not p.uses_autocast and p.format.name == "fp16"
    assert Precision("fp32", "cpu").format is None
    p8 = Precision("fp8_e5m2", "cpu")
    assert p8.format.name == "fp16" and p8.grad_format.name == "fp8_e5m2"
    with pytest.raises(ConfigError):
        UnderflowMonitor(every=0)
