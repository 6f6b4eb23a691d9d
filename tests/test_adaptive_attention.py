"""The adaptive scaler on attention: every weight-bearing GEMM gets a point, gradients stay exact, products
get a beta of their own, telemetry names attention's products, no host sync, clear errors.

Models: a small torchvision ViT and Swin, ``nn.TransformerEncoder`` (batch first and not, with padding and
causal masks), ``nn.Transformer`` (encoder-decoder: cross-attention), ``nn.MultiheadAttention`` calls of
every supported kind, and a GPT-style decoder (:mod:`adaloss.lab.attention_betas`' ``TinyGPT``: causal
``F.scaled_dot_product_attention``, a fused QKV ``nn.Linear``, the token embedding tied to the output
projection by ``F.linear``), also with nanoGPT's tying (an ``nn.Linear`` head sharing the embedding's
weight).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision
from omegaconf import OmegaConf
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from adaloss.adaptive import AdaptiveTransformError
from adaloss.adaptive import ops as adaptive_ops
from adaloss.adaptive.ops import AttentionOperands
from adaloss.lab.attention_betas.measure import underflow
from adaloss.lab.attention_betas.model import SIZES, TinyGPT, corpus, sample_batch
from adaloss.precision import Precision
from adaloss.runner.utils.targets import build_scaler
from adaloss.scalers.adaptive import AdaptiveLossScaler
from adaloss.telemetry import UnderflowMonitor
from conftest import load_script

# ----------------------------------------------------------------------------------------------- models


class TiedHeadGPT(TinyGPT):
    """nanoGPT's tying: an ``nn.Linear`` head whose weight is the token embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(16, 32, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class Encoder(nn.Module):
    """A linear input layer, a 2-layer ``nn.TransformerEncoder``, a linear head on the mean."""

    def __init__(self, batch_first: bool = True, norm_first: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.inp = nn.Linear(8, 16)
        layer = nn.TransformerEncoderLayer(
            16, 2, 32, dropout=dropout, batch_first=batch_first, norm_first=norm_first
        )
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.head(self.enc(h).mean(1 if self.batch_first else 0))


def _padding(batch: int = 2, length: int = 5, padded: int = 2) -> torch.Tensor:
    """A boolean key padding mask: the last ``padded`` positions of sample 0 are padding."""
    pad = torch.zeros(batch, length, dtype=torch.bool)
    pad[0, length - padded :] = True
    return pad


class PaddedEncoder(Encoder):
    """Batch first, pre-norm, a boolean key padding mask."""

    def __init__(self) -> None:
        super().__init__(batch_first=True, norm_first=True)
        self.register_buffer("pad", _padding())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.inp(x), src_key_padding_mask=self.pad).mean(1))


class CausalEncoder(Encoder):
    """Sequence first, a float causal mask given without ``is_causal`` (detected at run time)."""

    def __init__(self) -> None:
        super().__init__(batch_first=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).transpose(0, 1)
        mask = nn.Transformer.generate_square_subsequent_mask(h.shape[0], dtype=h.dtype)
        return self.head(self.enc(h, mask=mask).mean(0))


class MHAVariants(nn.Module):
    """``nn.MultiheadAttention`` called every supported way: cross-attention with its own key/value sizes
    (``kdim``/``vdim``: separate projection weights), key and value shared (slices of the packed weight),
    query, key and value all different, and self-attention with ``need_weights=True`` (the default),
    boolean ``attn_mask`` and ``key_padding_mask``, per-head weights used by the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mem = nn.Linear(8, 12)
        self.cross = nn.MultiheadAttention(16, 2, kdim=12, vdim=12, batch_first=True)
        self.shared_kv = nn.MultiheadAttention(16, 4)
        self.three = nn.MultiheadAttention(16, 2, batch_first=True, bias=False)
        self.self_attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 10)
        self.register_buffer("causal", torch.ones(5, 5, dtype=torch.bool).triu(1))
        self.register_buffer("pad", _padding(padded=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, m = self.inp(x), self.mem(x)
        h = h + self.cross(h, m, m, need_weights=False)[0]
        hs = h.transpose(0, 1)
        h = h + self.shared_kv(hs, hs * 0.5, hs * 0.5, need_weights=False)[0].transpose(0, 1)
        h = h + self.three(h, h * 2.0, h * 0.25, need_weights=False)[0]
        out, weights = self.self_attn(
            h, h, h, attn_mask=self.causal, key_padding_mask=self.pad, average_attn_weights=False
        )
        return self.head((h + out).mean(1)) + weights.sum((1, 2, 3)).unsqueeze(1)


class Seq2Seq(nn.Module):
    """``nn.Transformer``: encoder, decoder with a causal target mask and cross-attention on the memory."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.transformer = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        mask = nn.Transformer.generate_square_subsequent_mask(h.shape[1], dtype=h.dtype)
        return self.head(self.transformer(h, h.flip(1), tgt_mask=mask).mean(1))


