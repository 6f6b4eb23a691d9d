"""GradScaler parity of the four scalers: where they are imported from, the leading device argument,
``step()`` before any ``scale()``, ``is_enabled()``, the growth and backoff getters and setters, and the
host-sync line every hot-path method's docstring carries.

``torch.amp.GradScaler`` itself is the reference wherever it runs on this machine (its ``"cpu"`` device).
"""

from __future__ import annotations

import inspect
import math
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import adaloss
from adaloss.errors import ConfigError
from adaloss.scalers import (
    AdaptiveLossScaler,
    DynamicLossScaler,
    FixedLossScaler,
    LossScaler,
    NoLossScaler,
    ScaleNotCalledError,
)

SCALER_CLASSES = (NoLossScaler, FixedLossScaler, DynamicLossScaler, AdaptiveLossScaler)
GROWTH_METHODS = (
    "get_growth_factor",
    "set_growth_factor",
    "get_backoff_factor",
    "set_backoff_factor",
    "get_growth_interval",
    "set_growth_interval",
)
CUDA_MISSING = torch.cuda.amp.common.amp_definitely_not_available()


def _tiny(scaler: LossScaler) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = scaler.attach(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _iteration(scaler: LossScaler, model: nn.Module, optimizer, factor: float = 1.0) -> None:
    """One training iteration; ``factor`` inf makes every gradient Inf (an overflow)."""
    x = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
    scaler.scale(model(x).square().mean() * factor).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------- imports


def test_every_scaler_is_exported_from_the_package_and_from_scalers() -> None:
    from adaloss.scalers import adaptive, dynamic, static

    assert adaloss.AdaptiveLossScaler is adaptive.AdaptiveLossScaler is AdaptiveLossScaler
    assert adaloss.DynamicLossScaler is dynamic.DynamicLossScaler
    assert adaloss.FixedLossScaler is static.FixedLossScaler and adaloss.NoLossScaler is static.NoLossScaler
    assert {"AdaptiveLossScaler", "DynamicLossScaler", "FixedLossScaler", "NoLossScaler"} <= set(
        adaloss.__all__
    )
    assert "AdaptiveLossScaler" in dir(adaloss.scalers) and "AdaptiveLossScaler" in dir(adaloss)
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchScaler'"):
        adaloss.NoSuchScaler  # noqa: B018


def test_imports_in_a_fresh_interpreter() -> None:
    """``import adaloss`` stays light (no torch), and both import lines of the README work from scratch."""
    code = (
        "import sys\n"
        "import adaloss\n"
        "assert 'torch' not in sys.modules, 'import adaloss imported torch'\n"
        "from adaloss.scalers import AdaptiveLossScaler\n"
        "from adaloss import AdaptiveLossScaler as again, DynamicLossScaler, FixedLossScaler, NoLossScaler\n"
        "assert again is AdaptiveLossScaler\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------------------- device


def test_dynamic_signature_is_grad_scalers() -> None:
    """The first six parameters are GradScaler's, in its order and with its defaults (except ``device``:
    ``None``, any device, where GradScaler defaults to ``"cuda"``)."""
    theirs = list(inspect.signature(torch.amp.GradScaler.__init__).parameters.values())[1:]
    ours = list(inspect.signature(DynamicLossScaler.__init__).parameters.values())[1:]
    assert [p.name for p in ours[: len(theirs)]] == [p.name for p in theirs]
    for mine, ref in zip(ours[1 : len(theirs)], theirs[1:], strict=True):
        assert mine.default == ref.default, mine.name
        assert mine.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert ours[0].default is None
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs) :])


@pytest.mark.parametrize("cls", SCALER_CLASSES)
def test_device_is_the_first_argument(cls) -> None:
    params = list(inspect.signature(cls.__init__).parameters)
    assert params[1] == "device" and "enabled" in params
    for device in ("cpu", torch.device("cpu"), None):
        scaler = cls(device)
        assert scaler.is_enabled()
        model, optimizer = _tiny(scaler)
        _iteration(scaler, model, optimizer)
        assert not scaler.last_step_skipped


