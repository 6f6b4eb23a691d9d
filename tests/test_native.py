"""The native FP16 kernels: bit-identical to torch's casts, statistics and beta equal to the torch path,
and a clean fallback when they cannot be used."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from adaloss.adaptive.rules import ScaleRule, backward_fan_in, gemm_loss_scale, grad_stats, weight_factors
from adaloss.numerics import get_format, native, round_to_format
from adaloss.numerics.formats import round_to_format_

FP16 = get_format("fp16")
pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")

SPECIALS = [
    0.0,
    -0.0,
    2.0**-24,  # smallest FP16 subnormal: survives
    2.0**-25,  # exactly half of it: ties to even, so rounds to zero
    2.0**-25 * 1.0001,  # just above half: rounds up to 2**-24
    3 * 2.0**-26,
    -(2.0**-25),
    2.0**-14,
    2.0**-14 * (1 - 2.0**-11),  # the largest subnormal region boundary
    65504.0,
    65519.99,  # rounds down to 65504
    65520.0,  # ties away to infinity under IEEE (65520 is the overflow threshold)
    -65520.0,
    1e-45,  # float32 subnormal
    -1e-45,
    1.0 + 2.0**-11,  # a tie between two FP16 neighbours: to even
    1.0 + 3 * 2.0**-11,
    float("inf"),
    -float("inf"),
]


def _random_wide(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mant = torch.randn(n, generator=g)
    exps = torch.randint(-45, 25, (n,), generator=g).float()
    return mant * torch.exp2(exps)


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def test_round_f16_is_bit_identical_to_torch_casts():
    x = torch.cat([_random_wide(200_003), torch.tensor(SPECIALS * 100), torch.tensor([float("nan")] * 50)])
    ref = x.to(torch.float16).to(torch.float32)
    got = native.round_f16(x)
    assert got is not None and got is not x
    assert _bits_equal(ref, got)
    # the edge cases themselves, spelled out
    r = native.round_f16(torch.tensor(SPECIALS * 64)).view(64, -1)[0]
    assert r[2] == 2.0**-24 and r[3] == 0.0 and r[4] == 2.0**-24
    assert r[10] == 65504.0 and r[11] == float("inf") and r[12] == -float("inf")
    assert r[15] == 1.0 and r[16] == 1.0 + 4 * 2.0**-11
    # -0 and a negative underflow keep the sign
    assert torch.signbit(r[1]) and torch.signbit(r[6]) and r[6] == 0.0


@pytest.mark.parametrize(
    "pre,post", [(2.0**5, 1.0), (1.0, 2.0**-7), (2.0**-20, 2.0**12), (2.0**30, 2.0**-126)]
)
def test_round_f16_with_power_of_two_scales_equals_multiply_round_divide(pre, post):
    """The adaptive scaler's fused ops: beta * W then rounding, and rounding then division by alpha."""
    x = torch.cat([_random_wide(100_000, seed=5), torch.tensor(SPECIALS * 10)])
    ref = (x * pre).to(torch.float16).to(torch.float32) / (1.0 / post)
    got = native.round_f16(x, pre=pre, post=post)
    assert _bits_equal(ref, got)
    y = x.clone()
    assert native.round_f16(y, out=y, pre=pre, post=post) is y and _bits_equal(ref, y)


def test_round_to_format_uses_the_kernel_and_in_place_variant_bumps_the_version():
    x = _random_wide(50_000, seed=1)
    ref = x.to(torch.float16).float()
    calls = []
    original = native.round_f16

    def spy(*a, **k):
        out = original(*a, **k)
        calls.append(out is not None)
        return out

    native.round_f16 = spy
    try:
        assert _bits_equal(ref, round_to_format(x, FP16))
        y = x.clone()
        v0 = y._version
        assert round_to_format_(y, FP16) is y
        assert _bits_equal(ref, y) and y._version > v0
    finally:
        native.round_f16 = original
    assert calls == [True, True]


