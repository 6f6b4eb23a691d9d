"""The adaptive scaler's step compiles (issue 34): ``torch.compile(scaler.attach(model), fullgraph=True)``
traces Algorithm 3 into one graph per pass kind, with no graph break and no recompile while the alphas,
betas and the root scale change; the scales stay in device buffers at fixed addresses; the compiled
gradients are the eager ones (bitwise with ``aot_eager``, to FP32 rounding with Inductor) through
recompute and reuse passes, a skipped step and a resume; and a reuse pass hands no kernel a Python float
that came from a scale. CPU, FP32 (the compiled path is the same code on every device)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from adaloss.lab.bench.compiled import compile_run
from adaloss.scalers.adaptive import AdaptiveLossScaler


class Net(nn.Module):
    """Every kind of point: convs with batch norms (carried parameters), a residual branch, an
    activation-by-activation product (an attention-like matmul), a linear head with a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.stem(x)))
        h = h + torch.relu(self.conv(h))  # h feeds two consumers: a branch point
        t = h.flatten(2).transpose(1, 2)  # (batch, 16 tokens, 8)
        scores = self.q(t) @ self.k(t).transpose(1, 2)  # a product of two activations
        t = torch.softmax(scores, dim=-1) @ t
        return self.head(t.mean(1))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 3, 4, 4, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(n)]


#: the run (update_every=4): 0 recompute, 1 reuse, 2 a reuse that overflows (skipped), 3 recompute (after
#: the skip), 4 recompute (scheduled), 5 reuse; resumed at 6 into a reuse, 7 reuse, 8 recompute
OVERFLOW_AT, RESUME_AT, STEPS = 2, 6, 9
KINDS = ["recompute", "reuse", "reuse", "recompute", "recompute", "reuse", "reuse", "reuse", "recompute"]


def _train(backend: str | None) -> tuple[list[str], list[list[torch.Tensor]]]:
    """The pass kind and parameter gradients of each step, eager (``backend`` None) or compiled; at
    ``RESUME_AT`` the run continues in a new scaler and model loaded from the state dicts."""
    dynamo.reset()
    torch.manual_seed(0)
    base = Net()
    kinds, grads = [], []
    scaler, model, forward, opt = None, None, None, None
    for step, (x, y) in enumerate(_batches(STEPS)):
        if step in (0, RESUME_AT):
            saved = None if step == 0 else (scaler.state_dict(), copy.deepcopy(model.state_dict()))
            scaler = AdaptiveLossScaler(update_every=4, init_scale=2.0**-6)
            model = scaler.attach(copy.deepcopy(base))
            if saved is not None:
                scaler.load_state_dict(saved[0])
                model.load_state_dict(saved[1])
            forward = model if backend is None else torch.compile(model, fullgraph=True, backend=backend)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = nn.functional.cross_entropy(forward(x), y)
        if step == OVERFLOW_AT:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        scaler.step(opt)
        kinds.append(scaler.last_pass)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return kinds, grads


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]], step: int) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[step], b[step], strict=True))


def test_aot_eager_gradients_are_the_eager_ones_bitwise_through_skip_and_resume() -> None:
    kinds, eager = _train(None)
    assert kinds == KINDS, kinds
    compiled_kinds, compiled = _train("aot_eager")
    assert compiled_kinds == kinds
    for step in range(STEPS):
        if step == OVERFLOW_AT:  # non-finite either way
            assert not all(torch.isfinite(g).all() for g in compiled[step])
            continue
        assert _same(eager, compiled, step), f"step {step} ({kinds[step]})"


@pytest.mark.slow
def test_inductor_gradients_match_eager_to_float32_rounding() -> None:
    kinds, eager = _train(None)
    compiled_kinds, compiled = _train("inductor")
    assert compiled_kinds == kinds
    for step in range(STEPS):
        if step == OVERFLOW_AT:
            continue
        # FP32 rounding of the model's gradients: gradients zero in exact arithmetic (the stem's bias, under
        # a batch norm) are rounding noise of the largest ones, in whichever order the kernels sum
        largest = max(float(a.abs().max()) for a in eager[step])
        for a, b in zip(eager[step], compiled[step], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6 * largest)


def test_a_small_resnet_compiles_to_one_graph_per_kind_while_its_scales_change() -> None:
    """ResNet-8: 24 steps with ``update_every=3`` and a root scale doubling every 4 steps."""
    r = compile_run("resnet8", steps=24, update_every=3, growth_interval=4, init_scale=2.0**7)
    assert r["error"] is None
    assert r["graphs"] == 2 and r["graph_breaks"] == 0 and r["recompiles"] == 0, r
    assert r["kinds"]["recompute"] >= 4 and r["kinds"]["reuse"] >= 8, r
    assert r["root_scales"] >= 3 and r["beta_sets"] >= 2, r  # the scales did change
    assert r["addresses_fixed"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "steps"), [("resnet20", 300), ("gpt", 300), ("resnet110", 300), ("ssd300", 300)]
)
def test_the_issues_models_compile_without_breaks_or_recompiles(name: str, steps: int) -> None:
    r = compile_run(name, steps=steps)
    assert r["error"] is None and r["steps"] == steps, r
    assert r["graphs"] == 2 and r["graph_breaks"] == 0 and r["recompiles"] == 0, r
    assert r["root_scales"] >= 3 and r["beta_sets"] >= 2 and r["addresses_fixed"], r


class _FloatArgs(TorchDispatchMode):
    """Every Python float passed to an aten op."""

    def __init__(self) -> None:
        super().__init__()
        self.floats: list[tuple[str, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(value, float):
                self.floats.append((str(func), value))
        return func(*args, **kwargs)


def test_a_reuse_pass_takes_no_python_float_from_a_scale() -> None:
    """Scales reach a reuse pass's kernels as device tensors (what a compiled or captured step replays),
    never as host floats: no aten op of the backward pass gets a float equal to any alpha, beta, branch
    factor or ``alpha_{N+1} / alpha`` of the buffers (all but 1 differ from every constant of the model)."""
    torch.manual_seed(0)
    scaler = AdaptiveLossScaler(update_every=2, init_scale=2.0**-6)
    model = scaler.attach(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    batches = _batches(2)
    for step, (x, y) in enumerate(batches):
        loss = nn.functional.cross_entropy(model(x), y)
        if step == 1:
            with _FloatArgs() as seen:
                scaler.scale(loss).backward()
        else:
            scaler.scale(loss).backward()
        assert scaler.last_pass == ("recompute", "reuse")[step]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    scales = {v for t in scaler.state.buffers.tensors().values() if t.is_floating_point() for v in t.tolist()}
    scales -= {1.0}
    assert len(scales) >= 3, scales  # distinctive scales were in use
    assert not [(op, v) for op, v in seen.floats if v in scales]
