"""Mixture-of-experts under the adaptive scaler (issue 42): a grouped GEMM on a parameter
(``torch._grouped_mm``, transformers' ``grouped_mm`` and ``batched_mm`` experts, its
``grouped_mm_fallback`` custom op once captured) is one scaling point with one beta for all its experts,
exact in float64 and counted by ``coverage()``; an experts loop over the experts that received tokens
(data-dependent) is refused with a message naming the loop and the setting that avoids it.

``torch._grouped_mm`` has no float64 kernel, so the plain model's float64 gradients come from the same
experts multiplied group by group (:class:`LoopE`, transformers' ``eager`` experts), and the attached
model's grouped point computes float64 with one masked product per group."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from adaloss.adaptive import AdaptiveTransformError
from adaloss.scalers.adaptive import AdaptiveLossScaler
from adaloss.scalers.exactness import _grads, compare


class E(nn.Module):
    """The issue's smallest case: a grouped GEMM on a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(2, 8, 8) / 3)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(self.inp(x), self.w, offs=offs).square().mean()


class LoopE(E):
    """:class:`E` with its groups multiplied one by one (any dtype): the reference."""

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        h, start, out = self.inp(x), 0, []
        for g, end in enumerate(offs.tolist()):
            out.append(h[start:end] @ self.w[g])
            start = end
        return torch.cat(out).square().mean()


class LoopMoE(nn.Module):
    """The issue's data-dependent experts loop."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.w = nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e in (F.one_hot(idx, 4).sum(0) > 0).nonzero():
            rows = torch.where(idx == e[0])[0]
            out = out.index_add(0, rows, x[rows] @ self.w[e[0]])
        return out


class RoutedMoE(nn.Module):
    """A DeepSeek-V3-style block: top-k softmax routing, routed experts through two grouped GEMMs (tokens
    sorted by expert, group ends from a histogram), a shared expert, and the gate-weighted sum. With
    ``loop=True`` the routed experts are multiplied one by one (the reference)."""

    def __init__(
        self, d: int = 8, hidden: int = 12, experts: int = 4, k: int = 2, loop: bool = False
    ) -> None:
        super().__init__()
        self.k, self.experts, self.loop = k, experts, loop
        self.router = nn.Linear(d, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, d, hidden) / d**0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, d) / hidden**0.5)
        self.shared = nn.Sequential(nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, d))
        self.head = nn.Linear(d, 3)

    def _grouped(self, h: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if not self.loop:
            return torch._grouped_mm(h, w, offs=offs)
        start, out = 0, []
        for g, end in enumerate(offs.tolist()):
            out.append(h[start:end] @ w[g])
            start = end
        return torch.cat(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)
        top, idx = probs.topk(self.k, dim=-1)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=self.experts), 0).to(torch.int32)
        rows = x[order // self.k]
        h = F.silu(self._grouped(rows, self.up, offs))
        y = self._grouped(h, self.down, offs) * top.reshape(-1)[order].unsqueeze(-1)
        routed = torch.zeros_like(y).index_copy(0, order, y).reshape(x.shape[0], self.k, -1).sum(1)
        return self.head(routed + self.shared(x))


def _exact(reference: nn.Module, model: nn.Module, batches: list[tuple], loss) -> None:
    """``model`` attached (float64) gives plain backprop's gradients of ``reference`` (the same weights,
    float64; float32 for the rounding bound) on a recompute and a reuse step, under both rules."""
    reference = copy.deepcopy(reference)
    expected = []
    for batch in batches:
        got = {}
        for dtype in (torch.float64, torch.float32):
            ref = copy.deepcopy(reference).to(dtype)
            loss(ref(*[t.to(dtype) if t.is_floating_point() else t for t in batch])).backward()
            got[dtype] = _grads(ref)
        expected.append(got)
    for rule in ("reference", "paper"):
        scaler = AdaptiveLossScaler(update_every=len(batches), rule=rule)
        attached = scaler.attach(copy.deepcopy(model).double(), *batches[0])
        optimizer = torch.optim.SGD(attached.parameters(), lr=0.0)
        for batch, grads in zip(batches, expected, strict=True):
            attached.zero_grad(set_to_none=True)
            scaler.scale(loss(attached(*batch))).backward()
            scaler.unscale_(optimizer)
            checks = compare(grads[torch.float64], grads[torch.float32], _grads(attached))
            assert all(c.ok for c in checks), [str(c) for c in checks if not c.ok]
            scaler.step(optimizer)
            scaler.update()


def _e_batches() -> list[tuple]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(6, 8, generator=g, dtype=torch.float64), torch.tensor([2, 6], dtype=torch.int32)),
        (torch.randn(7, 8, generator=g, dtype=torch.float64), torch.tensor([5, 7], dtype=torch.int32)),
    ]


def test_a_grouped_gemm_on_a_parameter_is_exact():
    """The issue's first MoE case, float64 (the point computes group by group) against the loop."""
    torch.manual_seed(0)
    reference = LoopE().double()
    model = E()
    model.load_state_dict(reference.state_dict())
    _exact(reference, model, _e_batches(), lambda out: out * 1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_grouped_gemm_on_a_parameter_is_a_point_counted_in_aten(dtype):
    """One point for the grouped weight (float32: the kernel, ``aten._grouped_mm``, runs inside it)."""
    torch.manual_seed(0)
    x, offs = _e_batches()[0]
    scaler = AdaptiveLossScaler(update_every=1)
    scaler.attach(E().to(dtype))
    report = scaler.coverage(x.to(dtype), offs)
    assert [(p.name, p.weight) for p in report.points] == [("inp", "inp.weight"), ("w", "w")]
    assert report.every_gemm_weight_has_a_point and not report.outside, report.format()
    assert {c.point for c in report.calls} == {"inp", "w"}
    if dtype == torch.float32:
        assert ("_grouped_mm", "w", "w") in [(c.op, c.param, c.point) for c in report.calls]


def _routed_batches() -> list[tuple]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(n, 8, generator=g, dtype=torch.float64),) for n in (10, 7)]


