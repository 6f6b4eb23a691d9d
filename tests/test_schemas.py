"""The typed configs (src/adaloss/runner/schemas.py) and the one way every part is built.

* Every group and section rejects a wrong type, an out-of-range value and an unknown key with one line that
  names the key (and, for a value, an example): a type is refused by OmegaConf while Hydra composes (the
  line is ``train.py``'s ``describe_hydra_error``), a range and a key added with ``+`` by
  ``validate_config`` before anything is built.
* A class of the user's, defined in this module, trains through ``_target_`` as the scaler, the dataset
  and the logger (``<group>=custom <group>._target_=test_schemas.<name> +<group>.<key>=<value>``).
* Each option's YAML starts from its schema, and the schema's defaults are what a composed config holds.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra.errors import HydraException
from omegaconf import open_dict

from adaloss.errors import ConfigError
from adaloss.precision import Precision
from adaloss.runner.data import DatasetInfo, TensorImageDataset
from adaloss.runner.engine import train
from adaloss.runner.engine.config import validate_config
from adaloss.runner.logging import NullLogger
from adaloss.scalers import FixedLossScaler
from conftest import ROOT, TINY, compose_train

# ------------------------------------------------------------------------ every group rejects bad input

#: ``(group, overrides, expected substrings)``: for each group a wrong type, a value out of range and an
#: unknown key (added with ``+``, which Hydra accepts while composing).
CASES = [
    ("scaler", ["scaler=dynamic", "scaler.growth_factor=abc"], ["scaler.growth_factor must be a number"]),
    ("scaler", ["scaler=fixed", "scaler.scale=0"], ["scaler.scale must be a number > 0, got 0"]),
    ("scaler", ["scaler=fixed", "+scaler.bogus=1"], ["unknown key 'scaler.bogus'", "scaler=custom"]),
    ("dataset", ["dataset=digits", "dataset.test_fraction=abc"], ["dataset.test_fraction must be a number"]),
    ("dataset", ["dataset=digits", "dataset.test_fraction=1.5"], ["dataset.test_fraction must be a number"]),
    ("dataset", ["dataset=digits", "+dataset.bogus=1"], ["unknown key 'dataset.bogus'", "dataset=custom"]),
    ("model", ["model.depth=abc"], ["model.depth must be an integer, got 'abc'"]),
    ("model", ["model=mlp", "model.hidden=[0]"], ["model.hidden entries must be", "e.g. model.hidden="]),
    ("model", ["+model.bogus=1"], ["unknown key 'model.bogus'", "model has the fields"]),
    ("optimizer", ["optimizer.lr=abc"], ["optimizer.lr must be a number, got 'abc'", "optimizer.lr=0.1"]),
    ("optimizer", ["optimizer.momentum=1.5"], ["optimizer.momentum must be a number in [0, 1], got 1.5"]),
    ("optimizer", ["+optimizer.bogus=1"], ["unknown key 'optimizer.bogus'"]),
    ("schedule", ["schedule.gamma=abc"], ["schedule.gamma must be a number, got 'abc'"]),
    ("schedule", ["schedule.gamma=0"], ["schedule.gamma must be a number > 0, got 0"]),
    ("schedule", ["schedule=cosine", "+schedule.bogus=1"], ["unknown key 'schedule.bogus'"]),
    ("precision", ["precision.allow_tf32=maybe"], ["precision.allow_tf32 must be true or false"]),
    ("precision", ["precision.backend=gpu"], ["precision.backend must be one of auto, autocast, emulate"]),
    ("precision", ["+precision.bogus=1"], ["unknown key 'precision.bogus'"]),
    (
        "logger",
        ["logger=wandb", "logger.wandb.init_timeout=abc"],
        ["logger.wandb.init_timeout must be a number"],
    ),
    (
        "logger",
        ["logger=wandb", "logger.wandb.init_timeout=0"],
        ["logger.wandb.init_timeout must be a number > 0"],
    ),
    ("logger", ["logger=wandb", "+logger.wandb.bogus=1"], ["unknown key 'logger.wandb.bogus'"]),
    ("task", ["dataset=shapes", "model=ssd300", "task.init=[1,2]"], ["task.init: Cannot convert 'list'"]),
    (
        "task",
        ["dataset=shapes", "model=ssd300", "task.init=bogus"],
        ["task.init must be one of default, lsuv, got 'bogus'"],
    ),
    ("task", ["+task.bogus=1"], ["unknown key 'task.bogus'", "task=custom task._target_="]),
    ("trainer", ["trainer.batch_size=abc"], ["trainer.batch_size must be an integer, got 'abc'"]),
    ("trainer", ["trainer.batch_size=0"], ["trainer.batch_size must be a positive integer, got 0"]),
    ("trainer", ["+trainer.bogus=1"], ["unknown key 'trainer.bogus'", "trainer has the fields"]),
    ("telemetry", ["telemetry.quantile=abc"], ["telemetry.quantile must be a number, got 'abc'"]),
    ("telemetry", ["telemetry.quantile=2"], ["telemetry.quantile must be a number in (0, 1], got 2.0"]),
    ("telemetry", ["+telemetry.bogus=1"], ["unknown key 'telemetry.bogus'"]),
    (
        "adaptive_recipe",
        ["adaptive_recipe.update_every=0"],
        ["adaptive_recipe.update_every must be a positive"],
    ),
    ("top level", ["seed=abc"], ["seed must be an integer, got 'abc'", "seed=0"]),
    ("top level", ["+bogus=1"], ["unknown key 'bogus'", "the config has the fields"]),
]


def _load_cli() -> Any:
    spec = importlib.util.spec_from_file_location("adaloss_train_cli_schemas", ROOT / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def user_line(overrides: list[str]) -> str:
    """The ``error:`` line ``python train.py <overrides>`` prints (without the prefix), found in-process:
    Hydra's composition error as ``train.py`` describes it, else ``validate_config``'s ConfigError."""
    own_dataset = any(o.startswith("dataset=") for o in overrides)
    tiny = [o for o in TINY if not (own_dataset and o.startswith("dataset"))]
    try:
        cfg = compose_train([*tiny, *overrides])
    except HydraException as error:
        return _load_cli().describe_hydra_error(error)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    return str(info.value)


@pytest.mark.parametrize(("group", "overrides", "expected"), CASES, ids=[" ".join(c[1]) for c in CASES])
def test_every_group_rejects_a_wrong_type_a_bad_value_and_an_unknown_key(
    group: str, overrides: list[str], expected: list[str]
) -> None:
    line = user_line(overrides)
    assert "\n" not in line.strip()
    for text in expected:
        assert text in line, (text, line)


def test_the_table_covers_every_group_three_ways() -> None:
    groups = ("scaler", "dataset", "model", "task", "optimizer", "schedule", "precision", "logger", "trainer")
    for group in groups:
        assert len([c for c in CASES if c[0] == group]) == 3, group


def test_a_valid_config_passes() -> None:
    validate_config(compose_train(list(TINY)))
    validate_config(compose_train([*TINY, "scaler=adaptive", "precision=fp8_e5m2", "optimizer=adamw"]))


# --------------------------------------------------------------------------- a user's class, by _target_

#: What the user's classes saw, for the test to read.
SEEN: dict[str, Any] = {}


class MyScaler(FixedLossScaler):
    """A user's loss scaler: a fixed scale, built from ``+scaler.factor``."""

    def __init__(self, factor: float, device: Any = None) -> None:
        super().__init__(device, scale=2.0 * factor)
        SEEN["scaler"] = factor
        SEEN["scalers built"] = SEEN.get("scalers built", 0) + 1


