"""The paper's Tables 1-5 from finished runs, with the published value and our difference in every cell, and a
summary of every sweep.

    python scripts/make_tables.py results/sweeps/2025-06-01_10-00-00 [more folders ...] [--out results/tables]
    python scripts/make_tables.py --wandb ENTITY/PROJECT          # runs recorded in W&B (needs a network)

**Which runs count.** Finished runs only (:mod:`adaloss.lab.reports.runs`). A run's ``config`` (the resolved
config) says its model, dataset, precision, scaler (and scale), seed and batch size. The same configuration
and seed found twice (two sweeps over the same grid) counts once in the paper's tables: the last one in path
order, which for Hydra's timestamped sweep folders is the most recent. (The same configuration means the
whole resolved config but for paths, logging and worker settings, so a shortened run, ``trainer.max_steps``,
never replaces a full one.)

**What a cell says.** ``92.26 ± 0.10 (n=4) · paper 92.26 · Δ +0.00``: the mean over seeds of the final test
accuracy (classification) or mAP (detection), in %, the sample standard deviation and the number of seeds;
the paper's published value; ours minus the paper's. A cell without runs is ``—``, never zero. A run is
*diverged* when ``metrics.json`` says ``"diverged": true`` or its metric is not a finite number (the
trainer writes NaN as ``null``); diverged runs are counted (``2 diverged``) but not averaged, and a cell whose
runs all diverged reads ``diverged``. Where the paper wrote "diverged" the paper part says so.

**Fixed (best) / Fixed (worst)** are chosen as the paper chose them: among the fixed scales that were run
for that row, the one whose mean over seeds is highest / lowest (ties go to the smaller scale); the cell
names it (``S=4096``). A scale whose runs all diverged ranks below every finite mean. Table 1 chooses from
the paper's candidates 16 ... 16384 only (scale 1 belongs to Table 4); Table 3 from every scale run.

**Layout.** By default only the tables with runs are shown, each with only its rows that have runs;
``--all`` shows all five tables with every row of the paper (so what is still missing shows) besides any
other (dataset, model[, batch]) with runs, such as the bundled ``digits`` of the mini reproduction, whose
cells have no published value. Table 1 and Table 4 take the CIFAR ResNets (ResNet-20/56/110), Table 2 the
ImageNet ResNets (ResNet-18/50), Tables 3 and 5 the SSD detectors; a run of another model, of BF16/FP8, or of
a method a table has no column for is in no paper table (counted, listed on stderr). Runs of one row that
differ in more than seed and method (e.g. ``trainer.max_steps``) are averaged as asked but noted under the
table. After the paper's tables, every sweep gets a summary of its own, whatever it ran
(:mod:`adaloss.lab.reports.sweeps`).

**Output.** The Markdown of the tables and sweep summaries on stdout and in ``<out>/tables.md``; each table
shown also as ``<out>/<table>.md`` and ``<out>/<table>.csv`` (the CSV has, per column, mean, std, n,
diverged, scale where chosen, paper, delta; a missing value is an empty field), the summaries as
``<out>/sweeps.md`` and ``<out>/sweeps.csv``. The table names are the experiment names: ``table1_cifar`` ...
``table5_ssd_fixed`` (``configs/experiment/``); a table not shown this time has its old files removed. Bad
input (a folder that does not exist, no finished run at all, W&B unreachable) prints one ``error:`` line and
exits with status 2.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaloss.lab.reports import sweeps as sweep_summary
from adaloss.lab.reports.common import (
    DATASET_LABELS,
    DIVERGED,
    IRRELEVANT_KEYS,
    MODEL_LABELS,
    ReportError,
    Skip,
    Stats,
    config_value,
    flatten,
    fmt_num,
    format_stats,
    markdown_table,
    number,
)
from adaloss.lab.reports.runs import Record, Records, read_records, read_wandb_records

__all__ = [
    "TABLES",
    "Collection",
    "Entry",
    "ReportError",
    "Run",
    "Skip",
    "Stats",
    "Table",
    "build_table",
    "format_cell",
    "main",
    "make_tables",
    "pick_fixed",
    "read_folders",
    "read_wandb",
    "run_from_record",
    "table_csv",
    "table_markdown",
]

# --------------------------------------------------------------------------------------------------------
# The paper's published numbers (Zhao et al., section 4 and appendices A, B). All in %; "diverged" as printed.
# --------------------------------------------------------------------------------------------------------

Published = float | str  # a number, or "diverged"

_TABLE1_COLUMNS = ("fp32", "none", "fixed_best", "fixed_worst", "adaptive")
_TABLE2_COLUMNS = ("fp32", "none", "fixed128", "dynamic", "adaptive")
_TABLE3_COLUMNS = ("fp32", "none", "fixed_best", "dynamic", "adaptive")
_TABLE4_SCALES = (1, 16, 128, 1024, 4096, 8192, 16384)
_TABLE5_SCALES = (1, 8, 16, 128, 1024, 2048)


def _published(columns: Sequence[Any], values: Sequence[Published]) -> dict[Any, Published]:
    return dict(zip(columns, values, strict=True))


#: Table 1: CIFAR test accuracy, each averaged over 4 seeds. Keys: (dataset, model).
PAPER_TABLE1: dict[tuple[str, str], dict[str, Published]] = {
    ("cifar10", "resnet20"): _published(_TABLE1_COLUMNS, (91.25, 92.16, 92.24, 92.16, 92.26)),
    ("cifar10", "resnet56"): _published(_TABLE1_COLUMNS, (93.03, 92.79, 93.29, 92.78, 93.22)),
    ("cifar10", "resnet110"): _published(_TABLE1_COLUMNS, (93.57, 93.54, 93.85, 93.73, 93.90)),
    ("cifar100", "resnet20"): _published(_TABLE1_COLUMNS, (67.94, 68.31, 68.48, 68.18, 68.47)),
    ("cifar100", "resnet56"): _published(_TABLE1_COLUMNS, (71.15, 71.17, 71.56, 71.26, 71.26)),
    ("cifar100", "resnet110"): _published(_TABLE1_COLUMNS, (71.14, 72.05, 72.46, 72.34, 72.66)),
}

#: Table 2: ImageNet top-1 test accuracy. Keys: (dataset, model).
PAPER_TABLE2: dict[tuple[str, str], dict[str, Published]] = {
    ("imagenet", "resnet18"): _published(_TABLE2_COLUMNS, (69.76, 71.24, 71.39, 71.39, 71.44)),
    ("imagenet", "resnet50"): _published(_TABLE2_COLUMNS, (76.15, 76.07, 76.02, 76.12, 76.22)),
}

#: Table 3: SSD512 mAP on VOC2007 test. Keys: (dataset, model, batch). The batch-32 FP32 value is the one
#: the paper took from Fu et al. 2017; "Fixed (best)" is the best of the scales it tried (8, 128, 1024, 2048).
PAPER_TABLE3: dict[tuple[str, str, int], dict[str, Published]] = {
    ("voc", "ssd512", 8): _published(_TABLE3_COLUMNS, (78.94, DIVERGED, 79.11, 75.04, 79.24)),
    ("voc", "ssd512", 32): _published(_TABLE3_COLUMNS, (79.50, DIVERGED, 80.01, 80.17, 80.31)),
}

#: Table 4 (appendix A): CIFAR-10 test accuracy per fixed loss scale. Keys: (dataset, model).
PAPER_TABLE4: dict[tuple[str, str], dict[int, Published]] = {
    ("cifar10", "resnet20"): _published(_TABLE4_SCALES, (92.16, 92.19, 92.16, 92.20, 92.24, 92.24, 92.24)),
    ("cifar10", "resnet56"): _published(_TABLE4_SCALES, (92.80, 93.28, 92.79, 93.08, 93.19, 93.19, 93.19)),
}

#: Table 5 (appendix B): SSD512 mAP at batch 8 per fixed loss scale. Keys: (dataset, model, batch).
PAPER_TABLE5: dict[tuple[str, str, int], dict[int, Published]] = {
    ("voc", "ssd512", 8): _published(_TABLE5_SCALES, (DIVERGED, 24.62, DIVERGED, 79.04, 79.04, 79.11)),
}

#: The fixed scales Table 1 chooses its best and worst from (section 4.1: "scales selected from
#: {16, 128, 1024, 4096, 8192, 16384}"); scale 1, in Table 4 only, is not a candidate. Table 3's
#: "Fixed (best)" is "the best performance we can find after trying out several fixed loss scale values":
#: any scale that was run.
TABLE1_FIXED_SCALES = (16, 128, 1024, 4096, 8192, 16384)

#: Which models each family of tables takes.
CIFAR_RESNETS = ("resnet20", "resnet56", "resnet110")
IMAGENET_RESNETS = ("resnet18", "resnet50")
DETECTORS = ("ssd300", "ssd512")

#: ... and the keys that make the columns of a row (they differ between its cells by design).
_METHOD_KEYS = ("precision.", "scaler.")


# --------------------------------------------------------------------------------------------------------
# The runs of the paper's tables
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One finished run, reduced to what the tables need."""

    source: str  # metrics.json path or W&B run path
    model: str
    dataset: str
    method: str  # fp32 | none | fixed | dynamic | adaptive
    scale: float | None  # the fixed scaler's scale
    seed: int
    batch_size: int
    value: float | None  # final test accuracy or mAP (%); None if diverged
    setting: tuple[tuple[str, str], ...]  # flattened config (irrelevant keys removed), for consistency notes

    @property
    def diverged(self) -> bool:
        return self.value is None

    @property
    def identity(self) -> tuple[Any, ...]:
        """Two runs with the same identity are the same experiment repeated: same seed and same config, up to
        the keys that cannot change a result (paths, logging, workers)."""
        return (self.setting, self.seed)


