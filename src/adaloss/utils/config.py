"""Checks on the composed config, and the schedule length they imply.

``validate_config`` is called before anything is built or loaded, so a typo fails with one line that names
the problem and the fix (a :class:`ConfigError`) rather than deep inside the loop or with a traceback. It
checks the ``trainer``, ``optimizer``, ``schedule``, ``telemetry``, ``seed`` and ``device`` values the engine
reads, that every ``${...}`` interpolation resolves, that the model and dataset exist and suit each other
(a detector needs a detection dataset, a classifier images, a language model text) and that the
``_target_`` of the optimizer and schedule can be imported, and it runs the precision and scaler builders'
own checks. Data on disk is checked by the dataset builders, which read it.

Types are checked here, in one place, for every group (the builders keep their own range checks):

* **Booleans** (:data:`BOOLEAN_FIELDS`) take ``true``/``false`` and the other spellings YAML reads as
  booleans (``yes``/``no``/``on``/``off``, as OmegaConf loads them from a config file; on the command line
  Hydra passes them as strings, which are turned into real booleans here). Anything else, ``maybe``, ``1``,
  is an error: ``bool("no")`` would be ``True``.
* **Numbers** are finite: Hydra turns ``inf`` and ``nan`` on the command line into floats, and no setting
  here means anything with them (no clipping is ``trainer.grad_clip=null``, not ``inf``).

(Hydra's structured configs could type the groups instead, but they reject a value while composing, before
``train()`` runs, with OmegaConf's multi-line message, and several groups differ per option, such as
``model``; one table of checks keeps every existing override and config file working as before.)
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from adaloss.errors import ConfigError

#: The config sections the engine reads as mappings (``trainer=3`` would replace one), each with an
#: example of setting it properly: a field, or a config of its group.
_SECTION_EXAMPLES = {
    "trainer": "trainer.batch_size=128",
    "optimizer": "optimizer.lr=0.1",
    "schedule": "schedule.gamma=0.1",
    "telemetry": "telemetry.every=100",
    "paths": "paths.data_dir=<folder>",
    "model": "model=resnet20",
    "dataset": "dataset=cifar10",
    "scaler": "scaler=dynamic",
    "precision": "precision=fp16",
}
#: Keys whose value only exists inside a launched Hydra job: not resolved here.
_UNRESOLVED_HERE = frozenset({"hydra", "paths.output_dir"})


def _fix(key: str, example: Any) -> str:
    """``e.g. key=example``; for a list's entries (``"schedule.milestones entries"``) the list's key."""
    return f"e.g. {key.removesuffix(' entries')}={example}"


def _positive_int(value: Any, key: str, example: Any, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = " or null" if allow_none else ""
        raise ConfigError(f"{key} must be a positive integer{hint}, got {value!r}; {_fix(key, example)}")
    return value


def _number(
    value: Any, key: str, example: Any, low: float, high: float = math.inf, low_open: bool = False
) -> float:
    """A finite real number in ``[low, high]`` (``(low, high]`` with ``low_open``); else a ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}; {_fix(key, example)}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        if high == math.inf:
            bounds = f"> {low:g}" if low_open else f">= {low:g}"
        else:
            bounds = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise ConfigError(f"{key} must be a number {bounds}, got {value!r}; {_fix(key, example)}")
    return float(value)


