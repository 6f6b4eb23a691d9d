"""Models, optimizers and schedules from ``_target_`` configs: the bundled configs, a user's own module,
any torch optimizer or schedule, and a bad target as one ``ConfigError`` line."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from adaloss.errors import ConfigError
from adaloss.runner.engine import train
from adaloss.runner.engine.optim import WarmupCosine, build_optimizer, parameter_groups
from adaloss.runner.engine.tasks import ClassificationTask
from adaloss.runner.models import GPT, build_model, bundled_model, model_names
from conftest import CONFIG_DIR, compose_train


class TinyNet(nn.Module):
    """A user's own classifier, defined here and nowhere in the package: trained through model._target_."""

    def __init__(self, num_classes: int, in_features: int, width: int = 4) -> None:
        super().__init__()
        self.flatten = nn.Flatten(1)
        self.hidden = nn.Linear(in_features, width)
        self.act = nn.ReLU()
        self.out = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.hidden(self.flatten(x))))


class NeedsDepth(nn.Module):
    def __init__(self, num_classes: int, depth: int) -> None:
        super().__init__()
        if depth > 3:
            raise ValueError(f"depth {depth} is too deep for this toy")
        self.fc = nn.Linear(3, num_classes)


def not_a_module(num_classes: int) -> str:
    return "no"


def test_a_bundled_name_without_target_is_its_config_file() -> None:
    """The bundled models are the files of configs/model/: a config of a bundled name without _target_
    (scripts, tests) is exactly what model=<name> composes, and every file is a known name."""
    stems = {p.stem for p in (CONFIG_DIR / "model").glob("*.yaml")} - {"custom"}
    assert set(model_names()) == stems
    for stem in sorted(stems):
        composed = OmegaConf.to_container(compose_train([f"model={stem}"]).model, resolve=True)
        name, bundled = bundled_model({"name": stem})
        assert name == stem and OmegaConf.to_container(bundled, resolve=True) == composed, stem
    assert set(model_names("detection")) == {"ssd300", "ssd512"}
    assert set(model_names("language_model")) == {"gpt", "gpt2_small", "hf_bert", "hf_gpt2", "hf_llama"}


