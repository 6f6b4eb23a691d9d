"""Loss scalers: GradScaler equivalence, skipped steps, the state machine, checkpoints and config parsing."""

from __future__ import annotations

import copy
import io
import math
import re
from collections import namedtuple

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from adaloss.errors import ConfigError
from adaloss.runner.engine.config import validate_config
from adaloss.runner.utils.targets import build_scaler
from adaloss.scalers import (
    DynamicLossScaler,
    FixedLossScaler,
    LossScaler,
    NoLossScaler,
)
from conftest import compose_train

INF, NAN = float("inf"), float("nan")


# ---------------------------------------------------------------------- helpers


def _params(seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(4, 3, generator=gen)), nn.Parameter(torch.randn(3, generator=gen))]


def _drive(scaler: LossScaler, overflows: list[bool]) -> list[float]:
    """Run one iteration per entry (True: an Inf gradient) and return the scale after each update()."""
    param = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scales = []
    for bad in overflows:
        scaler.scale(torch.ones(()))  # as GradScaler, step() needs a scale() first
        param.grad = torch.tensor([1.0, INF if bad else 1.0])
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _snapshot(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> tuple[list, dict]:
    return [p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict())


def _assert_bitwise_equal(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_bitwise_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_bitwise_equal(x, y)
    else:
        assert a == b


# ---------------------------------------------------------------------- the key test: GradScaler equivalence

# iteration -> what is planted in the gradient: a literal Inf, a NaN, or a finite value that overflows float32
# only once multiplied by the loss scale (an overflow the scale itself causes).
PLANTED = {4: "inf", 9: "nan", 14: "inf", 15: "nan", 16: "huge", 22: "huge", 27: "inf"}


def _coefficients(n: int = 30) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    sequence = []
    for i in range(n):
        coeffs = [torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)]
        kind = PLANTED.get(i)
        if kind == "inf":
            coeffs[0][1, 2] = INF
        elif kind == "nan":
            coeffs[1][0] = NAN
        elif kind == "huge":
            coeffs[0][0, 0] = 1e36  # finite; times a scale >= 2**9 it is Inf in float32
        sequence.append(coeffs)
    return sequence


def _train(scaler, sequence: list[list[torch.Tensor]]) -> tuple[list[float], list[int], list[nn.Parameter]]:
    """Adam on raw parameters, loss sum(p * c): the gradient of p is the planted c (times the scale)."""
    params = _params()
    optimizer = torch.optim.Adam(params, lr=0.05)
    scales, skipped = [], []
    for i, coeffs in enumerate(sequence):
        optimizer.zero_grad(set_to_none=True)
        loss = sum((p * c).sum() for p, c in zip(params, coeffs, strict=True))
        scaler.scale(loss).backward()
        if i % 2 == 0:
            scaler.unscale_(optimizer)  # exercise the explicit path on half of the iterations
        steps_before = float(optimizer.state[params[0]].get("step", 0))
        scaler.step(optimizer)
        if float(optimizer.state[params[0]].get("step", 0)) == steps_before:
            skipped.append(i)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, skipped, params


@pytest.mark.parametrize("min_scale", [None, 0, 1.0])
def test_dynamic_matches_torch_grad_scaler(min_scale: float | None) -> None:
    sequence = _coefficients()
    ours = DynamicLossScaler(init_scale=2.0**16, growth_interval=3, min_scale=min_scale)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)

    our_scales, our_skipped, our_params = _train(ours, sequence)
    their_scales, their_skipped, their_params = _train(theirs, sequence)

    assert our_scales == their_scales
    assert our_skipped == their_skipped
    for a, b in zip(our_params, their_params, strict=True):
        assert torch.equal(a, b)
    # the sequence exercised what it was built for: every planted overflow skipped, growth and backoff seen
    assert our_skipped == sorted(PLANTED)
    assert ours.skipped_steps == ours.overflow_count == len(PLANTED)
    assert any(b > a for a, b in zip(our_scales, our_scales[1:], strict=False))
    assert any(b < a for a, b in zip(our_scales, our_scales[1:], strict=False))


