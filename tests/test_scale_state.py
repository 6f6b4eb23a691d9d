"""One scale state (issue 45): the device buffers are the only truth for the adaptive scaler's scales, the
loss scale of every scaler is one device tensor, one snapshot (one host read) feeds reporting and
checkpoints, one pass-kind value, and the adaptive scaler's options declared once (its recipe)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from adaloss.adaptive.state import PASS_KINDS, PassKind
from adaloss.errors import ConfigError
from adaloss.runner.utils.targets import build_scaler
from adaloss.scalers import AdaptiveLossScaler, DynamicLossScaler
from adaloss.scalers.recipe import AdaptiveRecipe


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def _step(scaler, model, optimizer, blow_up: bool = False) -> None:
    optimizer.zero_grad()
    x = torch.randn(4, 6)
    loss = model(x).square().mean() * (float("inf") if blow_up else 1.0)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def _trained(steps: int = 6) -> tuple[AdaptiveLossScaler, nn.Module, torch.optim.Optimizer]:
    """An adaptive scaler whose alpha_{N+1} moved: two overflows in a row back it off (8 -> 4) at the
    last update, so the buffers' alphas were computed under another alpha_{N+1} than the current one."""
    scaler = AdaptiveLossScaler(init_scale=8.0, update_every=3)
    model = scaler.attach(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(1)
    for i in range(steps):
        _step(scaler, model, optimizer, blow_up=i >= steps - 2)
        scaler.layer_scales()  # as telemetry reads them after every step: a snapshot, kept while valid
    return scaler, model, optimizer


class HostReads:
    """Counts the host reads of tensor values (``item``, ``tolist``, ``cpu``, ``numpy``, ``bool``/``float``
    of a tensor): on a GPU each is a device-to-host copy that waits for the device, a sync. Counted on the
    CPU by wrapping those methods of ``torch.Tensor`` (so calls made with torch-function modes off count
    too)."""

    METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def counted(t, *args, _original=original, **kwargs):
                self.count += 1
                return _original(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)

    def since(self, before: int) -> int:
        return self.count - before


def test_a_checkpoint_holds_the_scale_get_scale_reports_and_the_buffers_hold_after_loading() -> None:
    reference = _continued(*_trained())  # the same run, going on without a checkpoint
    scaler, model, optimizer = _trained()
    state = scaler.state_dict()
    assert state["scale"] == scaler.get_scale() == 4.0  # backed off at the last update
    assert scaler.state.buffers.alpha[0].item() == 4.0  # alpha_{N+1} is alpha[0]: one value
    assert state["slot_alphas"][0] == 8.0  # what the last backward pass carried (reporting)
    buffers = scaler.state.buffers
    for when in ("before attach", "after attach"):
        fresh = AdaptiveLossScaler(init_scale=8.0, update_every=3)
        if when == "before attach":
            fresh.load_state_dict(copy.deepcopy(state))
            assert fresh.get_scale() == 4.0  # loaded, waiting for attach
            fresh_model = fresh.attach(_model())
        else:
            fresh_model = fresh.attach(_model())
            fresh.load_state_dict(copy.deepcopy(state))
        fresh_model.load_state_dict(model.state_dict())
        assert fresh.get_scale() == state["scale"] == fresh.state.buffers.alpha[0].item(), when
        for name in ("alpha", "beta", "branch_alpha", "branch_factors", "carried_root", "to_root"):
            got = getattr(fresh.state.buffers, name)
            assert torch.equal(got.nan_to_num(-1.0), getattr(buffers, name).nan_to_num(-1.0)), (when, name)
        assert fresh.state_dict() == state, when
        # and the loaded scaler trains on exactly as the original does
        fresh_opt = torch.optim.SGD(fresh_model.parameters(), lr=0.05)
        fresh_opt.load_state_dict(optimizer.state_dict())
        assert _continued(fresh, fresh_model, fresh_opt) == reference, when


def _continued(scaler, model, optimizer) -> list[list[float]]:
    torch.manual_seed(7)
    for _ in range(3):
        _step(scaler, model, optimizer)
    return [p.detach().flatten().tolist() for p in model.parameters()]


def test_the_base_scalers_keep_their_scale_in_one_device_tensor() -> None:
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=1)
    assert scaler._scale is None and scaler.get_scale() == 2.0**10  # GradScaler's lazy init
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    _step(scaler, model, optimizer)
    assert isinstance(scaler._scale, torch.Tensor) and scaler._scale.dtype == torch.float32
    assert scaler.get_scale() == scaler._scale.item() == 2.0**11 == scaler.state_dict()["scale"]
    assert not any(
        isinstance(v, float) and v == 2.0**11 for k, v in vars(scaler).items() if k != "_exact_scale"
    )


