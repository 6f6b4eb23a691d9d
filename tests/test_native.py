"""The native FP16 rounding kernel: bit-identical to torch's casts, and a clean fallback when it cannot be
used."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

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
    assert native.round_f16(x) is None
    out = round_to_format(x, FP16)
    ref = x.detach().to(torch.float16).to(x.dtype)
    if x.requires_grad:
        assert out.grad_fn is not None
    out = out.detach()
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num())


def test_disabled_context_uses_torch():
    x = _random_wide(10_000)
    with native.disabled():
        assert native.round_f16(x) is None
    assert native.round_f16(x) is not None


RULE_CASES = {
    "paper": dict(name="paper"),
    "paper-below-one": dict(name="paper", allow_below_one=True),
    "reference-16-1024": dict(name="reference", scale_upper_bound=16.0, accum_upper_bound=1024.0),
    "reference-128-4096": dict(name="reference", scale_upper_bound=128.0, accum_upper_bound=4096.0),
    "reference-unbounded": dict(name="reference"),
}


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
