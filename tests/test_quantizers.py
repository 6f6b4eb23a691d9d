"""Gradient quantizers (``precision.grad_scaling``): conformance with the published formulas, the emulation's
hook, telemetry, and short GPT runs under every recipe and scaler.

Sources of the expected values (each derived by hand in a comment at the test):

- TE current scaling: ``transformer_engine/common/recipe/__init__.py`` (``Float8CurrentScaling``, ``QParams``:
  ``power_2_scale``, ``amax_epsilon``) and ``compute_scale_from_amax`` in ``common/recipe/recipe_common.cuh``:
  ``amax < eps -> eps``; ``amax`` 0, Inf or NaN -> scale 1; ``scale = fp8_max / amax``; Inf -> FP32 max;
  power of two: the FP32 scale with its mantissa bits cleared.
- TE delayed scaling: ``DelayedScaling``'s docstring (``new_scaling_factor = (FP8_MAX / amax) / (2 ^
  margin)``, history 1024, ``max`` / ``most_recent``) and the kernel of ``common/recipe/delayed_scaling.cu``
  (the window is ``history[0]`` plus the previous ``len - 1`` steps; then ``history[i] <- history[i+1]``,
  the last slot gets the recorded amax, slot 0 is zeroed; a 0 or non-finite amax keeps the old scale).
- OCP Microscaling Formats (MX) v1.0, section 6.3: ``X = 2^(floor(log2(amax)) - emax_elem)`` with an E8M0
  scale (exponent -127..127, 0xFF = NaN), ``emax_elem`` = 8 for E4M3 and 15 for E5M2, 32 elements per block,
  elements ``x / X`` converted with saturation to the element format's max normal.
- Mishra et al. 2025 ("Recipes for Pre-training LLMs with MXFP8"): ``X = 2^ceil(log2(amax / fp8_max))``.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import DictConfig

from adaloss.errors import ConfigError
from adaloss.numerics.emulation import EmulatedAutocast, Probe
from adaloss.numerics.formats import get_format
from adaloss.numerics.quantizers import (
    CurrentScaling,
    DelayedScaling,
    GlobalScaling,
    GradQuantizer,
    GradSite,
    MXBlockScaling,
    current_scale,
    delayed_update,
    mx_exponents,
    quantize_grad,
    recipe_from_config,
)
from adaloss.precision import Precision
from adaloss.runner.engine import train
from adaloss.telemetry import COUNTERFACTUAL_RECIPES, STORAGE_KEYS, UnderflowMonitor

E4M3, E5M2 = get_format("fp8_e4m3"), get_format("fp8_e5m2")
F32_MAX = torch.finfo(torch.float32).max


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _quantize(recipe: Any, x: torch.Tensor, fmt=E4M3, key: str = "g", dim: int = -1) -> torch.Tensor:
    return quantize_grad(x, fmt, GradSite(GradQuantizer(recipe, fmt), key, dim))


# ---- tensor_current: TE Float8CurrentScaling / compute_scale_from_amax -------------------------------------


def test_current_scaling_scale_and_te_fallbacks() -> None:
    plain = CurrentScaling()
    # 448 / 3.5 = 128 exactly; 448 / 3 = 149.333... rounds once to the FP32 149.33332824707031 (bitwise below)
    assert current_scale(_t(3.5), 448.0, plain).item() == 128.0
    assert current_scale(_t(3.0), 448.0, plain).item() == 149.3333282470703
    # amax 0, Inf and NaN keep the scale 1 (TE returns 1.f before dividing)
    assert current_scale(_t(0.0, math.inf, math.nan), 448.0, plain).tolist() == [1.0, 1.0, 1.0]
    # an amax so small that 448 / amax overflows FP32 (2^-149 * 2^128 > 448) gets FP32's largest value
    tiny = _t(2.0**-149)
    assert current_scale(tiny, 448.0, plain).item() == F32_MAX
    # amax_epsilon: an amax below it counts as epsilon: 448 / 2^-4 = 7168
    assert current_scale(_t(1e-6), 448.0, CurrentScaling(amax_epsilon=2.0**-4)).item() == 7168.0


def test_current_scaling_power_of_two_floor() -> None:
    pow2 = CurrentScaling(power_2_scale=True)
    # 448 / 3 = 149.33 = 1.1667 * 2^7: clearing the mantissa bits leaves 2^7 = 128 (the largest element
    # lands at 3 * 128 = 384 <= 448); 448 / 3.5 = 128 is already a power of two; 57344 / 5 = 11468.8 =
    # 1.4 * 2^13 -> 8192; FP32 max = 1.99.. * 2^127 -> 2^127; the fallback 1 stays 1
    assert current_scale(_t(3.0, 3.5, 0.0), 448.0, pow2).tolist() == [128.0, 128.0, 1.0]
    assert current_scale(_t(5.0), 57344.0, pow2).item() == 8192.0
    assert current_scale(_t(2.0**-149), 448.0, pow2).item() == 2.0**127


def test_current_scaling_dequantizes_and_rescues_values_plain_fp8_flushes() -> None:
    # amax 3.5 -> scale 128. 0.3 * 128 = 38.4 lies in E4M3's binade [32, 64) (spacing 4): 40, and 40 / 128 =
    # 0.3125 flows on; 3.5 * 128 = 448 is E4M3's max: back to 3.5
    out = _quantize(CurrentScaling(), _t(3.5, 0.3, -1.0))
    assert out.tolist() == [3.5, 0.3125, -1.0]
    # 2^-12 is below half of E4M3's smallest subnormal (2^-9 / 2 = 2^-10): plain rounding flushes it, the
    # quantizer scales it to 448 * 2^-12 * 2^12 / ... i.e. amax 2^-12 -> scale 448 * 2^12, x * s = 448: kept
    g = _t(2.0**-12, -(2.0**-13))
    assert quantize_grad(g, E4M3).tolist() == [0.0, 0.0]
    assert _quantize(CurrentScaling(), g).tolist() == [2.0**-12, -(2.0**-13)]
    # an Inf element keeps the scale 1 for the tensor and stays Inf (the loss scalers see the overflow)
    out = _quantize(CurrentScaling(), _t(math.inf, 0.3, 2.0**-12))
    assert out[0].item() == math.inf and out[1].item() == pytest.approx(0.3125) and out[2].item() == 0.0


# ---- the scales are the formula rounded once (TE's __fdiv_rn(max_fp8, amax)) ----------------------------


def _rounded_once(numerator: float, amax: torch.Tensor) -> torch.Tensor:
    """``numerator / amax`` correctly rounded to float32, the reference for every FP8 scale.

    Divided in float64, then rounded to float32. The double rounding is innocuous: for a quotient of two
    values of precision p = 24 computed in a precision p' >= 2p + 2 = 50 (float64 has p' = 53), rounding to
    p' bits then to p bits gives the correctly rounded p-bit result (Figueroa, "When is double rounding
    innocuous?", 1995); the quotients here are normal in float64, and the final float32 rounding handles
    subnormals and overflow as IEEE does. :func:`test_the_reference_is_correctly_rounded` checks it with
    exact rational arithmetic. (``numerator / amax`` on a float32 tensor is not this: torch evaluates
    ``float / tensor`` as ``amax.reciprocal() * numerator``, two float32 roundings.)"""
    return (numerator / amax.double()).float()


def _random_amaxes(n: int = 10_000) -> torch.Tensor:
    """``n`` float32 amaxes log-uniform over 1e-8 .. 1e5, plus those whose E4M3 / E5M2 quotient is a power
    of two (``1.75 * 2^j``: ``fp8_max = 1.75 * 2^k`` for both formats)."""
    gen = torch.Generator().manual_seed(37)
    logs = torch.empty(n, dtype=torch.float64).uniform_(-8.0, 5.0, generator=gen)
    pow2_quotients = torch.tensor([1.75 * 2.0**j for j in range(-27, 17)], dtype=torch.float64)
    return torch.cat([10.0**logs, pow2_quotients]).float()


def test_the_reference_is_correctly_rounded() -> None:
    # exact rationals: the reference is at least as close to numerator / amax as its two float32 neighbours
    amax = _random_amaxes(2000)
    for fp8_max in (448.0, 57344.0):
        ref = _rounded_once(fp8_max, amax)
        down = torch.nextafter(ref, torch.zeros_like(ref))
        up = torch.nextafter(ref, torch.full_like(ref, math.inf))
        for a, r, lo, hi in zip(amax.tolist(), ref.tolist(), down.tolist(), up.tolist(), strict=True):
            exact = Fraction(fp8_max) / Fraction(a)
            err = abs(Fraction(r) - exact)
            assert err <= abs(Fraction(lo) - exact) and err <= abs(Fraction(hi) - exact)


def test_current_scale_golden_vectors_are_rounded_once() -> None:
    # 448 / 3 = 149.3333...: rounded once, 149.33332824707031 (reciprocal-then-multiply: 149.33334350585938)
    assert current_scale(_t(3.0), 448.0, CurrentScaling()).item() == 149.3333282470703
    # 3 * 149.33332824707031 = 447.99998 rounds to E4M3's 448, and 448 * fl(1 / scale) is 3 again (the
    # two-rounding scale gave 2.9999998)
    probe = Probe(E4M3)
    out = quantize_grad(_t(3.0), E4M3, GradSite(GradQuantizer(CurrentScaling(), E4M3), "g", -1), probe)
    assert out.tolist() == [3.0] and probe.scale_min.item() == 149.3333282470703
    # 6.5394811e-06 * 149.33332824707031 rounds in FP32 to 2^-10, half E4M3's smallest subnormal: a tie,
    # to even 0 (the two-rounding scale put the product just above the tie: 2^-9, stored as 1.3078961e-05)
    out = _quantize(CurrentScaling(), _t(3.0, 6.5394811e-06))
    assert out.tolist() == [3.0, 0.0]


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_current_scale_is_bitwise_the_formula_rounded_once(fmt) -> None:
    amax = _random_amaxes()
    ref = _rounded_once(fmt.u_max, amax)
    assert torch.equal(current_scale(amax, fmt.u_max, CurrentScaling()), ref)
    # power_2_scale starts from the rounded quotient: TE clears the mantissa bits of the FP32 scale
    _, exp = torch.frexp(ref)
    pow2 = torch.ldexp(torch.ones_like(ref), exp - 1)
    assert torch.equal(current_scale(amax, fmt.u_max, CurrentScaling(power_2_scale=True)), pow2)
    # through the quantizer: the scale it reports for a tensor of amax a is the same, bitwise
    for a, r in zip(amax[:: len(amax) // 50], ref[:: len(amax) // 50], strict=True):
        probe = Probe(fmt)
        quantize_grad(
            torch.stack([a, a / 3]), fmt, GradSite(GradQuantizer(CurrentScaling(), fmt), "g", -1), probe
        )
        assert probe.scale_min.item() == r.item()


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(("margin", "compute", "n"), [(0, "max", 10_000), (3, "most_recent", 1000)])
def test_delayed_scale_is_bitwise_the_formula_rounded_once(fmt, margin: int, compute: str, n: int) -> None:
    # every update's scale is (fp8_max / amax) / 2^margin, the chosen amax from a window of 3, rounded once
    # (about 0.15 ms per update: the margin case on fewer amaxes)
    recipe = DelayedScaling(history_len=3, margin=margin, amax_compute=compute)
    amaxes = _random_amaxes(n)
    history, scale, scales = torch.zeros(3), torch.ones(()), []
    for amax in amaxes:
        history, scale = delayed_update(history, scale, amax, fmt.u_max, recipe)
        scales.append(scale)
    window = amaxes.double().unfold(0, 3, 1).amax(dim=1)  # the max of each step and the 2 before it
    chosen = torch.cat([torch.stack([amaxes[0].double(), amaxes[:2].double().max()]), window])
    chosen = chosen if compute == "max" else amaxes.double()
    assert torch.equal(torch.stack(scales), ((fmt.u_max / chosen) / 2.0**margin).float())


def test_delayed_scale_golden_vectors_and_overflow_as_te() -> None:
    # the scale from the history's amax 3 is 149.33332824707031, and the next step stores [3, 6.5394811e-06]
    # as [3, 0] (the two-rounding scale gave [2.9999998, 1.3078961e-05])
    quantizer = GradQuantizer(DelayedScaling(history_len=4), E4M3)
    site = GradSite(quantizer, "g", -1)
    quantize_grad(_t(3.0), E4M3, site)
    assert quantizer.state_dict()["sites"]["g"]["scale"].item() == 149.3333282470703
    assert quantize_grad(_t(3.0, 6.5394811e-06), E4M3, site).tolist() == [3.0, 0.0]
    # TE's kernel divides fp8_max * 2^-margin by the amax: with amax 2^-120, 448 / amax = 1.75 * 2^128
    # overflows but 1.75 * 2^126 (margin 2) does not; a scale that does overflow is FP32's largest value
    # (the kernel's isinf check), not Inf
    one, h = torch.ones(()), torch.zeros(2)
    assert delayed_update(h, one, _t(2.0**-120), 448.0, DelayedScaling(margin=2))[1].item() == 1.75 * 2.0**126
    assert delayed_update(h, one, _t(2.0**-120), 448.0, DelayedScaling())[1].item() == F32_MAX
    assert delayed_update(h, one, _t(2.0**-149), 448.0, DelayedScaling(margin=3))[1].item() == F32_MAX


# ---- tensor_delayed: TE DelayedScaling and delayed_scaling.cu ----------------------------------------------


def _delayed_scales(recipe: DelayedScaling, amaxes: list[float], fmt=E4M3) -> list[float]:
    """The scale each step quantized with: step k sees a tensor whose amax is amaxes[k]."""
    quantizer, used = GradQuantizer(recipe, fmt), []
    for amax in amaxes:
        probe = Probe(fmt)
        quantize_grad(_t(amax, 0.0), fmt, GradSite(quantizer, "g", -1), probe)
        used.append(probe.scale_min.item())
    return used


def test_delayed_scaling_history_rollover_max_most_recent_and_margin() -> None:
    amaxes = [8.0, 2.0, 1.0, 0.5, 0.25, 0.25]
    # history_len 3, max: the first step uses the initial scale 1. After step 1 the window is {8}: 448/8 = 56;
    # after 2 {8, 2}: 56; after 3 {8, 2, 1}: 56; after 4 the 8 has left, {2, 1, 0.5}: 224; after 5 {1, 0.5,
    # 0.25}: 448
    assert _delayed_scales(DelayedScaling(history_len=3), amaxes) == [1.0, 56.0, 56.0, 56.0, 224.0, 448.0]
    # most_recent: 448 / the previous step's amax
    most_recent = DelayedScaling(history_len=3, amax_compute="most_recent")
    assert _delayed_scales(most_recent, amaxes) == [1.0, 56.0, 224.0, 448.0, 896.0, 1792.0]
    # margin 1 halves every computed scale (the initial 1 is not computed)
    assert _delayed_scales(DelayedScaling(history_len=3, margin=1), amaxes) == [1, 28, 28, 28, 112, 224]
    # a window of 1 holds only the step being recorded: the same scales as most_recent
    assert _delayed_scales(DelayedScaling(history_len=1), amaxes) == [1.0, 56.0, 224.0, 448.0, 896.0, 1792.0]
    # E5M2: 57344 / 8 = 7168
    assert _delayed_scales(DelayedScaling(), [8.0, 1.0], E5M2) == [1.0, 7168.0]
    # the default window is 1024 steps: the first amax still decides after 5 steps
    assert _delayed_scales(DelayedScaling(), amaxes)[1:] == [56.0] * 5


def test_delayed_scaling_keeps_the_scale_for_zero_and_non_finite_amax() -> None:
    # most_recent, len 2: 4 -> 112; 0 -> kept 112; Inf -> kept 112; NaN -> kept 112; then 2 -> 224
    recipe = DelayedScaling(history_len=2, amax_compute="most_recent")
    assert _delayed_scales(recipe, [4.0, 0.0, math.inf, math.nan, 2.0, 1.0]) == [1, 112, 112, 112, 112, 224]
    # max, len 2: an Inf stays in the window for 2 updates: 4 -> 112; Inf -> max{4, Inf} = Inf, kept 112;
    # 1 -> max{Inf, 1}, kept 112; 1 -> max{1, 1} = 1 -> 448
    assert _delayed_scales(DelayedScaling(history_len=2), [4.0, math.inf, 1.0, 1.0, 1.0]) == [
        1.0, 112.0, 112.0, 112.0, 448.0,
    ]  # fmt: skip


def test_delayed_scaling_saturates_under_a_stale_scale_and_lays_out_history_as_te() -> None:
    quantizer = GradQuantizer(DelayedScaling(history_len=3), E4M3)
    site = GradSite(quantizer, "g", -1)
    quantize_grad(_t(8.0), E4M3, site)  # scale 1 -> 56
    state = quantizer.state_dict()["sites"]["g"]
    # TE's layout after the update: slot 0 cleared, the recorded amax at the end
    assert state["amax_history"].tolist() == [0.0, 0.0, 8.0] and state["scale"].item() == 56.0
    probe = Probe(E4M3)
    # amax 16 under the stale scale 56: 16 * 56 = 896 > 448 saturates to 448, which is 8 after unscaling;
    # 1 * 56 = 56 is exact in E4M3 (1.75 * 2^5): back to 1
    out = quantize_grad(_t(16.0, 1.0), E4M3, site, probe)
    assert out.tolist() == [8.0, 1.0] and probe.saturated.item() == 1
    assert quantizer.state_dict()["sites"]["g"]["amax_history"].tolist() == [0.0, 8.0, 16.0]


def test_delayed_state_round_trips_through_state_dict() -> None:
    recipe = DelayedScaling(history_len=4)
    a, b = GradQuantizer(recipe, E4M3), GradQuantizer(recipe, E4M3)
    for amax in (8.0, 2.0):
        quantize_grad(_t(amax), E4M3, GradSite(a, "layer", -1))
    b.load_state_dict(a.state_dict())
    probes = [Probe(E4M3), Probe(E4M3)]
    for quantizer, probe in zip((a, b), probes, strict=True):
        quantize_grad(_t(1.0), E4M3, GradSite(quantizer, "layer", -1), probe)
    assert probes[0].scale_min.item() == probes[1].scale_min.item() == 56.0
    with pytest.raises(ConfigError, match="resume with the same precision.grad_scaling"):
        GradQuantizer(DelayedScaling(history_len=8), E4M3).load_state_dict(a.state_dict())


# ---- mx_block: OCP MX v1.0 section 6.3, Mishra et al. 2025 -------------------------------------------------


def test_mx_exponent_rules_by_hand() -> None:
    amax = _t(1.0, 1.9, 1.75, 448.0, 449.0, 2.0**-20)
    # floor (OCP): floor(log2 amax) - 8 for E4M3: 1 -> -8, 1.9 -> -8, 1.75 -> -8, 448 = 1.75 * 2^8 -> 0,
    # 449 -> 0, 2^-20 -> -28
    assert mx_exponents(amax, 448.0, "floor").tolist() == [-8, -8, -8, 0, 0, -28]
    # ceil: ceil(log2(amax / 448)); 1/448 = 2^-8.81 -> -8; 1.9/448 = 2^-7.88 -> -7; 1.75/448 = 2^-8 exactly
    # -> -8; 448/448 = 1 -> 0; 449/448 -> 1; 2^-20/448 = 2^-28.81 -> -28
    assert mx_exponents(amax, 448.0, "ceil").tolist() == [-8, -7, -8, 0, 1, -28]
    # E5M2 (emax_elem 15, fp8_max 57344 = 1.75 * 2^15): floor 1 -> -15; ceil 1/57344 = 2^-15.81 -> -15
    assert mx_exponents(_t(1.0), 57344.0, "floor").item() == -15
    assert mx_exponents(_t(1.0), 57344.0, "ceil").item() == -15
    # E8M0 clamps at -127 / 127: an all-zero block gets -127; a huge amax clamps at 127; Inf / NaN -> NaN
    edge = mx_exponents(_t(0.0, 2.0**-140, F32_MAX, math.inf, math.nan), 448.0, "floor").tolist()
    assert edge[:3] == [-127, -127, 127 - 8] and math.isnan(edge[3]) and math.isnan(edge[4])


def test_mx_rceil_equals_ceil_for_float32_amax() -> None:
    # rceil converts the FP32 quotient amax / fp8_max to E8M0 rounding up. With fp8_max = 1.75 * 2^k, an FP32
    # amax just above 1.75 * 2^j is 1.75 * 2^j * (1 + n * 2^-23 / 1.75), so the quotient is 2^(j-k) * (1 +
    # n * 0.571 * 2^-23): more than half an ulp of 1 (2^-24) above it, so it never rounds down onto the power
    # of two; just below, 1 - n * 0.571 * 2^-23 is more than half an ulp (2^-25) below 1 and never rounds up
    # onto it. So the FP32 quotient lands on the same side of every power of two as the exact one.
    torch.manual_seed(0)
    amax = torch.cat([torch.randn(4096).abs() * 10.0 ** torch.randint(-30, 30, (4096,)), _t(1.75, 448.0)])
    around = _t(448.0, 1.75 * 2.0**-20) * torch.tensor([1.0 - 2.0**-23, 1.0 + 2.0**-22]).unsqueeze(1)
    amax = torch.cat([amax, around.flatten()])
    for fp8_max in (448.0, 57344.0):
        assert torch.equal(mx_exponents(amax, fp8_max, "rceil"), mx_exponents(amax, fp8_max, "ceil"))


def test_mx_block_values_floor_saturates_ceil_does_not() -> None:
    x = torch.zeros(32)
    x[:3] = _t(1.9, 1.0, 0.3)
    # floor: e = -8, X = 2^-8: 1.9 * 256 = 486.4 > 448 saturates to 448 -> 1.75; 1 * 256 = 256 exact; 0.3 *
    # 256 = 76.8 in [64, 128) (spacing 8): 80 -> 0.3125
    assert _quantize(MXBlockScaling(), x)[:3].tolist() == [1.75, 1.0, 0.3125]
    # ceil: e = -7, X = 2^-7: 1.9 * 128 = 243.2 in [128, 256) (spacing 16): 240 -> 1.875; 1 -> 128 -> 1;
    # 0.3 * 128 = 38.4 -> 40 -> 0.3125
    assert _quantize(MXBlockScaling(rounding="ceil"), x)[:3].tolist() == [1.875, 1.0, 0.3125]
    probe = Probe(E4M3)
    quantize_grad(x, E4M3, GradSite(GradQuantizer(MXBlockScaling(), E4M3), "g", -1), probe)
    assert probe.saturated.item() == 1 and probe.scale_min.item() == probe.scale_max.item() == 256.0


def test_mx_block_edges_and_a_partial_last_block() -> None:
    # 72 elements along the last dimension: blocks [0, 32), [32, 64), [64, 72) + 24 zeros of padding
    x = torch.full((2, 72), 2.0**-12)
    x[:, 31] = 64.0  # the last element of block 0
    x[:, 64] = 3.0  # the partial block's amax
    out = _quantize(MXBlockScaling(), x)
    assert out.shape == x.shape
    # block 0: amax 64 -> e = 6 - 8 = -2, X = 1/4: 2^-12 * 4 = 2^-10 is half E4M3's smallest subnormal
    # 2^-9, a tie to even: 0 (flushed); 64 * 4 = 256 is exact
    assert out[0, :31].abs().sum().item() == 0.0 and out[0, 31].item() == 64.0
    # block 1 (index 32 on): amax 2^-12 -> e = -12 - 8 = -20: 2^-12 * 2^20 = 256, kept exactly
    assert out[0, 32:64].tolist() == [2.0**-12] * 32
    # the partial block: amax 3 (the padding's zeros change nothing) -> e = 1 - 8 = -7: 3 * 128 = 384 exact;
    # 2^-12 * 128 = 2^-5 exact in E4M3: the 8 elements come back as they were, and as if quantized alone
    assert out[0, 64:].tolist() == [3.0] + [2.0**-12] * 7
    assert torch.equal(out[:, 64:], _quantize(MXBlockScaling(), x[:, 64:]))
    # an Inf in block 1 gives that block the NaN scale (E8M0 0xFF); the others are untouched
    x[1, 40] = math.inf
    out = _quantize(MXBlockScaling(), x)
    assert out[1, 32:64].isnan().all() and torch.equal(out[1, :32], out[0, :32])
    assert torch.equal(out[1, 64:], out[0, 64:])


def test_mx_blocks_run_along_the_chosen_dimension() -> None:
    # a (batch, channels, h, w) gradient, blocks along channels (dim 1): channel 0 holds 64, channels 32..63
    # 2^-12: the 2^-12 at channel 1 shares channel 0's block and flushes (as above), the ones at 32.. survive
    x = torch.full((1, 64, 2, 2), 2.0**-12)
    x[:, 0] = 64.0
    out = _quantize(MXBlockScaling(), x, dim=1)
    assert out[:, 1:32].abs().sum().item() == 0.0 and out[:, 32:].eq(2.0**-12).all()
    # along the last dimension instead, each block holds one channel's 2 values: nothing flushes
    assert _quantize(MXBlockScaling(), x, dim=-1).eq(x).all()


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_mx_block_views_match_blocks_moved_last_and_scaled_elementwise(fmt, rounding: str) -> None:
    # mx_block reduces each block in place (x viewed as (before, n / 32, 32, after), no copy) and rounds
    # in place; the reference moves the block dimension last, cuts it into blocks of 32 (or one shorter
    # block), and applies the tensor recipes' saturating round with each block's scale. Same values, NaN
    # where the reference has NaN, same saturation count: for conv-like (dim 1, 64 and 16 channels) and
    # linear-like (last dim 96) gradients, with Inf/NaN elements and tiny and huge magnitudes.
    torch.manual_seed(0)
    quantizer = GradQuantizer(MXBlockScaling(rounding=rounding), fmt)
    for shape, dim in (((4, 64, 3, 3), 1), ((4, 16, 5, 5), 1), ((6, 96), -1), ((3, 64, 2), 1)):
        x = torch.randn(shape) * torch.exp2(torch.randint(-30, 30, shape).float())
        x.view(-1)[::97] = math.inf
        x.view(-1)[5::131] = math.nan
        out, stats = quantizer.quantize(x, "g", dim, stats=True)
        moved = x.movedim(dim, -1)
        block = min(moved.shape[-1], 32)
        blocks = moved.reshape(*moved.shape[:-1], moved.shape[-1] // block, block)
        scale = torch.exp2(-mx_exponents(blocks.abs().amax(-1, keepdim=True), fmt.u_max, rounding))
        ref, saturated = quantizer._saturating_round(blocks, scale, True)
        ref = ref.reshape(moved.shape).movedim(-1, dim)
        assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num())
        assert stats.saturated.item() == saturated.item()
        assert (saturated.item() > 0) == (rounding == "floor")  # floor saturates somewhere, ceil never


def test_emulation_sites_block_along_channels_for_convolutions_and_last_dim_for_linear() -> None:
    quantizer = GradQuantizer(MXBlockScaling(), E4M3)
    emu = EmulatedAutocast(get_format("fp16"), grad_fmt=E4M3, grad_quantizer=quantizer)
    assert emu.grad_site(torch.zeros(2, 3, 4, 4)).dim == 1 and emu.grad_site(torch.zeros(2, 3, 4)).dim == -1
    sites: list[GradSite] = []
    original = GradQuantizer.quantize

    def spy(self, x, key, dim, stats=False):
        sites.append((tuple(x.shape), dim))
        return original(self, x, key, dim, stats)

    conv, linear = torch.nn.Conv2d(2, 4, 3), torch.nn.Linear(4, 5)
    GradQuantizer.quantize = spy
    try:
        with EmulatedAutocast(get_format("fp16"), grad_fmt=E4M3, grad_quantizer=quantizer):
            y = linear(conv(torch.randn(1, 2, 5, 5)).mean((2, 3)))
        y.sum().backward()
    finally:
        GradQuantizer.quantize = original
    assert ((1, 4, 3, 3), 1) in sites and ((1, 5), -1) in sites  # the conv's and the linear's outputs


# ---- through the emulation, with every loss scaler ---------------------------------------------------------


@pytest.mark.parametrize("grad_scaling", ["none", "tensor_current", "tensor_delayed", "mx_block"])
def test_the_stored_gradient_is_the_dequantized_one(grad_scaling: str) -> None:
    # y = x W^T with x = 1 (2 rows), loss = 2^-12 * sum(y): the gradient of y is 2^-12 and W's is 2 * 2^-12 =
    # 2^-11, both below half of E4M3's smallest subnormal (2^-10): plain E4M3 flushes them. Current and MX
    # scaling store them exactly (amax 2^-12 -> scale 448 * 2^12, resp. X = 2^(-12-8), and 2^-12 * 2^20 is
    # exact). Delayed scaling starts every site at scale 1: step 1 flushes y's gradient (and W's site sees
    # amax 0); step 2 keeps y's gradient (scale from amax 2^-12) but W's site still has scale 1 and flushes
    # 2^-11, recording it; from step 3 on both sites keep their gradients.
    precision = Precision("fp8_e4m3", "cpu", grad_scaling=grad_scaling)
    linear = torch.nn.Linear(4, 3, bias=False)
    grads = []
    for _ in range(3):
        linear.zero_grad()
        with precision.autocast():
            y = linear(torch.ones(2, 4))
        (y * 2.0**-12).sum().backward()
        grads.append(linear.weight.grad.unique().tolist())
    expected = {"none": [[0.0]] * 3, "tensor_delayed": [[0.0], [0.0], [2.0**-11]]}
    assert grads == expected.get(grad_scaling, [[2.0**-11]] * 3)


# ---- config ------------------------------------------------------------------------------------------------


def test_recipe_from_config_names_options_and_one_line_errors() -> None:
    assert recipe_from_config("none") == GlobalScaling()
    assert recipe_from_config({"name": "mx_block", "rounding": "ceil"}) == MXBlockScaling(rounding="ceil")
    assert recipe_from_config({"name": "tensor_delayed", "history_len": 16}) == DelayedScaling(history_len=16)
    assert DelayedScaling() == DelayedScaling(margin=0, history_len=1024, amax_compute="max")  # TE's defaults
    bad = [
        ("mx", "unknown precision.grad_scaling 'mx'"),
        (
            {"name": "mx_block", "round": "ceil"},
            "has no field(s) round; its fields are: rounding, block_size",
        ),
        ({"name": "mx_block", "rounding": "up"}, "rounding must be one of floor, ceil, rceil"),
        ({"name": "tensor_delayed", "history_len": 0}, "history_len must be an integer >= 1"),
        ({"name": "tensor_delayed", "amax_compute": "mean"}, "amax_compute must be one of max, most_recent"),
        ({"name": "tensor_current", "power_2_scale": "yes"}, "power_2_scale must be true or false"),
        ({"name": "tensor_current", "amax_epsilon": -1}, "amax_epsilon must be a finite number >= 0"),
    ]
    for value, message in bad:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
            recipe_from_config(value)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="needs an FP8 precision"):
        Precision("fp16", "cpu", grad_scaling="mx_block")


# ---- telemetry ---------------------------------------------------------------------------------------------


def test_monitor_reports_saturation_scale_range_and_sqnr() -> None:
    monitor = UnderflowMonitor(every=1, fmt=E4M3)
    # plain E4M3: 1 stays, 2^-12 flushes (underflow), 1000 saturates at 448 (torch's E4M3 cast saturates)
    g = _t(1.0, 2.0**-12, 1000.0, 0.0)
    quantize_grad(g, E4M3, None, monitor.probe("plain"))
    # current scaling on 0.3 and 3.5: scale 128 (see above), 0.3 -> 0.3125; nothing saturates
    quantize_grad(
        _t(0.3, 3.5), E4M3, GradSite(GradQuantizer(CurrentScaling(), E4M3), "s", -1), monitor.probe("cur")
    )
    rates = monitor.underflow_rates()
    storage = monitor.last_storage
    assert set(storage) == set(STORAGE_KEYS)
    assert rates == {"plain": 0.25, "cur": 0.0}
    assert storage["saturation_rate"] == {"plain": 0.25, "cur": 0.0}
    assert storage["grad_scale_min"] == storage["grad_scale_max"] == {"plain": 1.0, "cur": 128.0}
    # SQNR = 10 log10(sum g^2 / sum (g - q)^2): plain: (1 + 2^-24 + 10^6) / (2^-24 + 552^2);
    # current: (0.09 + 12.25) / 0.0125^2
    plain = 10 * math.log10((1 + 2.0**-24 + 1e6) / (2.0**-24 + 552.0**2))
    assert storage["sqnr_db"]["plain"] == pytest.approx(plain, rel=1e-6)
    assert storage["sqnr_db"]["cur"] == pytest.approx(10 * math.log10(12.34 / 0.0125**2), rel=1e-5)


# ---- runs: the GPT on the standard library corpus, FP8 E4M3 gradients --------------------------------------

GPT_FP8 = (
    "model=gpt",
    "dataset=pystdlib",
    "precision=fp8_e4m3",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "dataset.block_size=32",
    "dataset.val_windows=32",
    "trainer.batch_size=8",
    "trainer.eval_batch_size=32",
    "trainer.max_steps=3",
    "trainer.eval_every=3",
    "telemetry.every=2",
)
GPT_LAYERS = {"h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.mlp.c_fc", "h.0.mlp.c_proj", "lm_head"}


@pytest.mark.parametrize("scaler", ["dynamic", "adaptive"])
@pytest.mark.parametrize("grad_scaling", ["none", "tensor_current", "tensor_delayed", "mx_block"])
def test_gpt_fp8_trains_and_logs_storage_telemetry(
    make_full_cfg: Callable[..., DictConfig], tmp_path: Path, grad_scaling: str, scaler: str
) -> None:
    """``python train.py model=gpt dataset=pystdlib precision=fp8_e4m3 precision.grad_scaling=<recipe>
    scaler=<scaler>``, shrunk to 3 iterations."""
    metrics = train(make_full_cfg(*GPT_FP8, f"precision.grad_scaling={grad_scaling}", f"scaler={scaler}"))
    assert (
        math.isfinite(metrics["train_loss"])
        and metrics["config"]["precision"]["grad_scaling"] == grad_scaling
    )
    lines = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 3]
    for record in lines:
        for key in STORAGE_KEYS:
            assert GPT_LAYERS <= set(record[key]), (key, record[key])
        assert all(0.0 <= v <= 1.0 for v in record["saturation_rate"].values())
        assert all(v > 0 for v in record["sqnr_db"].values())  # the stored gradient is closer than its error
        low, high = record["grad_scale_min"], record["grad_scale_max"]
        assert all(low[k] <= high[k] for k in low)
    last = lines[-1]
    scales = {last["grad_scale_min"][k] for k in GPT_LAYERS} | {last["grad_scale_max"][k] for k in GPT_LAYERS}
    # scale 1 at the GEMM outputs without a recipe; the recipe's scales otherwise, under the adaptive
    # scaler too (its GradRound stores the GEMM outputs' gradients through quantize_grad)
    if grad_scaling == "none":
        assert scales == {1.0}
    else:
        assert scales != {1.0}
    for key in STORAGE_KEYS:
        assert metrics[key] == pytest.approx(last[key])


@pytest.mark.parametrize("scaler", ["none", "fixed"])
@pytest.mark.parametrize("grad_scaling", ["tensor_current", "tensor_delayed", "mx_block"])
def test_resnet_fp8_e5m2_composes_with_the_other_scalers(
    make_cfg: Callable[..., DictConfig], tmp_path: Path, grad_scaling: str, scaler: str
) -> None:
    metrics = train(
        make_cfg("precision=fp8_e5m2", f"precision.grad_scaling={grad_scaling}", f"scaler={scaler}")
    )
    assert math.isfinite(metrics["train_loss"]) and metrics["skipped_steps"] == 0
    last = json.loads((tmp_path / "telemetry.jsonl").read_text().splitlines()[-1])
    assert (
        set(last["grad_scale_max"]) == set(last["underflow_rate"])
        and max(last["grad_scale_max"].values()) > 1
    )


def test_wandb_table_and_summaries_carry_the_storage_telemetry(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    from wandb_files import offline_runs

    train(
        make_cfg("logger=wandb", "precision=fp8_e5m2", "precision.grad_scaling=mx_block", "telemetry.every=1")
    )
    (run,) = offline_runs(tmp_path)
    last = json.loads((tmp_path / "telemetry.jsonl").read_text().splitlines()[-1])
    logged = run.history[last["step"]]
    rows = {r["layer"]: r for r in run.table(logged["underflow/table"])}
    for key in STORAGE_KEYS:
        assert {layer: rows[layer][key] for layer in rows} == pytest.approx(last[key])
    saturation, sqnr = last["saturation_rate"].values(), last["sqnr_db"].values()
    assert logged["saturation/max"] == pytest.approx(max(saturation))
    assert logged["sqnr_db/min"] == pytest.approx(min(sqnr))
    assert logged["sqnr_db/mean"] == pytest.approx(sum(sqnr) / len(sqnr))
    assert logged["grad_scale/max"] == pytest.approx(max(last["grad_scale_max"].values()))


@pytest.mark.parametrize("grad_scaling", ["tensor_current", "tensor_delayed", "mx_block"])
def test_no_host_sync_in_the_backward_pass(grad_scaling: str) -> None:
    # amaxes, scales and histories stay tensors: the ATen-level trap of tests/sync_trap.py sees no value read
    # on the host and no tensor built from host data in a backward pass, with telemetry's probes recording too
    from sync_trap import no_host_sync

    precision = Precision("fp8_e4m3", "cpu", grad_scaling=grad_scaling)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 40, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(40 * 4, 5)
    )
    precision.prepare(model)
    monitor = UnderflowMonitor(every=1, fmt=E4M3)
    for step in range(2):
        with precision.autocast(monitor=monitor if step else None):
            loss = model(torch.randn(2, 3, 4, 4)).square().mean()
        with no_host_sync():
            loss.backward()
    assert set(monitor.underflow_rates()) == {"0", "3"} and set(monitor.last_storage["sqnr_db"]) == {"0", "3"}


def test_counterfactual_mode_measures_every_recipe_on_the_same_gradients(
    make_full_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    metrics = train(
        make_full_cfg(
            *GPT_FP8,
            "precision.grad_scaling=tensor_current",
            "scaler=dynamic",
            "telemetry.counterfactual=true",
        )
    )
    last = json.loads((tmp_path / "telemetry.jsonl").read_text().splitlines()[-1])
    counterfactual = last["counterfactual"]
    assert set(counterfactual) == set(COUNTERFACTUAL_RECIPES)
    for recipe, quantities in counterfactual.items():
        assert set(quantities) == {"underflow_rate", *STORAGE_KEYS}
        assert all(set(values) == set(last["underflow_rate"]) for values in quantities.values()), recipe
    # the run's own recipe, applied again to the same gradients, gives the run's own numbers
    for key in ("saturation_rate", "grad_scale_min", "grad_scale_max", "sqnr_db"):
        assert counterfactual["tensor_current"][key] == pytest.approx(last[key])
    assert counterfactual["tensor_current"]["underflow_rate"] == pytest.approx(last["underflow_rate"])
    # the global scale's tensors keep the scale 1; tensor_current's put the amax at E4M3's 448
    assert set(counterfactual["none"]["grad_scale_max"].values()) == {1.0}
    assert set(counterfactual["tensor_current"]["grad_scale_max"].values()) != {1.0}
    assert metrics["counterfactual"] == counterfactual  # the same numbers (JSON keeps floats exact)


def test_counterfactual_probe_matches_hand_values() -> None:
    # g = [1, 2^-12, 1000] in E4M3: none flushes 2^-12 and saturates 1000 (as above); tensor_current scales by
    # 448 / 1000 = 0.448: 2^-12 * 0.448 = 1.09e-4 is below 2^-10 and flushes too, nothing saturates; mx_block
    # floor: amax 1000 = 1.95 * 2^9 -> e = 9 - 8 = 1, 1000 / 2 = 500 > 448 saturates; ceil: e = ceil(log2(
    # 1000 / 448)) = 2, 1000 / 4 = 250, nothing saturates
    monitor = UnderflowMonitor(every=1, fmt=E4M3, counterfactual=True)
    quantize_grad(_t(1.0, 2.0**-12, 1000.0, 0.0), E4M3, None, monitor.probe("fc"))
    monitor.underflow_rates()
    counterfactual = monitor.last_storage["counterfactual"]
    assert {r: q["underflow_rate"]["fc"] for r, q in counterfactual.items()} == {
        "none": 0.25, "tensor_current": 0.25, "tensor_current_pow2": 0.25, "mx_block_floor": 0.25,
        "mx_block_ceil": 0.25,
    }  # fmt: skip
    assert {r: q["saturation_rate"]["fc"] for r, q in counterfactual.items()} == {
        "none": 0.25, "tensor_current": 0.0, "tensor_current_pow2": 0.0, "mx_block_floor": 0.25,
        "mx_block_ceil": 0.0,
    }  # fmt: skip
    # pow2 floor of 0.448 = 0.897 * 2^-1 -> 2^-2; mx scales are 1/X: 2^-1 (floor), 2^-2 (ceil)
    assert {r: q["grad_scale_max"]["fc"] for r, q in counterfactual.items()} == pytest.approx(
        {"none": 1.0, "tensor_current": 0.448, "tensor_current_pow2": 0.25, "mx_block_floor": 0.5,
         "mx_block_ceil": 0.25}
    )  # fmt: skip
    with pytest.raises(ConfigError, match="telemetry.counterfactual must be true or false"):
        UnderflowMonitor(counterfactual="yes")


@pytest.mark.slow  # a whole CLI run (about 15 s); the storage telemetry's parts are tested above
def test_the_issue_command_trains_on_the_cpu_and_writes_the_storage_telemetry(tmp_path: Path) -> None:
    """The issue's command as a user types it (one child process), shrunk by overrides; a recipe with
    options is a mapping on the command line."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    command = [
        sys.executable, "train.py", "model=gpt", "dataset=pystdlib", "precision=fp8_e4m3",
        "precision.grad_scaling=mx_block", "scaler=adaptive", *GPT_FP8[3:], "device=cpu", "logger=none",
        "trainer.progress_bar=false", f"hydra.run.dir={tmp_path / 'mx'}",
    ]  # fmt: skip
    # this checkout's package first, whichever one the virtual environment has installed
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in (tmp_path / "mx" / "telemetry.jsonl").read_text().splitlines()]
    assert lines and all(GPT_LAYERS <= set(r[key]) for r in lines for key in STORAGE_KEYS)
    # a recipe with options: {name: ..., field: value}
    options = ["precision.grad_scaling={name:mx_block,rounding:ceil}", "scaler=dynamic"]
    command = [*command[:5], *options, *command[7:-1], f"hydra.run.dir={tmp_path / 'ceil'}"]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = json.loads((tmp_path / "ceil" / "metrics.json").read_text())
    assert written["config"]["precision"]["grad_scaling"] == {"name": "mx_block", "rounding": "ceil"}
    assert max(written["grad_scale_max"].values()) > 1.0


