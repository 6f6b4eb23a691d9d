"""FP4 (NVFP4, MXFP4): bitwise conformance with the published formulas, stochastic rounding, the random
Hadamard transform, FP4 GEMM operands in both passes, layer selection, telemetry and the runner's options.

The references here are written independently of :mod:`adaloss.numerics.fp4`: every step of each recipe in
exact rational arithmetic (``fractions.Fraction``), rounded with :func:`_round` to the step's format (FP32,
E4M3, E2M1) exactly as the NVFP4 paper's appendix and OCP MX v1.0 write them.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from adaloss.errors import ConfigError
from adaloss.numerics.fp4 import (
    E2M1_VALUES,
    e2m1_codes,
    hadamard_transform,
    nvfp4_global_scale,
    quantize_fp4,
    random_hadamard,
    round_e2m1,
)
from adaloss.numerics.fp4_gemm import FP4Gemm, FP4Linear, FP4Recipe, fp4_recipe_from_config

F32_MAX = Fraction(torch.finfo(torch.float32).max)


def _round(v: Fraction, p: int, emin: int, vmax: Fraction) -> Fraction:
    """``v`` rounded to nearest, ties to even, in a binary format of ``p`` significant bits whose smallest
    normal exponent is ``emin`` (evenly spaced subnormals below), saturating at ``vmax``."""
    if v == 0:
        return Fraction(0)
    m = abs(v)
    e = m.numerator.bit_length() - m.denominator.bit_length()
    e += 1 if Fraction(2) ** (e + 1) <= m else 0
    e -= 1 if Fraction(2) ** e > m else 0  # now 2^e <= m < 2^(e+1)
    ulp = Fraction(2) ** (max(e, emin) - (p - 1))
    n, rest = divmod(m, ulp)
    n = int(n) + (1 if rest / ulp > Fraction(1, 2) or (rest / ulp == Fraction(1, 2) and n % 2) else 0)
    return (1 if v > 0 else -1) * min(n * ulp, vmax)


def f32(v: Fraction) -> Fraction:
    return _round(v, 24, -126, F32_MAX)


def e4m3(v: Fraction) -> Fraction:
    return _round(v, 4, -6, Fraction(448))


def e2m1(v: Fraction) -> Fraction:
    return _round(v, 2, 0, Fraction(6))


def _blocks(rows: int, cols: int, block: int, tile: int):
    """The (row, column) indices of each block (zero padding left out: it changes no amax)."""
    for r0 in range(0, rows, tile):
        for c0 in range(0, cols, block):
            yield [(r, c) for r in range(r0, min(r0 + tile, rows)) for c in range(c0, min(c0 + block, cols))]


def ref_nvfp4(x: list[list[float]], tile: int = 1):
    """NVFP4, the paper's appendix: ``(dequantized, e2m1 values, block scales, s_enc)`` as Fractions."""
    X = [[Fraction(v) for v in row] for row in x]
    amax = max((abs(v) for row in X for v in row), default=Fraction(0))
    s_enc = f32(Fraction(2688) / amax) if amax > 0 else Fraction(1)
    s_dec = f32(1 / s_enc)
    deq = [[None] * len(row) for row in X]
    q = [[None] * len(row) for row in X]
    scales = []
    for idx in _blocks(len(X), len(X[0]), 16, tile):
        amax_b = max(abs(X[r][c]) for r, c in idx)
        scale = e4m3(min(f32(f32(amax_b / 6) * s_enc), Fraction(448)))
        product = f32(scale * s_dec)
        enc = f32(1 / product) if product > 0 else F32_MAX
        scales.append(scale)
        for r, c in idx:
            q[r][c] = e2m1(f32(X[r][c] * enc))
            deq[r][c] = f32(f32(q[r][c] * scale) * s_dec)
    return deq, q, scales, s_enc


