"""A summary of any sweep, whatever it ran: one row per configuration, its seeds pooled.

The paper's tables only show runs that fit their rows and columns; a sweep over, say, fixed scales of an MLP
on digits fits none. Every sweep (:mod:`adaloss.lab.reports.runs`: the runs of one folder, or one W&B group)
therefore also gets a table of its own:

* **overrides**: what sets a configuration apart within its sweep: the run's command-line overrides
  (``.hydra/overrides.yaml``) less those every run of the sweep shares (listed once above the table), the
  seed and settings that cannot change a result (device, logging, paths, workers). Runs without Hydra's
  record (hand-made folders, W&B) are told apart by the config values that differ between them instead.
* **test metric**: the final test accuracy (classification) or mAP (detection), in %, mean ± sample standard
  deviation over the configuration's runs (``n``), diverged runs counted apart, as in the paper's tables.
* **seeds** of those runs; **skipped steps** and **mean underflow** (the mean over layers of the
  activation-gradient underflow rate at the last iteration, in %): means over the runs that did not
  diverge (a diverged run stopped early, so its last numbers are not the end of training).

Rows follow Hydra's job numbers. Cost: nothing beyond reading ``metrics.json`` (and ``overrides.yaml``).
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adaloss.lab.reports.common import (
    IRRELEVANT_KEYS,
    MISSING,
    Stats,
    flatten,
    fmt_num,
    format_stats,
    markdown_table,
    number,
)
from adaloss.lab.reports.runs import Record

__all__ = [
    "Sweep",
    "SweepRow",
    "configuration_labels",
    "diverged",
    "group_by_sweep",
    "summarize",
    "sweeps_csv",
    "sweeps_markdown",
]

#: Override keys that never set a configuration apart (beyond IRRELEVANT_KEYS): where and how jobs run.
_LAUNCH_KEYS = ("hydra", "cluster", "logger")


def _ignored(key: str) -> bool:
    """Whether a config or override key cannot change a result (so never names a configuration)."""
    key = key.lstrip("+~")
    if any(key == k or key.startswith((f"{k}.", f"{k}/")) for k in _LAUNCH_KEYS):
        return True
    return any(key.startswith(k) if k.endswith(".") else key == k for k in IRRELEVANT_KEYS)


def _plain(json_value: str) -> str:
    value = json.loads(json_value)
    return value if isinstance(value, str) else json.dumps(value)


def configuration_labels(records: Sequence[Record]) -> tuple[list[str], dict[str, str]]:
    """``(common, {source: label})`` for the runs of one sweep: the settings all share, and per run what
    sets it apart (``""`` when nothing does). From the overrides when every run has them, else from the
    config values that differ (``key=value``, keys sorted)."""
    if records and all(r.overrides is not None for r in records):
        kept = {
            r.source: [o for o in r.overrides or () if not _ignored(o.partition("=")[0])] for r in records
        }
        first = kept[records[0].source]
        common = [o for o in first if all(o in k for k in kept.values())]
        return common, {s: " ".join(o for o in k if o not in common) for s, k in kept.items()}
    flat = {r.source: {k: v for k, v in flatten(r.config).items() if not _ignored(k)} for r in records}
    keys = sorted({k for f in flat.values() for k in f})
    differing = [k for k in keys if len({f.get(k) for f in flat.values()}) > 1]
    labels = {
        s: " ".join(f"{k}={_plain(f[k]) if k in f else '(absent)'}" for k in differing)
        for s, f in flat.items()
    }
    return [], labels


@dataclass(frozen=True)
class SweepRow:
    """One configuration of a sweep and its runs' numbers."""

    label: str  # what sets it apart (configuration_labels); "" if nothing
    metric: str | None  # "test_accuracy", "map", or None when the runs record neither
    stats: Stats  # of the metric (%), over the runs
    seeds: tuple[Any, ...]
    skipped_steps: float | None  # mean over the runs that did not diverge
    mean_underflow: float | None  # mean over those runs of mean_underflow_rate (a fraction)
    sources: tuple[str, ...]


@dataclass(frozen=True)
class Sweep:
    name: str
    common: tuple[str, ...]  # the overrides every run shares
    rows: tuple[SweepRow, ...]

    @property
    def runs(self) -> int:
        return sum(len(r.sources) for r in self.rows)


def _metric(data: Mapping[str, Any]) -> str | None:
    return next((m for m in ("map", "test_accuracy") if m in data), None)


def _mean(values: Iterable[float | None]) -> float | None:
    finite = [v for v in values if v is not None]
    return statistics.fmean(finite) if finite else None