def test_sqnr_of_extreme_sums() -> None:
    from adaloss.telemetry import sqnr_db

    # 10 log10(100 / 1) = 20 dB; nothing changed: Inf; a finite gradient stored as Inf (plain FP16 or E5M2
    # overflow) makes the noise Inf: -Inf; no signal: -Inf; NaN in: NaN
    assert sqnr_db(100.0, 1.0) == pytest.approx(20.0) and sqnr_db(1.0, 0.0) == math.inf
    assert sqnr_db(1.0, math.inf) == -math.inf and sqnr_db(0.0, 1.0) == -math.inf
    assert math.isnan(sqnr_db(math.nan, 1.0)) and sqnr_db(1e-300, 1e300) == -math.inf
    # a probe on an overflowing E5M2 gradient: 1e5 > 57344 rounds to Inf; squares in float64
    probe = Probe(E5M2)
    probe.record(_t(1e5, 1.0))
    assert probe.noise.item() == math.inf and probe.saturated.item() == 1
    probe = Probe(get_format("fp16"))
    probe.record(_t(3e19, 1.0))  # (3e19)^2 overflows float32, not float64
    assert math.isfinite(probe.signal.item())


# ---- reduce_amax under data parallelism: 2 gloo processes on the CPU -------------------------------------


def _amax_worker(rank: int, port: int, out_dir: str) -> None:
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # rank 0's gradient has amax 2, rank 1's amax 8: reduced, both scale by 448 / 8 = 56
        x = torch.full((4,), 2.0 if rank == 0 else 8.0)
        found = {}
        for reduce in (False, True):
            current = GradQuantizer(CurrentScaling(reduce_amax=reduce), E4M3)
            _, stats = current.quantize(x, "g", -1, stats=True)
            delayed = GradQuantizer(DelayedScaling(history_len=4, reduce_amax=reduce), E4M3)
            delayed.quantize(x, "g", -1)  # step 1 records the amax; the scale of step 2 comes from it
            nan = torch.full((4,), math.nan if rank == 1 else 2.0)  # a NaN amax on rank 1 only
            _, nan_stats = GradQuantizer(CurrentScaling(reduce_amax=reduce), E4M3).quantize(
                nan, "g", -1, True
            )
            found[reduce] = {
                "current": stats.scale_max.item(),
                "delayed": delayed.state_dict()["sites"]["g"]["scale"].item(),
                "history": delayed.state_dict()["sites"]["g"]["amax_history"].tolist(),
                "nan": nan_stats.scale_max.item(),
            }
        torch.save(found, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_reduce_amax_gives_every_rank_the_max_amax_over_ranks(tmp_path: Path) -> None:
    # TE's amax reduction (DelayedScaling.reduce_amax, the amax reduction group of current scaling): under
    # data parallelism the amax of a tensor is the maximum over the ranks (an all-reduce MAX), so every rank
    # quantizes with the same scale; without it each rank scales with its own amax.
    import socket

    import torch.multiprocessing as mp

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_amax_worker, args=(port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    own = [r[False] for r in ranks]
    assert [o["current"] for o in own] == [224.0, 56.0] and [o["delayed"] for o in own] == [224.0, 56.0]
    reduced = [r[True] for r in ranks]
    assert [r["current"] for r in reduced] == [56.0, 56.0] and [r["delayed"] for r in reduced] == [56.0, 56.0]
    # the history holds the reduced amax (TE's layout: recorded amax in the last slot, slot 0 cleared)
    assert reduced[0]["history"] == reduced[1]["history"] == [0.0, 0.0, 0.0, 8.0]
    # a NaN amax on one rank: reduced, both ranks take TE's fallback (scale 1); alone, rank 0 scales by 224
    assert [o["nan"] for o in own] == [224.0, 1.0] and [r["nan"] for r in reduced] == [1.0, 1.0]
    # outside data parallelism the option changes nothing
    x = torch.full((4,), 2.0)
    assert torch.equal(_quantize(CurrentScaling(reduce_amax=True), x), _quantize(CurrentScaling(), x))


@pytest.mark.parametrize("grad_scaling", ["tensor_current", "mx_block"])
def test_the_adaptive_scaler_stores_its_gradients_through_the_quantizer(grad_scaling: str) -> None:
    """Under a quantizer, gradients far below E4M3's smallest value (2**-9) survive: the adaptive scaler's
    beta-scaled gradient and its weight gradients are stored through the recipe, as the plain emulation
    stores them, not rounded again without the scale (which flushed them to zero)."""
    from adaloss.scalers import AdaptiveLossScaler

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    x = torch.randn(16, 32)
    (plain(x).square().sum() * 2.0**-40).backward()
    expected = [p.grad.clone() for p in plain.parameters()]

    precision = Precision("fp8_e4m3", "cpu", grad_scaling=grad_scaling)
    scaler = AdaptiveLossScaler(init_scale=1.0)
    model = precision.prepare(scaler.attach(copy.deepcopy(plain)))
    model.zero_grad(set_to_none=True)
    with precision.autocast():
        loss = model(x).square().sum() * 2.0**-40
    scaler.scale(loss).backward()
    scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
    for got, want in zip((p.grad for p in model.parameters()), expected, strict=True):
        got, want = got.flatten() * 2.0**40, want.flatten() * 2.0**40  # cosine_similarity's eps is 1e-8
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.95