def ref_mxfp4(x: list[list[float]], rounding: str):
    """MXFP4, OCP MX v1.0 (``floor``) or ``amax / 6`` in FP32 rounded up to a power of two (``rceil``)."""
    X = [[Fraction(v) for v in row] for row in x]
    deq = [[None] * len(row) for row in X]
    scales = []
    for idx in _blocks(len(X), len(X[0]), 32, 1):
        amax_b = max(abs(X[r][c]) for r, c in idx)
        target = amax_b if rounding == "floor" else f32(amax_b / 6)
        e = -127
        if target > 0:
            e = target.numerator.bit_length() - target.denominator.bit_length() + 1
            while Fraction(2) ** (e - 1) >= target:  # smallest e with 2^e >= target
                e -= 1
            while Fraction(2) ** e < target:
                e += 1
            if rounding == "floor":  # floor(log2 amax) - emax_elem (2 for E2M1)
                e = (e if Fraction(2) ** e == target else e - 1) - 2
        e = max(-127, min(127, e))
        scales.append(Fraction(2) ** e)
        for r, c in idx:
            deq[r][c] = e2m1(X[r][c] / Fraction(2) ** e) * Fraction(2) ** e
    return deq, scales


def _golden(rows: int = 6, cols: int = 37) -> torch.Tensor:
    """Magnitudes log-uniform over 1e-8..1e5 with random signs; a row with an all-zero block beside a
    non-zero one and exact (signed) zeros; a row at the tensor's maximum; ``cols`` not a multiple of 16."""
    gen = torch.Generator().manual_seed(4)
    mag = 10.0 ** torch.empty(rows, cols, dtype=torch.float64).uniform_(-8.0, 5.0, generator=gen)
    x = (mag * (torch.randint(0, 2, (rows, cols), generator=gen) * 2 - 1)).float()
    x[1, :16] = 0.0
    x[1, 16:20] = torch.tensor([-0.0, 0.0, 3.0, -1e-8])
    x[2, :] = -x.abs().max()
    return x


def _as_tensor(values) -> torch.Tensor:
    return torch.tensor([[float(v) for v in row] for row in values], dtype=torch.float32)


@pytest.mark.parametrize("tile", [1, 16], ids=["1x16", "16x16"])
def test_nvfp4_is_bitwise_the_published_formula(tile: int) -> None:
    x = _golden(21 if tile == 16 else 6)  # 21 rows: the 16x16 tiles' rows padded too
    got = quantize_fp4(x, "nvfp4", tile=tile)
    deq, q, scales, s_enc = ref_nvfp4(x.tolist(), tile)
    assert got.global_scale.item() == float(s_enc)
    assert torch.equal(got.scales.flatten(), torch.tensor([float(s) for s in scales]))
    assert torch.equal(got.dequantized, _as_tensor(deq))
    assert torch.equal(got.values[: x.shape[0], : x.shape[1]], _as_tensor(q))
    # codes: sign bit and the magnitude's index; the signed zeros of the input stay signed
    codes = e2m1_codes(got.values[: x.shape[0], : x.shape[1]])
    negative = torch.signbit(x).tolist()
    expected = [
        [8 * negative[i][j] + E2M1_VALUES.index(abs(float(v))) for j, v in enumerate(row)]
        for i, row in enumerate(q)
    ]
    assert codes.tolist() == expected
    assert torch.equal(torch.signbit(got.dequantized), torch.signbit(x))


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mxfp4_is_bitwise_the_published_formula(rounding: str) -> None:
    x = _golden()
    got = quantize_fp4(x, "mxfp4", rounding)
    deq, scales = ref_mxfp4(x.tolist(), rounding)
    assert torch.equal(got.scales.flatten(), torch.tensor([float(s) for s in scales]))
    assert torch.equal(got.dequantized, _as_tensor(deq))
    assert torch.equal(torch.signbit(got.dequantized), torch.signbit(x))


