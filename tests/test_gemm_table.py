"""``coverage()`` cannot say yes falsely (issue 42): one definition of what a GEMM is
(:mod:`adaloss.adaptive.gemms`) serves the rewrite, the capture and the ATen count, and the count sees
every kind of GEMM: a plain one, a grouped one, a scaled (FP8) one, a fused attention kernel, a custom op
whose name says it multiplies, and a GEMM whose weight is computed from a parameter. Each is planted once,
hidden from the rewrite in a function fx keeps as a leaf, and the answer turns to no, naming the op and the
parameter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from adaloss.adaptive.gemms import is_gemm_op
from adaloss.scalers.adaptive import AdaptiveLossScaler

W = 16  # _scaled_mm's CPU kernel wants multiples of 16


@torch.library.custom_op("adaloss_test::fused_linear", mutates_args=())
def fused_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


@fused_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def hidden_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


def hidden_grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w, offs=offs)


def hidden_scaled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    one = torch.ones((), device=x.device)
    fp8 = torch.float8_e4m3fn
    return torch._scaled_mm(x.to(fp8), w.to(fp8).t(), one, one, out_dtype=x.dtype)


def hidden_attention(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    q = x.reshape(1, 1, -1, W)
    kv = w.reshape(1, 1, W, W)
    return F.scaled_dot_product_attention(q, kv, kv).reshape(x.shape)


def hidden_standardized(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w - w.mean(1, keepdim=True))


for _fn in (hidden_mm, hidden_grouped, hidden_scaled, hidden_attention, hidden_standardized):
    torch.fx.wrap(_fn.__name__)


class Planted(nn.Module):
    """A linear layer, then one GEMM of ``kind`` on a parameter that the rewrite does not see."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(W, W)
        self.w = nn.Parameter(torch.randn(W, W) / 4)
        self.experts = nn.Parameter(torch.randn(2, W, W) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.kind == "none":
            return h * self.w[0]  # the parameter read, but not multiplied by a GEMM
        if self.kind == "grouped":
            return hidden_grouped(h, self.experts, torch.tensor([2, 4], dtype=torch.int32))
        if self.kind == "custom op":
            return torch.ops.adaloss_test.fused_linear(h, self.w)
        hidden = {
            "mm": hidden_mm,
            "scaled_mm": hidden_scaled,
            "fused attention": hidden_attention,
            "computed weight": hidden_standardized,
        }[self.kind]
        return hidden(h, self.w)


PLANTS = {
    "mm": ("mm", "w"),
    "grouped": ("_grouped_mm", "experts"),
    "scaled_mm": ("_scaled_mm", "w"),
    "fused attention": ("_scaled_dot_product_flash_attention_for_cpu", "w"),
    "custom op": ("fused_linear", "w"),
    "computed weight": ("mm", "w"),
}


def _report(kind: str):
    torch.manual_seed(0)
    scaler = AdaptiveLossScaler()
    scaler.attach(Planted(kind))
    return scaler.coverage(torch.randn(4, W))


def test_without_a_plant_the_answer_is_yes():
    report = _report("none")
    assert report.every_gemm_weight_has_a_point, report.format()
    assert [(c.op, c.param, c.point) for c in report.calls] == [("addmm", "inp.weight", "inp")]


@pytest.mark.parametrize("kind", sorted(PLANTS))
def test_one_unscaled_gemm_of_each_kind_turns_the_answer_to_no(kind):
    report = _report(kind)
    op, param = PLANTS[kind]
    assert not report.every_gemm_weight_has_a_point, report.format()
    assert [(c.op, c.param) for c in report.outside] == [(op, param)]
    assert [(w.name, w.gemm) for w in report.unscaled] == [(param, True)]
    assert report.format().endswith("(1 GEMM weight under no point, 1 ATen GEMM call outside every point)")


def test_a_gemm_is_told_by_the_table_or_by_its_name():
    aten = torch.ops.aten
    for op in (aten.mm.default, aten._grouped_mm.default, aten._scaled_mm.default, aten.convolution.default):
        assert is_gemm_op(op)
    assert is_gemm_op(aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert is_gemm_op(torch.ops.adaloss_test.fused_linear.default)
    for op in (aten.add.Tensor, aten.embedding.default, aten._to_copy.default, aten.upsample_bilinear2d.vec):
        assert not is_gemm_op(op)
