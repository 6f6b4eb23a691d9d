"""The coverage report (``scaler.coverage()``, :mod:`adaloss.adaptive.coverage`) and attach()'s warning on
recurrent layers: what got a scaling point, what did not and why, counted in ATen where inputs are given.

Models: an ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` between two linear layers (none of their GEMMs is a point:
attach() warns, naming each weight), an ``nn.TransformerEncoderLayer`` behind an embedding (products with
and without betas, a lookup, a positional embedding), a CNN with batch norm and an MLP (every GEMM call
inside a point), and GEMMs the transform does not rewrite (``einsum`` and ``tensordot`` with a parameter).
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from adaloss.adaptive import Coverage
from adaloss.adaptive.attention import Product
from adaloss.adaptive.coverage import LOOKUP_REASON, OTHER_REASON, RECURRENT_REASON, GemmCalls
from adaloss.adaptive.ops import ScaledGEMM
from adaloss.scalers.adaptive import AdaptiveLossScaler

# ----------------------------------------------------------------------------------------------- models

RECURRENT = {
    "lstm": (nn.LSTM, {}),
    "gru": (nn.GRU, {}),
    "rnn": (nn.RNN, {}),
    "lstm_2_layers_bidirectional": (nn.LSTM, {"num_layers": 2, "bidirectional": True}),
}


class Recurrent(nn.Module):
    """A recurrent layer between two linear layers."""

    def __init__(self, cls: type[nn.Module], options: dict) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 8)
        self.rnn = cls(8, 8, batch_first=True, **options)
        self.out = nn.Linear(16 if options.get("bidirectional") else 8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.inp(x))
        return self.out(h)


class Cell(nn.Module):
    """A recurrent cell between two linear layers, one time step."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 8)
        self.cell = nn.LSTMCell(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.cell(self.inp(x))
        return self.out(h)


class Encoder(nn.Module):
    """Token embedding, a learned positional embedding added to it, one encoder layer, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 16)
        self.pos = nn.Parameter(0.1 * torch.randn(1, 5, 16))
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.head = nn.Linear(16, 11)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.emb(idx) + self.pos))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Conv2d(4, 4, 3, stride=2),
        nn.BatchNorm2d(4),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 5),
    )


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


class Einsum(nn.Module):
    """A GEMM by ``einsum`` with a parameter: a product without a beta (alpha passes through)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.w = nn.Parameter(torch.randn(5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,oi->bo", self.fc(x), self.w)


class Tensordot(nn.Module):
    """A GEMM by ``tensordot`` with a parameter: the transform sees an op it does not know, ATen an ``mm``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.w = nn.Parameter(torch.randn(5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tensordot(self.fc(x), self.w, dims=([1], [1]))


class FunctionalLookup(nn.Module):
    """A table read by ``F.embedding``: a lookup, not a GEMM."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(7, 6))
        self.fc = nn.Linear(6, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(F.embedding(idx, self.table))


def _sequences() -> torch.Tensor:
    return torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(1))


def _tokens() -> torch.Tensor:
    return torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))


def _attach(model: nn.Module, **options) -> tuple[AdaptiveLossScaler, nn.Module]:
    scaler = AdaptiveLossScaler(**options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return scaler, scaler.attach(model)


def _recurrent_weights(model: Recurrent) -> list[str]:
    return [f"rnn.{n}" for n, p in model.rnn.named_parameters() if p.dim() >= 2]


# ----------------------------------------------------------------------------------------------- recurrent


@pytest.mark.parametrize("case", sorted(RECURRENT))
def test_attach_warns_naming_each_recurrent_weight(case):
    """Never silently: one UserWarning per recurrent module, naming its path, its type and every GEMM
    weight it leaves without a point, and pointing to scaler.coverage()."""
    cls, options = RECURRENT[case]
    model = Recurrent(cls, options)
    scaler = AdaptiveLossScaler()
    with pytest.warns(UserWarning, match=rf"'rnn' \({cls.__name__}\) is a recurrent layer") as record:
        scaler.attach(model)
    ours = [w for w in record if "recurrent layer" in str(w.message)]
    assert len(ours) == 1
    message = str(ours[0].message)
    weights = [n.removeprefix("rnn.") for n in _recurrent_weights(model)]
    assert len(weights) == (8 if options else 2)
    for name in weights:
        assert re.search(rf"\b{name}\b", message), (name, message)
    assert "bias" not in message
    assert "scaler.coverage()" in message
    assert ours[0].filename == __file__  # points at the caller of attach()


@pytest.mark.parametrize("case", sorted(RECURRENT))
def test_coverage_lists_recurrent_weights_as_unscaled(case):
    """The recurrent weights are listed under no point with the recurrent reason, the two linear layers as
    points with their weights, and the ATen count finds the recurrent GEMMs outside every point."""
    cls, options = RECURRENT[case]
    model = Recurrent(cls, options)
    scaler, attached = _attach(model)
    report = scaler.coverage(_sequences())
    assert [(p.name, p.kind, p.weight, p.beta) for p in report.points] == [
        ("inp", "layer", "inp.weight", True),
        ("out", "layer", "out.weight", True),
    ]
    assert [(w.name, w.module, w.module_type, w.reason) for w in report.unscaled] == [
        (name, "rnn", cls.__name__, RECURRENT_REASON) for name in _recurrent_weights(model)
    ]
    assert all(w.gemm for w in report.unscaled) and report.lookups == []
    assert not report.every_gemm_weight_has_a_point
    assert {c.param for c in report.outside} == set(_recurrent_weights(model))
    assert sorted((c.param, c.point) for c in report.calls if c.point) == [
        ("inp.weight", "inp"),
        ("out.weight", "out"),
    ]
    assert "Every GEMM weight has a point: no" in str(report)


def test_recurrent_cells_are_named_too():
    scaler = AdaptiveLossScaler()
    with pytest.warns(UserWarning, match=r"'cell' \(LSTMCell\).*weight_ih, weight_hh get no scaling point"):
        scaler.attach(Cell())
    report = scaler.coverage(torch.randn(2, 3))
    assert [(w.name, w.reason) for w in report.unscaled] == [
        ("cell.weight_ih", RECURRENT_REASON),
        ("cell.weight_hh", RECURRENT_REASON),
    ]
    assert sorted(c.param for c in report.outside) == ["cell.weight_hh", "cell.weight_ih"]


def test_models_without_recurrent_layers_attach_without_a_warning():
    for model in (_mlp(), _cnn(), Encoder()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            AdaptiveLossScaler().attach(model)


@pytest.mark.parametrize("case", ["lstm", "gru"])
def test_recurrent_gradients_stay_exact_without_a_point(case):
    """What the warning says: the recurrent layer's gradients are exact (float64, a beta above 1 at the
    output layer), brought to the root scale by the alpha of its output gradient."""
    cls, options = RECURRENT[case]
    torch.manual_seed(0)
    reference = Recurrent(cls, options).double()
    scaler, attached = _attach(copy.deepcopy(reference))
    x = _sequences().double()
    reference(x).square().mean().mul(1e-6).backward()
    scaler.scale(attached(x).square().mean().mul(1e-6)).backward()
    assert max(scaler.layer_betas().values()) > 1
    scaler.unscale_(torch.optim.SGD(attached.parameters(), lr=0.1))
    for (name, p), q in zip(attached.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


# ----------------------------------------------------------------------------------------------- products


@pytest.mark.parametrize("product_betas", [True, False])
def test_attention_products_with_and_without_betas(product_betas):
    """The attention call is a product point with a beta under product_betas=True and one passing alpha
    through without; the projections are layer points with their weights; the embedding table is a
    lookup; the positional embedding is under no point, not as a GEMM weight."""
    torch.manual_seed(0)
    scaler, attached = _attach(Encoder(), product_betas=product_betas)
    report = scaler.coverage(_tokens())
    products = [(p.name, p.beta) for p in report.points if p.kind == "product"]
    assert products == [("layer.self_attn", product_betas)]
    layers = {p.name: p.weight for p in report.points if p.kind == "layer"}
    assert layers == {
        "layer.self_attn.in_proj": "layer.self_attn.in_proj_weight",
        "layer.self_attn.out_proj": "layer.self_attn.out_proj.weight",
        "layer.linear1": "layer.linear1.weight",
        "layer.linear2": "layer.linear2.weight",
        "head": "head.weight",
    }
    assert [(w.name, w.reason) for w in report.lookups] == [("emb.weight", LOOKUP_REASON)]
    assert [(w.name, w.module, w.reason, w.gemm) for w in report.unscaled] == [
        ("pos", "", OTHER_REASON, False)
    ]
    assert report.outside == [] and len(report.calls) == 5
    assert report.every_gemm_weight_has_a_point
    assert str(report).endswith("Every GEMM weight has a point: yes")


def test_a_table_read_by_f_embedding_is_a_lookup():
    scaler, _ = _attach(FunctionalLookup())
    report = scaler.coverage(torch.tensor([1, 3, 5]))
    assert [w.name for w in report.lookups] == ["table"] and report.unscaled == []
    assert report.every_gemm_weight_has_a_point


# ----------------------------------------------------------------------------------------------- ATen count


@pytest.mark.parametrize("factory, shape", [(_cnn, (2, 3, 8, 8)), (_mlp, (4, 6))])
def test_every_gemm_call_of_a_cnn_and_an_mlp_is_inside_its_point(factory, shape):
    """Counted in ATen: the plain model makes as many GEMM calls with a parameter as the attached one has
    layer points, and in the attached model each of them runs inside the point of its own weight."""
    torch.manual_seed(0)
    model = factory()
    x = torch.randn(*shape)
    with torch.no_grad(), GemmCalls(dict(model.named_parameters())) as plain:
        model(x)
    scaler, _ = _attach(model)
    report = scaler.coverage(x)
    weight_of = {p.name: p.weight for p in report.points}
    assert plain.calls and len(report.calls) == len(plain.calls) == len(report.points)
    assert all(c.point is not None and weight_of[c.point] == c.param for c in report.calls)
    assert report.outside == [] and report.unscaled == []
    assert report.every_gemm_weight_has_a_point


def test_the_count_follows_weights_into_autocast_copies():
    """Under autocast each GEMM multiplies a BF16 copy of its weight: still counted, inside its point."""
    torch.manual_seed(0)
    scaler, _ = _attach(_cnn())
    x = torch.randn(2, 3, 8, 8)
    full = scaler.coverage(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = scaler.coverage(x)
    assert [(c.param, c.point) for c in cast.calls] == [(c.param, c.point) for c in full.calls]
    assert len(cast.calls) == 3 and cast.outside == []


@pytest.mark.parametrize("model, op", [(Einsum, "bmm"), (Tensordot, "mm")])
def test_a_gemm_the_transform_misses_is_named_by_its_parameter(model, op):
    """A parameter multiplied by a GEMM the transform does not rewrite shows up in the ATen count as a call
    outside every point, named by its parameter, and under no point with a GEMM reason."""
    scaler, _ = _attach(model())
    report = scaler.coverage(torch.randn(2, 6))
    assert [(c.op, c.param) for c in report.outside] == [(op, "w")]
    assert [(c.param, c.point) for c in report.calls if c.point] == [("fc.weight", "fc")]
    assert [(w.name, w.gemm) for w in report.unscaled] == [("w", True)]
    assert not report.every_gemm_weight_has_a_point
    assert re.search(rf"^  {op} +w +1$", str(report), re.M), str(report)


def test_without_inputs_nothing_is_counted():
    scaler, _ = _attach(Tensordot())
    report = scaler.coverage()
    assert report.calls is None and report.outside == []
    assert [(w.name, w.reason, w.gemm) for w in report.unscaled] == [("w", OTHER_REASON, False)]
    assert "not counted" in report.format()


# ----------------------------------------------------------------------------------------------- state


@pytest.mark.parametrize("training", [True, False])
def test_coverage_leaves_the_model_and_the_scaler_as_they_were(training):
    """Batch-norm statistics, the training flag and the random generator are as before coverage(x), and
    the next training step matches one taken without the report."""
    torch.manual_seed(0)
    model = _cnn().train(training)
    twin = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8)
    scaler, attached = _attach(model)
    twin_scaler, twin_attached = _attach(twin)
    buffers = {n: b.clone() for n, b in attached.named_buffers()}
    rng = torch.get_rng_state()
    flags = [m.training for m in attached.modules()]
    assert training in flags
    scaler.coverage(x)
    assert [m.training for m in attached.modules()] == flags
    assert {n: b for n, b in attached.named_buffers()}.keys() == buffers.keys()
    for name, b in attached.named_buffers():
        assert torch.equal(b, buffers[name]), name
    assert torch.equal(torch.get_rng_state(), rng)
    losses = []
    for s, m in ((scaler, attached), (twin_scaler, twin_attached)):
        torch.manual_seed(1)
        loss = m(x).square().mean()
        s.scale(loss).backward()
        losses.append((loss.detach(), [p.grad for p in m.parameters()], s.layer_betas()))
    assert torch.equal(losses[0][0], losses[1][0]) and losses[0][2] == losses[1][2]
    for g, h in zip(losses[0][1], losses[1][1], strict=True):
        assert torch.equal(g, h)


def test_a_failing_forward_pass_restores_what_coverage_patched():
    scaler, _ = _attach(_mlp())
    gemm_forward, product_forward = ScaledGEMM.__dict__["_forward"], Product.__dict__["forward"]
    with pytest.raises(RuntimeError):
        scaler.coverage(torch.randn(4, 5))  # wrong width
    assert ScaledGEMM.__dict__["_forward"] is gemm_forward
    assert Product.__dict__["forward"] is product_forward


def test_coverage_before_attach_raises():
    with pytest.raises(RuntimeError, match=r"attach\(\)"):
        AdaptiveLossScaler().coverage()
    with pytest.raises(RuntimeError, match="disabled"):
        AdaptiveLossScaler(enabled=False).coverage()


def test_the_report_is_exported_and_prints_as_its_table():
    scaler, _ = _attach(_mlp())
    report = scaler.coverage()
    assert isinstance(report, Coverage)
    assert str(report) == report.format()
    assert (
        report.format().splitlines()[0]
        == "Scaling points: 3 layers, 0 products (0 with a beta, 0 passing alpha through)"
    )