def diverged(record: Record) -> bool:
    """Whether the run diverged (``trainer.on_divergence=record``): it did not train to the end."""
    return record.data.get("diverged") is True


def _row(label: str, records: Sequence[Record]) -> SweepRow:
    metric = _metric(records[0].data)
    values = [None if diverged(r) or metric is None else number(r.data.get(metric)) for r in records]
    finished = [r for r in records if not diverged(r)]
    return SweepRow(
        label=label,
        metric=metric,
        stats=Stats.of_values(values),
        seeds=tuple(r.config.get("seed") for r in records),
        skipped_steps=_mean(number(r.data.get("skipped_steps")) for r in finished),
        mean_underflow=_mean(number(r.data.get("mean_underflow_rate")) for r in finished),
        sources=tuple(r.source for r in records),
    )


def group_by_sweep(records: Iterable[Record]) -> dict[str, list[Record]]:
    """``{sweep name: its records in job order}``, sweeps in the order first met."""
    groups: dict[str, list[Record]] = {}
    for record in records:
        groups.setdefault(record.sweep, []).append(record)
    return {name: sorted(found, key=lambda r: r.order) for name, found in groups.items()}


def summarize(records: Iterable[Record]) -> list[Sweep]:
    """A :class:`Sweep` per sweep of ``records``, a row per configuration (seeds pooled)."""
    out = []
    for name, found in group_by_sweep(records).items():
        common, labels = configuration_labels(found)
        rows: dict[str, list[Record]] = {}
        for record in found:
            rows.setdefault(labels[record.source], []).append(record)
        out.append(Sweep(name, tuple(common), tuple(_row(label, rs) for label, rs in rows.items())))
    return out


_METRIC_HEADERS = {"test_accuracy": "test accuracy (%)", "map": "mAP (%)"}


def _metric_header(sweep: Sweep) -> str:
    metrics = {r.metric for r in sweep.rows if r.metric is not None}
    if len(metrics) == 1:
        return _METRIC_HEADERS[metrics.pop()]
    return "test accuracy or mAP (%)"


def _fmt(value: float | None, scale: float = 1.0) -> str:
    return MISSING if value is None else f"{value * scale:.3g}"


def sweeps_markdown(sweeps: Sequence[Sweep]) -> str:
    """The summaries as Markdown: a heading, what the columns mean, a table per sweep."""
    lines = [
        "## Sweeps",
        "",
        "A table per sweep (the runs of one folder), a row per configuration: what sets it apart from the "
        "other runs of the sweep, its final test metric as mean ± sample standard deviation over its runs "
        "(n), their seeds, and the means over its runs that did not diverge of the skipped steps and of the "
        "mean activation-gradient underflow over layers at the last iteration. — = not recorded.",
    ]
    if not sweeps:
        lines += ["", "(no finished runs)"]
    for sweep in sweeps:
        lines += ["", f"### {sweep.name} ({sweep.runs} run{'s' if sweep.runs != 1 else ''})", ""]
        if sweep.common:
            lines += [f"Every run: `{' '.join(sweep.common)}`", ""]
        headers = ["configuration", _metric_header(sweep), "seeds", "skipped steps", "mean underflow (%)"]
        rows = [
            [
                f"`{row.label}`" if row.label else "(every run)",
                format_stats(row.stats),
                " ".join(str(s) for s in row.seeds),
                _fmt(row.skipped_steps),
                _fmt(row.mean_underflow, 100.0),
            ]
            for row in sweep.rows
        ]
        lines.append(markdown_table(headers, rows, left=1))
    return "\n".join(lines) + "\n"


def sweeps_csv(sweeps: Sequence[Sweep]) -> str:
    """One line per configuration: sweep, configuration, metric, mean, std, n, diverged, seeds, skipped
    steps and mean underflow (%); a missing value is an empty field."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(
        ["sweep", "configuration", "metric", "mean", "std", "n", "diverged", "seeds", "skipped_steps",
         "mean_underflow_pct"]
    )  # fmt: skip
    for sweep in sweeps:
        for row in sweep.rows:
            stats = row.stats
            writer.writerow(
                [
                    sweep.name,
                    row.label,
                    row.metric or "",
                    "" if stats.mean is None else f"{stats.mean:.4f}",
                    "" if stats.std is None else f"{stats.std:.4f}",
                    stats.n,
                    stats.n_diverged,
                    " ".join(str(s) for s in row.seeds),
                    "" if row.skipped_steps is None else fmt_num(round(row.skipped_steps, 4)),
                    "" if row.mean_underflow is None else f"{100 * row.mean_underflow:.6g}",
                ]
            )
    return out.getvalue()