def test_fp4_golden_vectors_at_the_edges() -> None:
    # E2M1: nearest-even ties (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4),
    # saturation at 6, Inf -> 6, NaN kept, signed zero
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, -1e9, math.inf, -0.1, math.nan])
    out = round_e2m1(x)
    assert out[:10].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -6.0, 6.0]
    assert out[10].item() == 0.0 and torch.signbit(out[10]) and math.isnan(out[11].item())
    # 448 * 6 / 3 = 896 exactly; an all-zero tensor keeps s_enc = 1 (TE); Inf and NaN amaxes too; an
    # amax so tiny that 2688 / amax overflows gets FP32's largest value
    amax = torch.tensor([3.0, 0.0, math.inf, math.nan, 2.0**-149])
    assert nvfp4_global_scale(amax).tolist() == [896.0, 1.0, 1.0, 1.0, float(F32_MAX)]
    zeros = quantize_fp4(torch.zeros(2, 20), "nvfp4")
    assert zeros.dequantized.abs().sum().item() == 0 and zeros.scales.abs().sum().item() == 0
    # the block of the tensor's amax has the E4M3 scale 448; values at the maximum come back within an FP32
    # ulp, not exactly: s_enc = 2688 / 6 = 448, s_dec = fl(1 / 448), and 6 * 448 * fl(1 / 448) rounds to
    # 6.0000005 (the formula's own rounding, which the reference reproduces)
    top = quantize_fp4(torch.tensor([[6.0, -6.0, 1.0] + [0.0] * 13]), "nvfp4")
    assert top.scales[0, 0].item() == 448.0 and top.global_scale.item() == 448.0
    assert top.dequantized[0, :3].tolist() == [float(v) for v in ref_nvfp4([[6.0, -6.0, 1.0]])[0][0]]
    assert top.dequantized[0, 0].item() == 6.000000476837158
    assert quantize_fp4(torch.tensor([[6.0, -3.0]]), "mxfp4").dequantized.tolist() == [[6.0, -3.0]]
    # Inf and NaN elements stay non-finite (NaN: the loss scaler sees them); MXFP4's NaN scale makes the
    # block's finite elements NaN too
    inf = quantize_fp4(torch.tensor([[math.inf, 1.0, 2.0]]), "mxfp4").dequantized[0]
    assert inf.isnan().all()
    # NVFP4 with an Inf: s_enc falls back to 1, the Inf's block scale is capped at 448 (1 / 448 -> 0 in
    # E2M1), the next block's scale is e4m3(2 / 6) = 0.34375, so 2 comes back as 6 * 0.34375 = 2.0625
    nv = quantize_fp4(torch.tensor([[math.inf, 1.0] + [0.0] * 14 + [2.0]]), "nvfp4")
    assert math.isnan(nv.dequantized[0, 0]) and nv.dequantized[0, [1, 16]].tolist() == [0.0, 2.0625]
    assert nv.scales.tolist() == [[448.0, 0.34375]]


def test_stochastic_rounding_neighbours_unbiased_and_seeded() -> None:
    # 10^6 draws for each value: always one of the two neighbours, the mean within 5 standard errors
    values = torch.tensor([0.1, 0.3, 0.8, 1.2, 1.9, 2.6, 3.3, 4.5, 5.9, -2.2])
    n = 1_000_000
    gen = torch.Generator().manual_seed(0)
    x = values.repeat_interleave(n).reshape(len(values), n)
    out = round_e2m1(x, gen)
    grid = torch.tensor(E2M1_VALUES)
    for v, row in zip(values.tolist(), out, strict=True):
        m = abs(v)
        lo, hi = grid[grid <= m].max().item(), grid[grid >= m].min().item()
        assert set(row.abs().unique().tolist()) <= {lo, hi}
        p = (m - lo) / (hi - lo)
        se = (hi - lo) * math.sqrt(p * (1 - p) / n)  # the standard error of the mean of n draws
        assert abs(row.double().mean().item() - v) < 5 * se
    # reproducible from the seed; a generator state restored continues the same stream
    a = round_e2m1(x[:, :1000], torch.Generator().manual_seed(3))
    assert torch.equal(a, round_e2m1(x[:, :1000], torch.Generator().manual_seed(3)))
    gemm = FP4Gemm(FP4Recipe(stochastic_rounding=True, seed=5))
    g = torch.randn(8, 64)
    gemm.quantize(g, gradient=True)
    state = gemm.state_dict()
    expected = gemm.quantize(g, gradient=True).dequantized
    resumed = FP4Gemm(FP4Recipe(stochastic_rounding=True, seed=5))
    resumed.load_state_dict(state)
    assert torch.equal(resumed.quantize(g, gradient=True).dequantized, expected)
    # nearest for the non-gradient operands even with SR on
    assert torch.equal(gemm.quantize(g).dequantized, quantize_fp4(g, "nvfp4").dequantized)