@pytest.mark.parametrize(
    "make",
    [
        lambda x: x[::2],  # not contiguous
        lambda x: x.double(),  # not float32
        lambda x: x[: native.MIN_NUMEL - 1],  # below MIN_NUMEL
        lambda x: x.clone().requires_grad_(),  # autograd must see the op
    ],
    ids=["strided", "float64", "small", "requires_grad"],
)
def test_ineligible_tensors_fall_back_to_torch_with_the_same_result(make):
    x = make(_random_wide(20_000, seed=2))
    assert native.round_f16(x) is None and native.grad_stats(x, True) is None
    out = round_to_format(x, FP16)
    ref = x.detach().to(torch.float16).to(x.dtype)
    if x.requires_grad:
        assert out.grad_fn is not None
    out = out.detach()
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num())


def test_grad_stats_always_takes_strided_and_small_float32_tensors():
    """The host recompute pass must never fall back: ``always=True`` copies a strided tensor first."""
    for x in (_random_wide(20_000, seed=7)[::2], _random_wide(10, seed=8)):
        v, stats = native.grad_stats(x, True, always=True)
        ref = x.to(torch.float16).float()
        assert _bits_equal(ref, v)
        lo, hi = ref.aminmax()
        assert stats[1] == lo.abs() and stats[2] == hi.abs()
    with pytest.raises(RuntimeError, match="float32 CPU"):
        native.grad_stats(torch.ones(100, dtype=torch.float64), True, always=True)


def test_disabled_context_uses_torch():
    x = _random_wide(10_000)
    with native.disabled():
        assert native.round_f16(x) is None
    assert native.round_f16(x) is not None


@pytest.mark.parametrize("round_fp16", [True, False])
def test_grad_stats_match_torch_reductions(round_fp16):
    x = torch.randn(300_001, generator=torch.Generator().manual_seed(3)) * 1e-3
    out = native.grad_stats(x, round_fp16)
    assert len(out) == 2
    v, stats = out
    ref_v = x.to(torch.float16).float() if round_fp16 else x
    assert torch.equal(v, ref_v) and (v is x) == (not round_fp16)
    lo, hi = ref_v.aminmax()
    assert stats[1] == lo.abs() and stats[2] == hi.abs()
    exact = ref_v.double().square().sum().sqrt()
    assert abs(stats[0].double() - exact) / exact < 1e-6


def test_grad_stats_propagate_nan_and_inf():
    x = torch.randn(10_000)
    x[1234] = float("nan")
    _, stats = native.grad_stats(x, True)
    assert stats.isnan().all()
    x[1234] = float("inf")
    _, stats = native.grad_stats(x, False)
    assert stats[0] == float("inf") and stats[2] == float("inf")
    x[1234] = 70000.0  # finite in FP32, infinite once rounded to FP16
    _, stats = native.grad_stats(x, True)
    assert stats[2] == float("inf")


def test_round_scaled_f16_stores_the_scaled_gradient_in_fp16():
    """fp16(fp16(x) * scale) in one pass: Algorithm 3's beta * delta as FP16 training stores it (overflow to
    infinity above 65504, bits lost below the subnormals for a scale under 1)."""
    x = torch.cat([_random_wide(100_003, seed=5), torch.tensor(SPECIALS)])
    for scale in (1.0, 2.0, 2.0**10, 2.0**-3, 2.0**-12):
        got = native.round_scaled_f16(x, scale)
        ref = (x.half().float() * scale).half().float()
        assert _bits_equal(got, ref), scale
    big = torch.full((256,), 40000.0)
    assert native.round_scaled_f16(big, 2.0).isinf().all()  # 80000 is beyond FP16


RULE_CASES = {
    "paper": dict(name="paper"),
    "paper-below-one": dict(name="paper", allow_below_one=True),
    "reference-16-1024": dict(name="reference", scale_upper_bound=16.0, accum_upper_bound=1024.0),
    "reference-128-4096": dict(name="reference", scale_upper_bound=128.0, accum_upper_bound=4096.0),
    "reference-unbounded": dict(name="reference"),
}


