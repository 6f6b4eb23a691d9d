"""The SSD recipe of configs/dataset/voc.yaml as the authors ran it (kumasento/gradient-scaling,
examples/adaptive_loss_scaling/ssd/train_multi.py): biases at twice the learning rate (their
``GradientScaling(2)``) and without weight decay, weight decay 5e-4 on everything else, and a warm-up of
1000 iterations at lr x0.1 at any batch but 32. What the config says is what the optimizer and the schedule
do.
"""

from __future__ import annotations

import re

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from adaloss.errors import ConfigError
from adaloss.runner.engine.optim import build_optimizer, build_schedule, is_bias, parameter_groups
from adaloss.runner.models import build_model
from adaloss.runner.schemas import check_config
from conftest import compose_train

VOC = ("dataset=voc", "model=ssd512", "model.width_multiplier=0.125", "model.image_size=128")


def _voc(*overrides: str):
    return compose_train([*VOC, *overrides])


def _ssd(cfg) -> nn.Module:
    return build_model(cfg.model, num_classes=cfg.dataset.num_classes, input_shape=(3, 128, 128))


def test_the_voc_config_carries_the_recipe() -> None:
    cfg = _voc()
    o, s = cfg.optimizer, cfg.schedule
    assert (o.lr, o.momentum, o.weight_decay, o.decay_1d, o.decay_bias, o.bias_lr_factor) == (
        1e-3, 0.9, 5e-4, True, False, 2.0
    )  # fmt: skip
    assert (s.warmup, s.warmup_factor, s.warmup_unless_batch_size, s.batch_size) == ("constant", 0.1, 32, 32)
    assert round(s.warmup_fraction * 120000) == 1000
    assert _voc("trainer.batch_size=8").schedule.batch_size == 8  # follows the run's batch


def test_ssd_param_groups_are_what_the_config_says() -> None:
    cfg = _voc()
    model = _ssd(cfg)
    optimizer = build_optimizer(cfg.optimizer, model)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [
        (g["lr"], g["weight_decay"], sorted(names[id(p)] for p in g["params"]))
        for g in optimizer.param_groups
    ]
    assert len(groups) == 2
    (lr0, wd0, plain), (lr1, wd1, biases) = groups
    assert (lr0, wd0) == (1e-3, 5e-4) and (lr1, wd1) == (2e-3, 0.0)  # group 0: the logged lr is the recipe's
    assert biases == sorted(n for n in names.values() if n.endswith(".bias")) and biases
    assert all(not n.endswith(".bias") for n in plain)
    assert "net.backbone.conv4_3_norm.weight" in plain  # the 1-D L2Norm scale is decayed, as in Chainer
    assert len(plain) + len(biases) == len(list(model.parameters()))


def _lrs(cfg, model: nn.Module, updates: int) -> list[tuple[float, float]]:
    """(weights' lr, biases' lr) of each of the first ``updates`` updates, over the recipe's 120k."""
    optimizer = build_optimizer(cfg.optimizer, model)
    schedule = build_schedule(cfg.schedule, optimizer, 120000)
    out = []
    for _ in range(updates):
        out.append((optimizer.param_groups[0]["lr"], optimizer.param_groups[1]["lr"]))
        optimizer.step()
        schedule.step()
    return out


@pytest.mark.parametrize("batch", [8, 16])
def test_the_warm_up_at_another_batch_than_32(batch: int) -> None:
    """train_multi.py:297-309: lr x0.1 for iterations 1-1000, then the recipe's lr, /10 at 80k and 100k."""
    cfg = _voc(f"trainer.batch_size={batch}")
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 1))
    lrs = _lrs(cfg, model, 1003)
    assert all(lr == pytest.approx((1e-4, 2e-4), rel=1e-12) for lr in lrs[:1000])
    assert all(lr == pytest.approx((1e-3, 2e-3), rel=1e-12) for lr in lrs[1000:])
    rule = build_schedule(cfg.schedule, build_optimizer(cfg.optimizer, model), 120000).lr_lambdas[0]
    assert [rule(u) for u in (999, 1000, 79999, 80000, 99999, 100000)] == pytest.approx(
        [0.1, 1.0, 1.0, 0.1, 0.1, 0.01], rel=1e-12
    )