def test_random_hadamard_is_orthogonal_and_keeps_the_wgrad_gemm() -> None:
    t = random_hadamard(16, seed=0)
    assert torch.equal(t @ t.t(), torch.eye(16)) and torch.equal(t.abs(), torch.full((16, 16), 0.25))
    assert not torch.equal(t, random_hadamard(16, seed=1))  # the random signs
    gen = torch.Generator().manual_seed(1)
    dy, x = torch.randn(37, 24, generator=gen), torch.randn(37, 40, generator=gen)  # M = 37 tokens
    plain = dy.t() @ x
    transformed = hadamard_transform(dy.t(), t) @ hadamard_transform(x.t(), t).t()
    torch.testing.assert_close(transformed, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_fp4_linear_quantizes_each_gemm_along_its_reduction_dim(recipe: str) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 7, 48, generator=gen, requires_grad=True)  # M = 35 tokens, K = 48
    w = torch.randn(40, 48, generator=gen, requires_grad=True)  # N = 40
    b = torch.randn(40, generator=gen, requires_grad=True)
    dy = torch.randn(5, 7, 40, generator=gen)
    gemm = FP4Gemm(FP4Recipe(name=recipe))
    FP4Linear.apply(x, w, b, gemm, None).backward(dy)

    def q(t: torch.Tensor, tile: int = 1) -> torch.Tensor:
        return quantize_fp4(t, recipe, tile=tile).dequantized

    x2, dy2 = x.detach().reshape(35, 48), dy.reshape(35, 40)
    wf = q(w.detach(), 16) if recipe == "nvfp4" else q(w.detach())  # along K
    wd = q(w.detach(), 16) if recipe == "nvfp4" else q(w.detach().t()).t()  # along N
    y = FP4Linear.apply(x, w, b, gemm, None)
    assert torch.equal(y.detach().reshape(35, 40), q(x2) @ wf.t() + b.detach())
    assert torch.equal(x.grad.reshape(35, 48), q(dy2) @ wd)  # dy along N
    assert torch.equal(w.grad, q(dy2.t()) @ q(x2.t()).t())  # both along M
    assert torch.equal(b.grad, dy2.sum(0))
    # Hadamard: the wgrad operands transformed first; gradient-only: x and W unquantized
    gemm = FP4Gemm(FP4Recipe(name=recipe, hadamard=True, operands="grad"))
    w.grad = None
    FP4Linear.apply(x, w, b, gemm, None).backward(dy)
    t = random_hadamard(16)
    assert torch.equal(w.grad, q(hadamard_transform(dy2.t(), t)) @ hadamard_transform(x2.t(), t).t())


def test_layer_selection_keeps_head_embeddings_and_edge_blocks() -> None:
    names = [f"h.{i}.{part}" for i in range(4) for part in ("attn.c_attn", "attn.c_proj", "mlp.c_fc")]
    names.append("lm_head")
    gemm = FP4Gemm(FP4Recipe())
    gemm.bind(names)
    assert sorted(gemm.layers) == sorted(n for n in names if n.startswith(("h.1.", "h.2.")))
    assert not gemm.applies("lm_head") and not gemm.applies(None)
    gemm = FP4Gemm(FP4Recipe(keep=("c_fc",), keep_first=0, keep_last=2))
    gemm.bind(names)
    # keep replaces the default patterns: the head is FP4 now
    expected = [n for n in names if n.startswith(("h.0.", "h.1.")) and "c_fc" not in n] + ["lm_head"]
    assert sorted(gemm.layers) == sorted(expected)
    assert "lm_head" in FP4Gemm(FP4Recipe(keep=(), keep_first=0, keep_last=0)).layers_of(names)


def test_fp4_options_errors_are_one_clear_line() -> None:
    from adaloss.precision import Precision

    with pytest.raises(ConfigError, match="FP4 option: use it with precision=nvfp4"):
        Precision("fp16", "cpu", hadamard=True)
    with pytest.raises(ConfigError, match="precision.rounding must be one of floor, rceil"):
        fp4_recipe_from_config("mxfp4", {"rounding": "ceil"})
    with pytest.raises(ConfigError, match="precision.stochastic_rounding must be true or false"):
        fp4_recipe_from_config("nvfp4", {"stochastic_rounding": "yes"})
    with pytest.raises(ConfigError, match="no autocast"):
        Precision("nvfp4", "cpu", backend="autocast")
    with pytest.raises(ValueError, match="error: quantize_fp4 takes a 2-D matrix"):
        quantize_fp4(torch.zeros(2, 2, 2))


def test_nvfp4_global_scale_is_bitwise_the_formula_rounded_once() -> None:
    gen = torch.Generator().manual_seed(37)
    amax = (10.0 ** torch.empty(3000, dtype=torch.float64).uniform_(-8.0, 5.0, generator=gen)).float()
    expected = torch.tensor([float(f32(Fraction(2688) / Fraction(a))) for a in amax.tolist()])
    assert torch.equal(nvfp4_global_scale(amax), expected)


