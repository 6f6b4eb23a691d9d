"""The fused C++ autograd nodes: the same numbers as the Python nodes, and the plan they are built from."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from adaloss.models import build_model
from adaloss.numerics import fused, get_format
from adaloss.numerics.emulation import EmulatedAutocast
from adaloss.scalers import build_scaler
from adaloss.scalers.adaptive import AdaptiveLossScaler

FP16 = get_format("fp16")
pytestmark = pytest.mark.skipif(not fused.available(), reason=f"fused nodes: {fused.status()}")


def _half(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()


def _fit(scaler, model, steps: int, batch_and_loss, record=None) -> list[torch.Tensor]:
    """``steps`` SGD steps in emulated FP16 through ``scaler`` (attached first if it is adaptive);
    ``batch_and_loss(model, generator)`` draws a batch and returns its loss. Returns the final weights."""
    if hasattr(scaler, "attach"):
        model = scaler.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        with EmulatedAutocast(FP16):
            loss = batch_and_loss(model, g)
        if record is not None:
            record(scaler)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def _train(scaler, steps: int, model_cfg: dict | None = None, batch: int = 8, record=None):
    torch.manual_seed(0)
    model = build_model(OmegaConf.create(model_cfg or {"name": "resnet20", "depth": 20}), 10)

    def batch_and_loss(model, g):
        x = torch.randn(batch, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        return F.cross_entropy(model(x), y)

    return _fit(scaler, model, steps, batch_and_loss, record)


def test_gemm_node_equals_rounding_by_hand():
    """Forward: FP16 input, weight, bias and output; backward: FP16 incoming gradient, input gradient from
    beta * W, weight and bias gradients in FP16 times 1/alpha, input gradient rounded when asked."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, 10, 10, requires_grad=True)
    w = (torch.randn(16, 8, 3, 3) * 1e-3).requires_grad_()
    b = torch.randn(16, requires_grad=True)
    spec = fused.gemm_spec(dict(kind="conv", stride=(2, 2), padding=(1, 1), dilation=(1, 1), groups=1))
    y = fused.gemm(x, w, b, spec, True, True, 4.0, 0.25)
    g = torch.randn_like(y) * 1e-6
    y.backward(g)
    xr, wr, br = _half(x.detach()), _half(w.detach()), _half(b.detach())
    assert torch.equal(y, _half(F.conv2d(xr, wr, br, 2, 1)))
    gx, gw, gb = torch.ops.aten.convolution_backward(
        _half(g), xr, _half(wr * 4), [16], [2, 2], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]
    )
    assert torch.equal(x.grad, _half(gx))
    assert torch.equal(w.grad, _half(gw) * 0.25)
    assert torch.equal(b.grad, _half(gb) * 0.25)
    # the incoming gradient stays untouched when the caller still holds it
    assert not torch.equal(g, _half(g))