def my_data(size: int, data_dir: str) -> tuple[TensorImageDataset, TensorImageDataset, DatasetInfo]:
    """A user's dataset: random 3x8x8 images in 4 classes; ``data_dir`` is paths.data_dir."""
    SEEN["dataset"] = (size, data_dir)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(size, 3, 8, 8, generator=gen), torch.arange(size) % 4
    train_set, test_set = TensorImageDataset(x, y), TensorImageDataset(x[:8], y[:8])
    return train_set, test_set, DatasetInfo("mydata", 4, 8, 3, size, 8)


class MyLogger(NullLogger):
    """A user's logger: keeps the train losses it is given."""

    def __init__(self, tag: str, run_dir: Path) -> None:
        SEEN["logger"] = (tag, run_dir)
        SEEN["logged"] = []

    def log(self, metrics: Any, step: int) -> None:
        SEEN["logged"].append((step, dict(metrics)))


def test_a_users_scaler_dataset_and_logger_train_through_target(tmp_path: Path, single_thread: None) -> None:
    cfg = compose_train(
        [
            "model=mlp",
            "model.hidden=[16]",
            "scaler=custom",
            "scaler._target_=test_schemas.MyScaler",
            "+scaler.factor=8",
            "dataset=custom",
            "dataset._target_=test_schemas.my_data",
            "dataset.name=mydata",
            "+dataset.size=16",
            "logger=custom",
            "logger._target_=test_schemas.MyLogger",
            "+logger.tag=mine",
            "trainer.batch_size=4",
            "trainer.eval_batch_size=8",
            "trainer.max_steps=2",
            "trainer.steps=2",
            "trainer.log_every=1",
            "trainer.progress_bar=false",
            "device=cpu",
        ]
    )
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
    SEEN.clear()
    metrics = train(cfg)
    assert metrics["steps"] == 2 and metrics["config"]["scaler"]["name"] == "custom"
    assert SEEN["scaler"] == 8 and metrics["loss_scale"] == 16.0
    assert SEEN["dataset"] == (16, cfg.paths.data_dir)
    assert SEEN["logger"] == ("mine", tmp_path)
    assert any("train/loss" in logged for _, logged in SEEN["logged"])  # the run's numbers reach it
    assert metrics["config"]["dataset"]["name"] == "mydata"