def test_dynamic_matches_grad_scaler_when_growth_would_overflow_float32() -> None:
    ours = DynamicLossScaler(init_scale=2.0**126, growth_interval=1, min_scale=None)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**126, growth_interval=1)
    param = nn.Parameter(torch.zeros(1))
    for scaler in (ours, theirs):
        optimizer = torch.optim.SGD([param], lr=0.0)
        for _ in range(3):
            scaler.scale(param.sum()).backward()
            scaler.step(optimizer)
            scaler.update()
            param.grad = None
    assert ours.get_scale() == theirs.get_scale() == 2.0**127


# ---------------------------------------------------------------------- skipped steps


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=0.01),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    ],
    ids=["sgd-momentum", "adam", "adamw"],
)
@pytest.mark.parametrize("make_scaler", [NoLossScaler, FixedLossScaler, DynamicLossScaler])
@pytest.mark.parametrize("bad", [INF, NAN])
def test_skipped_step_leaves_params_and_optimizer_state_bitwise_unchanged(make_optimizer, make_scaler, bad):
    params = _params()
    optimizer = make_optimizer(params)
    scaler = make_scaler()
    for _ in range(2):  # build up momentum / Adam moments first
        optimizer.zero_grad()
        scaler.scale(sum(p.square().sum() for p in params)).backward()
        scaler.step(optimizer)
        scaler.update()
    before = _snapshot(optimizer, params)

    optimizer.zero_grad()
    scaler.scale(sum(p.square().sum() for p in params) * bad).backward()
    assert scaler.step(optimizer) is None
    scaler.update()

    _assert_bitwise_equal(_snapshot(optimizer, params), before)
    assert scaler.last_step_skipped
    assert scaler.skipped_steps == 1 and scaler.overflow_count == 1


def _adaptive_scaler():
    from adaloss.scalers.adaptive import AdaptiveLossScaler

    return AdaptiveLossScaler()


@pytest.mark.parametrize(
    "make_scaler",
    [NoLossScaler, FixedLossScaler, DynamicLossScaler, _adaptive_scaler],
    ids=["none", "fixed", "dynamic", "adaptive"],
)
def test_found_inf_is_all_reduced_under_torch_distributed(make_scaler, monkeypatch) -> None:
    """With a (simulated) process group of 2, the flag is MAX-all-reduced once per optimizer before step()
    reads it: another rank's Inf skips this rank's step too, with this rank's gradients all finite. (The real
    2-process run is in tests/test_distributed.py.)"""
    from adaloss.scalers import base

    calls = []

    def all_reduce(tensor, op=None, group=None):
        calls.append((tensor.shape, op))
        tensor.fill_(1.0)  # the other rank saw an Inf

    scaler = make_scaler()
    model = scaler.attach(nn.Linear(2, 1))  # one process while attaching (adaptive: no statistics group)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(3, 2)).sum()).backward()
    monkeypatch.setattr(base, "distributed_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    assert scaler.step(optimizer) is None
    scaler.update()
    assert scaler.last_step_skipped and scaler.skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert calls == [(torch.Size([]), torch.distributed.ReduceOp.MAX)]


def test_last_step_skipped_keeps_the_lr_schedule_in_place() -> None:
    params = _params()
    optimizer = torch.optim.SGD(params, lr=0.8)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scaler = DynamicLossScaler(init_scale=8.0)
    flags = []
    for factor in (1.0, NAN, 1.0, INF, INF):
        optimizer.zero_grad()
        scaler.scale(sum(p.sum() for p in params) * factor).backward()
        scaler.step(optimizer)
        scaler.update()
        flags.append(scaler.last_step_skipped)
        if not scaler.last_step_skipped:  # what the trainer does
            schedule.step()
    assert flags == [False, True, False, True, True]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.8 * 0.5**2)
    assert scaler.skipped_steps == 3 and scaler.overflow_count == 3
    assert scaler.get_scale() == 8.0 * 0.5**3