def test_a_device_gives_the_same_training_as_none() -> None:
    """The device names where the scaler is used; it changes nothing in the arithmetic."""
    runs = []
    for device in (None, "cpu"):
        scaler = DynamicLossScaler(device, init_scale=2.0**10, growth_interval=2)
        model, optimizer = _tiny(scaler)
        for factor in (1.0, float("inf"), 1.0, 1.0):
            _iteration(scaler, model, optimizer, factor)
        runs.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    assert runs[0][1] == runs[1][1] == 2.0**10
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0], strict=True))


@pytest.mark.parametrize("cls", SCALER_CLASSES)
def test_cuda_without_cuda_disables_like_grad_scaler(cls) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference = torch.amp.GradScaler("cuda")
        ours = cls("cuda")
    assert ours.is_enabled() == reference.is_enabled() == (not CUDA_MISSING)
    ours_warned = [w for w in caught if cls.__name__ in str(w.message)]
    if CUDA_MISSING:
        assert len(ours_warned) == 1 and "CUDA is not available. Disabling." in str(ours_warned[0].message)
        assert ours_warned[0].filename == __file__  # points at the caller's line, as GradScaler's does
        loss = torch.ones((), requires_grad=True)
        assert ours.scale(loss) is loss  # a passthrough, as a disabled GradScaler
    else:
        assert not ours_warned
    assert cls("cuda", enabled=False).is_enabled() is False


@pytest.mark.parametrize(
    ("cls", "keyword"),
    [
        (NoLossScaler, "enabled"),
        (FixedLossScaler, "scale"),
        (DynamicLossScaler, "init_scale"),
        (AdaptiveLossScaler, "t_uf"),
    ],
)
def test_a_number_in_the_device_slot_is_refused(cls, keyword: str) -> None:
    """``torch.device(4)`` would be the fourth GPU: a scale passed positionally must not become that."""
    with pytest.raises(
        TypeError,
        match=rf"first argument is the device.*got 4; pass it by keyword: "
        rf"{cls.__name__}\(\.\.\., {keyword}=4\)",
    ):
        cls(4)


def test_a_bad_device_string_is_refused() -> None:
    with pytest.raises(ValueError, match="got device 'cdua', which names no device type"):
        DynamicLossScaler("cdua")


def test_update_new_scale_tensor_follows_grad_scalers_rules() -> None:
    scaler = DynamicLossScaler("cpu", init_scale=8.0)
    model, optimizer = _tiny(scaler)
    _iteration(scaler, model, optimizer)
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=torch.tensor(32.0))
    assert scaler.get_scale() == 32.0
    with pytest.raises(ValueError, match="1-element tensor with requires_grad=False"):
        scaler.update(new_scale=torch.tensor([2.0, 4.0]))
    with pytest.raises(ValueError, match="1-element tensor with requires_grad=False"):
        scaler.update(new_scale=torch.tensor(2.0, requires_grad=True))
    meta = DynamicLossScaler("meta")  # made for another device type than the tensor's
    meta.scale(torch.ones(()))
    with pytest.raises(ValueError, match="got a tensor on 'cpu' but this scaler was made for device 'meta'"):
        meta.update(new_scale=torch.tensor(2.0))
    meta.update(new_scale=2.0)  # a float is fine anywhere
    assert meta.get_scale() == 2.0


# ---------------------------------------------------------------------------------------------- order