def test_a_run_builds_its_scaler_and_precision_once(
    tmp_path: Path, single_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The precision and scaler that ``validate_config`` builds to check the config are the run's: a user's
    scaler class is constructed once per run, and so is the precision (it used to be twice each)."""
    built: list[str] = []
    real_init = Precision.__init__

    @functools.wraps(real_init)  # the same signature: the builder fills device by name
    def counted(self: Precision, *args: Any, **kwargs: Any) -> None:
        built.append("precision")
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(Precision, "__init__", counted)
    cfg = compose_train([*TINY, "scaler=custom", "scaler._target_=test_schemas.MyScaler", "+scaler.factor=4"])
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
    SEEN.clear()
    metrics = train(cfg)
    assert metrics["steps"] == 2 and metrics["loss_scale"] == 8.0
    assert SEEN["scalers built"] == 1
    assert built == ["precision"]


def test_a_users_class_on_a_bundled_option_gets_its_keys_and_an_unknown_one_is_an_error() -> None:
    """``scaler=fixed scaler._target_=test_schemas.MyScaler``: MyScaler takes no ``scale``: one error line
    saying to choose scaler=custom, not a warning and a silently dropped key."""
    line = user_line(["scaler=fixed", "scaler._target_=test_schemas.MyScaler"])
    assert "scaler._target_=test_schemas.MyScaler takes no argument scale" in line and "scaler=custom" in line


# ---------------------------------------------------------------------------------- one place, one way


def test_every_option_starts_from_its_schema() -> None:
    for path in sorted((ROOT / "configs").glob("*/*.yaml")):
        group = path.parent.name
        if group in ("model", "dataset", "scaler", "precision", "optimizer", "schedule", "logger"):
            assert f"/schema/{group}/" in path.read_text(), path


def test_the_schema_holds_the_defaults() -> None:
    """configs/scaler/adaptive.yaml sets no value; the composed config has the schema's."""
    from adaloss.runner.schemas import AdaptiveScalerConf

    cfg = compose_train(["scaler=adaptive", "dataset=digits"])
    assert cfg.scaler.t_uf == AdaptiveScalerConf.t_uf and cfg.scaler.growth_interval == 2000
    assert cfg.scaler.update_every == 3  # the digits recipe's adaptive_recipe.update_every


def test_a_dataset_config_is_data_only_and_names_its_recipe() -> None:
    for path in sorted((ROOT / "configs" / "dataset").glob("*.yaml")):
        if path.stem == "custom":
            continue
        text = path.read_text()
        body = [line for line in text.splitlines() if line and not line.startswith(("#", " ", "-"))]
        assert body == ["defaults:", "dataset:"], (path.name, body)
        assert f"override /recipe: {path.stem}" in text
    # the recipe is selectable on its own: digits' data with CIFAR's recipe
    cfg = compose_train(["dataset=digits", "recipe=cifar10"])
    assert cfg.dataset.name == "digits" and cfg.trainer.steps == 64000 and cfg.trainer.batch_size == 128


def test_a_task_its_dataset_does_not_hold_is_named_as_the_task_not_the_data() -> None:
    """``task=detection`` on the synthetic images: the line says the task trains detection while the data
    is classification data (the dataset's schema knows what it holds), and names the dataset's own task."""
    line = user_line(["task=detection"])
    assert "task=detection trains detection but dataset=synthetic holds classification data" in line
    assert "(task=classification)" in line and "\n" not in line.strip()
