"""Reading finished runs: run folders (``metrics.json``, ``.hydra/``, ``telemetry.jsonl``) and W&B projects.

**Which runs count.** A run is a folder holding ``metrics.json`` and the ``done`` marker the trainer writes
after it (DomainBed's): a run that crashed or is still running lacks the marker (or both files) and is
never counted; the readers report the folders (with Hydra's ``.hydra/`` or a ``metrics.json`` but no
``done``) they passed over, so they can be relaunched. From W&B, only runs in state ``finished`` count.

**Sweeps.** A run belongs to the sweep of its folder's parent (a Hydra sweep folder holds one folder per
job; ``results/runs/<name>/`` holds the repeated runs of one name), named by its path below the folder
the reader was given; a W&B run to its group, which the trainer sets to the sweep folder.
``.hydra/overrides.yaml`` gives the command-line overrides of the run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaloss.lab.reports.common import (
    DATASET_LABELS,
    MODEL_LABELS,
    ReportError,
    Skip,
    config_value,
    fmt_num,
    number,
)

__all__ = [
    "DETECTION_DATASETS",
    "Record",
    "Records",
    "RunInfo",
    "experiment_of",
    "read_records",
    "read_telemetry",
    "read_wandb_records",
    "run_infos",
]

DETECTION_DATASETS = ("voc", "shapes", "coco")
NATIVE_IMAGE_SIZE = {"ssd300": 300, "ssd512": 512}


#: The marker a finished run writes last (``adaloss.runner.engine.run_folder.DONE_FILE``; not imported: the
#: readers stay free of the engine's imports).
DONE_FILE = "done"


@dataclass(frozen=True)
class Record:
    """One finished run as its ``metrics.json`` (or W&B summary) says, and where it came from."""

    source: str  # the metrics.json path, or "wandb:<entity>/<project>/<id>"
    data: Mapping[str, Any]  # the metrics.json content
    sweep: str  # the sweep it belongs to (module docstring)
    folder: Path | None = None  # the run folder (None for W&B)
    overrides: tuple[str, ...] | None = None  # .hydra/overrides.yaml, if there is one

    @property
    def config(self) -> Mapping[str, Any]:
        config = self.data.get("config")
        return config if isinstance(config, Mapping) else {}

    @property
    def order(self) -> tuple[Any, ...]:
        """Sort key within a sweep: Hydra's job number (``3_scaler.scale=16``), then the name."""
        name = self.folder.name if self.folder is not None else self.source
        match = re.match(r"(\d+)_", name)
        return (int(match.group(1)) if match else -1, name)


@dataclass
class Records:
    """The runs read, and what was passed over."""

    records: list[Record] = field(default_factory=list)  # path order
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (source, reason)
    unfinished: list[str] = field(default_factory=list)


