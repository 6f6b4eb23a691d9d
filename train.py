"""The command line: ``python train.py [group=option ...] [key=value ...]`` (see configs/train.yaml).

A thin ``@hydra.main`` wrapper around :func:`adaloss.runner.engine.train`: Hydra composes the config, picks
the run folder (``results/runs/...``, or ``results/sweeps/...`` with ``-m``) and logs to it; everything else
happens in ``train(cfg)``.

Bad input prints one line, ``error: <what is wrong>: <how to fix it>``, on stderr and exits with status 2,
without a traceback and without writing ``metrics.json``. That covers the command line Hydra itself rejects
(an unknown group option such as ``model=resnet21``, an unknown key, a malformed override) as well as the
values ``train`` rejects (a ``ConfigError``: an invalid number, missing data, an impossible pairing, a run
folder another run holds or another run's record fills). A run that fails that way before training also
removes the run folder Hydra made for it, if that folder holds nothing but Hydra's own files (``.hydra/``
and the log). ``HYDRA_FULL_ERROR=1`` keeps Hydra's full report.

A missing torchvision (the ``vision`` extra of ``pyproject.toml``) is bad input too: one ``error:`` line
saying which release to install; so is a Python without hydra or torch (a new shell where ``.venv`` is not
activated): the line says to activate it, or to run ``make setup`` first (``scripts/_env.py``).

Other endings, each one line and no traceback: a run stopped by a signal (SIGTERM, SIGINT, SIGUSR2, SIGHUP;
acknowledged at once by a line of its own) logs where it saved and how to resume, and exits with ``128 +
the signal number``; a write into the run folder that fails (disk full, read-only, folder deleted) prints
``error:`` and exits with status 1, as a diverged run does; a second Ctrl-C stops at once (status 130).
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "scripts"))
from _env import require_project_python  # noqa: E402 - standard library only

sys.path.pop(0)
require_project_python()  # a shell without .venv activated: one error: line naming the fix

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

CONFIG_DIR = ROOT / "configs"
# configs/paths/default.yaml reads the repository root from here, wherever train.py is launched from.
os.environ.setdefault("ADALOSS_ROOT", str(ROOT))
from adaloss.runner.schemas import register  # noqa: E402

register()  # the config schemas into Hydra's ConfigStore, where configs/*/*.yaml find them

#: Exit status for bad input (as argparse uses for a bad command line).
BAD_INPUT = 2
_FULL_ERROR = "HYDRA_FULL_ERROR"
_capture = False  # set by cli(): Hydra's composition errors are raised to it rather than printed
_started = False  # set by main(): Hydra has made the run folder and configured logging


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float:
    """Train one configuration; returns its test metric (accuracy or mAP, %; a language model's validation
    loss; NaN for a run recorded as diverged), for Hydra sweepers that optimize it."""
    # Composition succeeded (a sweep composes all its jobs before it runs the first): from here on Hydra
    # reports the job's own failures in its usual way.
    global _started
    _started = True
    _hydra_reports_errors(True)
    try:
        from adaloss.runner.engine import train  # imported here so `--help` and `--cfg` stay fast
    except ModuleNotFoundError as error:  # torchvision is an extra (pyproject.toml): say how to add it
        if error.name != "torchvision":
            raise
        _remove_untouched_run_folder(cfg)
        _fail(_no_torchvision())
    from adaloss.errors import ConfigError
    from adaloss.runner.engine.faults import TrainingDiverged
    from adaloss.runner.engine.run_folder import RunFolderError
    from adaloss.runner.engine.signals import RunInterrupted

    try:
        metrics = train(cfg)
    except ConfigError as error:
        _remove_untouched_run_folder(cfg)
        _fail(str(error))
    except (TrainingDiverged, RunFolderError) as error:  # not bad input: the run started; checkpoints stay
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
    except RunInterrupted as stopped:  # the line saying how to resume is logged already
        sys.exit(stopped.exit_status)
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once (train() has released the folder)
        print(_interrupted(), file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)
    metric = next(key for key in ("map", "val_loss", "test_accuracy") if key in metrics)
    return float(metrics[metric]) if metrics[metric] is not None else float("nan")


def cli() -> None:
    """Run :func:`main`, turning Hydra's composition errors into one ``error:`` line and exit status 2.

    Hydra composes the config inside ``@hydra.main``, before ``main`` runs, and by default prints its own
    multi-line report of a failure. With ``HYDRA_FULL_ERROR=1`` it raises the exception instead; ``cli``
    sets that while Hydra composes (``main`` clears it as soon as it starts), catches the exception and
    describes it. A user who set ``HYDRA_FULL_ERROR=1`` gets Hydra's full traceback, as before.
    """
    global _capture
    if os.environ.get(_FULL_ERROR) == "1":
        main()
        return
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    sys.argv[1:] = _flags_first(sys.argv[1:])
    _capture = True
    _hydra_reports_errors(False)
    try:
        main()
    except (HydraException, OmegaConfBaseException) as error:
        _fail(describe_hydra_error(error))
    except ValueError as error:  # Hydra's check of its own flags, or its log file that cannot be opened
        unwritable = _os_error_in(error)
        if unwritable is not None:
            _fail(_cannot_write(unwritable))
        if "can be specified" not in str(error):
            raise
        _fail(f"{error}: keep one of them")
    except OSError as error:  # Hydra making the run folder: a read-only or full disk
        if not _started and error.filename is not None:  # Hydra's write before the run, not the run's
            _fail(_cannot_write(error))
        raise
    except KeyboardInterrupt:  # Ctrl-C while Hydra composes, before the run
        print(_interrupted(), file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)
    finally:
        _hydra_reports_errors(True)
        _capture = False


#: Hydra's flags that take no value, and those that take exactly one.
_FLAGS = frozenset(
    {"-m", "--multirun", "--run", "-r", "--resolve", "-h", "--help", "--hydra-help", "--version"}
)
_FLAGS_WITH_VALUE = frozenset({"-c", "--cfg"})


def _flags_first(args: list[str]) -> list[str]:
    """Move Hydra's flags before the overrides: ``a=1 -m b=1,2`` means ``-m a=1 b=1,2``.

    Hydra's argparse parser takes the overrides as one run of positional arguments, so overrides on both
    sides of a flag fail with ``unrecognized arguments``. The order of the overrides is kept.
    """
    flags: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        if args[i] in _FLAGS:
            flags.append(args[i])
        elif args[i] in _FLAGS_WITH_VALUE and i + 1 < len(args):
            flags += args[i : i + 2]
            i += 1
        else:
            rest.append(args[i])
        i += 1
    return flags + rest


def _hydra_reports_errors(report: bool) -> None:
    """``report=True``: Hydra prints its own report of a failure; ``False``: it raises it to ``cli``.

    Only while ``cli`` captures errors; otherwise (``HYDRA_FULL_ERROR`` set by the user, ``main`` called
    from elsewhere) the environment is left as it is.
    """
    if not _capture:
        return
    if report:
        os.environ.pop(_FULL_ERROR, None)
    else:
        os.environ[_FULL_ERROR] = "1"


def _no_torchvision() -> str:
    """The line for a missing torchvision, naming the installed torch (the release must match it)."""
    import torch

    return (
        "torchvision is not installed, and training needs it (datasets, transforms, SSD): install the "
        f"release made for your torch {torch.__version__} (torch 2.14 takes torchvision 0.29, 2.13 takes "
        "0.28, 2.11 takes 0.26), or pip install -e '.[vision]'"
    )


def _interrupted() -> str:
    """The line for a Ctrl-C that stopped the run at once (before training, or pressed twice)."""
    how = "run the command again with resume=auto hydra.run.dir=<its folder>"
    try:
        from hydra.core.hydra_config import HydraConfig

        from adaloss.runner.engine.run_folder import resume_command

        if HydraConfig.initialized():  # inside main(): the run's own folder and overrides
            how = resume_command(Path(HydraConfig.get().runtime.output_dir))
    except Exception:  # noqa: BLE001 - the generic advice will do
        pass
    return (
        "interrupted: stopped at once, without a checkpoint (one Ctrl-C during training saves one first); "
        f"to continue from the last checkpoint, if any: {how}"
    )


def _os_error_in(error: BaseException) -> OSError | None:
    """The ``OSError`` behind ``error`` (``logging.config`` wraps a log file it cannot open), if any."""
    seen = error.__cause__ or error.__context__
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _cannot_write(error: OSError) -> str:
    """One line for a run folder Hydra cannot create or write its log into."""
    from adaloss.runner.engine.run_folder import describe_os_error

    where = Path(str(error.filename)) if error.filename else Path(".")
    folder = where.parent if where.suffix else where
    return f"cannot write to the run folder {folder} ({where.name}): {describe_os_error(error, folder)}"


def _fail(message: str) -> None:
    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    sys.exit(BAD_INPUT)


# ------------------------------------------------------------------------------- Hydra's errors, in one line

_GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def describe_hydra_error(error: Exception) -> str:
    """One line naming what Hydra rejected on the command line and how to fix it."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import (
        ConfigAttributeError,
        ConfigKeyError,
        OmegaConfBaseException,
        ValidationError,
    )

    if isinstance(error, MissingConfigException) and error.options is not None and error.missing_cfg_file:
        group, _, option = str(error.missing_cfg_file).rpartition("/")
        where = f" ({CONFIG_DIR.name}/{group}/)" if (CONFIG_DIR / group).is_dir() else ""
        choices = f"choose one of {', '.join(error.options)}{where}"
        if not option:
            return f"no {group} given in '{group}=': {choices}"
        return f"unknown {group} '{option}': {choices}"
    if isinstance(error, OverrideParseException):
        override = str(getattr(error, "override", "") or "")
        if override and "=" not in override and not override.startswith("~"):
            return f"'{override}' is not an override: write {override}=<value>"
        reason = _lines(error)[-1] if _lines(error) else "invalid syntax"
        for line in _lines(error):
            if not line.startswith(("See ", "Error parsing override")):
                reason = line
                break
        return (
            f"cannot parse the override '{override}': {reason}; write key=value and quote a value with "
            f"special characters, e.g. key='a,b' (grammar: {_GRAMMAR})"
        )
    cause = error.__cause__ or error.__context__
    within = re.match(r"In '((?:recipe|experiment|variant|cluster)/[^']+)'", str(error))
    if (
        within
        and isinstance(cause, ConfigAttributeError | ConfigKeyError)
        and getattr(cause, "full_key", None)
    ):
        # a recipe setting a key the chosen option lacks (recipe=shapes sets an SSD's model.image_size)
        group = str(cause.full_key).split(".", 1)[0]
        parent = getattr(cause, "parent_node", None)
        chosen = parent.get("name") if hasattr(parent, "get") and "name" in parent else None
        which = f", which {group}={chosen} does not have" if chosen else ""
        return f"{within.group(1)} sets {cause.full_key}{which}: " + _unknown_key(
            str(cause.full_key), cause, None
        )
    if isinstance(cause, ValidationError) and getattr(cause, "full_key", None):
        return _wrong_type(str(cause.full_key), cause)
    if isinstance(cause, ConfigAttributeError | ConfigKeyError) and getattr(cause, "full_key", None):
        appended = re.search(r"use \+(\S+=.*)$", str(error), flags=re.MULTILINE)
        return _unknown_key(str(cause.full_key), cause, appended.group(1) if appended else None)
    if isinstance(error, OmegaConfBaseException):
        key = getattr(error, "full_key", None)
        reason = _lines(error)[0] if _lines(error) else type(error).__name__
        return (
            f"cannot resolve {key or 'the config'}: {reason}; check the ${{...}} references in the "
            "overrides (python train.py <overrides> --cfg job shows the composed config)"
        )
    lines = [line.rstrip(".") for line in _lines(error) if not line.startswith("Config search path")]
    return "; ".join(lines[:4]).replace("\\'", "'") or type(error).__name__