def _tiny_gpt_step(precision, monitor=None) -> dict[str, torch.Tensor]:
    from adaloss.runner.models.gpt import GPT

    torch.manual_seed(0)
    model = precision.prepare(GPT(vocab_size=40, block_size=16, n_layer=4, n_head=2, n_embd=32))
    idx = torch.randint(0, 40, (4, 16), generator=torch.Generator().manual_seed(1))
    with precision.autocast(monitor):
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 40).float(), idx.reshape(-1))
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_nvfp4_precision_trains_fp4_layers_and_records_block_telemetry() -> None:
    from adaloss.precision import Precision
    from adaloss.telemetry import FP4_KEYS, UnderflowMonitor

    bf16 = _tiny_gpt_step(Precision("bf16", "cpu"))
    precision = Precision("nvfp4", "cpu", stochastic_rounding=True, hadamard=True)
    monitor = UnderflowMonitor(every=1, fmt="bf16")
    fp4 = _tiny_gpt_step(precision, monitor)
    monitor.underflow_rates()
    fp4_layers = sorted(precision.fp4.layers)
    assert fp4_layers == sorted(
        f"h.{i}.{p}" for i in (1, 2) for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    # the FP4 layers' weight gradients differ from BF16's; the kept layers' (h.0's input side) are BF16's
    assert not torch.equal(fp4["h.1.mlp.c_fc.weight"], bf16["h.1.mlp.c_fc.weight"])
    storage = monitor.last_storage
    for key in FP4_KEYS:
        assert sorted(storage[key]) == fp4_layers
    ratio = storage["fp4_grad_to_noise"]["h.1.mlp.c_fc"]
    assert 1.0 < ratio < 100.0  # FP4's noise on the weight gradient: a few per cent to tens of per cent
    assert 0.0 <= storage["fp4_block_clamped_share"]["h.1.mlp.c_fc"] <= 1.0
    assert storage["fp4_block_scale_spread_log2"]["h.1.mlp.c_fc"] > 0
    assert storage["sqnr_db"]["h.1.mlp.c_fc"] < 25.0  # the FP4-stored output gradient (BF16 gives ~50 dB)
    # the checkpointed generator continues the stochastic stream
    state = precision.state_dict()
    assert set(state["fp4"]) == {"fp4_recipe", "generator"}
    again = Precision("nvfp4", "cpu", stochastic_rounding=True, hadamard=True)
    again.load_state_dict(state)
    assert torch.equal(again.fp4.generator.get_state(), precision.fp4.generator.get_state())


def test_nvfp4_under_the_adaptive_scaler_runs_its_gemms_in_fp4() -> None:
    # the adaptive scaler replaces each linear layer by its own GEMM node (ScaledGEMM): FP4 runs there too
    from adaloss.precision import Precision
    from adaloss.runner.models.gpt import GPT
    from adaloss.runner.utils.targets import build_scaler
    from adaloss.telemetry import UnderflowMonitor

    torch.manual_seed(0)
    scaler = build_scaler({"name": "adaptive"}, None)
    model = GPT(vocab_size=40, block_size=16, n_layer=4, n_head=2, n_embd=32)
    precision = Precision("nvfp4", "cpu", stochastic_rounding=True)
    model = precision.prepare(scaler.attach(model) or model)
    idx = torch.randint(0, 40, (4, 16), generator=torch.Generator().manual_seed(1))
    monitor = UnderflowMonitor(every=1, fmt="bf16")
    with precision.autocast(monitor):
        loss = torch.nn.functional.cross_entropy(model(idx).reshape(-1, 40).float(), idx.reshape(-1))
    scaler.scale(loss).backward()
    monitor.underflow_rates()
    assert sorted(monitor.last_storage["fp4_grad_to_noise"]) == sorted(precision.fp4.layers)
    assert (
        monitor.last_storage["sqnr_db"]["h.1.mlp.c_fc"]
        < 25.0
        < monitor.last_storage["sqnr_db"]["h.0.mlp.c_fc"]
    )


def test_torchao_emulation_agrees_on_mxfp4_and_differs_on_nvfp4_where_documented() -> None:
    # docs/fp4.md, "torchao": MXFP4 bitwise equal; NVFP4 block scales differ only where the recipe's scale
    # is below E4M3's smallest normal (torchao clamps it to 2^-6), and dequantized values by FP32 ulps
    # (torchao keeps the decode scale amax / 2688, the recipe 1 / fl(2688 / amax))
    pytest.importorskip("torchao.prototype.mx_formats")
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_dtype, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    gen = torch.Generator().manual_seed(0)
    mag = 10.0 ** torch.empty(64, 512, dtype=torch.float64).uniform_(-8.0, 5.0, generator=gen)
    x = (mag * (torch.randint(0, 2, (64, 512), generator=gen) * 2 - 1)).float()
    for mode, rounding in ((ScaleCalculationMode.FLOOR, "floor"), (ScaleCalculationMode.RCEIL, "rceil")):
        scale, data = to_mx(x, torch.float4_e2m1fn_x2, 32, mode)
        theirs = to_dtype(data, scale, torch.float4_e2m1fn_x2, 32, torch.float32)
        assert torch.equal(theirs, quantize_fp4(x, "mxfp4", rounding).dequantized)
    ours = quantize_fp4(x, "nvfp4")
    theirs = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().max()))
    their_scales = theirs.scale.float().reshape(ours.scales.shape)
    differ = their_scales != ours.scales
    assert differ.any() and (ours.scales[differ] < 2.0**-6).all() and (their_scales[differ] == 2.0**-6).all()
    same = ~differ.repeat_interleave(16, 1)
    torch.testing.assert_close(
        theirs.dequantize(torch.float32)[same], ours.dequantized[same], rtol=2.5e-7, atol=0
    )