@pytest.mark.parametrize("cls", SCALER_CLASSES)
@pytest.mark.parametrize("method", ["step", "unscale_", "update"])
def test_no_scale_yet_raises_as_grad_scaler_does(cls, method: str) -> None:
    """GradScaler's condition: its scale tensor is made by the first ``scale()``; until then ``unscale_``,
    ``step`` and ``update`` raise ``AssertionError``. Ours raise ScaleNotCalledError, which is one."""
    param = nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    reference = torch.amp.GradScaler("cpu")
    with pytest.raises(AssertionError, match="_scale is None"):
        getattr(reference, method)(*([torch.optim.SGD([param], lr=0.1)] if method != "update" else []))

    scaler = cls()
    model, optimizer = _tiny(scaler)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    args = [optimizer] if method != "update" else []
    expected = rf"{method}\(\) was called before any scaler.scale\(loss\)"
    with pytest.raises(ScaleNotCalledError, match=expected):
        getattr(scaler, method)(*args)
    assert issubclass(ScaleNotCalledError, AssertionError) and issubclass(ScaleNotCalledError, RuntimeError)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))  # nothing applied
    assert scaler.skipped_steps == 0

    # The same condition as GradScaler, not a stricter one: once a loss has been scaled, a later iteration
    # may step without scaling (both scalers then treat the gradients as scaled).
    for ref_or_ours, opt in ((reference, torch.optim.SGD([param], lr=0.1)), (scaler, optimizer)):
        ref_or_ours.scale(torch.ones(()))
        ref_or_ours.step(opt)
        ref_or_ours.update()
        ref_or_ours.step(opt)
        ref_or_ours.update()


@pytest.mark.parametrize("cls", SCALER_CLASSES)
def test_disabled_scalers_need_no_scale(cls) -> None:
    scaler = cls(enabled=False)
    assert scaler.is_enabled() is False
    param = nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    optimizer = torch.optim.SGD([param], lr=0.5)
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(param.detach(), torch.full((2,), 0.5))


# ---------------------------------------------------------------------------------------------- growth


def test_dynamic_getters_and_setters_drive_the_rule_as_grad_scalers_do() -> None:
    """The same sequence of overflows and setter calls on GradScaler("cpu") and ours: equal scales."""
    ours = DynamicLossScaler("cpu", init_scale=2.0**10, growth_interval=3, min_scale=None)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    for name in ("get_growth_factor", "get_backoff_factor", "get_growth_interval"):
        assert getattr(ours, name)() == getattr(theirs, name)(), name
    # (step index, setter, value): applied to both before that step.
    changes = {2: ("set_growth_factor", 4.0), 5: ("set_backoff_factor", 0.25), 9: ("set_growth_interval", 2)}
    overflows = [False] * 3 + [True, False, True] + [False] * 5 + [True, False, False]
    param_ours, param_theirs = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt_ours = torch.optim.SGD([param_ours], lr=0.1)
    opt_theirs = torch.optim.SGD([param_theirs], lr=0.1)
    scales = []
    for i, bad in enumerate(overflows):
        if i in changes:
            name, value = changes[i]
            getattr(ours, name)(value)
            getattr(theirs, name)(value)
            assert getattr(ours, name.replace("set", "get"))() == value
        for scaler, param, opt in ((ours, param_ours, opt_ours), (theirs, param_theirs, opt_theirs)):
            scaler.scale(torch.ones(()))
            param.grad = torch.tensor([1.0, float("inf") if bad else 1.0])
            scaler.step(opt)
            scaler.update()
        scales.append((ours.get_scale(), theirs.get_scale()))
    assert all(a == b for a, b in scales), scales
    assert len({a for a, _ in scales}) >= 4  # growth by 2 and by 4, backoff by 0.5 and 0.25 all happened


def test_dynamic_lowered_interval_grows_at_the_next_clean_step() -> None:
    """The one documented difference: GradScaler compares the count for equality, so an interval lowered
    below it would never grow until the next overflow; ours grows at the next clean iteration."""
    scaler = DynamicLossScaler(init_scale=4.0, growth_interval=10)
    model, optimizer = _tiny(scaler)
    for _ in range(5):
        _iteration(scaler, model, optimizer)
    assert scaler.get_scale() == 4.0 and scaler.growth_tracker == 5
    scaler.set_growth_interval(3)
    _iteration(scaler, model, optimizer)
    assert scaler.get_scale() == 8.0 and scaler.growth_tracker == 0


