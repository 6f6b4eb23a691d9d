"""``DynamicLossScaler(rule="chainer")``: Chainer's dynamic loss scaling, step for step, and the configs
of the paper's Tables 2 and 3 that run it.

The reference is :class:`ChainerDynamicPort`, a re-implementation of the three methods of Chainer's
``Optimizer`` (chainer/chainer, ``chainer/optimizer.py``) that make its dynamic loss scaling:
``loss_scaling(interval, scale=None)`` (start at 1, multiplier ``2 ** (1 / interval)``),
``check_nan_in_grads`` (an overflow sets the "has overflowed ever" flag) and ``update_loss_scale`` (x0.5 on
an overflow, x2 before the first overflow, the multiplier after it, clamped to ``[1, _loss_scale_max =
65504]``), in Chainer's arithmetic: Python floats (float64).
"""

from __future__ import annotations

import io
import math
import random
import re

import pytest
import torch
from torch import nn

from adaloss.errors import ConfigError
from adaloss.runner.utils.targets import build_scaler
from adaloss.scalers import DynamicLossScaler
from adaloss.scalers.dynamic import CHAINER_MAX_SCALE
from conftest import compose_train, load_script


class ChainerDynamicPort:
    """Chainer's dynamic loss scaling (``Optimizer.loss_scaling`` / ``update_loss_scale``), re-written."""

    loss_scale_max = 65504  # Optimizer._loss_scale_max: "max representable value with fp16"

    def __init__(self, interval: int) -> None:
        self.loss_scale = 1.0
        self.multiplier = math.pow(2.0, 1.0 / interval)
        self.isnan_ever = False

    def update(self, isnan: bool) -> float:
        """One ``GradientMethod.update``: ``check_nan_in_grads`` then ``update_loss_scale``."""
        if isnan:
            self.isnan_ever = True
            multiplier = 0.5
        elif self.isnan_ever:
            multiplier = self.multiplier
        else:
            multiplier = 2.0
        self.loss_scale = max(1, min(self.loss_scale_max, self.loss_scale * multiplier))
        return self.loss_scale


def _float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def _iteration(scaler: DynamicLossScaler, param: nn.Parameter, optimizer, bad: bool) -> bool:
    """One training iteration whose gradient overflows when ``bad``; returns whether the step was applied."""
    optimizer.zero_grad(set_to_none=True)
    before = param.detach().clone()
    loss = (param * torch.tensor([1.0, math.inf if bad else 2.0])).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return not torch.equal(before, param.detach())


def _run(scaler: DynamicLossScaler, pattern: list[bool]) -> list[tuple[float, float, bool]]:
    """Drive ``scaler`` through ``pattern`` (True: an overflow); per step: (exact scale, applied scale,
    whether the update was applied)."""
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.01)
    out = []
    for bad in pattern:
        applied = _iteration(scaler, param, optimizer, bad)
        out.append((scaler.state_dict()["exact_scale"], scaler.get_scale(), applied))
    return out


def _pattern(name: str) -> list[bool]:
    if name == "growth_to_the_max":  # doubling: 2, 4, ..., 32768, then 65536 clamps to 65504
        return [False] * 20
    if name == "first_overflow_then_slow_growth":
        return [False] * 5 + [True] + [False] * 25
    if name == "clamp_at_one":  # halving from 8 down to the floor, then slow growth from 1
        return [False] * 3 + [True] * 6 + [False] * 12
    if name == "slow_growth_to_the_max":  # from 1, 2^(1/10) a step: 65504 after ~160 clean steps
        return [True] + [False] * 200 + [True] + [False] * 20
    rng = random.Random(7)  # "random": overflows scattered over both phases
    return [False] * 8 + [rng.random() < 0.08 for _ in range(600)]


PATTERNS = (
    "growth_to_the_max",
    "first_overflow_then_slow_growth",
    "clamp_at_one",
    "slow_growth_to_the_max",
    "random",
)