def _vit() -> nn.Module:
    model = torchvision.models.VisionTransformer(16, 8, 2, 2, 16, 32, num_classes=10)
    nn.init.normal_(model.heads.head.weight, std=0.1)  # torchvision zeroes it: no gradient would pass
    return model


def _swin(depths: tuple[int, ...] = (1, 1)) -> nn.Module:
    return torchvision.models.SwinTransformer(
        [2, 2], 8, list(depths), [2, 2], [2, 2], num_classes=10, stochastic_depth_prob=0.0
    )


def _swin_v2() -> nn.Module:
    """Swin V2: cosine attention (``logit_scale``), a position-bias MLP with ``ReLU(inplace=True)``, a qkv
    bias cloned inside the wrapped function."""
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformerBlockV2

    return torchvision.models.SwinTransformer(
        [2, 2],
        8,
        [2, 1],
        [2, 2],
        [2, 2],
        num_classes=10,
        stochastic_depth_prob=0.0,
        block=SwinTransformerBlockV2,
        downsample_layer=PatchMergingV2,
    )


class InPlace(nn.Module):
    """Ops that write into a GEMM's output: ``ReLU(inplace=True)`` after a conv, ``+=`` on a linear
    layer's output (on a 3-D input) with a value that has two consumers, ``relu_()`` on another."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.relu = nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True)
        self.fc, self.fc2, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.relu(self.conv(x)).flatten(2).transpose(1, 2)
        u = self.fc(t)
        u += t
        return self.out(self.fc2(u).relu_().mean(1))


class Functional(nn.Module):
    """GEMMs called as functions with parameters: ``F.conv2d`` with ``padding="same"`` and groups,
    ``F.conv_transpose2d`` with stride, ``x @ W``, ``x @ W.T`` and ``torch.mm`` on slices of one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_w = nn.Parameter(torch.randn(6, 3, 3, 3) * 0.3)
        self.conv_b = nn.Parameter(torch.randn(6) * 0.1)
        self.grouped_w = nn.Parameter(torch.randn(6, 2, 3, 3) * 0.3)
        self.up_w = nn.Parameter(torch.randn(6, 4, 2, 2) * 0.3)
        self.proj = nn.Parameter(torch.randn(4, 8) * 0.3)  # (in, out): used as x @ W
        self.packed = nn.Parameter(torch.randn(16, 8) * 0.3)  # two (out, in) halves
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(F.conv2d(x, self.conv_w, self.conv_b, padding="same"))
        h = torch.relu(F.conv2d(h, self.grouped_w, None, 1, 1, 1, 3))
        h = F.conv_transpose2d(h, self.up_w, stride=2)  # (B, 4, 32, 32)
        t = h.mean((2, 3))  # (B, 4)
        u = torch.tanh(t @ self.proj)
        v = torch.tanh(u @ self.packed[:8].T) + torch.mm(u, self.packed[8:].t())
        return self.head(v)


def _images(g: torch.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 3, 16, 16, generator=g, dtype=dtype), torch.randint(0, 10, (2,), generator=g)


def _sequences(g: torch.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 5, 8, generator=g, dtype=dtype), torch.randint(0, 10, (2,), generator=g)