@pytest.mark.parametrize(
    ("setter", "value", "message"),
    [
        ("set_growth_factor", 1.0, "scaler.growth_factor must be a number > 1"),
        ("set_backoff_factor", 1.5, "scaler.backoff_factor must be a number between 0 and 1"),
        ("set_growth_interval", 0, "scaler.growth_interval must be a positive integer"),
    ],
)
def test_dynamic_setters_check_their_values(setter: str, value: float, message: str) -> None:
    scaler = DynamicLossScaler()
    with pytest.raises(ConfigError, match=message):
        getattr(scaler, setter)(value)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (
        2.0,
        0.5,
        2000,
    )


def test_adaptive_growth_interval_regrows_alpha_and_its_factors_are_fixed() -> None:
    scaler = AdaptiveLossScaler(init_scale=8.0, update_every=1)
    model, optimizer = _tiny(scaler)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (
        2.0,
        0.5,
        2000,
    )
    for _ in range(2):  # two overflowing steps in a row halve alpha_{N+1}
        _iteration(scaler, model, optimizer, float("inf"))
    assert scaler.get_scale() == 8.0 * scaler.get_backoff_factor()
    _iteration(scaler, model, optimizer)
    assert scaler.get_scale() == 4.0  # the default interval (2000) is far away
    scaler.set_growth_interval(2)
    assert scaler.get_growth_interval() == 2
    _iteration(scaler, model, optimizer)  # the second clean step: alpha doubles back
    assert scaler.get_scale() == 4.0 * scaler.get_growth_factor() == 8.0
    scaler.set_growth_factor(2.0)  # re-setting the fixed values is harmless
    scaler.set_backoff_factor(0.5)
    with pytest.raises(ValueError, match="growth factor is fixed at 2"):
        scaler.set_growth_factor(4.0)
    with pytest.raises(ValueError, match="backoff factor is fixed at 0.5"):
        scaler.set_backoff_factor(0.25)
    with pytest.raises(ConfigError, match="scaler.growth_interval must be a positive integer"):
        scaler.set_growth_interval(0)


@pytest.mark.parametrize("cls", [NoLossScaler, FixedLossScaler])
def test_constant_scalers_have_no_growth_or_backoff(cls) -> None:
    scaler = cls()
    for name in GROWTH_METHODS:
        assert not hasattr(scaler, name), name
    assert all(hasattr(DynamicLossScaler(), name) for name in GROWTH_METHODS)
    assert all(hasattr(AdaptiveLossScaler(), name) for name in GROWTH_METHODS)


# ---------------------------------------------------------------------------------------------- docs


HOT_PATH = ("scale", "unscale_", "step", "update", "get_scale", "loss_scale_metric", "is_enabled", "attach")
ADAPTIVE_EXTRA = ("recompute_next", "layer_scales", "layer_betas", "branch_rescaled")


@pytest.mark.parametrize("cls", SCALER_CLASSES)
def test_every_hot_path_method_says_whether_it_syncs(cls) -> None:
    names = HOT_PATH + tuple(n for n in GROWTH_METHODS if hasattr(cls, n))
    if cls is AdaptiveLossScaler:
        names += ADAPTIVE_EXTRA
    missing = [n for n in names if "sync" not in (inspect.getdoc(getattr(cls, n)) or "").lower()]
    assert not missing, f"{cls.__name__}: no word on host-device syncs in {missing}"


# ---------------------------------------------------------------------------------------------- state dicts


def _moved(scaler, overflows: list[bool]) -> None:
    """Drive any GradScaler-like ``scaler`` through ``overflows`` on a 2-element parameter."""
    param = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.1)
    for bad in overflows:
        scaler.scale(torch.ones(()))
        param.grad = torch.tensor([1.0, float("inf") if bad else 1.0])
        scaler.step(opt)
        scaler.update()