@pytest.mark.parametrize("interval", [10, 3, 1000])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_scale_sequence_is_chainers(pattern: str, interval: int) -> None:
    steps = _pattern(pattern)
    port = ChainerDynamicPort(interval)
    scaler = DynamicLossScaler(rule="chainer", growth_interval=interval)
    assert scaler.get_scale() == 1.0 and not scaler.has_overflowed  # Chainer starts at 1
    for i, ((exact, applied_scale, applied), bad) in enumerate(zip(_run(scaler, steps), steps, strict=True)):
        expected = port.update(bad)
        assert exact == expected, f"step {i}: {exact!r} != Chainer's {expected!r}"  # float64, bit for bit
        assert applied_scale == _float32(expected), i  # what is applied: its float32 rounding
        assert applied is not bad, i  # an overflow skips the update, a clean step applies it
    assert scaler.has_overflowed == port.isnan_ever


def test_the_patterns_reach_both_phases_and_both_clamps() -> None:
    """The patterns above exercise what they are named for (else the comparison could pass vacuously)."""
    seen = {}
    for name in PATTERNS:
        scales = [
            s for s, _, _ in _run(DynamicLossScaler(rule="chainer", growth_interval=10), _pattern(name))
        ]
        seen[name] = scales
    assert seen["growth_to_the_max"][:4] == [2.0, 4.0, 8.0, 16.0] and seen["growth_to_the_max"][-1] == 65504.0
    slow = seen["first_overflow_then_slow_growth"]
    assert slow[4:6] == [32.0, 16.0] and slow[15] != 32.0 and math.isclose(slow[15], 32.0, rel_tol=1e-12)
    assert not float(slow[7]).is_integer()  # the scales leave the powers of two
    assert seen["clamp_at_one"][8] == 1.0 and seen["clamp_at_one"][-1] > 1.0
    assert CHAINER_MAX_SCALE in seen["slow_growth_to_the_max"][150:201]
    assert seen["slow_growth_to_the_max"][201] == 65504.0 / 2


@pytest.mark.parametrize(
    ("pattern", "cut"), [("random", 4), ("random", 300), ("first_overflow_then_slow_growth", 5)]
)
def test_a_checkpoint_mid_sequence_resumes_exactly(pattern: str, cut: int) -> None:
    """Saved before the first overflow (cut 4: the doubling phase) or after it, the resumed scaler continues
    Chainer's sequence bit for bit; the phase flag and the float64 scale travel in the checkpoint."""
    steps = _pattern(pattern)
    original = DynamicLossScaler(rule="chainer", growth_interval=10)
    _run(original, steps[:cut])
    buffer = io.BytesIO()
    torch.save({"scaler": original.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)["scaler"]
    assert state["rule"] == "chainer" and state["has_overflowed"] == any(steps[:cut])

    resumed = DynamicLossScaler(rule="chainer", growth_interval=10)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == original.state_dict()
    assert _run(resumed, steps[cut:]) == _run(original, steps[cut:])

    port = ChainerDynamicPort(10)
    expected = [port.update(bad) for bad in steps]
    assert original.state_dict()["exact_scale"] == expected[-1]


def test_the_phase_flag_matters_after_a_resume() -> None:
    """Without the flag a resumed run in the slow phase would double again: the test above can fail."""
    scaler = DynamicLossScaler(rule="chainer", growth_interval=10)
    _run(scaler, [False, False, True])
    state = scaler.state_dict()
    state["has_overflowed"] = False
    forgetful = DynamicLossScaler(rule="chainer", growth_interval=10)
    forgetful.load_state_dict(state)
    assert _run(forgetful, [False])[0][0] == 4.0  # doubles: 2 -> 4
    assert _run(scaler, [False])[0][0] == 2.0 * 2**0.1


def test_checkpoints_of_the_other_rule_are_refused() -> None:
    chainer = DynamicLossScaler(rule="chainer", growth_interval=10)
    _run(chainer, [False, True])
    with pytest.raises(ConfigError, match="scaler.rule=chainer but this run uses scaler.rule=torch"):
        DynamicLossScaler().load_state_dict(chainer.state_dict())
    with pytest.raises(ConfigError, match="scaler.rule=torch but this run uses scaler.rule=chainer"):
        DynamicLossScaler(rule="chainer").load_state_dict(DynamicLossScaler().state_dict())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rule": "apex"}, "scaler.rule must be one of torch, chainer for scaler=dynamic, got 'apex'"),
        ({"rule": None}, "scaler.rule must be one of torch, chainer"),
        ({"rule": "chainer", "hysteresis": 2}, "scaler.rule=chainer backs off on every overflow"),
        ({"rule": "chainer", "consecutive_hysteresis": True}, "has no hysteresis"),
        ({"rule": "chainer", "init_scale": 128}, "scaler.rule=chainer starts at scale 1"),
        ({"rule": "chainer", "min_scale": 0}, "scaler.rule=chainer needs a positive scaler.min_scale"),
        ({"rule": "chainer", "min_scale": None}, "scaler.rule=chainer needs a positive scaler.min_scale"),
    ],
)
def test_bad_chainer_options_are_config_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        DynamicLossScaler(**kwargs)