def test_no_loss_scaler_keeps_scale_one_and_skips_non_finite_steps() -> None:
    scaler = NoLossScaler()
    loss = torch.tensor(3.0, requires_grad=True)
    assert torch.equal(scaler.scale(loss), loss)
    assert _drive(scaler, [False, True, True, False]) == [1.0] * 4
    assert scaler.skipped_steps == 2 and scaler.overflow_count == 2
    assert scaler.loss_scale_metric() == 1.0
    with pytest.raises(ValueError, match="keeps the loss scale at 1.0"):
        scaler.update(new_scale=2.0)


def test_only_the_overflowing_optimizer_is_skipped_but_the_scale_backs_off_once() -> None:
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.5), torch.optim.SGD([b], lr=0.5)
    scaler = DynamicLossScaler(init_scale=4.0)
    scaler.scale(a.sum() + b.sum() * INF).backward()
    assert scaler.step(opt_a) is None and not scaler.last_step_skipped
    scaler.step(opt_b)
    assert scaler.last_step_skipped
    scaler.update()
    assert torch.equal(a.detach(), torch.full((2,), 0.5)) and torch.equal(b.detach(), torch.ones(2))
    assert scaler.get_scale() == 2.0
    assert scaler.skipped_steps == 1 and scaler.overflow_count == 1


# ---------------------------------------------------------------------- unscale_ and the state machine


@pytest.mark.parametrize("make_scaler", [lambda: FixedLossScaler(scale=1024), lambda: DynamicLossScaler()])
def test_unscale_gives_true_grads_then_step_applies_them(make_scaler) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 5), torch.randn(8, 2)

    nn.functional.mse_loss(reference(x), y).backward()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_optimizer.step()

    scaler = make_scaler()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    scaler.unscale_(optimizer)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # a power-of-two scale unscales exactly
    scaler.step(optimizer)  # must not unscale a second time
    scaler.update()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_state_machine_errors() -> None:
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = DynamicLossScaler()
    scaler.scale(param.sum()).backward()
    with pytest.raises(RuntimeError, match=re.escape("update() was called before any step()")):
        scaler.update()
    scaler.unscale_(optimizer)
    with pytest.raises(
        RuntimeError,
        match=re.escape("unscale_() has already been called on this optimizer since the last update()."),
    ):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match=re.escape("unscale_() was called after step()")):
        scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match=re.escape("step() has already been called on this optimizer")):
        scaler.step(optimizer)
    scaler.update()

    scaler.scale(param.sum()).backward()  # a new iteration starts cleanly after update()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    with pytest.raises(RuntimeError, match="closures"):
        scaler.step(optimizer, closure=lambda: 0.0)


def test_scale_handles_nested_sequences() -> None:
    scaler = FixedLossScaler(scale=4)
    Pair = namedtuple("Pair", "a b")
    out = scaler.scale(
        [torch.ones(2), (torch.ones(1), [torch.full((), 2.0)]), Pair(torch.ones(1), torch.zeros(1))]
    )
    assert torch.equal(out[0], torch.full((2,), 4.0))
    assert isinstance(out[1], tuple) and torch.equal(out[1][1][0], torch.tensor(8.0))
    assert isinstance(out[2], Pair) and torch.equal(out[2].a, torch.tensor([4.0]))
    with pytest.raises(TypeError, match="scale\\(\\) takes a Tensor"):
        scaler.scale({"loss": torch.ones(1)})