def test_a_routed_moe_with_a_shared_expert_is_exact_and_covered():
    """DeepSeek-V3-style routing (top-2 of 4, shared expert) through grouped GEMMs: exact against the
    loop, both expert weights points, every GEMM call inside one."""
    torch.manual_seed(0)
    reference = RoutedMoE(loop=True).double()
    model = RoutedMoE()
    model.load_state_dict(reference.state_dict())
    _exact(reference, model, _routed_batches(), lambda out: out.square().mean() * 1e-6)
    scaler = AdaptiveLossScaler()
    scaler.attach(model.float())
    report = scaler.coverage(_routed_batches()[0][0].float())
    assert {"up", "down"} <= {p.name for p in report.points}
    assert report.every_gemm_weight_has_a_point and not report.outside, report.format()


def test_a_data_dependent_experts_loop_is_refused_naming_the_loop_and_the_way_out():
    """The issue's second MoE case: refused at attach, naming the line of the loop and what avoids it."""
    with pytest.raises(AdaptiveTransformError) as info:
        AdaptiveLossScaler().attach(LoopMoE(), torch.randn(6, 8))
    message = str(info.value)
    assert "for e in (F.one_hot(idx, 4).sum(0) > 0).nonzero():" in message
    assert "test_moe.py" in message and "torch._grouped_mm" in message and "loop over the experts" in message


# --------------------------------------------------------------------------------------- transformers

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
VOCAB = 50


def mixtral() -> nn.Module:
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        use_cache=False,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def qwen2_moe() -> nn.Module:
    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    return transformers.Qwen2MoeForCausalLM(config)


def qwen3_moe() -> nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config)


MOE_MODELS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe}
#: make test keeps two models; the third runs in make test-full (each case about 10 s here)
MODEL_PARAMS = [
    pytest.param(n, marks=pytest.mark.slow) if n == "qwen3_moe" else n for n in sorted(MOE_MODELS)
]


def _lm_batches() -> list[tuple]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (b, t), generator=g),) for b, t in ((2, 8), (3, 6))]


def _lm_loss(out) -> torch.Tensor:
    return out.logits.square().mean() * 1e-6


def _expert_weights(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.dim() == 3}


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("name", MODEL_PARAMS)
def test_transformers_experts_are_exact_and_every_expert_weight_a_point(name, implementation):
    """Mixtral and Qwen2-MoE with the experts implementation transformers picks by default (grouped_mm:
    its fallback custom op, once captured) and with batched_mm (a product with a beta: the weights are
    gathered per token); the reference runs the eager loop."""
    torch.manual_seed(0)
    reference = MOE_MODELS[name]().double()
    reference.set_experts_implementation("eager")
    model = copy.deepcopy(reference)
    model.set_experts_implementation(implementation)
    _exact(reference, model, _lm_batches(), _lm_loss)
    scaler = AdaptiveLossScaler()
    scaler.attach(model, *_lm_batches()[0])
    report = scaler.coverage(*_lm_batches()[0])
    assert report.every_gemm_weight_has_a_point and not report.outside and not report.unscaled, (
        report.format()
    )
    if implementation == "grouped_mm":  # a layer point per expert weight
        assert _expert_weights(model) <= {p.weight for p in report.points}
    else:  # the experts' rows gathered per token (weight[expert_ids]) and bmm: a product with a beta
        assert any(p.kind == "product" and p.beta and "experts" in p.name for p in report.points)


def test_transformers_default_experts_implementation_is_grouped_mm():
    """What the test above calls the default is the default."""
    assert MOE_MODELS["mixtral"]().config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("name", MODEL_PARAMS)
def test_the_eager_experts_loop_is_refused_with_the_setting_that_avoids_it(name):
    model = MOE_MODELS[name]()
    model.set_experts_implementation("eager")
    with pytest.raises(AdaptiveTransformError) as info:
        AdaptiveLossScaler().attach(model, *_lm_batches()[0])
    message = str(info.value)
    assert "for expert_idx in expert_hit:" in message
    assert "model.set_experts_implementation('grouped_mm')" in message