def test_chainer_defaults_and_the_options_it_takes() -> None:
    for init in (None, 1, 2.0**16):  # "not chosen" (null, GradScaler's default) or Chainer's own start
        assert DynamicLossScaler(rule="chainer", init_scale=init).get_scale() == 1.0
    scaler = DynamicLossScaler(rule=" Chainer ")
    assert (scaler.rule, scaler.get_growth_interval(), scaler._max_scale, scaler._min_scale) == (
        "chainer",
        2000,
        65504.0,
        1.0,
    )
    # the authors' "no dynamic scaling" trick, loss_scaling(interval=inf) with _loss_scale_max = 1: scale 1
    assert _run(DynamicLossScaler(rule="chainer", max_scale=1), [False, True, False])[-1][1] == 1.0
    assert DynamicLossScaler(init_scale=None).get_scale() == 2.0**16  # torch: null is GradScaler's start


def test_the_applied_scale_is_the_float32_rounding() -> None:
    """In the slow phase the float64 scale is not a float32; what scale() multiplies by is its rounding."""
    scaler = DynamicLossScaler(rule="chainer", growth_interval=10)
    _run(scaler, [True, False, False, False])
    exact = scaler.state_dict()["exact_scale"]
    assert exact != _float32(exact)
    scaled = scaler.scale(torch.ones((), dtype=torch.float32))
    assert scaled.dtype == torch.float32 and scaled.item() == _float32(exact) == scaler.get_scale()


# ---------------------------------------------------------------------- the configs


def test_scaler_dynamic_stays_torch_and_the_command_line_selects_chainer() -> None:
    cfg = compose_train(["scaler=dynamic"])
    assert (cfg.scaler.rule, cfg.scaler.growth_interval) == ("torch", 2000)
    assert build_scaler(cfg.scaler).rule == "torch" and build_scaler(cfg.scaler).get_scale() == 2.0**16
    cfg = compose_train(["scaler=dynamic", "scaler.rule=chainer", "scaler.growth_interval=10"])
    scaler = build_scaler(cfg.scaler)
    assert (scaler.rule, scaler.get_growth_interval(), scaler.get_scale()) == ("chainer", 10, 1.0)
    for other in ("table1_cifar", "table4_fixed_scales"):  # tables whose dynamic column (if any) is torch's
        assert compose_train([f"experiment={other}", "variant=dynamic"]).scaler.rule == "torch"


