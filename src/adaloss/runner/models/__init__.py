"""The model zoo: ``build_model(cfg, ...)`` instantiates the ``model`` config group's ``_target_``.

Each config in ``configs/model/`` names a class or function with ``_target_`` and gives its arguments; the
builder knows no model by name. ``model.name`` is metadata: run folders, tables, figures, checkpoint keys
and the checks below go by it. What depends on the data is filled in by parameter name when the config does
not set it: ``num_classes``, ``in_channels``, ``image_size``, ``in_features`` (channels x height x width),
and for language models ``vocab_size`` and ``block_size``. So a user's own ``nn.Module`` trains unchanged
with ``python train.py model=custom model._target_=my_pkg.MyNet model.name=mynet`` (plus
``+model.<arg>=...``).

The bundled models are the files of ``configs/model/`` (each with its schema, :mod:`adaloss.runner.schemas`,
which also says what data the model trains on: its ``TASK``). A config of a bundled name without ``_target_``
(``{"name": "resnet20"}``, as scripts and tests write) is that file, with the mapping's keys on top.

Every bundled model but the Hugging Face ones (``model=hf_gpt2``, ``hf_llama``:
:mod:`adaloss.runner.models.hf`, which the adaptive scaler captures with ``torch.export``) traces with
``torch.fx.symbolic_trace`` (the adaptive scaler rewrites models with torch.fx), uses non-in-place activations
and has torchvision-like module names (``layer3.2.conv1``, ``h.0.attn.c_attn``) so per-layer telemetry reads
naturally.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from adaloss.errors import ConfigError
from adaloss.runner.models.cifar_resnet import CifarResNet, ShortcutA
from adaloss.runner.models.gpt import GPT, GPTConfig
from adaloss.runner.models.mlp import MLP
from adaloss.runner.models.ssd import DETECTION_MODEL_NAMES, SSDDetector
from adaloss.runner.models.vgg import VGGNoBN
from adaloss.runner.models.vit import ViT
from adaloss.runner.schemas import SCHEMAS, schema_of
from adaloss.runner.utils.targets import build_group, config_items, locate_target, target_parameters

__all__ = [
    "DETECTION_MODEL_NAMES",
    "GPT",
    "GPTConfig",
    "MLP",
    "CifarResNet",
    "SSDDetector",
    "ShortcutA",
    "VGGNoBN",
    "ViT",
    "build_detector",
    "build_model",
    "bundled_model",
    "model_names",
]


#: Where the bundled models' configs are: the repository's ``configs/`` (``ADALOSS_ROOT`` where the package
#: is installed apart from it).
CONFIG_DIR = Path(__file__).resolve().parents[4] / "configs"
_EXAMPLE = "model=custom model._target_=my_pkg.MyNet model.name=mynet"
_KIND_ORDER = ("classification", "detection", "language_model")


def _config_dir() -> Path:
    root = os.environ.get("ADALOSS_ROOT")
    return CONFIG_DIR if CONFIG_DIR.is_dir() or not root else Path(root) / "configs"


@functools.cache
def _bundled(name: str) -> DictConfig | None:
    """``configs/model/<name>.yaml`` over its schema (read-only; None if there is no such file)."""
    path = _config_dir() / "model" / f"{name}.yaml"
    if name == "custom" or not path.is_file():
        return None
    body = OmegaConf.load(path)
    defaults = [str(d) for d in body.pop("defaults", [])]
    node = body.get("model", body) if "@package _global_" in path.read_text().splitlines()[0] else body
    schema = next(d for d in defaults if d.startswith("/schema/model/")).split("@")[0]
    kind = next(k for g, n, k in SCHEMAS if f"/schema/{g}/{n}" == schema)
    merged = OmegaConf.merge(OmegaConf.structured(kind), node)
    OmegaConf.set_readonly(merged, True)
    return merged


def model_names(task: str | None = None) -> tuple[str, ...]:
    """The bundled models' names (``configs/model/*.yaml``), classifiers first, then detectors and language
    models; ``task``: only those that train on that data (``classification``, ``detection``,
    ``language_model``)."""
    names = [p.stem for p in (_config_dir() / "model").glob("*.yaml") if _bundled(p.stem) is not None]

    def order(name: str) -> tuple[int, str, int]:
        kind = getattr(schema_of(_bundled(name)), "TASK", None)
        stem, digits = re.fullmatch(r"(.*?)(\d*)", name).groups()  # type: ignore[union-attr]
        rank = _KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER)
        return rank, stem, int(digits or 0)

    chosen = [n for n in names if task is None or getattr(schema_of(_bundled(n)), "TASK", None) == task]
    return tuple(sorted(chosen, key=order))


def bundled_model(cfg: Any) -> tuple[str, DictConfig | None]:
    """``(model.name, the bundled model's config or None for a model of the user's own)``, after the checks
    that need no data: a name, a known name without a ``_target_``, and a name of the user's own for a
    replaced ``_target_`` (runs, tables and checkpoints would otherwise carry the replaced model's name).
    ``ConfigError`` naming the fix otherwise. No imports of the target, no side effects."""
    items = config_items(cfg)
    name = items.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"model config is missing the field 'name' (got {name!r}): choose a config with "
            "model=<option>, or "
            f"name your own model: {_EXAMPLE}"
        )
    target = items.get("_target_")
    bundled = _bundled(name)
    if bundled is None:
        bundled_targets = {_bundled(n)._target_ for n in model_names()}  # type: ignore[union-attr]
        if target is None or target in bundled_targets:
            raise ConfigError(
                f"unknown model '{name}': choose one of {', '.join(model_names())} (on the command line: "
                "model= "
                f"one of them), or name a model of your own: {_EXAMPLE}"
            )
        return name, None
    if target is not None and target != bundled._target_:
        raise ConfigError(
            f"model._target_={target} replaces the network of model={name} ({bundled._target_}), but "
            "model.name is "
            f"still '{name}': give your model its own name for run folders, tables and checkpoints, e.g. "
            f"model.name={str(target).rsplit('.', 1)[-1].lower()}"
        )
    return name, bundled


def _typed_model(cfg: Any) -> Any:
    """``cfg`` ready to build: a composed node as it is; a mapping without ``_target_`` of a bundled name
    that model's config with the mapping's keys on top (:func:`build_model` checks it against its schema)."""
    name, bundled = bundled_model(cfg)
    if schema_of(cfg) is not None or bundled is None:
        return cfg
    node = OmegaConf.merge(bundled, {})  # a writable copy
    OmegaConf.set_readonly(node, False)
    try:
        node = OmegaConf.merge(node, config_items(cfg))
    except Exception as error:  # noqa: BLE001 - an unknown key or a wrong type: one line naming it
        raise ConfigError(f"model {name}: {str(error).splitlines()[0]}") from None
    return node


def build_model(
    cfg: Any,
    num_classes: int | None = None,
    input_shape: tuple[int, int, int] | None = None,
    **data: Any,
) -> nn.Module:
    """Instantiate the model ``cfg`` describes, on the CPU, in FP32.

    ``cfg``: a ``model`` config (``_target_``, ``name`` and the target's arguments) or, for a bundled model,
    just ``name`` and arguments. Data-dependent arguments are filled in by parameter name where the config
    leaves them out: ``num_classes``; from ``input_shape = (channels, height, width)`` of one sample
    ``in_channels``, ``image_size`` (the smaller side) and ``in_features`` (their product); and every
    keyword in ``data`` (``vocab_size``, ``block_size``). Without ``input_shape`` a 3x32x32 sample fills only
    the parameters that have no default (an MLP's ``in_features``); a detector keeps its native size.

    Raises ``ConfigError`` for an unknown name, a bad target or invalid arguments; a target that does not
    return an ``nn.Module`` is one too. Cost: the target's import, allocation and init.
    """
    cfg = _typed_model(cfg)
    fill: dict[str, Any] = {k: v for k, v in data.items() if v is not None}
    if num_classes is not None:
        fill["num_classes"] = int(num_classes)
    shape = (3, 32, 32) if input_shape is None else tuple(int(v) for v in input_shape)
    from_shape = {
        "in_channels": shape[0],
        "image_size": min(shape[1:]),
        "in_features": shape[0] * shape[1] * shape[2],
    }
    if input_shape is not None:
        fill.update({k: v for k, v in from_shape.items() if k not in fill})
    else:
        fill.update(_required_only(cfg, from_shape))
    return build_group(
        "model", cfg, example=_EXAMPLE, fill=fill,
        expect=(
            lambda made: isinstance(made, nn.Module),
            "returned a {made}, not a torch.nn.Module: name the module's class (or a function that returns "
            f"one), e.g. {_EXAMPLE}",
        ),
    )  # fmt: skip


def build_detector(cfg: Any, num_classes: int) -> SSDDetector:
    """The detector of a ``model`` config for ``num_classes`` object classes: ``{"name": "ssd512",
    "image_size": 128}`` is ``configs/model/ssd512.yaml`` with that image size (the defaults are the
    model schema's, :class:`adaloss.runner.schemas.SSDConf`); :func:`build_model` builds it."""
    detector = build_model(cfg, num_classes)
    if not isinstance(detector, SSDDetector):
        raise ConfigError(f"model {dict(cfg).get('name')!r} is not an SSD detector: choose ssd300 or ssd512")
    return detector


def _required_only(cfg: Any, values: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` whose parameter in the target has no default."""
    target = config_items(cfg).get("_target_")
    signature = target_parameters(locate_target("model", target, _EXAMPLE))
    if signature is None:
        return {}
    params = signature[0]
    return {k: v for k, v in values.items() if k in params and params[k].default is params[k].empty}