def test_sparse_gradients_are_unscaled_and_checked() -> None:
    embedding = nn.Embedding(10, 3, sparse=True)
    optimizer = torch.optim.SGD(embedding.parameters(), lr=1.0)
    scaler = FixedLossScaler(scale=8)
    before = embedding.weight.detach().clone()
    scaler.scale(embedding(torch.tensor([1, 1, 4])).sum()).backward()
    scaler.unscale_(optimizer)
    assert torch.equal(embedding.weight.grad.to_dense().sum(dim=1)[[1, 4]], torch.tensor([6.0, 3.0]))
    scaler.step(optimizer)
    scaler.update()
    assert not torch.equal(embedding.weight.detach(), before)

    optimizer.zero_grad()
    after = embedding.weight.detach().clone()
    scaler.scale(embedding(torch.tensor([2])).sum() * INF).backward()
    assert scaler.step(optimizer) is None
    scaler.update()
    assert torch.equal(embedding.weight.detach(), after)


def test_fp16_gradients_are_refused() -> None:
    param = nn.Parameter(torch.ones(2, dtype=torch.float16))
    param.grad = torch.ones(2, dtype=torch.float16)
    scaler = FixedLossScaler(scale=2)
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.step(torch.optim.SGD([param], lr=0.1))


def test_update_with_new_scale() -> None:
    scaler = DynamicLossScaler(init_scale=16.0)
    _drive(scaler, [False])
    scaler.update(new_scale=2.0**10)
    assert scaler.get_scale() == 1024.0
    scaler.update(new_scale=torch.tensor(32.0))
    assert scaler.get_scale() == 32.0
    with pytest.raises(ValueError, match="finite positive"):
        scaler.update(new_scale=0.0)


# ---------------------------------------------------------------------- enabled=False


@pytest.mark.parametrize(
    "make_scaler",
    [
        lambda: NoLossScaler(enabled=False),
        lambda: FixedLossScaler(scale=64, enabled=False),
        lambda: DynamicLossScaler(enabled=False),
    ],
)
def test_disabled_scaler_is_a_passthrough(make_scaler) -> None:
    scaler = make_scaler()
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    loss = (param * torch.tensor([1.0, NAN])).sum()
    assert scaler.scale(loss) is loss
    model = nn.Linear(2, 2)
    assert scaler.attach(model) is model
    loss.backward()
    scaler.unscale_(optimizer)
    scaler.unscale_(optimizer)  # no state machine either
    torch.testing.assert_close(param.grad, torch.tensor([1.0, NAN]), rtol=0, atol=0, equal_nan=True)
    assert scaler.step(optimizer) is None  # SGD.step() returns None; the step itself was applied
    assert param[0].item() == pytest.approx(0.9) and math.isnan(param[1].item())
    scaler.update()
    scaler.update()
    assert not scaler.last_step_skipped and scaler.skipped_steps == 0 and scaler.overflow_count == 0
    assert scaler.get_scale() == 1.0 and scaler.loss_scale_metric() == 1.0
    assert scaler.state_dict() == {}
    scaler.load_state_dict({})
    assert not scaler.is_enabled()


# ---------------------------------------------------------------------- state_dict


def test_dynamic_state_dict_round_trip_continues_identically() -> None:
    outcomes = [False, True, False, False, True, True, False, False, False, True, False]
    more = [False, True, False, False, False, True, True, True, False, False, False, False]
    original = DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2)
    _drive(original, outcomes)
    state = original.state_dict()
    assert state["name"] == "dynamic"
    assert {
        "scale",
        "_growth_tracker",
        "hysteresis_tracker",
        "skipped_steps",
        "overflow_count",
    } <= state.keys()

    buffer = io.BytesIO()
    torch.save({original.state_dict_key: state}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)[DynamicLossScaler.state_dict_key]

    resumed = DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2)
    resumed.load_state_dict(loaded)
    assert resumed.state_dict() == state
    # mid-state, not the initial one: one clean step towards growth, one overflow of tolerance used
    assert (resumed.growth_tracker, resumed.hysteresis_tracker) == (original.growth_tracker, 1) == (1, 1)
    assert _drive(resumed, more) == _drive(original, more)
    assert resumed.state_dict() == original.state_dict()