def test_dynamic_loads_grad_scalers_state_dict_and_continues_as_it_does() -> None:
    theirs = torch.amp.GradScaler(
        "cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3
    )
    _moved(theirs, [False, True, False, False, False, False])  # tracker 1 after a growth: mid-interval
    ours = DynamicLossScaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_scale() == theirs.get_scale() == 3.0
    assert (ours.get_growth_factor(), ours.get_backoff_factor(), ours.get_growth_interval()) == (4.0, 0.25, 3)
    assert ours.growth_tracker == theirs._get_growth_tracker() == 1
    assert (ours.skipped_steps, ours.overflow_count, ours.last_step_skipped) == (0, 0, False)
    more = [False, False, True, False, False, False, False]
    scales = []
    for scaler in (ours, theirs):
        _moved(scaler, more)
        scales.append(scaler.get_scale())
    assert scales[0] == scales[1]


def test_grad_scaler_loads_dynamics_state_dict() -> None:
    ours = DynamicLossScaler(init_scale=2.0**10, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    _moved(ours, [False, True, False, False, False, False])
    state = ours.state_dict()
    assert {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} <= state.keys()
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(state)
    assert theirs.get_scale() == ours.get_scale()
    assert (theirs.get_growth_factor(), theirs.get_backoff_factor(), theirs.get_growth_interval()) == (
        4.0,
        0.25,
        3,
    )
    theirs.scale(torch.ones(()))  # the growth tracker tensor is made lazily, from the loaded value
    assert theirs._get_growth_tracker() == ours.growth_tracker == 1
    more = [False, False, True, False, False, False]
    _moved(theirs, more)
    _moved(ours, more)
    assert theirs.get_scale() == ours.get_scale()


def test_our_older_dynamic_checkpoints_still_load() -> None:
    """Checkpoints written before the GradScaler entries: ``growth_tracker``, no factors, no rule."""
    old = {"name": "dynamic", "scale": 512.0, "skipped_steps": 3, "overflow_count": 4,
           "last_step_skipped": True, "growth_tracker": 2, "hysteresis_tracker": 1}  # fmt: skip
    scaler = DynamicLossScaler(growth_interval=5, hysteresis=2)
    scaler.load_state_dict(old)
    assert (scaler.get_scale(), scaler.growth_tracker, scaler.hysteresis_tracker) == (512.0, 2, 1)
    assert (scaler.skipped_steps, scaler.overflow_count, scaler.last_step_skipped) == (3, 4, True)
    assert scaler.get_growth_interval() == 5 and scaler.rule == "torch"  # the config's, as before


@pytest.mark.parametrize("cls", [NoLossScaler, FixedLossScaler])
def test_constant_scalers_refuse_grad_scalers_state(cls) -> None:
    with pytest.raises(ConfigError, match=r"holds state of torch.amp.GradScaler \(a dynamic scale\)"):
        cls().load_state_dict(torch.amp.GradScaler("cpu").state_dict())


# ---------------------------------------------------------------------------------------------- fused steps


def _fused_run(scaler, unscale_every: int, data: list[tuple[torch.Tensor, torch.Tensor]]):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    assert optimizer._step_supports_amp_scaling  # the protocol this test is about
    scales, skipped = [], []
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if i in (2, 5):
            model[1].weight.grad[0, 0] = float("inf")
        if i % unscale_every == 0:
            scaler.unscale_(optimizer)  # the UNSCALED stage: the kernel gets grad_scale None
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(int(optimizer.state[model[0].weight]["step"].item()))
    return model, optimizer, scales, skipped


@pytest.mark.parametrize("unscale_every", [1000, 2])
def test_fused_adam_is_driven_as_grad_scaler_drives_it_bit_for_bit(unscale_every: int) -> None:
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(8)]
    runs = [
        # 1000: not a power of two, so dividing in the kernel and multiplying by 1/1000 round differently
        _fused_run(DynamicLossScaler("cpu", init_scale=1000.0, growth_interval=2), unscale_every, data),
        _fused_run(torch.amp.GradScaler("cpu", init_scale=1000.0, growth_interval=2), unscale_every, data),
    ]
    (m0, o0, s0, k0), (m1, o1, s1, k1) = runs
    assert s0 == s1 and k0 == k1 and k0[-1] == 6  # 8 iterations, 2 overflows: 6 applied steps
    for a, b in zip(m0.parameters(), m1.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad)
        for key in o0.state[a]:
            assert torch.equal(o0.state[a][key], o1.state[b][key]), key
    assert not hasattr(o0, "grad_scale") and not hasattr(o0, "found_inf")  # removed after the step


