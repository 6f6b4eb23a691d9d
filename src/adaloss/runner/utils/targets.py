"""Every part of a run is built the same way: ``hydra.utils.instantiate`` on its group's ``_target_``.

Each group (``model``, ``dataset``, ``scaler``, ``precision``, ``optimizer``, ``schedule``, ``logger``) names
what it builds with ``_target_`` (a dotted path to a class or function); the other keys of its node are its
arguments, except the fields its schema marks as the group's own (``name``: what runs, tables and
checkpoints call it; see :mod:`adaloss.runner.schemas`). What the config cannot know is added at build time,
by parameter name, where the target takes it: the data's ``num_classes``, the gradient format ``fmt``, the
optimizer's parameters, the schedule's length (``fill`` of :func:`build_target`).

A key the target does not take is an error (one ``ConfigError`` naming the target, the key and the fix), not
a warning: a class of the user's that replaces a bundled one gets the bundled option's keys, so it should be
chosen through the group's ``custom`` option (``scaler=custom scaler._target_=my_pkg.MyScaler``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from adaloss.errors import ConfigError
from adaloss.numerics import FloatFormat
from adaloss.precision import Precision
from adaloss.runner.schemas import arguments, schema_of, typed
from adaloss.scalers import LossScaler

__all__ = [
    "build_group",
    "build_precision",
    "build_scaler",
    "build_target",
    "config_items",
    "locate_target",
    "target_parameters",
]

#: Hydra's own keys (``_args_``, ``_recursive_``, ...): passed to ``instantiate`` untouched.
_SPECIAL = frozenset({"_target_", "_partial_", "_convert_", "_recursive_", "_args_"})


def config_items(node: Any) -> dict[str, Any]:
    """The keys of a config node (DictConfig, dict or attribute object) as plain Python values."""
    if isinstance(node, DictConfig):
        out = OmegaConf.to_container(node, resolve=True)
        assert isinstance(out, dict)
        return {str(k): v for k, v in out.items()}
    if isinstance(node, Mapping):
        return {
            str(k): OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
            for k, v in node.items()
        }
    return dict(vars(node))


def locate_target(group: str, path: Any, example: str) -> Callable[..., Any]:
    """The class or function ``path`` names; ``ConfigError`` if it cannot be imported or is not callable.

    ``example`` completes the fix in the message (``model._target_=adaloss.runner.models.vit.ViT``). Cost: the
    import of the target's module (cached by Python after the first call).
    """
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(
            f"{group}._target_ must be the dotted path of a class or function, got {path!r}; e.g. {example}"
        )
    quiet = logging.getLogger("hydra.utils")  # get_object logs its failure too; the ConfigError says it
    level, quiet.disabled = quiet.disabled, True
    try:
        obj = get_object(path)
    except Exception as error:  # noqa: BLE001 - ImportError, AttributeError, ValueError: all mean "not found"
        reason = _first_line(error.__cause__ or error)
        raise ConfigError(
            f"{group}._target_={path} cannot be imported ({reason}): give the full dotted path of a class "
            "in an "
            f"installed package, on PYTHONPATH or next to train.py, e.g. {example}"
        ) from None
    finally:
        quiet.disabled = level
    if not callable(obj):
        raise ConfigError(
            f"{group}._target_={path} is a {type(obj).__name__}, not a class or function: name a class (or a "
            f"function that returns one's instance), e.g. {example}"
        )
    return obj


def target_parameters(obj: Callable[..., Any]) -> tuple[dict[str, inspect.Parameter], bool] | None:
    """``(parameters by name, whether it also takes any keyword: **kwargs)`` of ``obj``, or None when
    Python cannot read its signature (some builtins)."""
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return None
    named = {
        n: p
        for n, p in params.items()
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }
    return named, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def build_target(
    group: str,
    cfg: Any,
    *,
    example: str,
    args: tuple[Any, ...] = (),
    fill: Mapping[str, Any] | None = None,
    metadata: Iterable[str] = ("name",),
    defaults: Mapping[str, Any] | None = None,
) -> Any:
    """Instantiate the ``group`` config ``cfg`` with ``hydra.utils.instantiate`` and return the object.

    * ``cfg["_target_"]`` (or ``defaults["_target_"]``) names the class or function; ``defaults`` are
      arguments the config may omit.
    * The arguments are the node's keys minus its schema's own fields
      (:func:`adaloss.runner.schemas.arguments`) and minus ``metadata`` (for a node without a schema). Every
      one of them must be a parameter of the target (or the target takes ``**kwargs``): an unknown key is a
      ``ConfigError``.
    * ``fill``: values from the run (the dataset's ``num_classes``, a schedule's ``length``) for the
      parameters the target names and the config does not set.
    * ``args``: positional arguments (an optimizer's parameter groups). A ``_partial_: true`` config gives a
      ``functools.partial``, which is then called with ``args`` here, so its errors are reported too.

    Any failure (not importable, not callable, missing or unexpected arguments, an exception in the
    constructor) is one ``ConfigError`` naming the target and the fix. Cost: one import and one call.
    """
    items = {**(defaults or {}), **(arguments(cfg) if schema_of(cfg) else config_items(cfg))}
    if schema_of(cfg) is None:  # a plain mapping (a YAML file read as it is: its defaults list is Hydra's)
        items = {k: v for k, v in items.items() if k not in {*metadata, "defaults"}}
    path = items.get("_target_")
    obj = locate_target(group, path, example)
    special = {k: v for k, v in items.items() if k in _SPECIAL}
    kwargs = {k: v for k, v in items.items() if k not in _SPECIAL}
    signature = target_parameters(obj)
    params, takes_any = signature if signature is not None else ({}, True)
    if not takes_any:
        unknown = [k for k in kwargs if k not in params]
        if unknown:
            raise ConfigError(
                f"{group}._target_={path} takes no argument {', '.join(unknown)} (the {group} config sets "
                f"{group}.{unknown[0]}): for a class of your own choose {group}=custom and give only its "
                f"arguments, e.g. {group}=custom {group}._target_={path} +{group}.<name>=<value>"
            )
    filled = {k: v for k, v in (fill or {}).items() if k not in kwargs and k in params}
    if signature is not None:
        _check_binding(group, path, obj, args, {**kwargs, **filled})
    if args and special.get("_partial_") is not True:
        raise ConfigError(
            f"{group}._target_={path} must be a _partial_ config (it is called with its "
            f"{'parameters' if group == 'optimizer' else 'optimizer'} later): set {group}._partial_=true"
        )
    special.setdefault("_convert_", "all")  # plain lists and dicts: picklable, and what torch expects
    try:
        # The config's arguments through instantiate; the run's objects (parameter groups, the gradient
        # format, a path) added by the call, so that they reach the target as they are, not converted.
        made = instantiate({**special, "_partial_": True, **kwargs})(*args, **filled)
    except InstantiationException as error:
        raise _call_error(group, path, error.__cause__ or error) from None
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - the target's own complaint about its arguments
        raise _call_error(group, path, error) from None
    return made


def build_group(
    group: str,
    node: Any,
    *,
    example: str,
    fill: Mapping[str, Any] | None = None,
    args: tuple[Any, ...] = (),
    metadata: Iterable[str] = ("name",),
    expect: tuple[Callable[[Any], bool], str] | None = None,
) -> Any:
    """The part a ``group`` config node describes: the node typed and checked by its schema, once
    (:func:`adaloss.runner.schemas.typed`: a composed node is checked, a plain mapping ``{"name": "fixed"}``
    takes the schema of that name), then built by :func:`build_target` with ``fill`` and ``args``. Every
    group's builder calls this.

    ``expect``: ``(test, what)``: ``ConfigError`` unless ``test(part)``; ``what`` completes the message
    ``<group>._target_=<path> `` with ``{made}`` standing for the part's type name
    (``"made a {made}, not a LossScaler: ..."``). Cost: the schema's checks, one import and one call."""
    typed_node = typed(group, node)
    made = build_target(group, typed_node, example=example, fill=fill, args=args, metadata=metadata)
    if expect is not None and not expect[0](made):
        path = config_items(typed_node).get("_target_")
        raise ConfigError(f"{group}._target_={path} " + expect[1].format(made=type(made).__name__))
    return made


def build_scaler(cfg: Mapping[str, Any], fmt: FloatFormat | None = None) -> LossScaler:
    """The loss scaler of a ``scaler`` config: ``hydra.utils.instantiate`` on its ``_target_``, with ``fmt``
    (the training gradient format; ``None`` for FP32) if the class takes it (the adaptive scaler scales
    against its smallest subnormal).

    ``cfg``: the composed ``scaler`` node (typed by its schema, :mod:`adaloss.runner.schemas`), or a plain
    mapping: ``{"name": "fixed", "scale": 8}`` takes the schema of that name, ``{"_target_": ...}`` is the
    class's own. Raises ``ConfigError`` for an unknown name or key, a wrong type or a value out of range.
    """
    return build_group(
        "scaler", cfg, example="scaler=custom scaler._target_=my_pkg.MyScaler", fill={"fmt": fmt},
        expect=(
            lambda made: isinstance(made, LossScaler),
            "made a {made}, not a LossScaler: subclass adaloss.scalers.LossScaler (torch.amp.GradScaler's "
            "interface)",
        ),
    )  # fmt: skip


def build_precision(cfg: Any, device: str | Any, telemetry_format: str = "fp16") -> Precision:
    """The precision of a ``precision`` config: ``hydra.utils.instantiate`` on its ``_target_``
    (:class:`~adaloss.precision.Precision`, or one of the user's), with ``device`` and ``telemetry_format``
    where it takes them. A plain mapping (``{"name": "fp16"}``) is typed by the precision schema
    (:mod:`adaloss.runner.schemas`) first. ``ConfigError`` for an unknown key, a wrong type or a value out of
    range."""
    fill = {"device": device, "telemetry_format": telemetry_format}
    return build_group("precision", cfg, example="precision=fp16", fill=fill)


def _check_binding(group: str, path: str, obj: Any, args: tuple, kwargs: dict[str, Any]) -> None:
    try:
        inspect.signature(obj).bind(*args, **kwargs)
    except TypeError as error:
        raise ConfigError(
            f"{group}._target_={path} cannot be called with {_show(kwargs)}: {error}; give the missing "
            f"arguments as {group}.<name>=<value> (a key the config lacks needs a +: +{group}.<name>=<value>)"
        ) from None


def _call_error(group: str, path: str, error: BaseException) -> ConfigError:
    if isinstance(error, ConfigError):
        return error
    return ConfigError(
        f"{group}._target_={path} failed: {type(error).__name__}: {_first_line(error)}; check its arguments "
        f"({group}.<name>=<value>; python train.py <overrides> --cfg job shows them)"
    )


def _show(kwargs: Mapping[str, Any]) -> str:
    return "(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "params")[:200] + ")"


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