def test_fixed_state_dict_round_trip_and_mismatch() -> None:
    fixed = FixedLossScaler(scale=256)
    _drive(fixed, [True, False])
    other = FixedLossScaler(scale=256)
    other.load_state_dict(fixed.state_dict())
    assert other.state_dict() == fixed.state_dict()
    assert other.skipped_steps == 1 and other.get_scale() == 256.0

    with pytest.raises(ConfigError, match="scaler=fixed but this run uses scaler=dynamic"):
        DynamicLossScaler().load_state_dict(fixed.state_dict())
    with pytest.raises(RuntimeError, match="empty"):
        DynamicLossScaler().load_state_dict({})
    with pytest.raises(RuntimeError, match="_growth_tracker"):
        DynamicLossScaler().load_state_dict({k: v for k, v in fixed.state_dict().items() if k != "name"})


# ---------------------------------------------------------------------- the dynamic scaler's rules


def test_hysteresis_tolerates_overflows_until_the_scale_grows() -> None:
    # DeepSpeed's default: the tolerance is refilled only when the scale grows.
    scaler = DynamicLossScaler(init_scale=64.0, growth_interval=100, hysteresis=3)
    scales = _drive(scaler, [True, True, True, False, True])
    assert scales == [64.0, 64.0, 32.0, 32.0, 16.0]  # 2 tolerated, then every overflow backs off
    assert scaler.skipped_steps == 4  # tolerated overflows are still skipped

    scaler = DynamicLossScaler(init_scale=64.0, growth_interval=2, hysteresis=2)
    scales = _drive(scaler, [True, False, False, True, True])
    assert scales == [64.0, 64.0, 128.0, 128.0, 64.0]  # growth refilled the tolerance
    assert scaler.growth_tracker == 0


def test_consecutive_hysteresis_refills_after_any_clean_step() -> None:
    scaler = DynamicLossScaler(
        init_scale=64.0, growth_interval=100, hysteresis=2, consecutive_hysteresis=True
    )
    assert _drive(scaler, [True, False, True, False, True]) == [64.0] * 5
    assert _drive(scaler, [False, True, True]) == [64.0, 64.0, 32.0]


def test_tolerated_overflow_resets_growth_count() -> None:
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=2, hysteresis=2)
    assert _drive(scaler, [False, True, False, False]) == [8.0, 8.0, 8.0, 16.0]


def test_min_and_max_scale_clamp() -> None:
    assert _drive(DynamicLossScaler(init_scale=4.0), [True] * 4) == [2.0, 1.0, 1.0, 1.0]  # default floor 1
    assert _drive(DynamicLossScaler(init_scale=2.0, min_scale=None), [True] * 3) == [1.0, 0.5, 0.25]
    assert _drive(DynamicLossScaler(init_scale=2.0, min_scale=0.75), [True] * 2) == [1.0, 0.75]
    capped = DynamicLossScaler(init_scale=2.0**22, growth_interval=1, max_scale=2.0**24)
    assert _drive(capped, [False] * 4) == [2.0**23, 2.0**24, 2.0**24, 2.0**24]