_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _e2m1_sweep() -> torch.Tensor:
    """Every multiple of 1/64 in [-6, 6], 14 to a 16-element block whose other two elements are +-6, so every
    block's amax is 6 and its scale is the tensor's."""
    t = torch.arange(-384, 385, dtype=torch.float32) / 64
    blocks = -(-t.numel() // 14)
    vals = torch.zeros(blocks, 16)
    vals[:, :14] = torch.cat([t, t.new_zeros(blocks * 14 - t.numel())]).view(blocks, 14)
    vals[:, 14], vals[:, 15] = 6.0, -6.0
    return vals.reshape(1, -1)


def test_nvfp4_against_torchao_differs_by_a_grid_step_only_at_midpoints() -> None:
    # docs/fp4.md, "torchao": on the E2M1 sweep at 100 tensor scales, where the block scales agree, values
    # differ by a whole grid step only at midpoints of the grid, and otherwise by at most 2 FP32 ulps. At
    # the tensor scale whose encode multiplier is exactly 1 (amax 6), adaloss's values are the
    # round-to-nearest-even ones, and torchao's fall a step below at the midpoints whose even neighbour is
    # the upper one.
    pytest.importorskip("torchao.prototype.mx_formats")
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    midpoints = (_E2M1_GRID[1:] + _E2M1_GRID[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    units = [1.0] + (10.0 ** torch.empty(99, dtype=torch.float64).uniform_(-6, 6, generator=gen)).tolist()
    steps, largest = [], 0.0
    for unit in units:
        x = (_e2m1_sweep().double() * unit).float()
        ours = quantize_fp4(x, "nvfp4")
        theirs = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().max()))
        same = (theirs.scale.float().reshape(ours.scales.shape) == ours.scales).repeat_interleave(16, 1)
        o, d = ours.dequantized[same].double(), theirs.dequantize(torch.float32)[same].double()
        rel = (o - d).abs() / o.abs().clamp_min(1e-38)
        step = rel > 1e-5
        largest = max(largest, rel[~step].max().item())
        scaled = (x[same].double() / unit)[step]  # where they differ, the element in units of the sweep
        assert ((scaled.abs().unsqueeze(-1) - midpoints).abs().min(-1).values < 1e-4).all()
        steps.append(int(step.sum()))
        if unit == 1.0:
            exact = x.double().flatten()
            grid_ix = (exact.abs().unsqueeze(-1) - _E2M1_GRID).abs()
            nearest = grid_ix == grid_ix.min(-1, keepdim=True).values
            even = nearest & (torch.arange(8) % 2 == 0)
            code = torch.where(even.any(-1), even.int().argmax(-1), nearest.int().argmax(-1))
            nearest_even = exact.sign() * _E2M1_GRID[code]  # the decode scale is 1 to within an FP32 ulp
            torch.testing.assert_close(ours.dequantized.double().flatten(), nearest_even, rtol=1e-6, atol=0)
            assert sorted(scaled.tolist()) == [-3.5, -1.75, -0.75, 0.75, 1.75, 3.5]
    assert sum(steps) > 0 and largest <= 2.4e-7


def test_mxfp4_rceil_against_torchao_differs_only_just_above_a_power_of_two() -> None:
    # docs/fp4.md, "torchao": rceil rounds amax / 6 (FP32) up to a power of two; torchao's log2 keeps the
    # power of two itself when amax / 6 lies a few ulps above it. Blocks swept over +-40 ulps around 6 * 2^k.
    pytest.importorskip("torchao.prototype.mx_formats")
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_dtype, to_mx

    bits = torch.tensor([6.0 * 2.0**k for k in range(-20, 21)]).view(torch.int32)
    amax = (bits[:, None] + torch.arange(-40, 41, dtype=torch.int32)).flatten().view(torch.float32)
    x = (torch.linspace(-1, 1, 32) * amax[:, None]).reshape(-1, 32 * 81)
    scale, data = to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.RCEIL)
    theirs = to_dtype(data, scale, torch.float4_e2m1fn_x2, 32, torch.float32)
    ours = quantize_fp4(x, "mxfp4", "rceil")
    differ = (theirs != ours.dequantized).view(-1, 32).any(1)
    wanted = amax / 6  # FP32, as the rule computes it; rceil's scale is the next power of two at or above it
    assert torch.equal(ours.scales.flatten(), torch.exp2(torch.ceil(torch.log2(wanted.double()))).float())
    above = wanted.double() / torch.exp2(torch.floor(torch.log2(wanted.double()))) - 1
    assert differ.sum() > 0 and (above[differ] > 0).all() and (above[differ] < 8 * 2.0**-23).all()