def test_a_users_own_module_trains_through_model_target(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    """``model=custom model._target_=...``: num_classes and in_features come from the data, width from the
    command line, and the run is named after the user's model. On a bundled option the class would get
    that option's keys: an unknown one is an error, not a warning."""
    cfg = make_cfg(
        "model=custom", "model._target_=test_targets.TinyNet", "model.name=tinynet", "+model.width=6"
    )
    metrics = train(cfg)
    assert metrics["steps"] == 2 and not metrics["diverged"]
    assert set(metrics["underflow_rate"]) == {"hidden", "out"}  # the user's layers, by their names
    assert metrics["config"]["model"]["name"] == "tinynet" and (tmp_path / "metrics.json").is_file()
    model = build_model(cfg.model, num_classes=10, input_shape=(3, 16, 16))
    assert (
        isinstance(model, TinyNet)
        and model.hidden.in_features == 3 * 16 * 16
        and model.hidden.out_features == 6
    )
    with pytest.raises(ConfigError, match="test_targets.TinyNet takes no argument depth"):
        train(make_cfg("model._target_=test_targets.TinyNet", "model.name=tinynet"))  # resnet20's depth


class SmoothedTask(ClassificationTask):
    """A user's own task, defined here and nowhere in the package: cross-entropy with label smoothing."""

    losses: list[float] = []  # every training loss it computed, for the test to see it was the one used

    def __init__(self, model: nn.Module, device: torch.device, smoothing: float) -> None:
        super().__init__(model, device)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=smoothing)

    def loss(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss, logits = super().loss(model, batch)
        SmoothedTask.losses.append(float(loss.detach()))
        return loss, logits


def test_a_users_own_task_trains_through_task_target(
    make_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    """``task=custom task._target_=...``: the user's class is built with the model, the device and its
    argument from the command line, and its loss is the one trained; a class that is not a Task, and a task
    of another kind than the data, are one ConfigError line each."""
    SmoothedTask.losses.clear()
    cfg = make_cfg(
        "task=custom", "task._target_=test_targets.SmoothedTask", "task.name=smoothed", "+task.smoothing=0.2"
    )
    metrics = train(cfg)
    assert metrics["steps"] == 2 and not metrics["diverged"] and "test_accuracy" in metrics
    assert len(SmoothedTask.losses) == 2
    assert metrics["config"]["task"] == {
        "_target_": "test_targets.SmoothedTask", "name": "smoothed", "smoothing": 0.2
    }  # fmt: skip
    with pytest.raises(ConfigError, match="task._target_=test_targets.TinyNet is not a subclass of"):
        train(make_cfg("task=custom", "task._target_=test_targets.TinyNet", "task.name=tiny"))
    # a bundled dataset's schema says what it holds: refused before anything is built
    with pytest.raises(ConfigError, match="task=detection trains detection but dataset=synthetic holds"):
        train(make_cfg("model=ssd300", "task=detection"))
    # a dataset of the user's says it when built (DatasetInfo.task): refused before the model is built
    users_data = ["dataset=custom", "dataset._target_=test_schemas.my_data", "dataset.name=mydata"]
    cfg = compose_train([*users_data, "+dataset.size=16", "model=ssd300", "task=detection", "device=cpu"])
    cfg.paths.output_dir = str(tmp_path / "users_data")
    with pytest.raises(
        ConfigError,
        match="holds classification data .* but task=detection trains detection: choose task=classification",
    ):
        train(cfg)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model._target_=no_such_pkg.Net", "model.name=net"],
            [
                "model._target_=no_such_pkg.Net cannot be imported",
                "No module named 'no_such_pkg'",
                "full dotted path",
            ],
        ),
        (
            ["model._target_=math.pi", "model.name=pi"],
            ["model._target_=math.pi is a float, not a class or function"],
        ),
        (
            ["model=custom", "model._target_=test_targets.NeedsDepth", "model.name=nd"],
            [
                "test_targets.NeedsDepth cannot be called",
                "missing a required argument: 'depth'",
                "+model.<name>",
            ],
        ),
        (
            ["model=custom", "model._target_=test_targets.NeedsDepth", "model.name=nd", "+model.depth=20"],
            ["model._target_=test_targets.NeedsDepth failed: ValueError: depth 20 is too deep"],
        ),
        (
            ["model=custom", "model._target_=test_targets.not_a_module", "model.name=x"],
            ["model._target_=test_targets.not_a_module returned a str, not a torch.nn.Module"],
        ),
        (
            ["model._target_=test_targets.TinyNet"],
            [
                "replaces the network of model=resnet20",
                "model.name is still 'resnet20'",
                "model.name=tinynet",
            ],
        ),
        (["model.depth=56"], ["model.depth=56 contradicts model.name=resnet20", "model.depth=20"]),
        (
            ["optimizer._target_=torch.optim.Adamm"],
            ["optimizer._target_=torch.optim.Adamm cannot be imported"],
        ),
        (["optimizer._partial_=false"], ["must be a _partial_ config", "optimizer._partial_=true"]),
        (["optimizer.lr=-1"], ["optimizer.lr must be a number > 0"]),
        (
            ["schedule=custom", "schedule._target_=torch.optim.lr_scheduler.StepLR"],
            ["schedule._target_=torch.optim.lr_scheduler.StepLR cannot be called", "'step_size'"],
        ),
        (
            ["schedule._target_=torch.nn.Identity", "schedule._partial_=true"],
            ["schedule._target_=torch.nn.Identity made a Identity, not a learning-rate schedule"],
        ),
    ],
    ids=[
        "unimportable",
        "not-callable",
        "missing-argument",
        "constructor-raises",
        "not-a-module",
        "stale-name",
        "fixed-argument",
        "optimizer-unimportable",
        "optimizer-not-partial",
        "optimizer-lr",
        "schedule-missing-argument",
        "schedule-not-a-schedule",
    ],
)
def test_a_bad_target_is_one_config_error_line(
    make_cfg: Callable[..., DictConfig], tmp_path: Path, overrides: list[str], expected: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        train(make_cfg(*overrides))
    message = str(info.value)
    assert "\n" not in message
    for text in expected:
        assert text in message, (text, message)
    assert not (tmp_path / "metrics.json").exists()


def test_any_torch_optimizer_and_schedule_plug_in(make_cfg: Callable[..., DictConfig]) -> None:
    """``optimizer=custom``: RMSprop with the recipe's lr and weight decay; ``schedule=custom``:
    CosineAnnealingLR gets the run's length as T_max, so the lr reaches eta_min at the last of 4 updates."""
    steps: list[tuple[type, float]] = []

    def spy(step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: object) -> None:
        steps.append((type(optimizer), optimizer.param_groups[0]["lr"]))

    cfg = make_cfg(
        "optimizer=custom",
        "optimizer._target_=torch.optim.RMSprop",
        "optimizer.lr=0.01",
        "schedule=custom",
        "schedule._target_=torch.optim.lr_scheduler.CosineAnnealingLR",
        "+schedule.eta_min=0.001",
        "trainer.max_steps=4",
        "precision=fp32",
    )
    metrics = train(cfg, callbacks=[spy])
    assert metrics["skipped_steps"] == 0
    assert {kind for kind, _ in steps} == {torch.optim.RMSprop}
    lrs = [lr for _, lr in steps]
    expected = [0.001 + 0.009 * (1 + math.cos(math.pi * k / 4)) / 2 for k in (1, 2, 3, 4)]
    assert lrs == pytest.approx(expected, rel=1e-9)


def test_adamw_decays_only_weights_with_two_or_more_dimensions() -> None:
    model = GPT(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=8)
    cfg = compose_train(["optimizer=adamw", "recipe=none"]).optimizer  # its own settings, no recipe
    optimizer = build_optimizer(cfg, model)
    assert type(optimizer) is torch.optim.AdamW
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay["betas"] == [0.9, 0.95] or tuple(decay["betas"]) == (0.9, 0.95)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    names = {id(p): n for n, p in model.named_parameters()}  # the tied head appears once, as wte.weight
    assert {names[id(p)] for p in decay["params"]} == {
        "wte.weight",
        "wpe.weight",
        "h.0.attn.c_attn.weight",
        "h.0.attn.c_proj.weight",
        "h.0.mlp.c_fc.weight",
        "h.0.mlp.c_proj.weight",
    }
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    # SGD's recipe (decay_1d: true) keeps one group of every parameter, He et al.'s
    assert len(parameter_groups(model, 1e-4, decay_1d=True)) == 1


def test_warmup_cosine_ramps_then_decays_to_the_final_factor() -> None:
    rule = WarmupCosine(length=1000, warmup_fraction=0.1, final_factor=0.1)
    assert rule(0) == pytest.approx(1 / 101) and rule(99) == pytest.approx(
        100 / 101
    )  # linear, first step moves
    assert rule(100) == pytest.approx(1.0)
    assert rule(550) == pytest.approx(0.55)  # half way down the cosine: (1 + 0.1) / 2
    assert rule(1000) == pytest.approx(0.1) and rule(5000) == pytest.approx(0.1)
    values = [rule(u) for u in range(100, 1001)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))  # never rises after the warm-up
    assert rule.__dict__ == WarmupCosine(1000, 0.1, 0.1).__dict__  # plain state: LambdaLR saves it


def test_the_schedule_squeezes_into_max_steps_and_resumes(make_cfg: Callable[..., DictConfig]) -> None:
    """schedule=cosine over trainer.max_steps: the lr after the last update is final_factor * lr."""
    seen: list[float] = []
    cfg = make_cfg(
        "schedule=cosine", "schedule.warmup_fraction=0.25", "trainer.max_steps=4", "precision=fp32"
    )
    train(
        cfg, callbacks=[lambda step, model, optimizer, scaler: seen.append(optimizer.param_groups[0]["lr"])]
    )
    base = float(cfg.optimizer.lr)
    assert seen[0] == pytest.approx(base) and seen[-1] == pytest.approx(0.1 * base)