def test_dynamic_defaults_are_grad_scalers() -> None:
    scaler = DynamicLossScaler()
    reference = torch.amp.GradScaler("cpu")
    assert scaler.get_scale() == reference.get_scale() == 2.0**16
    assert (scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval) == (
        reference.get_growth_factor(),
        reference.get_backoff_factor(),
        reference.get_growth_interval(),
    )
    assert (scaler._min_scale, scaler._max_scale, scaler.hysteresis_tracker) == (1.0, None, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_scale": 0}, "scaler.init_scale must be a positive number, got 0"),
        ({"init_scale": 1e39}, "scaler.init_scale must fit in float32"),
        ({"growth_factor": 1.0}, "scaler.growth_factor must be a number > 1, got 1.0"),
        ({"growth_factor": "fast"}, "scaler.growth_factor must be a number > 1, got 'fast'"),
        ({"backoff_factor": 1}, "scaler.backoff_factor must be a number between 0 and 1"),
        ({"backoff_factor": 0}, "scaler.backoff_factor must be a number between 0 and 1"),
        ({"growth_interval": 0}, "scaler.growth_interval must be a positive integer, got 0"),
        ({"growth_interval": 2.5}, "scaler.growth_interval must be a positive integer, got 2.5"),
        ({"growth_interval": True}, "scaler.growth_interval must be a positive integer, got True"),
        ({"hysteresis": 0}, "scaler.hysteresis must be a positive integer, got 0"),
        ({"min_scale": -1}, "scaler.min_scale must be a number >= 0 or null, got -1"),
        ({"max_scale": 0}, "scaler.max_scale must be a positive number or null, got 0"),
        ({"min_scale": 8, "max_scale": 4, "init_scale": 4}, "scaler.max_scale (4) is below scaler.min_scale"),
        ({"init_scale": 2.0**20, "max_scale": 2.0**16}, "scaler.init_scale (1.04858e+06) lies outside"),
        ({"init_scale": 0.5}, "scaler.init_scale (0.5) lies outside [min_scale, max_scale] = [1, inf]"),
    ],
)
def test_dynamic_invalid_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        DynamicLossScaler(**kwargs)


# ---------------------------------------------------------------------- fixed scale validation


@pytest.mark.parametrize("bad", [0, -1, INF, NAN, "abc", "", True, None, [128]])
def test_fixed_invalid_scale(bad: object) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"scaler.scale must be a positive number, got {bad!r}")):
        FixedLossScaler(scale=bad)


def test_fixed_scale_accepts_numbers_and_numeric_strings() -> None:
    assert FixedLossScaler().get_scale() == 128.0
    assert FixedLossScaler(scale="1024").get_scale() == 1024.0
    assert FixedLossScaler(scale=8).get_scale() == 8.0
    assert _drive(FixedLossScaler(scale=8), [True, False, True]) == [8.0] * 3


# ---------------------------------------------------------------------- build_scaler


def test_build_scaler_each_name() -> None:
    assert type(build_scaler({"name": "none"})) is NoLossScaler
    fixed = build_scaler({"name": "fixed", "scale": 256})
    assert type(fixed) is FixedLossScaler and fixed.get_scale() == 256.0
    assert build_scaler({"name": "fixed"}).get_scale() == 128.0
    cfg = OmegaConf.create(
        {
            "name": "dynamic",
            "init_scale": 1024,
            "growth_factor": "2",
            "backoff_factor": 0.5,
            "growth_interval": "3",
            "min_scale": None,
            "max_scale": 2.0**24,
            "hysteresis": 2,
        }
    )
    dynamic = build_scaler(cfg, fmt=None)
    assert type(dynamic) is DynamicLossScaler
    assert dynamic.get_scale() == 1024.0 and dynamic._growth_interval == 3 and dynamic._min_scale == 0.0
    assert _drive(dynamic, [True, True, False, False, False]) == [1024.0, 512.0, 512.0, 512.0, 1024.0]
    assert build_scaler({"name": "dynamic"}).get_scale() == 2.0**16
    assert type(build_scaler({"name": "Dynamic"})) is DynamicLossScaler


def test_build_scaler_reports_bad_config() -> None:
    with pytest.raises(ConfigError, match=re.escape("scaler.scale must be a finite number, got 'abc'")):
        build_scaler({"name": "fixed", "scale": "abc"})
    with pytest.raises(
        ConfigError, match="unknown scaler 'loss'; choose scaler= one of none, fixed, dynamic, adaptive"
    ):
        build_scaler({"name": "loss"})
    with pytest.raises(ConfigError, match="unknown scaler None"):
        build_scaler({"scale": 2})
    with pytest.raises(
        ConfigError, match="scaler=fixed has no field\\(s\\) init_scale; its fields are: scale"
    ):
        build_scaler({"name": "fixed", "init_scale": 2})
    with pytest.raises(ConfigError, match="scaler must be a config group"):
        build_scaler("dynamic")  # type: ignore[arg-type]