def test_a_snapshot_is_one_host_read_and_feeds_every_report(monkeypatch: pytest.MonkeyPatch) -> None:
    scaler, model, _ = _trained()
    still = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.recompute_next()  # a step that writes the buffers: the next snapshot is a new read
    _step(scaler, model, still)
    reads = HostReads(monkeypatch)
    before = reads.count
    snap = scaler.snapshot()
    assert reads.since(before) == 1
    before = reads.count
    scales, betas = scaler.layer_scales(snap), scaler.layer_betas(snap)
    assert scales and betas and set(scales) == set(betas)
    assert scales == scaler.layer_scales() and betas == scaler.layer_betas()  # the same snapshot, kept
    state = scaler.state_dict()
    assert reads.since(before) == 0  # the scale, every beta, branch factor and alpha: that snapshot
    assert state["scale"] == snap.root == scaler.get_scale()
    scaler.recompute_next()
    _step(scaler, model, still)
    before = reads.count
    assert scaler.state_dict()["scale"] == scaler.snapshot().root
    assert reads.since(before) == 1  # written again by the recompute: one new read


def test_a_new_root_scale_shows_in_the_next_report_and_checkpoint() -> None:
    """The snapshot kept for reuse steps is dropped when update() moves alpha_{N+1}: a growth on a reuse
    step shows at once in state_dict() (a stale host copy would keep the old one)."""
    scaler = AdaptiveLossScaler(init_scale=8.0, update_every=100, growth_interval=2)
    model = scaler.attach(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    roots = []
    for blow_up in (True, True, False, False, False, False):
        _step(scaler, model, optimizer, blow_up=blow_up)
        scaler.layer_scales()  # telemetry after every step
        roots.append(scaler.state_dict()["scale"])
        assert roots[-1] == scaler.get_scale() == scaler.state.buffers.alpha[0].item()
    assert roots == [8.0, 4.0, 4.0, 8.0, 8.0, 8.0]  # backed off after two overflows, grown back


def test_reuse_steps_read_nothing_on_the_host_but_the_overflow_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """scale(), the backward pass and update() of a reuse step read no tensor on the host: which scales are
    exactly 1 is a cache derived from the buffers, refilled once after a recompute, not a sync per step."""
    scaler = AdaptiveLossScaler(update_every=4)
    model = scaler.attach(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    _step(scaler, model, optimizer)  # the recompute step, and its one read of the units
    reads = HostReads(monkeypatch)
    for _ in range(2):
        optimizer.zero_grad()
        loss = model(torch.randn(4, 6)).square().mean()
        before = reads.count
        scaler.scale(loss).backward()
        assert scaler.last_pass == "reuse"
        assert reads.since(before) == 0
        scaler.step(optimizer)  # the Inf/NaN flag: the iteration's one read
        before = reads.count
        scaler.update()
        assert reads.since(before) == 0


def test_the_pass_kind_is_one_value_users_read_as_a_string() -> None:
    scaler = AdaptiveLossScaler(update_every=2)
    model = scaler.attach(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    kinds = []
    for i in range(4):
        optimizer.zero_grad()
        x = torch.randn(4, 6, requires_grad=True)
        loss = model(x).square().mean()
        if i == 3:  # GradScaler's gradient-penalty recipe: the second backward pass is a plain one
            (grad,) = torch.autograd.grad(scaler.scale(loss), x, create_graph=True)
            kinds.append(scaler.last_pass)
            loss = loss + grad.square().sum()
        scaler.scale(loss).backward()
        kinds.append(scaler.last_pass)
        scaler.step(optimizer)
        scaler.update()
    assert kinds == ["recompute", "reuse", "recompute", "reuse", "plain"]
    assert all(isinstance(k, PassKind) and k in PASS_KINDS for k in kinds)
    assert scaler.state.kind is PassKind.RECOMPUTE  # planned for the next iteration (4 % 2 == 0)


def test_the_recipe_declares_each_option_once() -> None:
    recipe = AdaptiveRecipe(t_uf="1e-4", update_every=5.0, rule=" Paper ", allow_below_one=True)
    assert (recipe.t_uf, recipe.update_every, recipe.rule) == (1e-4, 5, "paper")  # parsed
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.t_uf = 0.5  # type: ignore[misc]
    built = AdaptiveLossScaler.from_recipe(recipe)
    by_keywords = AdaptiveLossScaler(t_uf=1e-4, update_every=5, rule="paper", allow_below_one=True)
    for s in (built, by_keywords):
        assert s.recipe == recipe
    assert vars(built.rule) == vars(by_keywords.rule)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("t_uf", 2.0),
        ("update_every", 0),
        ("init_scale", -1.0),
        ("rule", "bogus"),
        ("root", "bogus"),
        ("scale_upper_bound", -3),
        ("accum_upper_bound", float("inf")),
        ("u_min", float("nan")),
        ("growth_interval", 0),
        ("allow_below_one", True),  # under the reference rule
    ],
)
def test_the_config_schema_reports_a_bad_option_as_the_constructor_does(option: str, value: object) -> None:
    with pytest.raises(ConfigError) as from_library:
        AdaptiveLossScaler(**{option: value})
    with pytest.raises(ConfigError) as from_config:
        build_scaler({"name": "adaptive", option: value}, None)
    assert str(from_config.value) == str(from_library.value)
    assert str(from_library.value).startswith(f"scaler.{option}")