def test_no_warm_up_at_batch_32() -> None:
    cfg = _voc("trainer.batch_size=32")
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 1))
    assert all(lr == pytest.approx((1e-3, 2e-3), rel=1e-12) for lr in _lrs(cfg, model, 5))
    rule = build_schedule(cfg.schedule, build_optimizer(cfg.optimizer, model), 120000).lr_lambdas[0]
    assert [rule(u) for u in (0, 80000, 100000)] == pytest.approx([1.0, 0.1, 0.01], rel=1e-12)


def _train_sgd(bias_lr_factor: float, grad_factor: float, nesterov: bool) -> list[torch.Tensor]:
    """20 SGD-momentum steps under a warm-up and a decay; the biases' gradients times ``grad_factor``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1))
    opt = OmegaConf.create(
        {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.05, "momentum": 0.9, "nesterov": nesterov,
         "weight_decay": 5e-4, "decay_bias": False, "bias_lr_factor": bias_lr_factor}
    )  # fmt: skip
    optimizer = build_optimizer(opt, model)
    sched = OmegaConf.create(
        {"_target_": "adaloss.runner.engine.optim.multistep", "_partial_": True, "milestones": [0.5, 0.75],
         "warmup_fraction": 0.2, "warmup_factor": 0.1, "warmup_unless_batch_size": 32, "batch_size": 8}
    )  # fmt: skip
    schedule = build_schedule(sched, optimizer, 20)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        x = torch.randn(2, 3, 6, 6, generator=gen)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        for name, p in model.named_parameters():
            if is_bias(name):
                p.grad.mul_(grad_factor)  # ChainerCV's GradientScaling hook
        optimizer.step()
        schedule.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("nesterov", [False, True])
def test_bias_lr_factor_2_is_gradient_scaling_2_bit_for_bit(nesterov: bool) -> None:
    """The equivalence the config relies on: SGD momentum with the biases' lr x2 moves every parameter
    exactly as SGD momentum with the biases' gradients x2 (ChainerCV's GradientScaling(2))."""
    by_lr = _train_sgd(bias_lr_factor=2.0, grad_factor=1.0, nesterov=nesterov)
    by_grad = _train_sgd(bias_lr_factor=1.0, grad_factor=2.0, nesterov=nesterov)
    plain = _train_sgd(bias_lr_factor=1.0, grad_factor=1.0, nesterov=nesterov)
    assert all(torch.equal(a, b) for a, b in zip(by_lr, by_grad, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(by_lr, plain, strict=True))  # the factor does something


def test_default_groups_are_unchanged() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    (one,) = parameter_groups(model, 1e-4, decay_1d=True)
    assert len(one["params"]) == 4 and "lr" not in one
    decayed, plain = parameter_groups(model, 1e-4, decay_1d=False)
    assert [p.dim() for p in decayed["params"]] == [2] and len(plain["params"]) == 3
    assert (decayed["weight_decay"], plain["weight_decay"]) == (1e-4, 0.0)
    # decay_bias=false alone: the LayerNorm's gain is still decayed (decay_1d), the biases are not
    (d, p) = parameter_groups(model, 1e-4, decay_1d=True, decay_bias=False)
    assert [t.shape for t in d["params"]] == [(4, 3), (4,)] and len(p["params"]) == 2


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optimizer.bias_lr_factor=0", "optimizer.bias_lr_factor must be a number > 0, got 0"),
        (
            "schedule.warmup_unless_batch_size=0",
            "schedule.warmup_unless_batch_size must be a positive integer",
        ),
    ],
)
def test_bad_recipe_values_are_config_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(_voc(override))


def test_a_recipe_boolean_is_a_boolean() -> None:
    """``optimizer.decay_bias`` is typed: a value that is not a boolean is refused while composing."""
    with pytest.raises(Exception, match="decay_bias"):
        _voc("optimizer.decay_bias=maybe")


def test_a_bias_factor_needs_an_lr_and_a_batch_condition_needs_the_batch() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="optimizer.bias_lr_factor multiplies optimizer.lr"):
        parameter_groups(model, 0.0, True, bias_lr_factor=2.0, lr=None)
    sched = OmegaConf.create(
        {"_target_": "adaloss.runner.engine.optim.multistep", "_partial_": True, "milestones": [0.5],
         "warmup_unless_batch_size": 32}
    )  # fmt: skip
    with pytest.raises(ConfigError, match="schedule.warmup_unless_batch_size needs the run's batch size"):
        build_schedule(sched, torch.optim.SGD(model.parameters(), lr=0.1), 10)