def test_linear_node_equals_rounding_by_hand():
    torch.manual_seed(0)
    x = torch.randn(6, 5, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    y = fused.gemm(x, w, b, fused.gemm_spec({"kind": "linear"}), False, False, 2.0, 0.5)
    g = torch.randn(6, 3)
    y.backward(g)
    assert torch.equal(y, _half(F.linear(x.detach(), _half(w.detach()), _half(b.detach()))))
    gr = _half(g)
    assert torch.equal(x.grad, gr.matmul(_half(w.detach()) * 2))
    assert torch.equal(w.grad, _half(gr.t().matmul(x.detach())) * 0.5)
    assert torch.equal(b.grad, _half(gr.sum(0)) * 0.5)


@pytest.mark.parametrize("factors", [[1.0, 8.0], [4.0, 1.0], [2.0, 4.0], [1.0, 1.0]])
def test_rescale_sums_the_rescaled_gradients(factors):
    a = torch.randn(5, 100, requires_grad=True)
    o1, o2 = fused.rescale([a, a], factors, True)
    (o1.exp() + 3 * o2).sum().backward()
    assert torch.equal(a.grad, a.detach().exp() * factors[0] + 3 * factors[1])


def test_rescale_of_separate_outputs_scales_each():
    a = torch.randn(4, 10, requires_grad=True)
    lo, hi = a.split(5, dim=1)
    o1, o2 = fused.rescale([lo, hi], [2.0, 1.0], False)
    (o1 * 3 + o2).sum().backward()
    expected = torch.cat([torch.full((4, 5), 6.0), torch.ones(4, 5)], dim=1)
    assert torch.equal(a.grad, expected)


@pytest.mark.parametrize("name", ["dynamic", "none"])
def test_emulated_training_is_identical_with_and_without_fused_nodes(name):
    """The emulation routes conv2d to the fused node; nothing but speed may change."""
    cfg = OmegaConf.create({"name": name})
    fast = _train(build_scaler(cfg, FP16), 3)
    with fused.disabled():
        ref = _train(build_scaler(cfg, FP16), 3)
    assert all(torch.equal(a, b) for a, b in zip(fast, ref, strict=True))


@pytest.mark.parametrize("rule", ["reference", "paper"])
def test_adaptive_training_is_identical_with_and_without_fused_nodes(rule):
    """Reuse steps build fused nodes carrying the planned scales, recompute steps compute them with the
    rule's arithmetic in C: same weights and scales as the Python nodes, bit for bit, under both rules."""
    used = []

    def record(scaler):
        used.append(scaler.state.fused_built)

    fast_scaler = AdaptiveLossScaler(update_every=3, init_scale=2.0**-10, rule=rule)
    fast = _train(fast_scaler, 7, record=record)
    with fused.disabled():
        ref_scaler = AdaptiveLossScaler(update_every=3, init_scale=2.0**-10, rule=rule)
        ref = _train(ref_scaler, 7)
    # steps 0, 3, 6 recompute, the others reuse: each forward pass builds the matching fused nodes
    assert used == ["recompute", "reuse", "reuse", "recompute", "reuse", "reuse", "recompute"]
    scales = fast_scaler.layer_scales()
    assert scales == ref_scaler.layer_scales() and len(set(scales.values())) > 2
    assert all(torch.equal(a, b) for a, b in zip(fast, ref, strict=True))


def _graph_nodes(root) -> list[str]:
    seen, stack, names = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(node.name())
        stack.extend(n for n, _ in node.next_functions)
    return names


def test_reuse_pass_builds_branch_nodes_only_where_a_factor_is_not_one():
    """A branch point whose planned factors are all 1 is autograd's plain accumulation: a reuse pass
    builds no node (and no views) for it. The others keep their fused node; the bitwise test above
    trains through both kinds."""
    torch.manual_seed(0)
    # the paper's rule: at this initialization it rescales some of ResNet-20's branch points and not others
    scaler = AdaptiveLossScaler(update_every=10, rule="paper")
    model = scaler.attach(build_model(OmegaConf.create({"name": "resnet20", "depth": 20}), 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    counts = []
    for _ in range(2):  # a recompute pass, then a reuse pass
        with EmulatedAutocast(FP16):
            loss = F.cross_entropy(model(x), y)
        counts.append(sum("FusedRescale" in n for n in _graph_nodes(loss.grad_fn)))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    branch = scaler.state.plan.branch
    scaled = sum(any(f != 1.0 for f in fs) for fs in branch)
    assert 0 < scaled < len(branch)  # both kinds of point occur here
    assert counts == [len(branch), scaled]


def test_plan_holds_every_slot_and_follows_the_host_copies():
    scaler = AdaptiveLossScaler(update_every=10)
    _train(scaler, 1)
    plan = scaler.state.plan
    assert plan is not None and plan.root == scaler.get_scale()
    state = scaler.state
    for p in state.gemms:
        beta, inv_alpha = plan.gemm[p.index]
        assert beta == state.beta_host[p.index]
        assert inv_alpha == 1.0 / plan.slot_alpha[p.in_slot]
        assert plan.slot_alpha[p.out_slot] == plan.slot_alpha[p.in_slot] * beta
    # a loss scale set by hand re-arms it on the new root scale
    scaler.update(new_scale=4.0)
    assert scaler.state.plan.root == 4.0 and scaler.state.plan.slot_alpha[0] == 4.0


def test_forward_built_for_reuse_then_changed_state_is_a_clear_error():
    scaler = AdaptiveLossScaler(update_every=10)
    _train(scaler, 1)
    assert scaler.state.plan is not None
    scaler.state.fused_built = "reuse"  # as if a forward pass had built fused nodes
    scaler.recompute_next()  # ... and then the scales were invalidated
    with pytest.raises(RuntimeError, match="run the forward pass again"):
        scaler.scale(torch.ones((), requires_grad=True))


def test_no_cxx_compiler_means_python_nodes(tmp_path):
    """With a C compiler but no C++ one, the FP16 kernels load and the fused nodes say why they are off."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("cc", "as", "ld"):  # what building the C kernels needs
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"no {tool} on PATH")
        (bin_dir / tool).symlink_to(found)
    code = (
        "from adaloss.numerics import fused, native\n"
        "assert native.available(), native.status()\n"
        "assert not fused.available()\n"
        "print(fused.status())\n"
    )
    env = {**os.environ, "CXX": "", "PATH": str(bin_dir), "ADALOSS_CACHE": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "no C++ compiler" in res.stdout


def test_disabled_by_environment():
    code = "from adaloss.numerics import fused\nprint(fused.available(), fused.status())\n"
    env = {**os.environ, "ADALOSS_FUSED": "0"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("False disabled"), res.stdout + res.stderr


def test_gradient_accumulation_is_identical_with_and_without_fused_nodes():
    """Two backward passes per iteration: on a recompute iteration the first pass's fused nodes write the
    record and the second pass (Python nodes) reuses what it computed; on a reuse iteration both passes
    build fused nodes with the plan."""

    def run():
        torch.manual_seed(0)
        model = build_model(OmegaConf.create({"name": "resnet20", "depth": 20}), 10)
        scaler = AdaptiveLossScaler(update_every=2, init_scale=2.0**-8)
        model = scaler.attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        built = []
        for _ in range(4):
            for _ in range(2):
                x = torch.randn(4, 3, 32, 32, generator=g)
                y = torch.randint(0, 10, (4,), generator=g)
                with EmulatedAutocast(FP16):
                    loss = F.cross_entropy(model(x), y) / 2
                built.append(scaler.state.fused_built)
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()], scaler.layer_scales(), built

    fast_w, fast_s, built = run()
    with fused.disabled():
        ref_w, ref_s, ref_built = run()
    assert built == ["recompute", None, "reuse", "reuse"] * 2 and set(ref_built) == {None}
    assert fast_s == ref_s and len(set(fast_s.values())) > 2
    assert all(torch.equal(a, b) for a, b in zip(fast_w, ref_w, strict=True))


def test_state_dict_after_a_fused_recompute_pass_holds_its_scales():
    scaler = AdaptiveLossScaler(update_every=5, init_scale=2.0**-8)
    _train(scaler, 1)
    saved = scaler.state_dict()
    with fused.disabled():
        ref = AdaptiveLossScaler(update_every=5, init_scale=2.0**-8)
        _train(ref, 1)
        expected = ref.state_dict()
    assert saved == expected
    assert any(b is not None and b > 1 for b in saved["betas"])


TINY_GPT = OmegaConf.load(Path(__file__).parents[1] / "configs" / "model" / "gpt.yaml")


def _train_gpt(scaler, steps: int, record=None) -> list[torch.Tensor]:
    """``model=gpt`` (4 blocks, width 64, tied head, causal SDPA) on random byte windows in emulated FP16."""
    torch.manual_seed(0)
    model = build_model(TINY_GPT, vocab_size=256, block_size=16)

    def batch_and_loss(model, g):
        idx = torch.randint(0, 256, (4, 16), generator=g)
        return F.cross_entropy(model(idx).flatten(0, 1), torch.roll(idx, -1, 1).flatten())

    return _fit(scaler, model, steps, batch_and_loss, record)


def test_emulated_linear_layers_take_the_fused_node_bit_for_bit(monkeypatch):
    """The emulation routes ``linear`` (3-D activations included) to the fused node as it does ``conv2d``:
    every GEMM of a dynamic GPT's forward pass is one fused node, and it trains to the same weights as
    with the Python rounding nodes."""
    calls = []
    real = fused.gemm
    monkeypatch.setattr(fused, "gemm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    model = build_model(TINY_GPT, vocab_size=256, block_size=16)
    with EmulatedAutocast(FP16):
        model(torch.randint(0, 256, (2, 16)))
    # 4 blocks x (qkv, attention out, MLP in, MLP out) + the head (lm_head, holding wte.weight)
    assert len(calls) == 17 and all(s[:2] == (2, 16) for s in calls)
    monkeypatch.setattr(fused, "gemm", real)
    cfg = OmegaConf.create({"name": "dynamic"})
    fast = _train_gpt(build_scaler(cfg, FP16), 3)
    with fused.disabled():
        ref = _train_gpt(build_scaler(cfg, FP16), 3)
    assert all(torch.equal(a, b) for a, b in zip(fast, ref, strict=True))


@pytest.mark.parametrize("product_betas", [True, False])
def test_gpt_reuse_passes_mix_fused_and_python_nodes_bit_for_bit(product_betas, monkeypatch):
    """The GPT's attention products and tied embedding have no fused form: recompute passes run every
    point in Python, reuse passes build fused nodes for the linear layers and the tied head beside Python
    nodes for the rest, all carrying one plan's scales. Same weights and scales as the Python nodes
    alone."""
    used, calls = [], []
    real = fused.gemm
    monkeypatch.setattr(fused, "gemm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))

    def record(scaler):
        used.append((scaler.state.fused_built, len(calls)))
        calls.clear()

    def make():
        return AdaptiveLossScaler(update_every=3, init_scale=2.0**-10, product_betas=product_betas)

    fast_scaler = make()
    fast = _train_gpt(fast_scaler, 7, record=record)
    with fused.disabled():
        ref_scaler = make()
        ref = _train_gpt(ref_scaler, 7)
    # fused GEMM nodes per forward pass: none on recompute passes, on reuse passes 4 blocks x 4 layers
    # and the head; the attention products and the embedding stay Python nodes
    recompute, reuse = (None, 0), ("reuse", 17)
    assert used == [recompute, reuse, reuse, recompute, reuse, reuse, recompute]
    kinds = {type(m).__name__: m.fusable() for m in fast_scaler.state.point_modules}
    assert kinds["AdaptiveGEMM"] and not all(kinds.values())  # a mixed model
    scales = fast_scaler.layer_scales()
    assert scales == ref_scaler.layer_scales() and len(set(scales.values())) > 2
    assert all(torch.equal(a, b) for a, b in zip(fast, ref, strict=True))


class _FunctionalNet(torch.nn.Module):
    """GEMMs called as functions with parameters: ``F.linear(x, self.w1)`` (fused on reuse passes) and
    ``h @ self.w2`` (a transposed view: stays a Python node), between a layer that has a fused form."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(12, 16)
        self.w1 = torch.nn.Parameter(torch.randn(24, 16) * 0.2)
        self.b1 = torch.nn.Parameter(torch.zeros(24))
        self.w2 = torch.nn.Parameter(torch.randn(24, 5) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.relu(F.linear(h, self.w1, self.b1))
        return h @ self.w2


def _encoder() -> torch.nn.Module:
    from test_adaptive_attention import Encoder

    return Encoder()


def _swin() -> torch.nn.Module:
    from test_adaptive_attention import _swin

    return _swin((2, 1))  # the second block of stage one shifts its windows


def _swin_v2() -> torch.nn.Module:
    from test_adaptive_attention import _swin_v2

    return _swin_v2()


@pytest.mark.parametrize(
    "make, shape, fused_pass",
    [
        # a layer and F.linear with a parameter are fused; h @ w2 (a transposed view) is not
        (_FunctionalNet, (12,), [(16, 12), (24, 16)]),
        # nn.TransformerEncoder: nn.MultiheadAttention's packed in-projection (F.linear with the
        # in_proj_weight parameter) beside the out-projection, feed-forward, input and head layers
        (_encoder, (5, 8), sorted([(16, 8), (10, 16)] + 2 * [(48, 16), (16, 16), (32, 16), (16, 32)])),
        # Swin: the qkv and output projections inside torchvision's wrapped attention function (LeafGEMMs)
        # beside the layers; None: every GEMM point of the model
        (_swin, (3, 16, 16), None),
        (_swin_v2, (3, 16, 16), None),
    ],
    ids=["functional", "transformer-encoder", "swin", "swin-v2"],
)
def test_functional_gemms_are_fused_on_reuse_passes_bit_for_bit(make, shape, fused_pass, monkeypatch):
    """GEMMs whose weight is a graph value (``F.linear``/``F.conv*`` with a parameter, the GEMMs inside a
    wrapped attention function) are fused nodes on reuse passes, as layers are: same weights and scales
    as the Python nodes, bit for bit."""
    calls = []
    real = fused.gemm
    monkeypatch.setattr(fused, "gemm", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))

    def batch_and_loss(model, g):
        x, y = torch.randn(8, *shape, generator=g), torch.randint(0, 5, (8,), generator=g)
        return F.cross_entropy(model(x), y)

    def run(counts):
        torch.manual_seed(0)
        scaler = AdaptiveLossScaler(update_every=3, init_scale=2.0**-10)

        def record(scaler):
            counts.append(sorted(tuple(s) for s in calls))
            calls.clear()

        return scaler, _fit(scaler, make(), 6, batch_and_loss, record)

    counts: list = []
    fast_scaler, fast = run(counts)
    with fused.disabled():
        ref_scaler, ref = run([])
    if fused_pass is None:
        fused_pass = counts[1]
        assert len(fused_pass) == len(fast_scaler.state.gemms)
        assert any(type(m).__name__ == "LeafGEMMs" for m in fast_scaler.state.point_modules)
    # recompute passes (steps 0 and 3) in Python; reuse passes fuse what has a fused form
    assert counts == [[], fused_pass, fused_pass, [], fused_pass, fused_pass]
    assert fast_scaler.layer_scales() == ref_scaler.layer_scales()
    assert all(torch.equal(a, b) for a, b in zip(fast, ref, strict=True))