def validate_config(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` naming the first invalid value and its fix.

    One side effect: a boolean field given as a YAML spelling (``trainer.save_final=no`` arrives from the
    command line as the string ``"no"``) is replaced in ``cfg`` by the real boolean, so every reader, and
    the config recorded with the run, sees ``False``. Cost: one walk over the config, one CUDA availability
    query, and the imports of the model, data, precision and scaler modules (which the run needs anyway).
    """
    _check_sections(cfg)
    # names before resolving: a mismatched pair may leave ${model.image_size} dangling
    _check_model_and_dataset(cfg)
    _check_interpolations(cfg, "")
    _check_booleans(cfg)
    _check_trainer(cfg.trainer)
    _check_optimizer_and_schedule(cfg)
    _check_group_numbers(cfg)
    _check_run(cfg)


def _check_sections(cfg: DictConfig) -> None:
    for section in _SECTION_EXAMPLES:
        node = cfg.get(section)
        if not isinstance(node, DictConfig):
            raise ConfigError(
                f"{section}={node!r} replaces the whole {section} section with a single value: "
                f"write e.g. {_SECTION_EXAMPLES[section]} instead"
            )


def _check_model_and_dataset(cfg: DictConfig) -> None:
    """Known names, a model ``_target_`` that fits its name, and a task both agree on (classification,
    detection or language modelling). Reads only the names; imports no model."""
    # Imported here: these modules pull in torch and torchvision, which `--help` and `--cfg` do not need.
    from adaloss.data import DATASET_NAMES, DETECTION_DATASET_NAMES, TEXT_DATASET_NAMES
    from adaloss.engine.tasks import check_model_and_dataset

    _name(cfg.model, "model")
    dataset = _name(cfg.dataset, "dataset")
    datasets = DATASET_NAMES + DETECTION_DATASET_NAMES + TEXT_DATASET_NAMES
    if dataset not in datasets:
        raise ConfigError(
            f"unknown dataset '{dataset}' (dataset.name): choose dataset= one of {', '.join(datasets)}"
        )
    check_model_and_dataset(cfg.model, dataset)


def _name(node: DictConfig, section: str) -> str:
    try:
        name = node.get("name")
    except OmegaConfBaseException as error:
        raise ConfigError(
            f"{section}.name cannot be resolved ({_first_line(error)}): give it a plain value"
        ) from None
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"{section}.name must be a name, got {name!r}: choose a config with {section}=<option>"
        )
    return name


def _check_interpolations(node: DictConfig | ListConfig, prefix: str) -> None:
    """Resolve every ``${...}`` (but Hydra's own, which only resolve in a launched job)."""
    if isinstance(node, DictConfig):
        paths = [(key, f"{prefix}.{key}" if prefix else str(key)) for key in node.keys()]
    else:
        paths = [(index, f"{prefix}[{index}]") for index in range(len(node))]
    for key, path in paths:
        if path in _UNRESOLVED_HERE:
            continue
        try:
            value = node[key]
        except OmegaConfBaseException as error:
            raise ConfigError(
                f"{path} cannot be resolved: {_first_line(error)}; give {path} a plain value or point its "
                "${...} at a key that exists"
            ) from None
        if isinstance(value, DictConfig | ListConfig):
            _check_interpolations(value, path)


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


#: Every boolean setting, wherever a config file or the code reads one. A group option that lacks the key
#: (``scaler=fixed`` has no ``allow_below_one``) skips it.
BOOLEAN_FIELDS: tuple[str, ...] = (
    "trainer.progress_bar",
    "trainer.save_final",
    "telemetry.expected_loss_scale",
    "optimizer.nesterov",
    "scaler.allow_below_one",
    "scaler.product_betas",
    "scaler.consecutive_hysteresis",
    "dataset.download",
    "dataset.augment",
    "dataset.use_difficult",
    "model.shared_hidden",
)
#: The strings YAML 1.1 reads as booleans, as PyYAML's (and so OmegaConf's) loader does: a config file's
#: ``save_final: no`` is ``False``, so ``trainer.save_final=no`` on the command line means the same.
_YAML_BOOLEANS = {
    **dict.fromkeys(("true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON"), True),
    **dict.fromkeys(("false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF"), False),
}


def _check_booleans(cfg: DictConfig) -> None:
    """Every :data:`BOOLEAN_FIELDS` entry present is a boolean; YAML spellings become one in ``cfg``."""
    for key in BOOLEAN_FIELDS:
        section, _, field = key.partition(".")
        node = cfg.get(section)
        if not isinstance(node, DictConfig) or field not in node:
            continue
        value = node[field]
        if isinstance(value, bool):
            continue
        if isinstance(value, str) and value.strip() in _YAML_BOOLEANS:
            with open_dict(node):
                node[field] = _YAML_BOOLEANS[value.strip()]
            continue
        raise ConfigError(f"{key} must be true or false, got {value!r}; e.g. {key}=false")


def _check_trainer(t: DictConfig) -> None:
    _positive_int(t.batch_size, "trainer.batch_size", 128)
    _positive_int(t.eval_batch_size, "trainer.eval_batch_size", 500)
    _positive_int(t.eval_every, "trainer.eval_every", 2000)
    _positive_int(t.log_every, "trainer.log_every", 50)
    _positive_int(t.max_steps, "trainer.max_steps", 1000, allow_none=True)
    if (t.steps is None) == (t.epochs is None):
        raise ConfigError(
            f"set exactly one of trainer.steps and trainer.epochs (got steps={t.steps}, epochs={t.epochs}); "
            "e.g. trainer.epochs=null"
        )
    _positive_int(t.steps, "trainer.steps", 64000, allow_none=True)
    _positive_int(t.epochs, "trainer.epochs", 90, allow_none=True)
    if t.grad_clip is not None:
        _number(t.grad_clip, "trainer.grad_clip", 1.0, 0.0, low_open=True)
    _number(t.get("loss_multiplier", 1.0), "trainer.loss_multiplier", 1.0, 0.0, low_open=True)
    if isinstance(t.num_workers, bool) or not isinstance(t.num_workers, int) or t.num_workers < 0:
        raise ConfigError(
            f"trainer.num_workers must be an integer >= 0, got {t.num_workers!r}; e.g. trainer.num_workers=0"
        )


def _check_optimizer_and_schedule(cfg: DictConfig) -> None:
    from adaloss.engine.optim import check_optimizer_and_schedule

    check_optimizer_and_schedule(cfg.optimizer, cfg.schedule, _number)


def _check_group_numbers(cfg: DictConfig) -> None:
    """Numbers of the option groups that their builders convert without looking (``int(h)``, ``float(v)``):
    an ``inf`` or ``nan`` there would fail with a traceback or train on nonsense."""
    model, dataset, scaler = cfg.model, cfg.dataset, cfg.scaler
    if "hidden" in model:
        hidden = model.hidden
        if not isinstance(hidden, ListConfig):
            raise ConfigError(
                f"model.hidden must be a list of layer widths, got {hidden!r}; e.g. model.hidden=[256,256]"
            )
        for width in hidden:
            _positive_int(width, "model.hidden entries", "[256,256]")
    if "depth" in model:
        _positive_int(model.depth, "model.depth", 20)
    for key, positive in (("mean", False), ("std", True)):
        if dataset.get(key) is None:
            continue
        values = dataset[key]
        if not isinstance(values, ListConfig):
            raise ConfigError(
                f"dataset.{key} must be a list of per-channel values, got {values!r}; "
                f"e.g. dataset.{key}=[0.5,0.5,0.5]"
            )
        low = 0.0 if positive else -math.inf  # a standard deviation divides
        for value in values:
            _number(value, f"dataset.{key} entries", "[0.5,0.5,0.5]", low, low_open=positive)
    for key in ("u_min", "u_max"):  # the adaptive scaler's optional format bounds (defaults: the format's)
        if scaler.get(key) is not None:
            _number(scaler[key], f"scaler.{key}", "6e-8" if key == "u_min" else 65504, 0.0, low_open=True)


def _check_run(cfg: DictConfig) -> None:
    """``seed``, ``telemetry``, ``device``, and the precision and scaler builders' own checks."""
    from adaloss.precision import Precision
    from adaloss.scalers import build_scaler
    from adaloss.utils.device import select_device

    seed = cfg.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64:
        raise ConfigError(f"seed must be an integer (64-bit), got {seed!r}; e.g. seed=0")
    _positive_int(cfg.telemetry.every, "telemetry.every", 100)
    select_device(cfg.device)  # raises for an unknown name, and for cuda without a CUDA device
    # The CPU suffices to check the names; the scaler needs the gradient format (fp8_e5m2 has its own).
    precision = Precision.from_config(cfg.precision, "cpu", telemetry_format=cfg.telemetry.format)
    build_scaler(cfg.scaler, precision.grad_format)


def schedule_length(trainer: DictConfig, iters_per_epoch: int) -> tuple[int, int]:
    """``(full, run)``: the recipe's schedule length in iterations, and the iterations this run does.

    ``full`` is ``trainer.steps`` or ``trainer.epochs * iters_per_epoch``; ``run`` is ``full`` capped by
    ``trainer.max_steps``. The lr schedule is laid over ``run``, so a capped run keeps the decay shape.
    """
    full = int(trainer.steps) if trainer.steps is not None else int(trainer.epochs) * iters_per_epoch
    run = min(full, int(trainer.max_steps)) if trainer.max_steps is not None else full
    return full, run


def resolved_config(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain containers with every interpolation resolved, without Hydra's own node.

    This is what W&B and ``metrics.json`` record, so a result can be traced to the exact values that made
    it. Cost: one walk over the config.
    """
    # Hydra's node (present with compose(return_hydra_config=True)) is dropped before resolving: parts of
    # it (hydra.job.num) exist only inside a launched job.
    own = OmegaConf.masked_copy(cfg, [key for key in cfg.keys() if key != "hydra"])
    container = OmegaConf.to_container(own, resolve=True, throw_on_missing=False)
    assert isinstance(container, dict)
    return container