@pytest.mark.parametrize("case", sorted(RULE_CASES))
def test_kernel_beta_equals_the_torch_path(case):
    """The kernel's beta is the torch path's beta under every rule, over gradients from tiny (large beta) to
    huge (overflow bound, beta below one), incoming alphas beyond the accumulation bound, all-zero
    gradients and NaN gradients: the same float32 steps (ScaleRule.beta)."""
    fp16 = get_format("fp16")
    rule = ScaleRule(u_min=fp16.u_min, u_max=fp16.u_max, t_uf=1e-3, **RULE_CASES[case])
    g = torch.Generator().manual_seed(4)
    below_one = 0
    for i in range(120):
        w_mag, g_mag = torch.empty(2).uniform_(0, 1, generator=g).tolist()
        w = torch.randn(64, 32, 3, 3, generator=g) * 10.0 ** (-3 + 4 * w_mag)
        delta = torch.randn(8, 64, 8, 8, generator=g) * 10.0 ** (-9 + 13 * g_mag)
        alpha = 2.0 ** int(torch.randint(0, 14, (1,), generator=g))
        if i == 0:
            delta.zero_()
        if i == 1:
            delta[0, 0, 0, 0] = float("nan")
        a, b = rule.layer_constants(w.numel(), backward_fan_in("conv", w.shape))
        fast = native.weight_factors([w], [(rule.lower_constant(a, delta.numel()), b)])[0]
        _, stats = native.grad_stats(delta, False)
        beta, beta_float = native.beta_host(fast, stats, rule.flags, *rule.caps, alpha)
        assert beta_float == float(beta)
        factors = torch.cat([fast, torch.tensor(rule.caps)])
        with native.disabled():
            one = torch.ones(())
            ref = gemm_loss_scale(w, delta, rule, factors=factors, stats=grad_stats(delta, alpha, one))
            device_alpha = grad_stats(delta, torch.tensor(alpha), one)
            ref_device_alpha = gemm_loss_scale(w, delta, rule, factors=factors, stats=device_alpha)
        assert beta.dtype == ref.dtype and beta.shape == ref.shape
        assert torch.equal(beta, ref), (i, beta, ref)
        assert torch.equal(beta, ref_device_alpha), (i, beta, ref_device_alpha)
        below_one += beta_float < 1
        if i in (0, 1):  # no statistics (all zero) or NaN: scale 1, under the caps
            assert beta_float == min(1.0, rule.caps[1] / alpha)
    # the rules that allow it reach below one in this range (overflow or accumulation bound); the others never
    allows = case != "paper"
    assert (below_one > 0) == allows, below_one


def test_weight_factors_kernel_matches_the_torch_path():
    g = torch.Generator().manual_seed(6)
    weights = [
        torch.randn(*shape, generator=g) * scale
        for shape, scale in [
            ((16, 3, 3, 3), 0.3),
            ((64, 64, 3, 3), 0.05),
            ((10, 64), 1e-4),
            ((32, 16, 1, 1), 2.0),
        ]
    ]
    weights[1][3, 2, 1, 0] = -7.5  # the max magnitude is a negative value
    fp16 = get_format("fp16")
    rule = ScaleRule("reference", fp16.u_min, fp16.u_max, 1e-3)
    kinds = ["conv", "conv", "linear", "conv"]
    consts = [
        rule.layer_constants(w.numel(), backward_fan_in(k, w.shape))
        for w, k in zip(weights, kinds, strict=True)
    ]
    fast = native.weight_factors(weights, consts)
    ref = weight_factors(weights, torch.tensor([[a, b, *rule.caps] for a, b in consts], dtype=torch.float32))
    for a, b in zip(fast.unbind(0), ref.unbind(0), strict=True):
        assert a.dtype == b.dtype == torch.float32 and a.shape == (3,) and b.shape == (5,)
        assert torch.equal(a[1:], b[1:3])  # B / max|W|: the max is exact either way
        assert abs(float(a[0]) / float(b[0]) - 1) < 1e-6  # the norms differ only in accumulation order
        assert (b[3].item(), b[4].item()) == rule.caps
    # B = u_max / F for the reference rule: F = 64 * 3 * 3 for the second weight, whose max is 7.5
    assert abs(float(fast[1][1]) * 7.5 * (64 * 9) / fp16.u_max - 1) < 1e-6


