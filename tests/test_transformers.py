"""The transformers: GPT (nanoGPT's shape, tied head, causal) and ViT; torch.fx and the adaptive scaler."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from adaloss.errors import ConfigError
from adaloss.runner.models import GPT, ViT, build_model
from adaloss.scalers.adaptive import AdaptiveLossScaler

TINY_GPT = {"vocab_size": 256, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16}


def test_gpt_shapes_tying_and_parameter_count() -> None:
    torch.manual_seed(0)
    model = GPT(**TINY_GPT)
    assert model.lm_head.weight is model.wte.weight  # one parameter, two GEMMs
    idx = torch.randint(0, 256, (3, 16))
    assert model(idx).shape == (3, 16, 256)
    assert model(idx[:, :5]).shape == (3, 5, 256)  # shorter windows than block_size
    C, L, V, T = 16, 2, 256, 16
    per_block = 12 * C * C + 13 * C  # c_attn 3C^2+3C, c_proj C^2+C, c_fc 4C^2+4C, c_proj 4C^2+C, 2 LN 4C
    assert sum(p.numel() for p in model.parameters()) == V * C + T * C + L * per_block + 2 * C
    untied = GPT(**TINY_GPT, tie_weights=False)
    assert untied.lm_head.weight is not untied.wte.weight
    assert sum(p.numel() for p in untied.parameters()) == V * C * 2 + T * C + L * per_block + 2 * C
    # one fused QKV linear per block and PyTorch's fused attention: no MultiheadAttention
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    assert model.h[0].attn.c_attn.out_features == 3 * C


def test_gpt_is_causal_and_starts_near_uniform() -> None:
    torch.manual_seed(0)
    model = GPT(**TINY_GPT).eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256  # change the future
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])  # earlier positions do not see it
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    # GPT-2 init (std 0.02): logits near 0, so the first loss on unrelated targets is about ln(vocab)
    loss = F.cross_entropy(a.flatten(0, 1), torch.randint(0, 256, (2 * 16,)))
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.05


def test_gpt2_small_config_has_gpt2_sizes() -> None:
    model = build_model({"name": "gpt2_small"}, vocab_size=50304, block_size=1024)
    assert (model.config.n_layer, model.config.n_head, model.config.n_embd) == (12, 12, 768)
    assert model.num_params() == pytest.approx(124e6, rel=0.01)  # nanoGPT's "124M" (position table excluded)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"n_embd": 30, "n_head": 4}, "multiple of model.n_head"),
        ({"n_layer": 0}, "model.n_layer must be a positive integer"),
        ({"dropout": 1.5}, "model.dropout"),
    ],
)
def test_gpt_rejects_bad_sizes(fields: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        GPT(**{**TINY_GPT, **fields})


def test_vit_shapes_and_bad_patch() -> None:
    model = build_model({"name": "vit"}, num_classes=7, input_shape=(3, 32, 32))
    assert isinstance(model, ViT) and model.pos_embed.shape == (1, 64, 64)  # 8x8 patches of 4x4
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    gray = build_model({"name": "vit", "patch": 2, "dim": 32}, num_classes=3, input_shape=(1, 16, 16))
    assert gray(torch.randn(2, 1, 16, 16)).shape == (2, 3) and gray.pos_embed.shape == (1, 64, 32)
    with pytest.raises(ConfigError, match="model.patch=5 does not divide"):
        build_model({"name": "vit", "patch": 5}, num_classes=3, input_shape=(3, 32, 32))


def _gpt() -> nn.Module:
    return GPT(**TINY_GPT, tie_weights=False)


def _vit() -> nn.Module:
    return ViT(num_classes=5, image_size=16, patch=4, dim=16, depth=2, heads=2)


def _batch(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(model, GPT):
        return torch.randint(0, 256, (3, 16)), torch.randint(0, 256, (3 * 16,))
    return torch.randn(3, 3, 16, 16, dtype=torch.float64), torch.randint(0, 5, (3,))


@pytest.mark.parametrize("make", [_gpt, _vit], ids=["gpt", "vit"])
def test_transformers_trace_with_every_gemm_a_module(make) -> None:  # noqa: ANN001 - a factory
    """What the adaptive scaler needs: every linear/conv layer is a call_module node of the fx graph (no
    F.linear on a parameter, no MultiheadAttention), and the traced graph computes what the model does."""
    torch.manual_seed(0)
    model = make()
    traced = torch.fx.symbolic_trace(model)
    gemms = {name for name, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)}
    called = {n.target for n in traced.graph.nodes if n.op == "call_module"}
    assert gemms and gemms <= called, sorted(gemms - called)
    functions = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    assert not [f for f in functions if "linear" in f]
    assert any("scaled_dot_product_attention" in f for f in functions)
    x, _ = _batch(model.double())
    torch.testing.assert_close(traced(x), model(x))


@pytest.mark.parametrize("make", [_gpt, _vit], ids=["gpt-untied", "vit"])
def test_adaptive_scaler_rewrites_them_with_exact_float64_gradients(make) -> None:  # noqa: ANN001
    """``AdaptiveLossScaler.attach`` on the current transform: the unscaled gradients equal plain
    backprop's in float64, on a recompute step and on a reuse step, every GEMM layer gets a scale."""
    torch.manual_seed(0)
    model = make().double()
    reference = copy.deepcopy(model)
    x, y = _batch(model)

    def loss_of(m: nn.Module) -> torch.Tensor:
        out = m(x)
        return F.cross_entropy(out.flatten(0, 1) if out.dim() == 3 else out, y)

    loss_of(reference).backward()
    scaler = AdaptiveLossScaler(update_every=2, init_scale=1024.0)
    attached = scaler.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    gemms = {n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)}
    for _ in range(2):  # a recompute step, then a reuse step
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss_of(attached)).backward()
        scaler.unscale_(optimizer)
        for (name, p), (_, q) in zip(reference.named_parameters(), model.named_parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-14, msg=name)
        scaler.step(optimizer)
        scaler.update()
    assert gemms <= set(scaler.layer_scales())