def _wrong_type(full_key: str, cause: Any) -> str:
    """``scaler.scale=abc``: the type the schema wants, what was given, and the value of the default config
    as the example (``python train.py --cfg job`` shows every default)."""
    text = _lines(cause)[0] if _lines(cause) else type(cause).__name__
    default = _default_value(full_key)
    if isinstance(default, dict):  # trainer=3: a section replaced by a single value
        first = next(iter(default), "<key>")
        return (
            f"{full_key}=... replaces the whole {full_key} section with a single value: write e.g. "
            f"{full_key}.{first}={_shown(default.get(first, '<value>'))} instead"
        )
    wanted = re.search(r"could not be converted to (\w+)|(not a valid bool)", text)
    given = re.search(r"Value '(.*?)'", text)
    kinds = {"Integer": "an integer", "Float": "a number", "String": "a string"}
    what = "true or false" if wanted and wanted.group(2) else kinds.get(wanted.group(1), "") if wanted else ""
    hint = f"; e.g. {full_key}={_shown(default)}" if default is not None else ""
    if not what:
        return f"{full_key}: {text}{hint}"
    return f"{full_key} must be {what}, got {given.group(1) if given else '?'!r}{hint}"


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _default_value(full_key: str) -> Any:
    """What ``full_key`` holds in the default config (``python train.py``), as plain values; None if
    nothing (or it cannot be composed)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            value = OmegaConf.select(compose(config_name="train"), full_key, throw_on_missing=False)
        return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    except Exception:  # noqa: BLE001 - an example is a nicety
        return None


def _lines(error: BaseException) -> list[str]:
    return [line.strip() for line in str(error).splitlines() if line.strip()]


def _unknown_key(full_key: str, cause: Any, override: str | None) -> str:
    """``scaler.scale=3`` under ``scaler=none``: the options that have the key; ``trainer.batch_sise=3``:
    the closest existing keys; else the fields the section has."""
    parent_path, _, key = full_key.rpartition(".")
    parent = getattr(cause, "parent_node", None)
    keys = parent.keys() if hasattr(parent, "keys") else []
    fields = [str(k) for k in keys if k != "hydra" and not str(k).startswith("_")]
    message = f"unknown key '{full_key}'"
    owners = _options_with_key(parent_path, key) if parent_path else []
    close = difflib.get_close_matches(key, fields, n=3, cutoff=0.6)
    if not parent_path and hasattr(parent, "keys"):  # a top-level key: maybe a field of a section
        close += [f"{section}.{key}" for section in fields if _has_key(parent, section, key)]
    if owners:
        having = " and ".join(f"{parent_path}={owner}" for owner in owners)
        return (
            f"{message}: the chosen {parent_path} has no field '{key}', but {having} "
            f"{'does' if len(owners) == 1 else 'do'}; select one first, e.g. {parent_path}={owners[0]} "
            f"{override or full_key + '=...'}"
        )
    prefix = f"{parent_path}." if parent_path else ""
    if close:
        return f"{message}: did you mean {' or '.join(prefix + c for c in close)}?"
    where = f"{parent_path} has" if parent_path else "the config has"
    listed = f"; {where} the fields {', '.join(fields)}" if fields else ""
    return f"{message}{listed} (a new key needs a leading +, e.g. +{override or full_key + '=...'})"


def _has_key(root: Any, section: str, key: str) -> bool:
    try:
        node = root.get(section)
        return hasattr(node, "keys") and key in node
    except Exception:  # an unresolvable node: not a suggestion
        return False


def _options_with_key(group: str, key: str) -> list[str]:
    """The options of ``configs/<group>/`` whose file sets ``key`` (scaler=fixed sets scaler.scale)."""
    from omegaconf import OmegaConf

    folder = CONFIG_DIR / group
    if "/" in group or "." in group or not folder.is_dir():
        return []
    owners = []
    for path in sorted(folder.glob("*.yaml")):
        try:
            loaded = OmegaConf.load(path)
        except Exception:  # an unreadable option file is Hydra's to report, not ours
            continue
        text = path.read_text(errors="replace")
        if "@package _global_" in text.split("\n", 1)[0]:
            loaded = loaded.get(group)
        if (hasattr(loaded, "keys") and key in loaded) or key in _schema_fields(text, group):
            owners.append(path.stem)
    return owners


def _schema_fields(text: str, group: str) -> list[str]:
    """The fields of the schema an option's file starts from (``- /schema/scaler/fixed@_here_``)."""
    import dataclasses

    from adaloss.runner.schemas import SCHEMAS

    found = re.search(rf"- /schema/{group}/(\w+)@", text)
    if found is None:
        return []
    kind = next((k for g, n, k in SCHEMAS if g == group and n == found.group(1)), None)
    return [f.name for f in dataclasses.fields(kind) if not getattr(kind, "OPEN", False)] if kind else []