def test_build_scaler_adaptive_builds_the_layer_wise_scaler() -> None:
    from adaloss.adaptive.rules import REFERENCE_FP16_U_MIN
    from adaloss.numerics import get_format
    from adaloss.scalers.adaptive import AdaptiveLossScaler

    cfg = {"name": "adaptive", "t_uf": "1e-2", "update_every": 7, "init_scale": 4}
    scaler = build_scaler(cfg, get_format("fp8_e5m2"))
    assert type(scaler) is AdaptiveLossScaler
    assert (scaler.t_uf, scaler.update_every, scaler.get_scale()) == (1e-2, 7, 4.0)
    assert scaler.u_min == 2.0**-16  # the gradient format's smallest subnormal: FP8 e5m2's, not FP16's
    # No format given: FP16, with the u_min each rule's source uses (the authors' code 6e-8, the text 2^-24).
    assert build_scaler({"name": "adaptive"}).u_min == REFERENCE_FP16_U_MIN == 6e-8
    assert build_scaler({"name": "adaptive", "rule": "paper"}).u_min == 2.0**-24


@pytest.mark.parametrize(
    ("value", "expected"), [(None, True), ("false", False), ("no", False), ("true", True)]
)
def test_product_betas_from_the_command_line_reach_the_scaler(value: str | None, expected: bool) -> None:
    """``scaler.product_betas=false`` (a key of ``configs/scaler/adaptive.yaml``, no ``+``) is read as the
    boolean YAML means and arrives at ``AdaptiveLossScaler``; absent, the config's default (on) holds."""
    cfg = compose_train(["scaler=adaptive", *([f"scaler.product_betas={value}"] if value else [])])
    validate_config(cfg)
    assert build_scaler(cfg.scaler).product_betas is expected


def test_product_betas_must_be_a_boolean() -> None:
    from hydra.errors import HydraException

    from adaloss.scalers.adaptive import AdaptiveLossScaler

    with pytest.raises(HydraException, match="scaler.product_betas"):  # the schema's type, while composing
        compose_train(["scaler=adaptive", "scaler.product_betas=maybe"])
    with pytest.raises(ConfigError, match="scaler.product_betas must be true or false, got 1"):
        AdaptiveLossScaler(product_betas=1)  # the class checks it too (library use)


def test_build_scaler_instantiates_the_target_with_the_format() -> None:
    """One way to build: the node's ``_target_`` through ``hydra.utils.instantiate``, given ``fmt`` only if
    the class takes it; the name is not an argument."""
    from adaloss.numerics import get_format

    fmt = get_format("fp8_e5m2")
    scaler = build_scaler(compose_train(["scaler=adaptive"]).scaler, fmt)
    assert type(scaler).__name__ == "AdaptiveLossScaler" and scaler.fmt is fmt
    fixed = build_scaler(compose_train(["scaler=fixed", "scaler.scale=8"]).scaler, fmt)
    assert type(fixed) is FixedLossScaler and fixed.get_scale() == 8.0
    with pytest.raises(ConfigError, match="takes no argument scale"):
        build_scaler(OmegaConf.create({"_target_": "adaloss.scalers.NoLossScaler", "scale": 8}))


def test_scale_is_float32_exact_and_metric_is_a_float() -> None:
    scaler = DynamicLossScaler(init_scale=3.0, growth_factor=1.1, growth_interval=1, min_scale=None)
    _drive(scaler, [False])
    expected = float(torch.tensor(3.0 * 1.1, dtype=torch.float32))
    assert scaler.get_scale() == expected and isinstance(scaler.loss_scale_metric(), float)
    assert scaler.scale(torch.ones(())).item() == expected
    assert math.isfinite(scaler.get_scale())