def _method(config: Mapping[str, Any]) -> tuple[str, float | None]:
    precision = str(config_value(config, "precision.name"))
    scaler = str(config_value(config, "scaler.name"))
    if precision == "fp32":
        if scaler != "none":
            raise Skip(f"FP32 with scaler {scaler} is in no paper table")
        return "fp32", None
    if precision != "fp16":
        raise Skip(f"precision {precision} is in no paper table")
    if scaler == "fixed":
        scale = number(config_value(config, "scaler.scale"))
        if scale is None or scale <= 0:
            raise Skip(f"its fixed scale {config_value(config, 'scaler.scale')!r} is not a positive number")
        return "fixed", scale
    if scaler in ("none", "dynamic", "adaptive"):
        return scaler, None
    raise Skip(f"scaler {scaler} is in no paper table")


def run_from_record(record: Mapping[str, Any], source: str) -> Run:
    """The :class:`Run` in a ``metrics.json`` record (or a W&B run turned into one).

    Raises:
        Skip: if the record has no usable config or metric, or is in no table (BF16, another model, ...).
    """
    config = record.get("config")
    if not isinstance(config, Mapping):
        raise Skip("it has no config")
    model = str(config_value(config, "model.name"))
    dataset = str(config_value(config, "dataset.name"))
    if model not in (*CIFAR_RESNETS, *IMAGENET_RESNETS, *DETECTORS):
        raise Skip(f"model {model} is in no paper table")
    method, scale = _method(config)
    metric = "map" if model in DETECTORS else "test_accuracy"
    if metric not in record:
        raise Skip(f"it has no {metric}")
    value = number(record[metric])
    if record.get("diverged") is True:
        value = None
    setting = tuple(sorted((k, v) for k, v in flatten(config).items() if not k.startswith(IRRELEVANT_KEYS)))
    return Run(
        source=source,
        model=model,
        dataset=dataset,
        method=method,
        scale=scale,
        seed=int(config_value(config, "seed")),
        batch_size=int(config_value(config, "trainer.batch_size")),
        value=value,
        setting=setting,
    )