def test_fused_step_hands_the_optimizer_the_scale_and_the_flag() -> None:
    """GradScaler's contract, seen from the optimizer: grads still scaled, grad_scale, found_inf."""

    class Recording(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None):
            self.seen = (
                self.param_groups[0]["params"][0].grad.clone(),
                self.grad_scale,
                self.found_inf.item(),
            )

    param = nn.Parameter(torch.ones(2))
    optimizer = Recording([param], lr=0.1)
    scaler = FixedLossScaler(scale=8.0)
    scaler.scale(param.sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    grad, grad_scale, found_inf = optimizer.seen
    assert torch.equal(grad, torch.full((2,), 8.0)) and grad_scale.item() == 8.0 and found_inf == 0.0
    param.grad = None
    scaler.scale(param.sum() * float("inf")).backward()
    scaler.step(optimizer)
    scaler.update()
    assert optimizer.seen[2] == 1.0 and scaler.skipped_steps == 1 and scaler.last_step_skipped


def test_the_deprecated_grad_scaler_keyword_protocol_is_refused() -> None:
    class OldStyle(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            return None

    param = nn.Parameter(torch.ones(2))
    scaler = DynamicLossScaler()
    scaler.scale(param.sum()).backward()
    with pytest.raises(RuntimeError, match="grad_scaler= keyword, GradScaler's deprecated protocol"):
        scaler.step(OldStyle([param], lr=0.1))


# ---------------------------------------------------------------------------------------------- copies


SCALAR_SCALERS = {
    "none": lambda: NoLossScaler(),
    "fixed": lambda: FixedLossScaler(scale=64.0),
    "dynamic": lambda: DynamicLossScaler(init_scale=64.0, growth_interval=2),
    "chainer": lambda: DynamicLossScaler(rule="chainer", growth_interval=3),
}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("kind", sorted(SCALAR_SCALERS))
def test_copies_work_and_are_independent(kind: str, how: str) -> None:
    import copy
    import pickle

    original = SCALAR_SCALERS[kind]()
    _moved(original, [False, True, False])
    original.scale(torch.ones(()))  # a cached device scale, mid-iteration state included
    clone = copy.deepcopy(original) if how == "deepcopy" else pickle.loads(pickle.dumps(original))
    assert clone.state_dict() == original.state_dict()
    more = [False, False, True, False, False]
    _moved(clone, more)
    assert original.state_dict()["skipped_steps"] == 1  # the copy's steps do not reach the original
    _moved(original, more)
    assert clone.state_dict() == original.state_dict()  # and the two follow the same rule


def test_the_adaptive_scaler_drives_fused_optimizers_as_grad_scaler_does() -> None:
    """Every parameter gradient leaves the adaptive scaler's backward pass at ``get_scale()``, one number a
    kernel can divide by: a fused Adam gets ``grad_scale`` and ``found_inf`` and unscales inside its kernel,
    and trains as an unfused Adam does after ``unscale_``, overflowing steps skipped alike."""

    class Recording(torch.optim.Adam):
        seen = False

        def step(self, closure=None):
            self.seen = self.seen or getattr(self, "grad_scale", None) is not None
            return super().step(closure)

    runs = []
    for fused in (True, False):
        scaler = AdaptiveLossScaler(init_scale=2.0**10)
        torch.manual_seed(0)
        model = scaler.attach(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        optimizer = Recording(model.parameters(), lr=0.01, fused=fused)
        for factor in (1.0, 1.0, math.inf, 1.0):
            _iteration(scaler, model, optimizer, factor)
        assert scaler.skipped_steps == 1
        runs.append([p.detach().clone() for p in model.parameters()])
        assert optimizer.seen is fused  # the fused kernel was handed the scale
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