def _overrides(folder: Path) -> tuple[str, ...] | None:
    import yaml

    try:
        loaded = yaml.safe_load((folder / ".hydra" / "overrides.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    return tuple(str(item) for item in loaded) if isinstance(loaded, list) else None


def read_records(folders: Sequence[str | Path], into: Records | None = None) -> Records:
    """Every finished run (``**/metrics.json`` beside a ``done`` marker) under ``folders``, in path order.

    Raises:
        ReportError: if a folder does not exist.
    """
    out = into or Records()
    roots: dict[Path, Path] = {}  # metrics.json -> the folder argument it was found under
    hydra_dirs: set[Path] = set()
    for folder in folders:
        root = Path(folder)
        if not root.is_dir():
            raise ReportError(f"no such folder: {folder}")
        for path in root.rglob("metrics.json"):
            roots.setdefault(path.resolve(), root.resolve())
        hydra_dirs.update(p.parent.resolve() for p in root.rglob(".hydra") if p.is_dir())
    paths = {p for p in roots if (p.parent / DONE_FILE).is_file()}  # finished: the marker comes last
    finished = {p.parent for p in paths}
    started = hydra_dirs | {p.parent for p in roots}
    out.unfinished.extend(str(d) for d in sorted(started - finished))
    for path in sorted(paths):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            out.unreadable.append((str(path), f"it cannot be read ({error})"))
            continue
        if not isinstance(data, Mapping):
            out.unreadable.append((str(path), "it is not a JSON object"))
            continue
        folder = path.parent
        out.records.append(Record(str(path), data, _sweep(folder, roots[path]), folder, _overrides(folder)))
    return out


def _sweep(folder: Path, root: Path) -> str:
    """The sweep of a run folder: its parent, named relative to the folder it was found under (the folder
    itself by its name), so the name does not depend on where the command runs."""
    try:
        inside = folder.parent.relative_to(root)
    except ValueError:  # the run folder itself was given
        return folder.parent.name
    return root.name if inside == Path() else str(inside)


def read_wandb_records(project: str, into: Records | None = None, api: Any = None) -> Records:
    """Every finished run of the W&B ``ENTITY/PROJECT``, through W&B's public API (summary + config).

    ``api`` stands in for ``wandb.Api()`` in tests. The summary holds the last value of each logged key (or,
    for keys with ``define_metric`` summaries, ``{"max": ..., "last": ...}``: the last is taken); the
    trainer's ``test/accuracy`` (or ``test_accuracy``) and ``test/map`` (or ``map``) are read from it, with
    ``skipped_steps`` and ``underflow/mean``. A run's sweep is its W&B group.

    Raises:
        ReportError: naming the cause when W&B cannot be reached or the project cannot be read.
    """
    out = into or Records()
    found: list[Record] = []
    try:
        if api is None:
            import wandb

            api = wandb.Api(timeout=30)
        for run in api.runs(project):  # pages through the project; summaries may load lazily
            source = "wandb:" + "/".join(str(p) for p in getattr(run, "path", [project, run.id]))
            if getattr(run, "state", None) != "finished":
                out.unfinished.append(source)
                continue
            group = getattr(run, "group", None)
            sweep = f"wandb:{project}" + (f" group {group}" if group else "")
            found.append(Record(source, _wandb_data(run), sweep))
    except Exception as error:  # noqa: BLE001 - whatever W&B raises, the user gets one line
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ReportError(
            f"could not read the W&B runs of {project!r} ({type(error).__name__}: {reason}). Reading "
            "W&B needs a network and an API key (`wandb login` or WANDB_API_KEY); offline runs can be "
            "read from their folders instead: python scripts/make_tables.py results/sweeps/..."
        ) from None
    out.records.extend(sorted(found, key=lambda r: r.source))
    return out


def _last(value: Any) -> Any:
    return value.get("last") if isinstance(value, Mapping) else value


def _wandb_data(run: Any) -> dict[str, Any]:
    """A W&B run as a ``metrics.json``-like record: its config, and the metrics from its summary."""
    summary = getattr(run, "summary_metrics", None)
    if not isinstance(summary, Mapping):
        summary = dict(run.summary.items())
    data: dict[str, Any] = {"config": dict(run.config)}
    for key, aliases in (
        ("test_accuracy", ("test_accuracy", "test/accuracy")),
        ("map", ("map", "test/map")),
        ("diverged", ("diverged",)),
        ("skipped_steps", ("skipped_steps",)),
        ("mean_underflow_rate", ("mean_underflow_rate", "underflow/mean")),
    ):
        found = [_last(summary[a]) for a in aliases if a in summary]
        if found:
            data[key] = found[0]
    return data


def experiment_of(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The experiment that launched the run: the config's ``experiment`` if it records one, else Hydra's
    ``runtime.choices.experiment`` in ``.hydra/hydra.yaml``, else ``experiment=`` in
    ``.hydra/overrides.yaml``."""
    if isinstance(config.get("experiment"), str):
        return config["experiment"]
    import yaml

    try:
        hydra = yaml.safe_load((folder / ".hydra" / "hydra.yaml").read_text(encoding="utf-8"))
        choice = hydra["hydra"]["runtime"]["choices"].get("experiment")
        if choice:
            return str(choice)
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        pass
    for item in _overrides(folder) or ():
        key, _, value = item.lstrip("+~").partition("=")
        if key == "experiment" and value:
            return value
    return None


def read_telemetry(path: Path) -> list[dict[str, Any]]:
    """The telemetry steps of ``path`` sorted by step (a step written twice: the last); [] if no file.
    Lines that are not JSON objects with a ``step`` are ignored."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int | float):
            by_step[int(row["step"])] = row
    return [by_step[s] for s in sorted(by_step)]


@dataclass(eq=False)
class RunInfo:
    """One finished run folder: what its config says, and (read on first use) its telemetry."""

    path: Path  # the run folder
    config: Mapping[str, Any]
    experiment: str | None = None
    record: Record | None = None
    _telemetry: list[dict[str, Any]] | None = field(default=None, repr=False)

    def cfg(self, dotted: str, default: Any = None) -> Any:
        """A config value, or ``default`` when the config lacks it."""
        try:
            return config_value(self.config, dotted)
        except Skip:
            return default

    @property
    def model(self) -> str:
        return str(self.cfg("model.name", "?"))

    @property
    def dataset(self) -> str:
        return str(self.cfg("dataset.name", "?"))

    @property
    def precision(self) -> str:
        return str(self.cfg("precision.name", "?"))

    @property
    def scaler(self) -> str:
        return str(self.cfg("scaler.name", "?"))

    @property
    def scale(self) -> float | None:
        return number(self.cfg("scaler.scale"))

    @property
    def batch_size(self) -> Any:
        return self.cfg("trainer.batch_size")

    @property
    def seed(self) -> Any:
        return self.cfg("seed")

    @property
    def name(self) -> str:
        return str(self.cfg("name") or self.path.name)

    @property
    def is_detection(self) -> bool:
        return self.model.startswith("ssd") or self.dataset in DETECTION_DATASETS

    @property
    def telemetry_path(self) -> Path:
        return self.path / "telemetry.jsonl"

    @property
    def telemetry(self) -> list[dict[str, Any]]:
        if self._telemetry is None:
            self._telemetry = read_telemetry(self.telemetry_path)
        return self._telemetry

    @property
    def method(self) -> str:
        """``FP32``, ``FP16, fixed scale 128``, ``FP16, adaptive scaling``, ``FP16, no loss scaling``."""
        precision = self.precision.upper()
        if self.scaler == "none":
            return precision if self.precision == "fp32" else f"{precision}, no loss scaling"
        if self.scaler == "fixed" and self.scale is not None:
            return f"{precision}, fixed scale {fmt_num(self.scale)}"
        return f"{precision}, {self.scaler} scaling"

    def label(self) -> str:
        """``SSD512 (128 px) on shapes``: model (input size when not the native one) and dataset."""
        model = MODEL_LABELS.get(self.model, self.model)
        size = self.cfg("model.image_size")
        native = NATIVE_IMAGE_SIZE.get(self.model)
        if native is not None and isinstance(size, int) and size != native:
            model += f" ({size} px)"
        return f"{model} on {DATASET_LABELS.get(self.dataset, self.dataset)}"

    def describe(self) -> str:
        """One line for the console and the index: setting, method, batch, seed and folder."""
        exp = f", experiment {self.experiment}" if self.experiment else ""
        return f"{self.label()}, {self.method}, batch {self.batch_size}, seed {self.seed}{exp} ({self.path})"


def run_infos(records: Records) -> list[RunInfo]:
    """A :class:`RunInfo` per record read from a folder that has a config (the others are added to
    ``records.unreadable`` with the reason)."""
    runs = []
    for record in records.records:
        if record.folder is None:
            continue
        if not isinstance(record.data.get("config"), Mapping):
            records.unreadable.append((record.source, "it has no config"))
            continue
        experiment = experiment_of(record.folder, record.config)
        runs.append(RunInfo(path=record.folder, config=record.config, experiment=experiment, record=record))
    return runs
