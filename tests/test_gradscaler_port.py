"""PyTorch's device-generic GradScaler tests (the ``test_grad_scaling_*`` family of pytorch/pytorch
``test/test_torch.py`` and its ``_run_scaling_case`` harness, ``_create_scaling_case`` in
``torch/testing/_internal/common_cuda.py``), re-written for our scalers and run on the CPU.

Each test is parametrized over :data:`SCALERS`, a table of factories. The harness builds a control model
trained without scaling and a scaled copy, calls ``scaler.attach(model)`` on the scaled copy before building
its optimizer (identity for the scalar scalers; the adaptive scaler returns its transformed module), runs the
same iterations with one planted Inf, and checks the scale the rule predicts and that both models agree.
Where a scaler has GradScaler's rule (``twin``), the same iterations also run under ``torch.amp.GradScaler``
on a third copy, and parameters, gradients and optimizer state must be equal bit for bit. To add a scaler,
add a :class:`ScalerCase`.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from adaloss.scalers import AdaptiveLossScaler, DynamicLossScaler, FixedLossScaler, NoLossScaler

INIT = 128.0  # the harness's modest initial scale, and its unrealistically large growth (x2 every clean step)


@dataclass(frozen=True)
class ScalerCase:
    """How the harness makes and checks one kind of scaler."""

    make: Callable[[bool], object]  #: enabled -> a fresh scaler (its rule set as the harness expects)
    expected_scale: Callable[[int, int], float]  #: (clean steps, skipped steps) -> the scale after the run
    twin: Callable[[bool], torch.amp.GradScaler] | None = None  #: GradScaler with the same rule, if any
    no_twin: str = ""  #: why there is no twin (the skip reason)
    #: the scale after each update of an overflow pattern, where the scale is not constant without a twin
    scale_after: Callable[[list[bool]], float] | None = None
    one_model: str = ""  #: why one scaler cannot serve two models (the skip reason), if it cannot


SCALERS: dict[str, ScalerCase] = {
    "none": ScalerCase(
        make=lambda enabled: NoLossScaler(enabled=enabled),
        expected_scale=lambda unskipped, skipped: 1.0,
        no_twin="scaler=none keeps the scale at 1 and GradScaler has no constant mode (growth_factor must "
        "be > 1, backoff_factor < 1); it is checked against the unscaled control run instead",
    ),
    "fixed": ScalerCase(
        make=lambda enabled: FixedLossScaler(scale=INIT, enabled=enabled),
        expected_scale=lambda unskipped, skipped: INIT,
        no_twin="scaler=fixed never changes its scale and GradScaler has no constant mode (growth_factor "
        "must be > 1, backoff_factor < 1); it is checked against the unscaled control run instead",
    ),
    "dynamic": ScalerCase(
        make=lambda enabled: DynamicLossScaler(
            init_scale=INIT, growth_factor=2.0, growth_interval=1, enabled=enabled
        ),
        expected_scale=lambda unskipped, skipped: INIT * 2.0**unskipped * 0.5**skipped,
        twin=lambda enabled: torch.amp.GradScaler(
            "cpu", init_scale=INIT, growth_factor=2.0, growth_interval=1, enabled=enabled
        ),
    ),
    # The adaptive scaler keeps alpha_{N+1} unless two overflows come in a row (one only recomputes the
    # betas), so the harness's single Inf leaves it at INIT; its layer-wise betas (update_every=1) make
    # the scaled run differ from GradScaler's, so it is checked against the unscaled control run.
    "adaptive": ScalerCase(
        make=lambda enabled: AdaptiveLossScaler(init_scale=INIT, update_every=1, enabled=enabled),
        expected_scale=lambda unskipped, skipped: INIT,
        no_twin="the adaptive scaler scales layer by layer (no GradScaler rule to match bit for bit); it is "
        "checked against the unscaled control run instead",
        scale_after=lambda overflows: _adaptive_root(overflows),
        one_model="deliberate difference (AdaptiveLossScaler.attach): the adaptive scaler rewrites the one "
        "model it is attached to, so two models need two scalers",
    ),
}
KINDS = sorted(SCALERS)


def _adaptive_root(overflows: list[bool]) -> float:
    """alpha_{N+1} after these iterations (AdaptiveLossScaler's docstring): halved on the second overflow
    in a row and every one after it; doubled back towards INIT after 2000 clean steps."""
    scale, in_a_row, clean = INIT, 0, 0
    for bad in overflows:
        in_a_row, clean = (in_a_row + 1, 0) if bad else (0, clean + 1)
        if in_a_row >= 2:
            scale /= 2
        if clean >= 2000 and scale < INIT:
            scale, clean = scale * 2, 0
    return scale


# ---------------------------------------------------------------------------------------------- the harness


def _models(copies: int) -> list[nn.Module]:
    """``copies`` identical models: the 8x8 linear pair of ``_create_scaling_models_optimizers``."""
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    out = [first]
    for _ in range(copies - 1):
        other = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        other.load_state_dict(first.state_dict())
        out.append(other)
    return out


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(4)]


SKIP_ITER = 2  # the iteration whose gradients the scaled runs poison with Inf

Run = Callable[..., object]


def _optimizer(model: nn.Module, ctor, kwargs) -> torch.optim.Optimizer:
    return ctor(model.parameters(), **{"lr": 1.0, **(kwargs or {})})


def _assert_close_runs(control, scaled, opt_control, opt_scaled, atol: float) -> None:
    for c, s in zip(control.parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(c.grad, s.grad, atol=atol, rtol=1e-5)
        for key in opt_control.state[c]:
            torch.testing.assert_close(
                opt_control.state[c][key], opt_scaled.state[s][key], atol=atol, rtol=1e-5
            )
        torch.testing.assert_close(c, s, atol=atol, rtol=1e-5)


def run_scaling_case(kind: str, run: Run, unskipped: int, skipped: int, atol: float = 1e-7,
                     optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None) -> None:  # fmt: skip
    """``_run_scaling_case``: enabled and disabled, the scaled run must match the control run and end at the
    scale the rule predicts (1.0 when disabled: one training loop for every configuration)."""
    case = SCALERS[kind]
    for enabled in (True, False):
        control, scaled = _models(2)
        scaler = case.make(enabled)
        scaled = scaler.attach(scaled)
        opt_control = _optimizer(control, optimizer_ctor, optimizer_kwargs)
        opt_scaled = _optimizer(scaled, optimizer_ctor, optimizer_kwargs)
        data = _data()
        run(data, control, opt_control, scaler, SKIP_ITER, False)
        scaler = run(data, scaled, opt_scaled, scaler, SKIP_ITER, True) or scaler
        expected = case.expected_scale(unskipped, skipped) if enabled else 1.0
        assert scaler.get_scale() == expected
        _assert_close_runs(control, scaled, opt_control, opt_scaled, atol)


def run_against_grad_scaler(
    kind: str, run: Run, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None
) -> None:
    """The same scaled iterations under our scaler and under its GradScaler twin: equal bit for bit."""
    case = SCALERS[kind]
    if case.twin is None:
        pytest.skip(case.no_twin)
    for enabled in (True, False):
        ours_model, their_model = _models(2)
        ours = case.make(enabled)
        ours_model = ours.attach(ours_model)
        theirs = case.twin(enabled)
        opt_ours = _optimizer(ours_model, optimizer_ctor, optimizer_kwargs)
        opt_theirs = _optimizer(their_model, optimizer_ctor, optimizer_kwargs)
        ours = run(_data(), ours_model, opt_ours, ours, SKIP_ITER, True) or ours
        theirs = run(_data(), their_model, opt_theirs, theirs, SKIP_ITER, True) or theirs
        assert ours.get_scale() == theirs.get_scale()
        for a, b in zip(ours_model.parameters(), their_model.parameters(), strict=True):
            assert torch.equal(a, b)
            assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
            for key in opt_ours.state[a]:
                assert torch.equal(opt_ours.state[a][key], opt_theirs.state[b][key]), key


def _poison(model: nn.Module, scaler, i: int) -> None:
    if i == SKIP_ITER and scaler.is_enabled():
        model.get_submodule("1").weight.grad.data.fill_(float("inf"))


def _step_unless_skipped(optimizer, scaler, i: int) -> None:
    if (not scaler.is_enabled()) or i != SKIP_ITER:
        optimizer.step()


# ---------------------------------------------------------------------------------------------- the runs


def run_plain(data, model, optimizer, scaler, skip_iter, try_scaling_api, autocast=False, try_pickle=False):
    """test_grad_scaling_autocast's loop; ``try_pickle``: the scaler is pickled and unpickled after each
    iteration, and the copy drives the next one (the same model, the same optimizer)."""
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if try_scaling_api:
            scaler.scale(loss).backward()
            _poison(model, scaler, i)
            scaler.step(optimizer)
            scaler.update()
            if try_pickle:
                scaler = pickle.loads(pickle.dumps(scaler))
        else:
            loss.backward()
            _step_unless_skipped(optimizer, scaler, i)
    return scaler


def run_clipping(data, model, optimizer, scaler, skip_iter, try_scaling_api):
    """Clip the scaled gradients at ``max_norm * scale`` (test_grad_scaling_clipping)."""
    max_norm = 0.2
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if try_scaling_api:
            scaler.scale(loss).backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
            _poison(model, scaler, i)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            _step_unless_skipped(optimizer, scaler, i)
    return scaler


def run_clipping_separate_unscale(data, model, optimizer, scaler, skip_iter, try_scaling_api):
    """``unscale_`` first, then clip the true gradients (test_grad_scaling_clipping_separate_unscale)."""
    max_norm = 0.2
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if try_scaling_api:
            scaler.scale(loss).backward()
            _poison(model, scaler, i)
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            _step_unless_skipped(optimizer, scaler, i)
    return scaler


def run_penalty(data, model, optimizer, scaler, skip_iter, try_scaling_api):
    """A gradient penalty through ``autograd.grad`` of the scaled loss (test_grad_scaling_penalty)."""
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if try_scaling_api:
            grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
            grads = [g * (1.0 / scaler.get_scale()) for g in grads]
        else:
            grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        loss = loss + sum(g.pow(2).sum() for g in grads).sqrt()
        if try_scaling_api:
            scaler.scale(loss).backward()
            _poison(model, scaler, i)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            _step_unless_skipped(optimizer, scaler, i)
    return scaler


def run_accumulation(data, model, optimizer, scaler, skip_iter, try_scaling_api):
    """Two backward passes per step (test_grad_scaling_accumulation): no Inf, 2 steps."""
    every = 2
    for i, (x, y) in enumerate(data):
        loss = nn.functional.mse_loss(model(x), y) / every
        (scaler.scale(loss) if try_scaling_api else loss).backward()
        if (i + 1) % every == 0:
            if try_scaling_api:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
    return scaler


# ---------------------------------------------------------------------------------------------- the tests


RUNS = {
    "plain": (run_plain, 3, 1, 1e-7),
    "clipping": (run_clipping, 3, 1, 1e-5),
    "clipping_separate_unscale": (run_clipping_separate_unscale, 3, 1, 1e-6),
    "penalty": (run_penalty, 3, 1, 1e-7),
    "accumulation": (run_accumulation, 2, 0, 1e-7),
}


@pytest.mark.parametrize("name", sorted(RUNS))
@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_matches_the_unscaled_control(kind: str, name: str) -> None:
    run, unskipped, skipped, atol = RUNS[name]
    run_scaling_case(kind, run, unskipped, skipped, atol=atol)


@pytest.mark.parametrize("name", sorted(RUNS))
@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_matches_grad_scaler_bit_for_bit(kind: str, name: str) -> None:
    run_against_grad_scaler(kind, RUNS[name][0])


@pytest.mark.parametrize(
    ("optimizer_ctor", "optimizer_kwargs"),
    [
        (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 1e-4}),
        (torch.optim.Adam, {"lr": 0.01}),
        (torch.optim.AdamW, {"lr": 0.01, "foreach": True}),
        (torch.optim.Adam, {"lr": 0.01, "fused": True}),  # _step_supports_amp_scaling: the kernel unscales
        (torch.optim.SGD, {"momentum": 0.9, "fused": True}),
    ],
    ids=["sgd_momentum", "adam", "adamw_foreach", "adam_fused", "sgd_fused"],
)
@pytest.mark.parametrize("twin", [False, True], ids=["control", "grad_scaler"])
@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_autocast_with_each_optimizer(
    kind: str, twin: bool, optimizer_ctor, optimizer_kwargs
) -> None:
    """test_grad_scaling_autocast and its optimizer variants: CPU autocast (bfloat16), FP32 master weights;
    against the control run, and (``twin``) against GradScaler bit for bit. As PyTorch's test, a second
    round pickles the scaler after every iteration and trains on with the copy."""
    for try_pickle in (False, True):

        def run(*args, try_pickle=try_pickle):
            return run_plain(*args, autocast=True, try_pickle=try_pickle)

        options = {"optimizer_ctor": optimizer_ctor, "optimizer_kwargs": optimizer_kwargs}
        if twin:
            run_against_grad_scaler(kind, run, **options)
        else:
            run_scaling_case(kind, run, 3, 1, atol=1e-3, **options)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_multiple(kind: str) -> None:
    """Two models, two optimizers, one scaler; only the second one's step is skipped
    (test_grad_scaling_multiple), one of them unscaled separately."""
    case = SCALERS[kind]
    if case.one_model:
        pytest.skip(case.one_model)
    for enabled in (True, False):
        c0, c1, s0, s1 = _models(4)
        scaler = case.make(enabled)
        s0, s1 = scaler.attach(s0), scaler.attach(s1)
        opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in (c0, c1, s0, s1)]
        for i, (x, y) in enumerate(_data()):
            for opt in opts:
                opt.zero_grad()
            for (m0, m1), (o0, o1), scaling in (((c0, c1), opts[:2], False), ((s0, s1), opts[2:], True)):
                out0, out1 = m0(x), m1(x)
                loss0 = nn.functional.mse_loss(0.3 * out0 + 0.7 * out1, y)
                loss1 = nn.functional.mse_loss(0.6 * out0 - 0.4 * out1, y)
                if scaling:
                    scaler.scale(loss0).backward(retain_graph=True)
                    scaler.scale(loss1).backward()
                    _poison(m1, scaler, i)
                    scaler.unscale_(o0)
                    scaler.step(o0)
                    scaler.step(o1)
                    scaler.update()
                else:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    o0.step()
                    _step_unless_skipped(o1, scaler, i)
        assert scaler.get_scale() == (case.expected_scale(3, 1) if enabled else 1.0)
        _assert_close_runs(c0, s0, opts[0], opts[2], 1e-7)
        _assert_close_runs(c1, s1, opts[1], opts[3], 1e-7)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_unscale(kind: str) -> None:
    """``unscale_`` divides the gradients by the scale in place and finds Inf and NaN; ``step`` then skips
    (test_grad_scaling_unscale, through the scaler rather than the bare kernel)."""
    for bad in (None, float("inf"), float("nan")):
        scaler = SCALERS[kind].make(True)
        param = nn.Parameter(torch.zeros(20, 20))
        optimizer = torch.optim.SGD([param], lr=1.0)
        scale = scaler.get_scale()
        scaler.scale((param * 4.0).sum()).backward()
        assert torch.equal(param.grad, torch.full((20, 20), 4.0 * scale))
        if bad is not None:
            param.grad[6, 6] = bad
        scaler.unscale_(optimizer)
        expected = torch.full((20, 20), 4.0)
        if bad is None:
            assert torch.equal(param.grad, expected)
        scaler.step(optimizer)
        scaler.update()
        assert scaler.last_step_skipped is (bad is not None)
        assert torch.equal(param.detach(), torch.zeros(20, 20) if bad is not None else -expected)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_unscale_sparse(kind: str) -> None:
    """Sparse gradients are unscaled through their values and checked; FP16 sparse gradients are coalesced
    first, so duplicate indices that overflow FP16 only once summed are found
    (test_grad_scaling_unscale_sparse)."""
    scaler = SCALERS[kind].make(True)
    scale = scaler.get_scale()
    scaler.scale(torch.ones(()))
    indices = torch.tensor([[0, 1, 2], [2, 0, 2]])
    for bad, skipped in ((None, False), (float("inf"), True), (float("nan"), True)):
        values = torch.tensor([16.0, 32.0, 64.0]) * scale
        if bad is not None:
            values[1] = bad
        param = nn.Parameter(torch.zeros(3, 3))
        param.grad = torch.sparse_coo_tensor(indices, values, (3, 3), check_invariants=True)
        optimizer = torch.optim.SGD([param], lr=1.0)
        scaler.step(optimizer)
        scaler.update()
        scale = scaler.get_scale()
        scaler.scale(torch.ones(()))
        assert scaler.last_step_skipped is skipped
        if not skipped:
            assert torch.equal(param.grad.coalesce().values(), torch.tensor([16.0, 32.0, 64.0]))
    # FP16: two entries at one index, each finite, their sum (2 * 2**15) is Inf in FP16
    param = nn.Parameter(torch.zeros(3, 3, dtype=torch.float16))
    param.grad = torch.sparse_coo_tensor(
        torch.tensor([[1, 1], [2, 2]]), torch.full((2,), 2.0**15).half(), (3, 3)
    )
    groups = scaler._grads_by_device_and_dtype(torch.optim.SGD([param], lr=1.0), allow_fp16=True)
    assert scaler._unscale_grad_groups_(groups, 1.0).item() > 0


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_update_scale(kind: str) -> None:
    """The scale and growth tracker after each update (test_grad_scaling_update_scale, which drives
    ``torch._amp_update_scale_``): compared with GradScaler's where the rule is GradScaler's."""
    case = SCALERS[kind]
    pattern = [False, False, True, False, False, False, True, True, False]
    ours = case.make(True)
    theirs = case.twin(True) if case.twin else None
    for step, bad in enumerate(pattern):
        for scaler in (ours, theirs) if theirs is not None else (ours,):
            param = nn.Parameter(torch.zeros(2))
            optimizer = torch.optim.SGD([param], lr=1.0)
            scaler.scale(param.sum()).backward()
            if bad:
                param.grad[0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
        if theirs is None and case.scale_after is not None:
            assert ours.get_scale() == case.scale_after(pattern[: step + 1])
        elif theirs is None:
            assert ours.get_scale() == case.expected_scale(0, 0)  # a constant scale
        else:
            assert ours.get_scale() == theirs.get_scale()
            assert ours.growth_tracker == theirs._get_growth_tracker()
    if theirs is None:
        pytest.skip(case.no_twin)


@pytest.mark.parametrize("lazy_init_scale", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_state_dict(kind: str, lazy_init_scale: bool) -> None:
    """A state dict moves the scale (and, where the scaler has them, the growth factor, backoff factor,
    interval and tracker) into a scaler made with other values, before or after its first scale()."""
    if kind == "dynamic":
        s0 = DynamicLossScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        s1 = DynamicLossScaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
        s1._growth_tracker = 7  # a value for load_state_dict to overwrite
    else:
        s0, s1 = SCALERS[kind].make(True), SCALERS[kind].make(True)
    if lazy_init_scale:
        s1.scale(torch.full((1,), 4.0))
    s1.load_state_dict(s0.state_dict())
    assert s1.get_scale() == s0.get_scale()
    assert s1.state_dict() == s0.state_dict()
    if kind == "dynamic":
        assert (s1.get_scale(), s1.get_growth_factor(), s1.get_backoff_factor()) == (3.0, 4.0, 0.5)
        assert (s1.get_growth_interval(), s1.growth_tracker) == (2, 0)
        theirs = torch.amp.GradScaler("cpu", init_scale=6.0, growth_factor=7.0, growth_interval=1)
        if lazy_init_scale:
            theirs.scale(torch.full((1,), 4.0))
        theirs.load_state_dict(s0.state_dict())
        assert (theirs.get_scale(), theirs.get_growth_factor(), theirs.get_growth_interval()) == (3.0, 4.0, 2)


CONTAINERS = {
    "tensor": lambda t: t,
    "list": lambda t: [t, t * 2],
    "tuple": lambda t: (t, (t * 2, [t * 3])),
    "generator": lambda t: (x for x in [t, t * 2]),
}


@pytest.mark.parametrize("container", sorted(CONTAINERS))
@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_scale(kind: str, container: str) -> None:
    """``scale`` multiplies a tensor and the tensors of nested lists and tuples, keeping the structure
    (test_grad_scaling_scale; its second-GPU case needs two GPUs)."""
    if container == "generator":
        pytest.skip(
            "deliberate difference (LossScaler.scale's docstring): GradScaler maps other iterables lazily "
            "and returns an iterator; ours refuses them with a TypeError"
        )
    scaler = SCALERS[kind].make(True)
    t = torch.full((1,), 4.0)
    scaled = scaler.scale(CONTAINERS[container](t))
    scale = scaler.get_scale()
    flat: list[torch.Tensor] = []

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            flat.append(value)
        else:
            assert isinstance(value, (list, tuple))
            for v in value:
                walk(v)

    walk(scaled)
    expected = {"tensor": [1], "list": [1, 2], "tuple": [1, 2, 3]}[container]
    assert [v.item() for v in flat] == [4.0 * k * scale for k in expected]
    assert type(scaled) is type(CONTAINERS[container](t))


def run_preset_grad_scale(data, model, optimizer, scaler, skip_iter, try_scaling_api):
    """A caller-set ``optimizer.grad_scale`` multiplies the scaler's for a fused optimizer, and is removed
    after the step (GradScaler.step's product of scales)."""
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        _poison(model, scaler, i)
        optimizer.grad_scale = torch.tensor(4.0)
        scaler.step(optimizer)
        assert hasattr(optimizer, "grad_scale") is not scaler.is_enabled()  # disabled: a plain step
        if hasattr(optimizer, "grad_scale"):
            del optimizer.grad_scale
        scaler.update()
    return scaler


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_with_a_preset_grad_scale(kind: str) -> None:
    run_against_grad_scaler(kind, run_preset_grad_scale, torch.optim.Adam, {"lr": 0.01, "fused": True})