@dataclass
class Collection:
    """The runs read for the paper's tables, what was passed over (for the report on stderr and the head
    of tables.md), and every finished record (for the sweep summaries)."""

    runs: list[Run] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (source, reason)
    unfinished: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)  # sources dropped for a later identical run
    records: list[Record] = field(default_factory=list)

    def add(self, found: Records) -> Collection:
        """Take in the records read (a run in no paper table is skipped with the reason)."""
        self.unfinished.extend(found.unfinished)
        self.skipped.extend(found.unreadable)
        for record in found.records:
            self.records.append(record)
            try:
                self.runs.append(run_from_record(record.data, record.source))
            except Skip as why:
                self.skipped.append((record.source, str(why)))
        return self

    def deduplicated(self) -> list[Run]:
        """One run per identity: the last in ``runs`` order (path order), earlier ones go to duplicates."""
        latest: dict[tuple[Any, ...], Run] = {}
        for run in self.runs:
            if run.identity in latest:
                self.duplicates.append(latest[run.identity].source)
            latest[run.identity] = run
        self.runs = list(latest.values())
        return self.runs


def read_folders(folders: Sequence[str | Path], collection: Collection | None = None) -> Collection:
    """Every finished run (``**/metrics.json``) under ``folders``, in path order.

    Raises:
        ReportError: if a folder does not exist.
    """
    return (collection or Collection()).add(read_records(folders))