def test_fp4_lab_cells_cross_formats_rounding_hadamard_and_scalers() -> None:
    from adaloss.lab.fp8.fp4 import FP4_MODELS, FP4_SMOKE_CELLS, fp4_cells

    assert FP4_MODELS == ("gpt", "resnet20")
    cells = fp4_cells()
    names = [c.name for c in cells]
    assert len(names) == len(set(names)) == 1 + 2 * 3 + 2 * 3 * 2 * 2
    assert set(FP4_SMOKE_CELLS) <= set(names)
    sr_rht = next(c for c in cells if c.name == "MXFP4/dynamic/sr/rht").overrides
    assert {"precision=mxfp4", "scaler=dynamic", "precision.stochastic_rounding=true"} <= set(sr_rht)
    assert {"precision.hadamard=true", "precision.keep_first=0", "precision.keep_last=0"} <= set(sr_rht)


@pytest.mark.slow
def test_fp4_lab_smoke_runs_and_tabulates(tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, str(root / "scripts" / "fp4_lab.py"), "--smoke", "--out", str(tmp_path),
         "--runs-dir", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=900, check=True,
    ).stdout  # fmt: skip
    table = (tmp_path / "fp4_lab.md").read_text()
    assert "| NVFP4/adaptive/nearest/plain | 2 |" in table and table.strip() in out
    # one table per model: the GPT's, then ResNet-20's (its FP4 cells are its convolutions)
    gpt, resnet = table.split("## ResNet-20, digits", 1)
    assert "## tiny GPT" in gpt and "| MXFP4/dynamic/sr/rht | 2 |" in gpt
    assert "| MXFP4/dynamic/sr/rht | 2 |" in resnet and "test accuracy" in resnet


@pytest.mark.parametrize("model", ["gpt", "resnet20"])
def test_the_fp4_docs_page_shows_each_models_committed_table(model: str) -> None:
    from pathlib import Path

    from adaloss.lab.fp8.cells import settings_digest
    from adaloss.lab.fp8.fp4 import fp4_cells, fp4_table
    from adaloss.lab.fp8.runs import read_rows

    root = Path(__file__).resolve().parents[1]
    rows = read_rows(root / "results" / "fp4" / f"runs_{model}.jsonl", settings_digest(model, False))
    marker = "table" if model == "gpt" else f"{model} table"
    page = (root / "docs" / "fp4.md").read_text(encoding="utf-8")
    region = page.split(f"<!-- fp4-lab: {marker} -->\n", 1)[1].split(f"<!-- end fp4-lab: {marker} -->", 1)[0]
    assert region == fp4_table(rows, model, fp4_cells()) + "\n", (
        f"docs/fp4.md's {model} table is stale: paste it from results/fp4/fp4_lab.md "
        "(python scripts/fp4_lab.py --report-only)"
    )
    heading = "## tiny GPT" if model == "gpt" else "## ResNet-20"
    assert heading in (root / "results" / "fp4" / "fp4_lab.md").read_text(encoding="utf-8")