# ---------------------------------------------------------------------- hysteresis and DeepSpeed (documented)


def test_hysteresis_h_tolerates_h_minus_1_overflows_not_necessarily_consecutive() -> None:
    """configs/scaler/dynamic.yaml's comment: h - 1 overflows are tolerated, clean steps between them or not;
    only a growth refills the tolerance (unless consecutive_hysteresis)."""
    spread = [True, False, False, True, False, True]  # three overflows, never two in a row
    scaler = DynamicLossScaler(init_scale=64.0, growth_interval=100, hysteresis=3)
    assert _drive(scaler, spread) == [64.0, 64.0, 64.0, 64.0, 64.0, 32.0]  # the 3rd backs off, not the 4th
    scaler = DynamicLossScaler(
        init_scale=64.0, growth_interval=100, hysteresis=3, consecutive_hysteresis=True
    )
    assert _drive(scaler, spread) == [64.0] * 6  # clean steps between them refill: nothing backs off
    assert _drive(scaler, [False, True, True, True]) == [64.0, 64.0, 64.0, 32.0]  # h = 3 in a row does


class DeepSpeedPort:
    """DeepSpeed's ``DynamicLossScaler.update_scale`` (deepspeed/runtime/fp16/loss_scaler.py), re-written."""

    def __init__(
        self, init: float, window: int, min_scale: float, hysteresis: int, consecutive: bool
    ) -> None:
        self.scale, self.window, self.min_scale = init, window, min_scale
        self.delayed_shift = self.hysteresis = hysteresis
        self.consecutive = consecutive
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update(self, overflow: bool) -> float:
        if overflow:
            if self.delayed_shift == 1 or self.hysteresis == 1:
                if self.scale == self.min_scale:  # raise_error_at_min_scale=True, its default
                    raise RuntimeError("loss scale already at minimum")
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive:
                self.hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.window == 0:
                if not self.consecutive:
                    self.hysteresis = self.delayed_shift
                self.scale *= 2
        self.cur_iter += 1
        return self.scale


@pytest.mark.parametrize(("hysteresis", "consecutive"), [(1, False), (2, False), (3, False), (2, True)])
def test_growth_and_hysteresis_follow_deepspeed_step_for_step(hysteresis: int, consecutive: bool) -> None:
    """The docstring's comparison: DeepSpeed grows after W clean steps the first time and every W after,
    as we do, and its hysteresis is ours; the scales agree until DeepSpeed would raise at min_scale."""
    gen = torch.Generator().manual_seed(3)
    pattern = [False] * 7 + (torch.rand(300, generator=gen) < 0.2).tolist()
    ours = DynamicLossScaler(init_scale=2.0**20, growth_interval=3, hysteresis=hysteresis,
                             consecutive_hysteresis=consecutive)  # fmt: skip
    theirs = DeepSpeedPort(2.0**20, 3, 1.0, hysteresis, consecutive)
    expected = [theirs.update(bad) for bad in pattern]
    assert _drive(ours, pattern) == expected
    assert expected[:3] == [2.0**20, 2.0**20, 2.0**21]  # the first growth after W = 3 clean steps
    assert min(expected) > 1.0  # the pattern never brings DeepSpeed to its floor (where it raises)


def test_at_min_scale_deepspeed_raises_and_we_keep_skipping() -> None:
    theirs = DeepSpeedPort(2.0, 1000, 1.0, 1, False)
    theirs.update(True)
    with pytest.raises(RuntimeError, match="minimum"):
        theirs.update(True)
    ours = DynamicLossScaler(init_scale=2.0, growth_interval=1000)
    assert _drive(ours, [True] * 5) == [1.0] * 5 and ours.skipped_steps == 5