@pytest.mark.parametrize("experiment", ["table2_imagenet", "table3_ssd"])
def test_tables_2_and_3_run_the_chainer_rule_with_interval_10(experiment: str) -> None:
    cfg = compose_train([f"experiment={experiment}", "variant=dynamic"])
    scaler = build_scaler(cfg.scaler)
    assert (scaler.rule, scaler.get_growth_interval(), scaler.get_scale()) == ("chainer", 10, 1.0)
    # the other variants of the table are untouched by the recipe
    for variant, name in (("adaptive", "adaptive"), ("fixed128", "fixed"), ("none", "none")):
        other = compose_train([f"experiment={experiment}", f"variant={variant}"])
        assert other.scaler.name == name and build_scaler(other.scaler).name == name
    assert compose_train([f"experiment={experiment}", "variant=adaptive"]).scaler.rule == "reference"


@pytest.mark.parametrize("experiment", ["table2_imagenet", "table3_ssd"])
def test_the_mini_forms_of_tables_2_and_3_run_the_chainer_rule(experiment: str) -> None:
    mini = load_script("reproduce_mini")
    (overrides,) = [o for name, o in mini.LAUNCHES if name == experiment]
    single = [o.split(",")[0] if o.startswith("trainer.batch_size=") else o for o in overrides]
    cfg = compose_train([f"experiment={experiment}", *single, "variant=dynamic"])
    assert (cfg.scaler.rule, cfg.scaler.growth_interval) == ("chainer", 10)


# ---------------------------------------------------------------------- through the trainer

RUN = ("model=mlp", "scaler=dynamic", "scaler.rule=chainer", "scaler.growth_interval=3",
       "trainer.max_steps=8", "trainer.checkpoint_every=4", "trainer.eval_every=8", "trainer.save_final=true",
       "faults.inject=[{step:3,layer:fc,value:inf},{step:6,layer:fc,value:inf}]")  # fmt: skip


def test_training_with_the_chainer_rule_follows_chainer_and_resumes_exactly(make_cfg, tmp_path) -> None:
    """The trainer builds the rule from the config, skips the two planted overflows, follows Chainer's
    sequence, and a run resumed from the checkpoint at step 4 (after the first overflow: the slow phase)
    ends bitwise on the uninterrupted run's weights and scales."""
    from adaloss.runner.engine import train

    def record(into):
        return lambda step, model, optimizer, scaler: into.append((step, scaler.state_dict()["exact_scale"]))

    full: list[tuple[int, float]] = []
    metrics = train(make_cfg(*RUN), callbacks=[record(full)])
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    port = ChainerDynamicPort(3)
    expected = [port.update(step in (3, 6)) for step in range(1, 9)]
    # the callback sees completed iterations; the skipped ones (3 and 6) included or not, the scales agree
    assert [scale for _, scale in full] == [expected[step - 1] for step, _ in full]
    assert metrics["skipped_steps"] == 2 and metrics["loss_scale"] == _float32(expected[-1])
    assert (
        full[-1][0] == 8 and len(full) >= 6 and not full[-1][1].is_integer()
    )  # in the slow phase at the end

    (tmp_path / "model.pt").unlink()
    (tmp_path / "metrics.json").unlink()
    resumed: list[tuple[int, float]] = []
    checkpoint = tmp_path / "checkpoints" / "step_4.pt"
    train(make_cfg(*RUN, f"resume={checkpoint}"), callbacks=[record(resumed)])
    assert resumed == [entry for entry in full if entry[0] > 4]
    again = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(weights[k], again[k]) for k in weights)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["scaler.rule=apex"], "scaler.rule must be one of torch, chainer, got 'apex'"),
        (["scaler.rule=chainer", "scaler.hysteresis=2"], "scaler.rule=chainer backs off on every overflow"),
        (["scaler.rule=chainer", "scaler.init_scale=1024"], "scaler.rule=chainer starts at scale 1"),
    ],
)
def test_bad_rule_settings_fail_the_config_check_in_one_line(overrides: list[str], message: str) -> None:
    from omegaconf import open_dict

    from adaloss.runner.engine.config import validate_config

    cfg = compose_train(["scaler=dynamic", *overrides])
    with open_dict(cfg):
        cfg.paths.output_dir = "/tmp/run"
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        validate_config(cfg)
    assert "\n" not in str(error.value)