# ------------------------------------------------------------------------------------ leaving no trace


def _remove_untouched_run_folder(cfg: DictConfig) -> None:
    """Remove this run's folder if it holds only Hydra's files (``.hydra/*.yaml``, ``*.log``).

    Called when the run failed before training: such a folder records nothing. A folder with anything else
    in it (W&B files, a checkpoint, a file of the user's) is left alone. Then the folder Hydra made above it
    goes too if nothing else is left in it: ``runs/<name>/`` of a single run, or the sweep folder of a
    sweep whose first job failed (it holds only ``multirun.yaml``).
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        hydra_cfg = HydraConfig.get()
        run_dir = Path(hydra_cfg.runtime.output_dir)
        sweep = hydra_cfg.mode == RunMode.MULTIRUN
    except Exception:  # not inside a launched job (e.g. composed in a test): nothing of ours to remove
        return
    if not run_dir.is_dir() or run_dir.is_symlink() or not _only_hydra_files(run_dir):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    parent = run_dir.parent
    try:
        if sweep:
            if [p.name for p in parent.iterdir()] == ["multirun.yaml"]:
                (parent / "multirun.yaml").unlink()
                parent.rmdir()
        elif parent.resolve().parent == (Path(str(cfg.paths.results_dir)) / "runs").resolve():
            parent.rmdir()  # only if empty: another run of the same name may live there
    except OSError:
        pass


def _only_hydra_files(run_dir: Path) -> bool:
    for entry in run_dir.iterdir():
        if entry.is_symlink():
            return False
        if entry.name == ".hydra" and entry.is_dir():
            if not all(f.is_file() and not f.is_symlink() and f.suffix == ".yaml" for f in entry.iterdir()):
                return False
        elif not (entry.is_file() and entry.suffix == ".log"):
            return False
    return True


if __name__ == "__main__":
    cli()