def _tokens(g: torch.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


# name: (factory, batch maker)
CASES = {
    "vit": (_vit, _images),
    "swin": (lambda: _swin((2, 1)), _images),  # the second block of stage one shifts its windows
    "swin_v2": (_swin_v2, _images),
    "in_place_after_gemms": (InPlace, _images),
    "functional_gemms": (Functional, _images),
    "encoder_batch_first_padded": (PaddedEncoder, _sequences),
    "encoder_sequence_first_causal": (CausalEncoder, _sequences),
    "transformer": (Seq2Seq, _sequences),
    "mha_variants": (MHAVariants, _sequences),
    "gpt": (TinyGPT, _tokens),
    "gpt_tied_head": (TiedHeadGPT, _tokens),
}
#: the loss is multiplied by this: gradients small enough that several betas exceed 1
LOSS_FACTOR = 2.0**-30


def _run(
    factory, batch, rule: str, update_every: int = 1, steps: int = 1, product_betas: bool = True, **bounds
):
    """Plain float64 backprop and the attached model's unscaled gradients, step by step (lr 0)."""
    torch.manual_seed(0)
    reference = factory().double()
    scaler = AdaptiveLossScaler(update_every=update_every, rule=rule, product_betas=product_betas, **bounds)
    attached = scaler.attach(copy.deepcopy(reference))
    opt = torch.optim.SGD(attached.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = batch(g, torch.float64)
        reference.zero_grad(set_to_none=True)
        expected = reference(x)
        (_loss(expected, y) * LOSS_FACTOR).backward()
        out = attached(x)
        assert torch.allclose(out, expected, rtol=1e-12, atol=0), "the rewrite changed the forward pass"
        scaler.scale(_loss(out, y) * LOSS_FACTOR).backward()
        scaler.unscale_(opt)
        _assert_exact(reference, attached)
        yield scaler
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def _assert_exact(reference: nn.Module, attached: nn.Module) -> None:
    names = dict(attached.named_parameters())
    assert names.keys() == dict(reference.named_parameters()).keys()
    for name, ref in reference.named_parameters():
        denom = ref.grad.abs().max()
        assert denom > 0, name
        got = names[name].grad
        assert ((got - ref.grad).abs().max() / denom).item() <= 1e-10, name


# ----------------------------------------------------------------------------------------------- exactness


#: bounds on beta: the rule's defaults, or at most 2 per point (so the scale builds up over many points,
#: attention's included, and branches meet different alphas) from a root scale alpha_{N+1} of 4
BOUNDS = {"default": {}, "spread": {"scale_upper_bound": 2.0, "accum_upper_bound": None, "init_scale": 4.0}}


@pytest.mark.parametrize("bounds", sorted(BOUNDS))
@pytest.mark.parametrize("rule", ["reference", "paper"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_unscaled_gradients_equal_plain_backprop_in_float64(case, rule, bounds):
    """Every parameter's unscaled gradient equals plain backprop (relative 1e-10) while several layers
    scale by more than 1 (and, with the spread bounds, every attention and product point); the forward
    pass is unchanged."""
    factory, batch = CASES[case]
    (scaler,) = list(_run(factory, batch, rule, **BOUNDS[bounds]))
    alphas, betas = scaler.layer_scales(), scaler.layer_betas()
    kinds = {p.name: p.kind for p in scaler.state.gemms}
    assert len({a for a in alphas.values() if a > 1}) >= 2, alphas
    assert sum(b > 1 for n, b in betas.items() if kinds[n] == "layer") >= 2, betas
    products = [b for n, b in betas.items() if kinds[n] == "product"]
    # every attention call is a product point; Swin's products sit inside its wrapped function (none)
    assert bool(products) == (not case.startswith(("swin", "in_place", "functional"))), betas
    if bounds == "spread":
        assert all(b > 1 for b in products), betas


@pytest.mark.parametrize("case", ["gpt", "mha_variants"])
def test_reuse_steps_and_pass_through_products_stay_exact(case):
    """Steps between recomputes reuse every beta (product points' included) as host floats; with
    ``product_betas=False`` products have no point and alpha passes through them: exact either way."""
    factory, batch = CASES[case]
    kinds = []
    for scaler in _run(factory, batch, "reference", update_every=3, steps=3, **BOUNDS["spread"]):
        kinds.append(scaler.last_pass)
        betas, points = scaler.layer_betas(), scaler.state.gemms
        assert all(betas[p.name] > 1 for p in points if p.kind == "product"), betas
    assert kinds == ["recompute", "reuse", "reuse"]
    (plain,) = list(_run(factory, batch, "paper", product_betas=False))
    assert not [p for p in plain.state.gemms if p.kind == "product"]


def test_a_size_read_before_one_gemm_and_used_after_another():
    """A batch size read once and used on both sides of GEMMs carries no gradient: no scale conflict."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(12, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b = x.size(0)
            return self.fc2(torch.relu(self.fc1(x.view(b, -1))).view(b, -1))

    def batch(g, dtype):
        return torch.randn(4, 3, 4, generator=g, dtype=dtype), torch.randint(0, 3, (4,), generator=g)

    (scaler,) = list(_run(Net, batch, "paper"))
    assert [p.name for p in scaler.state.gemms] == ["fc1", "fc2"]


# ----------------------------------------------------------------------------------------------- coverage

_GEMM_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.convolution.default,
}


class _WeightGEMMs(TorchDispatchMode):
    """Records every GEMM call (mm, addmm, bmm, baddbmm, convolution) with a matrix operand inside a
    parameter's storage (the weight itself, its transpose, a slice of a packed weight), and whether it ran
    inside ``ScaledGEMM`` (``inside`` is set by the test while that op's forward runs)."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        super().__init__()
        self.storage = {p.untyped_storage().data_ptr(): n for n, p in params.items()}
        self.calls: list[tuple[str, bool]] = []
        self.inside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func in _GEMM_OPS:
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim() >= 2:
                    name = self.storage.get(a.untyped_storage().data_ptr())
                    if name is not None:
                        self.calls.append((name, self.inside))
        return func(*args, **(kwargs or {}))


COVERAGE = {
    # the models and counts before this change: ViT 6 of 10 weights, Swin 7 of 11, encoder 2 of 10
    "vit": (_vit, _images, 10),
    "swin": (_swin, _images, 11),
    "swin_v2": (_swin_v2, _images, None),
    "functional_gemms": (Functional, _images, 6),  # 7 GEMM calls: two on halves of one weight
    "encoder": (Encoder, _sequences, 10),
    "encoder_sequence_first_causal": (CausalEncoder, _sequences, 10),
    "transformer": (Seq2Seq, _sequences, None),
    "mha_variants": (MHAVariants, _sequences, None),
    "gpt": (TinyGPT, _tokens, None),
    "gpt_tied_head": (TiedHeadGPT, _tokens, None),
}


@pytest.mark.parametrize("case", sorted(COVERAGE))
def test_every_weight_gemm_gets_a_scaling_point(case, monkeypatch):
    """Counted independently in ATen: the GEMM calls of a plain forward pass that multiply by a parameter.
    The attached model has one weight GEMM point per such call, and its forward pass makes every such
    call inside ScaledGEMM (Algorithm 4), none outside."""
    factory, batch, weights = COVERAGE[case]
    torch.manual_seed(0)
    model = factory()
    x, _ = batch(torch.Generator().manual_seed(1), torch.float32)
    with _WeightGEMMs(dict(model.named_parameters())) as plain:
        model(x)
    scaler = AdaptiveLossScaler()
    attached = scaler.attach(model)
    with _WeightGEMMs(dict(attached.named_parameters())) as counted:
        original = adaptive_ops.ScaledGEMM._forward

        def flagged(*args, **kwargs):
            counted.inside = True
            try:
                return original(*args, **kwargs)
            finally:
                counted.inside = False

        monkeypatch.setattr(adaptive_ops.ScaledGEMM, "_forward", staticmethod(flagged))
        attached(x)
    layer_points = [p for p in scaler.state.gemms if p.kind == "layer"]
    assert plain.calls, "the counter saw no GEMM"
    assert len(layer_points) == len(plain.calls)
    assert [name for name, inside in counted.calls if not inside] == []
    assert sorted(name for name, _ in counted.calls) == sorted(name for name, _ in plain.calls)
    if weights is not None:
        assert len({name for name, _ in plain.calls}) == weights


# ----------------------------------------------------------------------------------------------- products


def test_product_betas_lower_attention_and_qkv_underflow():
    """``scripts/attention_betas.py``'s measurement, one setting: the tiny GPT at initialization, FP8
    e5m2 gradients, the reference rule. With attention's own beta the QKV projection's output gradient
    and attention's products lose less (measured: QKV 0.53% -> 0.21%, 8 of 12 layers better) and no
    layer loses more."""
    torch.manual_seed(0)
    weights = TinyGPT(**SIZES).state_dict()
    data = corpus()
    batch = sample_batch(data, torch.Generator().manual_seed(7))
    off, on = (underflow(weights, "fp8_e5m2", "reference", b, batch) for b in (False, True))
    assert off.keys() == on.keys()
    qkv = [k for k in off if k.endswith("c_attn")]
    assert sum(off[k] for k in qkv) > 0.003 * len(qkv)  # the baseline loses gradients: the test discriminates
    assert sum(on[k] for k in qkv) < 0.6 * sum(off[k] for k in qkv)
    assert all(on[k] <= off[k] for k in off), {k: (off[k], on[k]) for k in off}
    assert sum(on[k] < off[k] for k in off) >= 6


def test_the_entry_point_prints_a_row_and_writes_a_csv_per_setting(tmp_path, capsys):
    """``scripts/attention_betas.py`` itself, one FP32 step: a row per regime, gradient format and rule,
    printed and returned, and each setting's per-layer CSV (docs/transform.md's table is made of them)."""
    import csv

    rows = load_script("attention_betas").main(["--steps", "1", "--out", str(tmp_path)])
    settings = [(r["regime"], r["gradients"], r["rule"]) for r in rows]
    assert settings == [
        (regime, fmt, rule) for regime in ("init", "trained") for fmt in ("fp16", "fp8_e5m2")
        for rule in ("reference", "paper")
    ]  # fmt: skip
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "FP32 training: 1 steps, final loss " + printed[0].rsplit(" ", 1)[1]
    assert [line.split(" | ")[:3] for line in printed[3:]] == [[f"| {a}", b, c] for a, b, c in settings]
    for regime, fmt, rule in settings:
        with open(tmp_path / f"{regime}_{fmt}_{rule}.csv", newline="") as f:
            layers = list(csv.DictReader(f))
        assert {"wte", "blocks.0.attn.c_attn", "blocks.1.attn.scores"} <= {r["layer"] for r in layers}
        for r in layers:
            assert (
                0 <= float(r["underflow_product_betas_off"]) <= 1
                and 0 <= float(r["underflow_product_betas_on"]) <= 1
            )


def test_the_entry_point_writes_into_the_checkout_it_is_in(tmp_path):
    """``scripts/attention_betas.py`` copied into another checkout, ``src/`` linked (as the docs' blocks run
    it): its default ``--out`` is that checkout's ``results/attention_betas``, not the package's."""
    import os
    import shutil
    import subprocess
    import sys

    from conftest import ROOT

    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    (tmp_path / "src").symlink_to(ROOT / "src", target_is_directory=True)
    before = sorted((ROOT / "results" / "attention_betas").iterdir())
    stamps = [p.stat().st_mtime_ns for p in before]
    run = subprocess.run(
        [sys.executable, str(tmp_path / "scripts" / "attention_betas.py"), "--steps", "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr
    assert len(list((tmp_path / "results" / "attention_betas").glob("*.csv"))) == 8
    assert [p.stat().st_mtime_ns for p in before] == stamps  # the committed CSVs untouched


def test_product_betas_combine_the_statistics_of_all_ranks():
    """Under DDP a product's operands and gradients differ between ranks, so :func:`product_beta` combines
    each tensor's second moment and max over the ranks (the same ``reduce_fn`` as the GEMM points'): each
    rank then gets the beta of the whole batch. Two ranks simulated in one process: rank 1's statistics
    are recorded, rank 0's reducer combines them with its own as the all-gather would; here rank 0 alone
    would pick another beta."""
    from adaloss.adaptive.ops import MatmulOperands, product_beta

    rule = AdaptiveLossScaler(rule="paper").rule
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 6, 5, generator=g, dtype=torch.float64).requires_grad_()
    b = torch.randn(4, 5, 7, generator=g, dtype=torch.float64).requires_grad_()
    delta = torch.randn(4, 6, 7, generator=g, dtype=torch.float64) * 1e-9
    delta[:2] *= 1e-3  # rank 0's half of the batch has much smaller gradients
    halves = [(a[:2], b[:2], delta[:2]), (a[2:], b[2:], delta[2:])]
    recorded = []

    def record(ms, top):
        recorded.append((ms, top))
        return ms, top

    def combine(ms, top):  # rank 0 meets rank 1's statistics, in the same order
        other_ms, other_top = recorded.pop(0)
        return (ms + other_ms) / 2, torch.maximum(top, other_top)

    def beta(half, reduce_fn=None):
        x, w, d = half
        return product_beta(MatmulOperands(x, w).pairs(d), rule, 1.0, reduce_fn).item()

    whole = beta((a, b, delta))
    beta(halves[1], record)
    assert beta(halves[0], combine) == whole
    assert not recorded  # every statistic was combined
    assert beta(halves[0]) != whole  # alone, rank 0 would choose another beta


def test_the_scores_gradient_recomputed_for_telemetry_is_autograds():
    """``AttentionOperands`` recomputes the attention scores' gradient dS (which only exists inside the
    attention kernel) from query, key, value and the output gradient: it equals autograd's gradient of the
    explicit computation, with a causal mask, a float mask and grouped-query heads."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    for kv_heads, causal, mask in (
        (4, True, None),
        (4, False, torch.randn(6, 6, generator=g).double()),
        (2, False, None),
    ):
        k = torch.randn(2, kv_heads, 6, 8, generator=g, dtype=torch.float64)
        v = torch.randn(2, kv_heads, 6, 8, generator=g, dtype=torch.float64)
        d_out = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
        kk, vv = (t.repeat_interleave(4 // kv_heads, dim=1) for t in (k, v))
        scores = (q @ kk.transpose(-2, -1) / 8**0.5).requires_grad_()
        s = (
            scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
            if causal
            else scores
        )
        s = s + mask if mask is not None else s
        (torch.softmax(s, -1) @ vv).backward(d_out)
        recomputed = AttentionOperands(q, k, v, mask, causal, None)._recompute(d_out)[3]
        assert torch.allclose(recomputed, scores.grad, rtol=1e-10, atol=1e-14), (kv_heads, causal)


@pytest.mark.parametrize("product_betas", [True, False])
def test_telemetry_counts_every_gemm_and_attention_product(product_betas):
    """A telemetry step of the GPT in emulated FP16 (small gradients): every GEMM point and both products
    of each attention call (``<path>.scores``, ``<path>.values``) get a rate, and some of them lose
    gradients (the probes count)."""
    torch.manual_seed(0)
    precision = Precision("fp16", "cpu")
    scaler = AdaptiveLossScaler(update_every=1, fmt=precision.grad_format, product_betas=product_betas)
    model = precision.prepare(scaler.attach(TinyGPT()))
    monitor = UnderflowMonitor(every=1, fmt=precision.telemetry_format)
    x, y = _tokens(torch.Generator().manual_seed(1), torch.float32)
    with precision.autocast(monitor=monitor):
        loss = _loss(model(x), y) * 2.0**-10
    scaler.scale(loss).backward()
    rates = monitor.underflow_rates()
    layers = {p.name for p in scaler.state.gemms if p.kind == "layer"}
    products = {f"blocks.{i}.attn.{what}" for i in range(2) for what in ("scores", "values")}
    assert set(rates) == layers | products
    assert all(0.0 <= r <= 1.0 for r in rates.values())
    assert any(rates[k] > 0 for k in products) and any(rates[k] > 0 for k in layers)


# ----------------------------------------------------------------------------------------------- host syncs


@pytest.mark.parametrize(
    "backend,dtype_name", [("emulate", "fp16"), ("autocast", "fp16"), ("autocast", "bf16")]
)
def test_no_host_sync_in_the_gpt_backward_pass(backend, dtype_name):
    """The GPT decoder: recompute and reuse steps read no value on the host and copy no host data to the
    device while backpropagating (tests/sync_trap.py), product points and tied embeddings included."""
    from sync_trap import trapped_steps

    precision = Precision(dtype_name, "cpu", backend=backend)
    cfg = {"name": "adaptive", "update_every": 2}
    scaler = build_scaler(OmegaConf.create(cfg), precision.grad_format)
    torch.manual_seed(0)
    model = precision.prepare(scaler.attach(TinyGPT()))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    batches = [_tokens(g, torch.float32) for _ in range(3)]

    def loss_fn(model, batch):
        return _loss(model(batch[0]).float(), batch[1]) * 2.0**-12  # small gradients: FP16 betas above 1

    kinds = trapped_steps(scaler, model, opt, precision, batches, loss_fn)
    assert kinds == ["recompute", "reuse", "recompute"]
    # FP16: betas other than 1 took part (BF16 has FP32's range: its betas are 1, see test_gpu_path.py)
    betas = set(scaler.layer_betas().values())
    assert len(betas) > 1 if dtype_name == "fp16" else betas == {1.0}
    assert scaler.state.points.unscales, "the tied embedding's use is unscaled by its own point"


# ----------------------------------------------------------------------------------------------- semantics


def test_eval_mode_turns_attention_dropout_off():
    """Attention dropout follows the attached model's ``train()``/``eval()`` at run time (fx would have
    frozen the flag it saw when tracing): in eval mode the attached models give the plain models' outputs,
    in training mode dropout acts."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    images = torch.randn(2, 3, 16, 16)
    for model, inp in (
        (Encoder(dropout=0.5), x),
        (
            torchvision.models.SwinTransformer([2, 2], 8, [1, 1], [2, 2], [2, 2], attention_dropout=0.5),
            images,
        ),
    ):
        attached = AdaptiveLossScaler().attach(copy.deepcopy(model))
        assert not torch.equal(attached(inp), attached(inp))  # training: dropout draws differ
        attached.eval()
        model.eval()
        with torch.no_grad():
            assert torch.allclose(attached(inp), model(inp), rtol=1e-5, atol=1e-6)


class _Attention(nn.Module):
    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x)[0]


def test_ops_writing_into_a_gemm_output_work_in_emulation():
    """In emulated FP16 an op that writes in place into a GEMM's output gets a copy, not a view it may not
    modify, and trains."""
    torch.manual_seed(0)
    precision = Precision("fp16", "cpu")
    scaler = AdaptiveLossScaler(update_every=1)
    model = precision.prepare(scaler.attach(InPlace()))
    x, y = _images(torch.Generator().manual_seed(1), torch.float32)
    with precision.autocast():
        loss = _loss(model(x), y)
    scaler.scale(loss).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.isfinite(grads).all() and grads.abs().max() > 0


@pytest.mark.parametrize("option", ["add_bias_kv", "add_zero_attn"])
def test_attention_options_the_scaler_does_not_rewrite_are_clear_errors(option):
    with pytest.raises(AdaptiveTransformError, match=f"'attn' uses {option}=True") as info:
        AdaptiveLossScaler().attach(_Attention(**{option: True}))
    assert "build it without that option" in str(info.value)


def test_state_dict_keys_and_parameters_are_unchanged():
    for factory in (TinyGPT, TiedHeadGPT, MHAVariants, _vit, _swin):
        model = factory()
        attached = AdaptiveLossScaler().attach(model)
        assert sorted(attached.state_dict()) == sorted(model.state_dict())
        assert {id(p) for p in attached.parameters()} == {id(p) for p in model.parameters()}