def test_train_records_fp4_block_telemetry_in_metrics_and_telemetry_log(make_full_cfg, tmp_path) -> None:
    # the runner's command, shrunk: precision=nvfp4 with SR and Hadamard under the adaptive scaler; W&B
    # (offline) gets the same per-layer values in its table, and their extremes as scalars
    import json

    from adaloss.runner.engine import train
    from adaloss.runner.logging.wandb_logger import FP4_COLUMNS
    from adaloss.telemetry import FP4_KEYS
    from wandb_files import offline_runs

    gpt = ("model=gpt", "dataset=pystdlib", "model.n_layer=3", "model.n_head=2", "model.n_embd=32")
    gpt += ("dataset.block_size=32", "dataset.val_windows=16", "trainer.batch_size=4", "trainer.max_steps=2")
    fp4 = ("precision=nvfp4", "precision.stochastic_rounding=true", "precision.hadamard=true")
    run = (*gpt, *fp4, "scaler=adaptive", "trainer.eval_every=2", "telemetry.every=1", "logger=wandb")
    metrics = train(make_full_cfg(*run))
    assert not metrics["diverged"] and math.isfinite(metrics["val_loss"])
    fp4_layers = {f"h.1.{p}" for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    for key in ("fp4_block_clamped_share", "fp4_block_subnormal_share", "fp4_block_scale_spread_log2"):
        assert set(metrics[key]) == fp4_layers
    assert all(v > math.sqrt(3) for v in metrics["fp4_grad_to_noise"].values())
    lines = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(set(line["fp4_grad_to_noise"]) == fp4_layers for line in lines)
    assert FP4_COLUMNS == FP4_KEYS
    (wandb_run,) = offline_runs(tmp_path)
    logged = wandb_run.history[lines[-1]["step"]]
    rows = {r["layer"]: r for r in wandb_run.table(logged["underflow/table"])}
    for key in FP4_KEYS:
        assert {layer: rows[layer][key] for layer in fp4_layers} == pytest.approx(lines[-1][key])
    assert logged["fp4/grad_to_noise_min"] == pytest.approx(min(lines[-1]["fp4_grad_to_noise"].values()))
    assert logged["fp4/block_subnormal_share_max"] == pytest.approx(
        max(lines[-1]["fp4_block_subnormal_share"].values())
    )


def test_a_resumed_nvfp4_run_continues_the_stochastic_rounding_stream(make_full_cfg, tmp_path) -> None:
    # the checkpoint holds the SR generator's state: resumed at step 2, the run ends bitwise on the weights of
    # the uninterrupted one (a fresh generator would draw other roundings from step 3 on)
    from adaloss.runner.engine import train
    from adaloss.runner.engine.checkpoint import load_checkpoint
    from test_checkpoint import _assert_bitwise_equal, _weights

    run = ("model=gpt", "dataset=pystdlib", "model.n_layer=3", "model.n_head=2", "model.n_embd=32")
    run += ("dataset.block_size=32", "dataset.val_windows=16", "trainer.batch_size=4", "trainer.max_steps=4")
    run += ("trainer.checkpoint_every=2", "trainer.eval_every=4", "trainer.save_final=true", "scaler=dynamic")
    run += ("precision=nvfp4", "precision.stochastic_rounding=true", "precision.hadamard=true")
    train(make_full_cfg(*run))
    first = _weights(tmp_path / "model.pt")
    assert "generator" in load_checkpoint(tmp_path / "checkpoints" / "step_2.pt")["grad_quantizer"]["fp4"]
    (tmp_path / "model.pt").unlink()
    (tmp_path / "metrics.json").unlink()
    train(make_full_cfg(*run, f"resume={tmp_path / 'checkpoints' / 'step_2.pt'}"))
    _assert_bitwise_equal(first, _weights(tmp_path / "model.pt"))