@pytest.mark.parametrize("rule", ["reference", "paper"])
def test_adaptive_training_is_identical_with_and_without_the_kernels(rule):
    """Same weights, same per-layer scales after a few emulated-FP16 steps: the kernels change speed only."""
    from omegaconf import OmegaConf

    from adaloss.models import build_model
    from adaloss.numerics.emulation import EmulatedAutocast
    from adaloss.scalers.adaptive import AdaptiveLossScaler

    def run() -> tuple[list[torch.Tensor], dict[str, float]]:
        torch.manual_seed(0)
        model = build_model(OmegaConf.create({"name": "resnet20", "depth": 20}), 10)
        scaler = AdaptiveLossScaler(update_every=2, init_scale=2.0**-10, rule=rule)
        model = scaler.attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(8, 3, 32, 32, generator=g)
            y = torch.randint(0, 10, (8,), generator=g)
            with EmulatedAutocast(FP16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()], scaler.layer_scales()

    fast_w, fast_s = run()
    with native.disabled():
        ref_w, ref_s = run()
    assert fast_s == ref_s and len(set(fast_s.values())) > 2  # betas other than 1 took part
    assert all(torch.equal(a, b) for a, b in zip(fast_w, ref_w, strict=True))


def test_no_compiler_means_torch_fallback(tmp_path):
    """Without a C compiler the package works: the kernels say why they are off, rounding stays exact."""
    code = (
        "import torch\n"
        "from adaloss.numerics import native, round_to_format, get_format\n"
        "assert not native.available(), native.status()\n"
        "print(native.status())\n"
        "x = torch.randn(5000) * 1e-6\n"
        "assert torch.equal(round_to_format(x, get_format('fp16')), x.half().float())\n"
    )
    env = {**os.environ, "PATH": str(tmp_path), "ADALOSS_CACHE": str(tmp_path / "cache"), "CC": ""}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "no C compiler" in res.stdout


def test_damaged_cache_entry_is_rebuilt(tmp_path):
    code = (
        "from adaloss.numerics import native\n"
        "assert native.available(), native.status()\n"
        "print(native.status())\n"
    )
    env = {**os.environ, "ADALOSS_CACHE": str(tmp_path)}
    first = _run(code, env)
    assert first.returncode == 0, first.stderr
    (lib,) = tmp_path.glob("adaloss_fast_*.so")
    lib.write_bytes(b"not a shared library")
    second = _run(code, env)
    assert second.returncode == 0, second.stderr
    assert lib.read_bytes()[:4] == b"\x7fELF"


def test_disabled_by_environment(tmp_path):
    code = "from adaloss.numerics import native\nprint(native.available(), native.status())\n"
    env = {**os.environ, "ADALOSS_NATIVE": "0"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("False disabled"), res.stdout + res.stderr


def test_cpu_allocator_tuning_applies_once_and_can_be_turned_off():
    """glibc's mallopt accepts the settings (Linux); ADALOSS_TUNE_MALLOC=0 leaves malloc alone."""
    code = (
        "from adaloss.utils.allocator import tune_cpu_allocator\n"
        "print(tune_cpu_allocator(), tune_cpu_allocator())\n"
    )
    on = _run(code, dict(os.environ))
    off = _run(code, {**os.environ, "ADALOSS_TUNE_MALLOC": "0"})
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    expected = "True True" if glibc else "False False"
    assert on.stdout.split() == expected.split()
    assert off.stdout.split() == ["False", "False"]