def read_wandb(project: str, collection: Collection | None = None, api: Any = None) -> Collection:
    """Every finished run of the W&B ``ENTITY/PROJECT`` (:func:`adaloss.lab.reports.runs.read_wandb_records`;
    ``api`` stands in for ``wandb.Api()`` in tests).

    Raises:
        ReportError: naming the cause when W&B cannot be reached or the project cannot be read.
    """
    return (collection or Collection()).add(read_wandb_records(project, api=api))


# --------------------------------------------------------------------------------------------------------
# Aggregating seeds and choosing the cells
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One cell: our stats (None: no runs), the fixed scale it was chosen at, the paper's value."""

    stats: Stats | None
    paper: Published | None
    scale: float | None = None

    @property
    def delta(self) -> float | None:
        if self.stats is None or self.stats.mean is None or not isinstance(self.paper, float | int):
            return None
        return self.stats.mean - float(self.paper)


Method = tuple[str, float | None]  # ("fixed", 128.0), ("fp32", None), ...


def pick_fixed(cells: Mapping[Method, Stats], best: bool) -> tuple[float, Stats] | None:
    """The fixed scale with the highest (``best``) or lowest mean among those run; ties: the smaller scale.

    A scale whose runs all diverged ranks below every finite mean. None if no fixed scale was run.
    """
    candidates = [(m[1], s) for m, s in cells.items() if m[0] == "fixed" and not s.missing]
    if not candidates:
        return None

    def rank(item: tuple[float, Stats]) -> tuple[float, float]:
        scale, stats = item
        mean = stats.mean if stats.mean is not None else -math.inf
        return (mean if best else -mean, -scale)  # max() of this: highest (lowest) mean, then smaller scale

    return max(candidates, key=rank)


# --------------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------------

RowKey = tuple[Any, ...]  # (dataset, model) or (dataset, model, batch)


@dataclass(frozen=True)
class Column:
    label: str
    draws_on: Callable[[Method], bool]  # whether runs of this method are candidates for the cell
    choose: Callable[[Mapping[Method, Stats]], tuple[Stats | None, float | None]]  # -> (stats, chosen scale)
    paper_key: Any  # key into the row's published values
    shows_scale: bool = False


