"""Config composition: every option of every group, the paper's recipes, and the documented overrides."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf, open_dict

from adaloss.errors import ConfigError
from adaloss.runner.engine import MultiStepWithWarmup
from adaloss.runner.engine.config import resolved_config, schedule_length, validate_config
from conftest import CONFIG_DIR, compose_train

GROUPS = (
    "model",
    "dataset",
    "scaler",
    "precision",
    "optimizer",
    "schedule",
    "logger",
    "recipe",
    "paths",
    "hydra",
)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


ALL_OPTIONS = [(group, option) for group in GROUPS for option in _options(group)]


def test_every_group_has_the_expected_options() -> None:
    assert _options("model") == [
        "custom",
        "gpt",
        "gpt2_small",
        "hf_bert",
        "hf_gpt2",
        "hf_llama",
        "mlp",
        "resnet110",
        "resnet18",
        "resnet20",
        "resnet50",
        "resnet56",
        "ssd300",
        "ssd512",
        "vgg_nobn",
        "vit",
    ]
    assert _options("dataset") == [
        "cifar10",
        "cifar100",
        "custom",
        "digits",
        "imagenet",
        "pystdlib",
        "shapes",
        "synthetic",
        "tokens",
        "voc",
    ]
    assert _options("optimizer") == ["adamw", "custom", "sgd"]
    assert _options("schedule") == ["cosine", "custom", "multistep"]
    assert _options("scaler") == ["adaptive", "custom", "dynamic", "fixed", "none"]
    assert _options("precision") == ["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "mxfp4", "nvfp4"]
    assert _options("logger") == ["custom", "none", "wandb"]
    # the paper's (and our CPU) recipes, one per dataset, and none
    assert _options("recipe") == sorted([*(o for o in _options("dataset") if o != "custom"), "none"])
    assert (CONFIG_DIR / "experiment").is_dir()


@pytest.mark.parametrize(("group", "option"), ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_every_option_composes_and_resolves(group: str, option: str) -> None:
    # a detector needs detection data and the reverse (validate_config rejects the mixed pairs)
    partners = {
        "model": {
            "ssd300": "dataset=shapes",
            "ssd512": "dataset=voc",
            "gpt": "dataset=pystdlib",
            "gpt2_small": "dataset=tokens",
            "hf_bert": "dataset=pystdlib",
            "hf_gpt2": "dataset=pystdlib",
            "hf_llama": "dataset=pystdlib",
        },
        "dataset": {
            "shapes": "model=ssd512 dataset=shapes",
            "voc": "model=ssd300",
            "pystdlib": "model=gpt dataset=pystdlib",
            "tokens": "model=gpt",
            "custom": "dataset._target_=my_pkg.my_data",
        },
        "recipe": {
            "shapes": "model=ssd512 dataset=shapes",
            "voc": "model=ssd512 dataset=voc",
            "pystdlib": "model=gpt dataset=pystdlib",
            "tokens": "model=gpt dataset=tokens",
        },
    }
    # a custom option names the user's class
    partners["model"]["custom"] = "model._target_=torch.nn.Flatten"
    partners["scaler"] = {"custom": "scaler._target_=adaloss.scalers.NoLossScaler"}
    partners["optimizer"] = {"custom": "optimizer._target_=torch.optim.RMSprop"}
    partners["schedule"] = {"custom": "schedule._target_=torch.optim.lr_scheduler.CosineAnnealingLR"}
    partners["logger"] = {"custom": "logger._target_=adaloss.runner.logging.NullLogger"}
    partner = partners.get(group, {}).get(option)
    overrides = [f"{group}={option}", *(partner.split() if partner else [])]
    cfg = compose_train(overrides, return_hydra_config=(group == "hydra"))
    if group in ("model", "dataset", "scaler", "precision", "optimizer", "schedule"):
        assert cfg[group].name == option
    if group == "logger":
        assert (cfg.logger.wandb is None) == (option != "wandb")
    with open_dict(cfg):
        cfg.paths.output_dir = "/tmp/run"
    validate_config(cfg)
    resolved = resolved_config(cfg)  # every interpolation resolves
    assert "hydra" not in resolved
    assert resolved["name"].startswith(f"{resolved['model']['name']}_{resolved['dataset']['name']}_")


def test_defaults_are_the_paper_setting() -> None:
    cfg = compose_train()
    assert (cfg.model.name, cfg.dataset.name, cfg.precision.name, cfg.scaler.name) == (
        "resnet20",
        "cifar10",
        "fp16",
        "none",
    )
    assert cfg.device == "auto" and cfg.seed == 0 and cfg.telemetry.every == 100
    assert cfg.logger.wandb.mode == "offline"


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100"])
def test_cifar_recipe_is_he_et_al(dataset: str) -> None:
    cfg = compose_train([f"dataset={dataset}"])
    assert cfg.trainer.batch_size == 128 and cfg.trainer.steps == 64000 and cfg.trainer.epochs is None
    assert cfg.optimizer == {
        "_target_": "torch.optim.SGD",
        "_partial_": True,
        "name": "sgd",
        "lr": 0.1,
        "momentum": 0.9,
        "weight_decay": 1e-4,
        "nesterov": False,
        "decay_1d": True,
        "decay_bias": True,  # the schema's: biases decayed and at the optimizer's lr (voc's recipe differs)
        "bias_lr_factor": 1.0,
    }
    assert cfg.dataset.augment is True and cfg.dataset.image_size == 32
    full, run = schedule_length(cfg.trainer, iters_per_epoch=390)
    rule = MultiStepWithWarmup(run, list(cfg.schedule.milestones), cfg.schedule.gamma)
    assert (full, run) == (64000, 64000)
    assert rule.milestones == [32000, 48000] and rule.gamma == 0.1 and rule.warmup_steps == 0
    assert rule(31999) == 1.0 and rule(32000) == pytest.approx(0.1) and rule(48000) == pytest.approx(0.01)


def test_imagenet_recipe_is_torchvision_reference() -> None:
    cfg = compose_train(["dataset=imagenet", "model=resnet50"])
    assert cfg.trainer.batch_size == 256 and cfg.trainer.epochs == 90 and cfg.trainer.steps is None
    assert cfg.optimizer.lr == 0.1 and cfg.optimizer.weight_decay == 1e-4 and cfg.optimizer.momentum == 0.9
    iters = 1281167 // 256  # drop_last
    full, run = schedule_length(cfg.trainer, iters_per_epoch=iters)
    assert full == run == 90 * iters
    rule = MultiStepWithWarmup(run, list(cfg.schedule.milestones), cfg.schedule.gamma)
    assert rule.milestones == [30 * iters, 60 * iters]  # lr /10 every 30 epochs


def test_resnet110_warms_up_as_he_et_al() -> None:
    cfg = compose_train(["model=resnet110"])
    s = cfg.schedule
    rule = MultiStepWithWarmup(64000, list(s.milestones), s.gamma, s.warmup_fraction, s.warmup_factor)
    assert rule.warmup_steps == 400 and rule(399) * cfg.optimizer.lr == pytest.approx(0.01)
    assert rule(400) == 1.0
    # other depths do not warm up
    assert compose_train(["model=resnet56"]).schedule.warmup_fraction == 0.0


def test_max_steps_squeezes_the_schedule() -> None:
    cfg = compose_train(["trainer.max_steps=1000"])
    full, run = schedule_length(cfg.trainer, iters_per_epoch=390)
    assert (full, run) == (64000, 1000)
    assert MultiStepWithWarmup(run, list(cfg.schedule.milestones), 0.1).milestones == [500, 750]
    # a cap above the schedule changes nothing
    assert schedule_length(compose_train(["trainer.max_steps=100000"]).trainer, 390) == (64000, 64000)


def test_documented_overrides_work_as_spelled() -> None:
    cfg = compose_train(
        [
            "model=resnet56",
            "dataset=digits",
            "scaler=fixed",
            "scaler.scale=16",
            "precision=bf16",
            "seed=3",
            "trainer.max_steps=10",
            "device=cpu",
            "logger=none",
            "hydra.run.dir=/tmp/somewhere",
        ],
        return_hydra_config=True,
    )
    assert cfg.model.name == "resnet56" and cfg.dataset.name == "digits"
    assert cfg.scaler == {"_target_": "adaloss.scalers.FixedLossScaler", "name": "fixed", "scale": 16}
    assert cfg.precision.name == "bf16" and cfg.seed == 3 and cfg.device == "cpu"
    assert cfg.trainer.max_steps == 10 and cfg.logger.wandb is None
    assert cfg.hydra.run.dir == "/tmp/somewhere"
    assert cfg.name == "resnet56_digits_bf16_fixed16_seed3"
    assert compose_train(["logger.wandb.mode=online"]).logger.wandb.mode == "online"


def test_run_and_sweep_folders_are_readable() -> None:
    cfg = compose_train(["scaler=dynamic", "seed=2"], return_hydra_config=True)
    run_dir = OmegaConf.to_container(cfg.hydra.run, resolve=True)["dir"]
    assert "/results/runs/resnet20_cifar10_fp16_dynamic_seed2/" in run_dir
    sweep = cfg.hydra.sweep
    assert "/results/sweeps/" in str(sweep.dir)
    assert OmegaConf.to_container(sweep)["subdir"] == "${hydra.job.num}_${hydra.job.override_dirname}"
    assert "logger" in cfg.hydra.job.config.override_dirname.exclude_keys


def test_joblib_launcher_is_selectable() -> None:
    cfg = compose_train(["hydra/launcher=joblib"], return_hydra_config=True)
    assert "joblib" in cfg.hydra.launcher._target_.lower()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.max_steps=0", "trainer.max_steps"),
        ("trainer.steps=null", "exactly one of trainer.steps and trainer.epochs"),
        ("trainer.batch_size=-4", "trainer.batch_size"),
        ("optimizer.lr=0", "optimizer.lr"),
        ("schedule.milestones=[0.75,0.5]", "increasing"),
        ("schedule.milestones=[50]", "schedule.milestones"),
        ("trainer.grad_clip=-1", "trainer.grad_clip"),
    ],
)
def test_invalid_values_are_config_errors(override: str, message: str) -> None:
    cfg = compose_train([override])
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


def test_linear_warmup_ramps_to_the_base_lr() -> None:
    rule = MultiStepWithWarmup(1000, [0.8], 0.1, warmup_fraction=0.1, warmup_factor=0.0, warmup="linear")
    assert rule(0) == 0.0 and rule(50) == pytest.approx(0.5) and rule(99) == pytest.approx(0.99)
    assert rule(100) == 1.0 and rule(799) == 1.0 and rule(800) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="schedule.warmup"):
        MultiStepWithWarmup(1000, [0.8], 0.1, warmup="cosine")