def _method_column(label: str, method: Method, paper_key: Any) -> Column:
    return Column(label, lambda m: m == method, lambda cells: (cells.get(method), None), paper_key)


def _fixed_column(label: str, best: bool, paper_key: str, candidates: Iterable[float] | None) -> Column:
    """Fixed (best) or (worst) among the scales run that are in ``candidates`` (None: any scale)."""
    allowed = None if candidates is None else {float(s) for s in candidates}

    def draws_on(method: Method) -> bool:
        return method[0] == "fixed" and (allowed is None or method[1] in allowed)

    def choose(cells: Mapping[Method, Stats]) -> tuple[Stats | None, float | None]:
        picked = pick_fixed({m: s for m, s in cells.items() if draws_on(m)}, best)
        return (picked[1], picked[0]) if picked else (None, None)

    return Column(label, draws_on, choose, paper_key, shows_scale=True)


@dataclass(frozen=True)
class TableSpec:
    name: str  # file stem, the experiment's name
    title: str
    metric: str
    models: tuple[str, ...]
    with_batch: bool  # rows keyed by (dataset, model, batch) instead of (dataset, model)
    paper: Mapping[RowKey, Mapping[Any, Published]]
    columns: Callable[[Sequence[Method]], list[Column]]  # from the methods found in the table's runs
    fixed_note: str = ""  # how Fixed (best/worst) is chosen, under the title


def _table1_columns(_: Sequence[Method]) -> list[Column]:
    return [
        _method_column("FP32", ("fp32", None), "fp32"),
        _method_column("None", ("none", None), "none"),
        _fixed_column("Fixed (best)", True, "fixed_best", TABLE1_FIXED_SCALES),
        _fixed_column("Fixed (worst)", False, "fixed_worst", TABLE1_FIXED_SCALES),
        _method_column("Adaptive", ("adaptive", None), "adaptive"),
    ]


def _table2_columns(_: Sequence[Method]) -> list[Column]:
    return [
        _method_column("FP32", ("fp32", None), "fp32"),
        _method_column("None", ("none", None), "none"),
        _method_column("Fixed (128)", ("fixed", 128.0), "fixed128"),
        _method_column("Dynamic", ("dynamic", None), "dynamic"),
        _method_column("Adaptive", ("adaptive", None), "adaptive"),
    ]


def _table3_columns(_: Sequence[Method]) -> list[Column]:
    return [
        _method_column("FP32", ("fp32", None), "fp32"),
        _method_column("None", ("none", None), "none"),
        _fixed_column("Fixed (best)", True, "fixed_best", None),
        _method_column("Dynamic", ("dynamic", None), "dynamic"),
        _method_column("Adaptive", ("adaptive", None), "adaptive"),
    ]


def _scale_columns(paper_scales: Iterable[float]) -> Callable[[Sequence[Method]], list[Column]]:
    """One column per fixed scale: the paper's, then any other scale that was run, in increasing order."""

    def columns(found: Sequence[Method]) -> list[Column]:
        scales = sorted({float(s) for s in paper_scales} | {m[1] for m in found if m[0] == "fixed"})
        return [_method_column(fmt_num(s), ("fixed", s), s) for s in scales]

    return columns


TABLES: tuple[TableSpec, ...] = (
    TableSpec(
        "table1_cifar",
        "Table 1: CIFAR-10/100 test accuracy (%) of the CIFAR ResNets",
        "final test accuracy",
        CIFAR_RESNETS,
        False,
        PAPER_TABLE1,
        _table1_columns,
        "Fixed (best/worst): of the scales 16, 128, 1024, 4096, 8192, 16384 that were run, the one (S) with "
        "the highest/lowest mean.",
    ),
    TableSpec(
        "table2_imagenet",
        "Table 2: ImageNet top-1 test accuracy (%)",
        "final top-1 test accuracy",
        IMAGENET_RESNETS,
        False,
        PAPER_TABLE2,
        _table2_columns,
    ),
    TableSpec(
        "table3_ssd",
        "Table 3: SSD512 mAP (%) on VOC2007 test",
        "final mAP",
        DETECTORS,
        True,
        PAPER_TABLE3,
        _table3_columns,
        "Fixed (best): of the fixed scales that were run, the one (S) with the highest mean.",
    ),
    TableSpec(
        "table4_fixed_scales",
        "Table 4: test accuracy (%) per fixed loss scale (the paper: CIFAR-10 ResNet-20/56)",
        "final test accuracy",
        CIFAR_RESNETS,
        False,
        PAPER_TABLE4,
        _scale_columns(_TABLE4_SCALES),
        "Columns: the fixed loss scale.",
    ),
    TableSpec(
        "table5_ssd_fixed",
        "Table 5: SSD512 mAP (%) per fixed loss scale (the paper: batch 8)",
        "final mAP",
        DETECTORS,
        True,
        PAPER_TABLE5,
        _scale_columns(_TABLE5_SCALES),
        "Columns: the fixed loss scale.",
    ),
)


@dataclass
class Table:
    spec: TableSpec
    columns: list[Column]
    rows: list[tuple[RowKey, list[Entry]]]
    notes: list[str]
    used: set[str]  # sources of the runs in this table

    @property
    def key_headers(self) -> list[str]:
        return ["Dataset", "Model", "Batch"] if self.spec.with_batch else ["Dataset", "Model"]


def _row_key(spec: TableSpec, run: Run) -> RowKey:
    key = (run.dataset, run.model)
    return (*key, run.batch_size) if spec.with_batch else key


def _row_order(spec: TableSpec, key: RowKey) -> tuple[Any, ...]:
    paper = list(spec.paper)
    if key in paper:
        return (0, paper.index(key))
    return (1, key[0], spec.models.index(key[1]), *key[2:])


def build_table(spec: TableSpec, runs: Sequence[Run], found_only: bool = False) -> Table:
    """Group ``runs`` into the rows and columns of ``spec``; rows with no runs are kept unless ``found_only``.

    A run belongs to the table when its model is one of the table's and some column draws on its method.
    """
    models = [r for r in runs if r.model in spec.models]
    columns = spec.columns(sorted({(r.method, r.scale) for r in models}, key=lambda m: (m[0], m[1] or 0)))
    by_row: dict[RowKey, dict[Method, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for run in models:
        if any(c.draws_on((run.method, run.scale)) for c in columns):
            by_row[_row_key(spec, run)][(run.method, run.scale)].append(run)

    keys = set(by_row) if found_only else set(by_row) | set(spec.paper)
    rows: list[tuple[RowKey, list[Entry]]] = []
    notes: list[str] = []
    used: set[str] = set()
    for key in sorted(keys, key=lambda k: _row_order(spec, k)):
        cells = {m: Stats.of(rs) for m, rs in by_row.get(key, {}).items()}
        published = spec.paper.get(key, {})
        entries = []
        for column in columns:
            stats, scale = column.choose(cells)
            entries.append(Entry(stats, published.get(column.paper_key), scale))
        rows.append((key, entries))
        row_runs = [r for rs in by_row.get(key, {}).values() for r in rs]
        used.update(r.source for r in row_runs)
        differing = _differing_keys(row_runs)
        if differing:
            notes.append(f"{_row_label(key)}: its runs differ in {differing}; they are averaged together.")
    return Table(spec, columns, rows, notes, used)


def _differing_keys(runs: Sequence[Run], shown: int = 3) -> str:
    """``key (a, b)`` for each config key (method keys aside) whose value is not the same in all ``runs``."""
    keys = {k for r in runs for k, _ in r.setting if not k.startswith(_METHOD_KEYS)}
    values: dict[str, set[str]] = defaultdict(set)
    for run in runs:
        setting = dict(run.setting)
        for key in keys:
            values[key].add(setting.get(key, "(absent)"))
    differing = sorted(k for k, v in values.items() if len(v) > 1)
    return ", ".join(f"{k} ({', '.join(sorted(values[k])[:shown])})" for k in differing)


# --------------------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------------------


def _row_label(key: RowKey) -> str:
    dataset, model, *batch = key
    label = f"{DATASET_LABELS.get(dataset, dataset)} {MODEL_LABELS.get(model, model)}"
    return f"{label} batch {batch[0]}" if batch else label


def _fmt_paper(value: Published) -> str:
    return value if isinstance(value, str) else f"{value:.2f}"


def format_cell(entry: Entry) -> str:
    """``ours · paper P · Δ D``: the paper part where the paper has a value, Δ where both are numbers."""
    parts = [format_stats(entry.stats, entry.scale)]
    if entry.paper is not None:
        parts.append(f"paper {_fmt_paper(entry.paper)}")
    if entry.delta is not None:
        parts.append(f"Δ {entry.delta:+.2f}")
    return " · ".join(parts)


def _key_cells(key: RowKey) -> list[str]:
    dataset, model, *batch = key
    return [DATASET_LABELS.get(dataset, dataset), MODEL_LABELS.get(model, model), *(str(b) for b in batch)]


def table_markdown(table: Table) -> str:
    spec = table.spec
    lines = [
        f"## {spec.title}",
        "",
        f"Each cell: ours, the {spec.metric} as mean ± sample standard deviation over seeds (n runs) · the "
        "paper's value · Δ = ours − paper. — = no finished run.",
    ]
    if spec.fixed_note:
        lines[-1] += " " + spec.fixed_note
    lines.append("")
    headers = [*table.key_headers, *(c.label for c in table.columns)]
    rows = [[*_key_cells(key), *(format_cell(e) for e in entries)] for key, entries in table.rows]
    if rows:
        lines.append(markdown_table(headers, rows, left=len(table.key_headers)))
    else:
        lines.append("(no finished runs)")
    if table.notes:
        lines.append("")
        lines.extend(f"Note: {note}" for note in table.notes)
    return "\n".join(lines) + "\n"


def _csv_number(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def table_csv(table: Table) -> str:
    """One row per table row; per column ``<label> mean, std, n, diverged, [scale,] paper, delta``."""
    headers = [h.lower() for h in table.key_headers]
    for column in table.columns:
        fields = [
            "mean",
            "std",
            "n",
            "diverged",
            *(["scale"] if column.shows_scale else []),
            "paper",
            "delta",
        ]
        headers.extend(f"{column.label} {f}" for f in fields)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(headers)
    for key, entries in table.rows:
        row: list[str] = [str(k) for k in key]
        for column, entry in zip(table.columns, entries, strict=True):
            stats = entry.stats
            if stats is None or stats.missing:
                mean, std, n, diverged = "", "", "0", "0"
            else:
                mean = DIVERGED if stats.all_diverged else _csv_number(stats.mean)
                std, n, diverged = _csv_number(stats.std), str(stats.n), str(stats.n_diverged)
            row.extend([mean, std, n, diverged])
            if column.shows_scale:
                row.append("" if entry.scale is None else fmt_num(entry.scale))
            paper = "" if entry.paper is None else _fmt_paper(entry.paper)
            row.extend([paper, _csv_number(entry.delta)])
        writer.writerow(row)
    return out.getvalue()


# --------------------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------------------


def make_tables(collection: Collection, found_only: bool = False) -> tuple[list[Table], list[Run]]:
    """The five tables from the runs of ``collection`` (deduplicated), and the runs that are in none."""
    runs = collection.deduplicated()
    tables = [build_table(spec, runs, found_only) for spec in TABLES]
    used = set().union(*(t.used for t in tables))
    return tables, [r for r in runs if r.source not in used]


def summary_lines(collection: Collection, unused: Sequence[Run]) -> list[str]:
    """What was read and passed over, one line each (stderr; the counts also head tables.md)."""
    lines = [f"Finished runs in the tables: {len(collection.runs) - len(unused)}."]
    if collection.duplicates:
        lines.append(
            "Runs repeated by a later run of the same configuration and seed, left out: "
            f"{len(collection.duplicates)}."
        )
    if collection.unfinished:
        lines.append(
            "Unfinished runs (no metrics.json: still running or crashed), ignored: "
            f"{len(collection.unfinished)}."
        )
    if collection.skipped or unused:
        lines.append(
            f"Finished runs in no paper table (listed on stderr): {len(collection.skipped) + len(unused)}."
        )
    return lines


def _details(collection: Collection, unused: Sequence[Run]) -> list[str]:
    out = [f"  in no table: {src}: {why}" for src, why in collection.skipped]
    out += [f"  in no table: {r.source}: no table has a {r.method} column for {r.model}" for r in unused]
    out += [f"  unfinished: {d}" for d in collection.unfinished]
    out += [f"  counted once (a later run repeats it): {d}" for d in collection.duplicates]
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="make_tables.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("folders", nargs="*", help="result folders (sweeps or runs); searched recursively")
    p.add_argument("--out", default="results/tables", help="output folder (default: results/tables)")
    p.add_argument(
        "--wandb", metavar="ENTITY/PROJECT", help="also read the finished runs of this W&B project"
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="show all five paper tables with every row of the paper, also those without runs",
    )
    p.add_argument(
        "--found-only", action="store_true", help="with --all: leave out the paper's rows that have no runs"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[Table]:
    """The command line; returns the tables shown. Bad input prints one ``error:`` line on stderr and exits
    with status 2."""
    args = parse_args(argv)
    try:
        return _main(args)
    except ReportError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _main(args: argparse.Namespace) -> list[Table]:
    if not args.folders and not args.wandb:
        raise ReportError("give at least one results folder (e.g. results/sweeps/<time>) or --wandb")
    collection = read_folders(args.folders)
    if args.wandb:
        read_wandb(args.wandb, collection)
    if not collection.runs and not collection.skipped:
        where = ", ".join([*args.folders, *([f"W&B {args.wandb}"] if args.wandb else [])])
        raise ReportError(f"no finished run (metrics.json) in {where}")

    tables, unused = make_tables(collection, found_only=args.found_only or not args.all)
    shown = tables if args.all else [t for t in tables if t.rows]
    summary = summary_lines(collection, unused)
    for line in [*summary, *_details(collection, unused)]:
        print(line, file=sys.stderr)
    for table in shown:
        for note in table.notes:
            print(f"note ({table.spec.name}): {note}", file=sys.stderr)

    document = "# The paper's tables, reproduced\n\n" + "\n".join(summary) + "\n"
    if not shown:
        document += "\nNo paper table has a finished run (`--all` shows them empty).\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for table in tables:
        files = (out / f"{table.spec.name}.md", out / f"{table.spec.name}.csv")
        if table not in shown:
            for stale in files:  # an earlier call's table, which no longer describes these runs
                stale.unlink(missing_ok=True)
            continue
        markdown = table_markdown(table)
        document += "\n" + markdown
        files[0].write_text(markdown, encoding="utf-8")
        files[1].write_text(table_csv(table), encoding="utf-8")
    sweeps = sweep_summary.summarize(collection.records)
    sweeps_md = sweep_summary.sweeps_markdown(sweeps)
    document += "\n" + sweeps_md
    (out / "sweeps.md").write_text(sweeps_md, encoding="utf-8")
    (out / "sweeps.csv").write_text(sweep_summary.sweeps_csv(sweeps), encoding="utf-8")
    (out / "tables.md").write_text(document, encoding="utf-8")
    sys.stdout.write(document)
    print(f"tables written to {out}", file=sys.stderr)
    return shown
