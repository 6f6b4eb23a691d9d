"""The paper's six claims, checked on finished runs: a verdict per claim, from run folders.

    python -m adaloss.lab.reports.claims results/mini/8_claims_ssd --out results/mini/claims

Reads every finished run under the folders given (``metrics.json``, ``scalars.csv``, ``telemetry.jsonl``),
groups them into *tasks* (model, dataset, batch size) and *cells* (a method: ``fp32``, ``none``, ``fixed<S>``,
``dynamic``, ``adaptive``), one value per seed, and decides each claim the paper makes:

1. no loss scaling diverges on SSD (Tables 3, 5);
2. the result is not monotonic in the fixed loss scale (Tables 4, 5);
3. dynamic loss scaling does poorly at batch 8 (Table 3);
4. adaptive loss scaling is at least as good as the best fixed scale, without tuning (Tables 1-3);
5. adaptive scaling leaves less activation-gradient underflow than fixed scale 128, layer by layer (Fig. 4b);
6. the adaptive loss scales stay far below 128 (Fig. 4a).

**The statistics.** A cell's value is the mean over its seeds with a 95% confidence interval from Student's t
(``mean ± t_{0.975, n-1} * s / sqrt(n)``). Two cells that ran the same seeds (the same initial weights and
data order) differ when the 95% t-interval of their per-seed differences excludes 0; cells with other seeds
differ only when their own intervals do not overlap. Otherwise the comparison is *inconclusive*, whatever
the means say. A cell whose runs all diverged is worse than any cell with a finished run. The verdict of each
claim is ``reproduced``, ``not reproduced`` or ``inconclusive``; the rule of each is in its function's
docstring and under the claims table.

**The metric.** Detection runs are compared by their training loss over the last :data:`LAST_ITERATIONS`
iterations (``scalars.csv``; lower is better): at mini scale their mAP varies more between seeds than between
methods. Classification runs by their final test accuracy (higher is better).

Writes ``claims.md`` (the claims table, then a table of the cells), ``claims.csv`` and ``claims.json`` under
``--out``.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from adaloss.lab.reports.common import MODEL_LABELS, ReportError, config_value, markdown_table, number
from adaloss.lab.reports.runs import read_records, read_telemetry

__all__ = [
    "Cell",
    "Claim",
    "RunSummary",
    "Task",
    "compare",
    "describe_difference",
    "paired_difference",
    "evaluate",
    "interval",
    "main",
    "summarize_run",
    "t_quantile",
    "tasks_of",
    "write_claims",
]

#: Detection runs: the metric is the mean training loss over this many last iterations.
LAST_ITERATIONS = 20
#: Claim 6: "far below 128" means at least this many times below it (3 octaves: alpha <= 16).
FAR_BELOW = 8.0
#: The verdicts.
REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"


# ------------------------------------------------------------------------------------------- statistics


def _t_cdf(x: float, df: float) -> float:
    """Student's t distribution function at ``x >= 0``: 1/2 plus Simpson's rule over the density on [0, x]."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    steps = 2000  # even; the density is smooth, so this is exact to ~1e-10 for the x of interest
    h = x / steps
    total = 0.0
    for i in range(steps + 1):
        t = i * h
        weight = 1 if i in (0, steps) else (4 if i % 2 else 2)
        total += weight * math.exp(log_norm - (df + 1) / 2 * math.log1p(t * t / df))
    return 0.5 + total * h / 3


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile (``0.5 < p < 1``) of Student's t with ``df`` degrees of freedom, by bisection."""
    if not 0.5 < p < 1 or df <= 0:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df > 0, got p={p}, df={df}")
    low, high = 0.0, 1.0
    while _t_cdf(high, df) < p:
        low, high = high, high * 2
    for _ in range(45):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


def interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """``(mean, low, high)``: the mean of ``values`` and its ``level`` t-interval; None for fewer than 2."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    half = t_quantile(0.5 + level / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


# ------------------------------------------------------------------------------------------------ runs


@dataclass
class RunSummary:
    """What the claims read of one finished run."""

    method: str  # fp32 | none | fixed<S> | dynamic | adaptive
    seed: Any
    diverged: bool
    metric: float | None  # None when diverged or not a finite number
    map: float | None = None  # detection: the final mAP, reported next to the metric
    underflow: dict[str, float] = field(default_factory=dict)  # per layer, mean over telemetry steps
    alphas: list[float] = field(default_factory=list)  # adaptive: every layer's alpha at every step after 1


def method_of(config: Mapping[str, Any]) -> str:
    """``fp32``, ``none`` (FP16 without scaling), ``fixed128``, ``dynamic``, ``adaptive``, ``bf16-none``..."""
    precision = str(_cfg(config, "precision.name", "?"))
    scaler = str(_cfg(config, "scaler.name", "?"))
    if precision == "fp32":
        return "fp32"
    prefix = "" if precision == "fp16" else f"{precision}-"
    if scaler == "fixed":
        scale = number(_cfg(config, "scaler.scale"))
        return f"{prefix}fixed{scale:g}" if scale is not None else f"{prefix}fixed?"
    return prefix + scaler


def _cfg(config: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    try:
        return config_value(config, dotted)
    except Exception:  # noqa: BLE001  (Skip: the key is absent)
        return default


def _last_loss(folder: Path) -> float | None:
    """Mean training loss over the last :data:`LAST_ITERATIONS` rows of ``scalars.csv`` (None: no file,
    or a non-finite loss among them)."""
    try:
        with open(folder / "scalars.csv", encoding="utf-8", newline="") as handle:
            rows = list(csv.DictReader(handle))
    except OSError:
        return None
    losses = [number(row.get("loss")) for row in rows[-LAST_ITERATIONS:]]
    if not losses or any(v is None or not math.isfinite(v) for v in losses):
        return None
    return statistics.fmean(losses)  # type: ignore[arg-type]


def summarize_run(folder: Path, data: Mapping[str, Any]) -> RunSummary:
    """A :class:`RunSummary` of the run in ``folder`` whose ``metrics.json`` holds ``data``."""
    config = data.get("config") or {}
    detection = "map" in data or str(_cfg(config, "model.name", "")).startswith("ssd")
    diverged = bool(data.get("diverged", False))
    if detection:
        metric = None if diverged else _last_loss(folder)
    else:
        metric = None if diverged else number(data.get("accuracy"))
    telemetry = read_telemetry(folder / "telemetry.jsonl")
    sums: dict[str, list[float]] = {}
    alphas: list[float] = []
    for row in telemetry:
        for layer, rate in (row.get("underflow_rate") or {}).items():
            if number(rate) is not None:
                sums.setdefault(layer, []).append(float(rate))
        scales = row.get("loss_scale")
        if isinstance(scales, Mapping) and row.get("step", 0) > 1:
            alphas.extend(float(v) for v in scales.values() if number(v) is not None)
    return RunSummary(
        method=method_of(config),
        seed=_cfg(config, "seed"),
        diverged=diverged,
        metric=metric if metric is None or math.isfinite(metric) else None,
        map=number(data.get("map")),
        underflow={layer: statistics.fmean(v) for layer, v in sums.items()},
        alphas=alphas,
    )


@dataclass
class Cell:
    """The runs of one method on one task."""

    method: str
    runs: list[RunSummary]

    @property
    def values(self) -> list[float]:
        return [r.metric for r in self.runs if r.metric is not None]

    @property
    def n_diverged(self) -> int:
        return sum(r.diverged for r in self.runs)

    @property
    def all_diverged(self) -> bool:
        return bool(self.runs) and self.n_diverged == len(self.runs)

    @property
    def ci(self) -> tuple[float, float, float] | None:
        return interval(self.values)

    def describe(self, digits: int = 3) -> str:
        """``5.612 [5.601, 5.623] (n=5)``, ``diverged (5 of 5)``, ``5.61 (n=1)``."""
        if self.all_diverged:
            return f"diverged ({self.n_diverged} of {len(self.runs)})"
        div = f", {self.n_diverged} diverged" if self.n_diverged else ""
        ci = self.ci
        if ci is None:
            vals = self.values
            return f"{vals[0]:.{digits}f} (n=1{div})" if vals else f"no value (n=0{div})"
        return f"{ci[0]:.{digits}f} [{ci[1]:.{digits}f}, {ci[2]:.{digits}f}] (n={len(self.values)}{div})"


@dataclass
class Task:
    """The cells of one model, dataset and batch size."""

    model: str
    dataset: str
    batch_size: Any
    higher_is_better: bool  # classification accuracy: True; detection training loss: False
    loss_multiplier: float = 1.0  # trainer.loss_multiplier: the calibration of the gradients' magnitude
    cells: dict[str, Cell] = field(default_factory=dict)

    @property
    def is_detection(self) -> bool:
        return self.model.startswith("ssd")

    @property
    def label(self) -> str:
        """``SSD512 on shapes, batch 8, gradients x 2^-12`` (the calibration when there is one)."""
        label = f"{MODEL_LABELS.get(self.model, self.model)} on {self.dataset}, batch {self.batch_size}"
        if self.loss_multiplier != 1.0:
            power = math.log2(self.loss_multiplier)
            label += (
                f", gradients x 2^{power:g}"
                if power.is_integer()
                else f", gradients x {self.loss_multiplier:g}"
            )
        return label

    @property
    def metric_name(self) -> str:
        return "test accuracy (%)" if self.higher_is_better else f"training loss (last {LAST_ITERATIONS} it.)"

    def fixed_cells(self, with_none: bool = False) -> list[tuple[float, Cell]]:
        """``(scale, cell)`` of the fixed scales in increasing order; ``with_none``: no scaling as scale 1."""
        out = [(float(m[5:]), c) for m, c in self.cells.items() if m.startswith("fixed") and m[5:] != "?"]
        if with_none and "none" in self.cells and all(s != 1.0 for s, _ in out):
            out.append((1.0, self.cells["none"]))
        return sorted(out, key=lambda item: item[0])


def tasks_of(folders: Sequence[str | Path]) -> list[Task]:
    """Every finished run under ``folders``, grouped into tasks and cells.

    Raises:
        ReportError: a folder does not exist, or holds no finished run.
    """
    records = read_records(folders)
    tasks: dict[tuple[str, str, str, float], Task] = {}
    for record in records.records:
        if record.folder is None or not isinstance(record.data.get("config"), Mapping):
            continue
        config = record.config
        model, dataset = str(_cfg(config, "model.name", "?")), str(_cfg(config, "dataset.name", "?"))
        batch = _cfg(config, "trainer.batch_size")
        multiplier = number(_cfg(config, "trainer.loss_multiplier", 1.0)) or 1.0
        key = (model, dataset, str(batch), multiplier)
        if key not in tasks:
            tasks[key] = Task(model, dataset, batch, "map" not in record.data, multiplier)
        run = summarize_run(record.folder, record.data)
        tasks[key].cells.setdefault(run.method, Cell(run.method, [])).runs.append(run)
    if not tasks:
        raise ReportError(
            f"no finished run (metrics.json with a config) under {', '.join(map(str, folders))}"
        )
    return [tasks[k] for k in sorted(tasks, key=lambda k: (*k[:3], -k[3]))]  # the mildest calibration first


# ---------------------------------------------------------------------------------------------- claims


def paired_difference(a: Cell, b: Cell) -> tuple[float, float, float, int] | None:
    """``(mean, low, high, n)`` of ``a - b`` over the seeds both cells finished, with its 95% t-interval;
    None unless both cells ran the same seeds and at least 2 of them finished in both."""
    va = {r.seed: r.metric for r in a.runs if r.metric is not None}
    vb = {r.seed: r.metric for r in b.runs if r.metric is not None}
    if {r.seed for r in a.runs} != {r.seed for r in b.runs}:
        return None
    diffs = [va[s] - vb[s] for s in sorted(set(va) & set(vb), key=str)]
    ci = interval(diffs)
    return None if ci is None else (*ci, len(diffs))


def compare(a: Cell, b: Cell, higher_is_better: bool) -> str:
    """``better``, ``worse`` (a than b), ``overlap`` (not separable, or both cells diverged) or ``unknown``
    (fewer than 2 finished runs). A cell whose runs all diverged is worse than any cell with a finished run.

    Cells that ran the same seeds (same initial weights and data order, so the seed's share of the noise
    cancels) are compared by the 95% t-interval of their per-seed differences: separable when it excludes 0.
    Otherwise by their own 95% intervals: separable only when these do not overlap."""
    if a.all_diverged or b.all_diverged:
        if a.all_diverged and b.all_diverged:
            return "overlap"
        return "worse" if a.all_diverged else "better"
    paired = paired_difference(a, b)
    if paired is not None:
        low, high = paired[1], paired[2]
    else:
        ca, cb = a.ci, b.ci
        if ca is None or cb is None:
            return "unknown"
        low, high = ca[1] - cb[2], ca[2] - cb[1]  # > 0 / < 0: the intervals are disjoint
    if low > 0:
        return "better" if higher_is_better else "worse"
    if high < 0:
        return "worse" if higher_is_better else "better"
    return "overlap"


def describe_difference(a: Cell, b: Cell, digits: int = 3) -> str:
    """``a - b = -0.012 [-0.020, -0.004] (paired, n=5)``, or ``(unpaired)`` when the seeds differ."""
    paired = paired_difference(a, b)
    if paired is None:
        return "unpaired: the cells' intervals"
    mean, low, high, n = paired
    return f"difference {mean:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}] (paired, n={n})"


@dataclass
class Claim:
    """One claim checked on one task."""

    number: int
    claim: str
    source: str  # where the paper makes it
    task: str
    result: str  # the numbers behind the verdict
    verdict: str  # reproduced | not reproduced | inconclusive
    rule: str  # what would make it reproduced


def _best(task: Task, cells: Sequence[tuple[float, Cell]]) -> tuple[float, Cell] | None:
    """The fixed scale with the best mean among those with a finished run."""
    finished = [(s, c) for s, c in cells if c.values]
    if not finished:
        return None
    sign = 1 if task.higher_is_better else -1
    return max(finished, key=lambda item: sign * statistics.fmean(item[1].values))


def _verdict_of(relation: str, good: str) -> str:
    """A comparison's verdict: the relation the claim predicts (``good``), its opposite, or neither."""
    if relation == good:
        return REPRODUCED
    if relation in ("better", "worse"):
        return NOT_REPRODUCED
    return INCONCLUSIVE


def claim_none_diverges(task: Task) -> Claim | None:
    """Claim 1 (detection tasks): reproduced if most of the runs without loss scaling diverged and no FP32
    run did; not reproduced if none of them diverged; otherwise inconclusive."""
    none, fp32 = task.cells.get("none"), task.cells.get("fp32")
    if not task.is_detection or none is None or fp32 is None:
        return None
    n_div, n = none.n_diverged, len(none.runs)
    if 2 * n_div > n and fp32.n_diverged == 0:
        verdict = REPRODUCED
    elif n_div == 0:
        verdict = NOT_REPRODUCED
    else:
        verdict = INCONCLUSIVE
    relation = compare(none, fp32, task.higher_is_better)
    result = (
        f"no scaling: {n_div} of {n} runs diverged, FP32: {fp32.n_diverged} of {len(fp32.runs)}; "
        f"{task.metric_name}: no scaling {none.describe()}, FP32 {fp32.describe()} "
        f"(no scaling {_relation_words(relation)} FP32: {describe_difference(none, fp32)})"
    )
    rule = "most no-scaling runs diverge and no FP32 run does; not reproduced if no run diverges"
    return Claim(1, "no loss scaling diverges on SSD", "Tables 3, 5", task.label, result, verdict, rule)


def _relation_words(relation: str) -> str:
    return {
        "better": "better than",
        "worse": "worse than",
        "overlap": "not separable from",
        "unknown": "not comparable (fewer than 2 runs) with",
    }[relation]


def claim_non_monotonic(task: Task) -> Claim | None:
    """Claim 2: reproduced if some fixed scale (no scaling counting as scale 1) is better than a smaller and a
    larger scale, or worse than both (disjoint intervals); not reproduced if the means are monotonic in the
    scale and the smallest and largest scale differ; otherwise inconclusive."""
    cells = task.fixed_cells(with_none=True)
    if len(cells) < 3:
        return None
    hib = task.higher_is_better
    found = None
    for j in range(1, len(cells) - 1):
        for shape, relation in (("peak", "better"), ("dip", "worse")):
            below = [s for s, c in cells[:j] if compare(cells[j][1], c, hib) == relation]
            above = [s for s, c in cells[j + 1 :] if compare(cells[j][1], c, hib) == relation]
            if below and above and found is None:
                found = f"a {shape} at scale {cells[j][0]:g} (against {below[0]:g} and {above[-1]:g})"
    means = [_mean_or_worst(c, hib) for _, c in cells]
    monotonic = means == sorted(means) or means == sorted(means, reverse=True)
    ends = compare(cells[0][1], cells[-1][1], hib)
    if found:
        verdict = REPRODUCED
    elif monotonic and ends in ("better", "worse"):
        verdict = NOT_REPRODUCED
    else:
        verdict = INCONCLUSIVE
    listing = "; ".join(f"{s:g}: {c.describe()}" for s, c in cells)
    result = f"{task.metric_name} per scale: {listing}; " + (found or "no scale separates from both sides")
    rule = "a scale beats (or loses to) both a smaller and a larger one, disjoint 95% CIs"
    return Claim(2, "the result is not monotonic in the fixed scale", "Tables 4, 5", task.label, result,
                 verdict, rule)  # fmt: skip


def _mean_or_worst(cell: Cell, higher_is_better: bool) -> float:
    """The cell's mean; a cell without a finished run counts as the worst value."""
    if cell.values:
        return statistics.fmean(cell.values)
    return -math.inf if higher_is_better else math.inf


def _against_best_fixed(task: Task, method: str) -> tuple[Cell, tuple[float, Cell], str] | None:
    cell, best = task.cells.get(method), _best(task, task.fixed_cells())
    if cell is None or best is None:
        return None
    return cell, best, compare(cell, best[1], task.higher_is_better)


def claim_dynamic_poor(task: Task) -> Claim | None:
    """Claim 3 (detection tasks): reproduced if dynamic scaling is worse than the best fixed scale (disjoint
    intervals), not reproduced if it is better, inconclusive if they overlap."""
    found = _against_best_fixed(task, "dynamic") if task.is_detection else None
    if found is None:
        return None
    cell, (scale, best), relation = found
    fp32 = task.cells.get("fp32")
    versus_fp32 = f"; FP32 {fp32.describe()}" if fp32 is not None else ""
    result = (
        f"{task.metric_name}: dynamic {cell.describe()}, best fixed (S={scale:g}) {best.describe()}"
        f"{versus_fp32}; dynamic {_relation_words(relation)} the best fixed scale: "
        f"{describe_difference(cell, best)}"
    )
    rule = "dynamic worse than the best fixed scale, disjoint 95% CIs"
    return Claim(3, "dynamic loss scaling does poorly at batch 8", "Table 3", task.label, result,
                 _verdict_of(relation, "worse"), rule)  # fmt: skip


def claim_adaptive_vs_best_fixed(task: Task) -> Claim | None:
    """Claim 4: reproduced if adaptive scaling is better than the best fixed scale (disjoint intervals), not
    reproduced if it is worse, inconclusive if they overlap (equal within noise proves nothing here)."""
    found = _against_best_fixed(task, "adaptive")
    if found is None:
        return None
    cell, (scale, best), relation = found
    result = (
        f"{task.metric_name}: adaptive {cell.describe()}, best fixed (S={scale:g}, chosen after the fact) "
        f"{best.describe()}; adaptive {_relation_words(relation)} the best fixed scale: "
        f"{describe_difference(cell, best)}"
    )
    rule = "adaptive better than the best fixed scale, disjoint 95% CIs; worse: not reproduced"
    return Claim(4, "adaptive scaling is at least as good as the best fixed scale, without tuning",
                 "Tables 1-3", task.label, result, _verdict_of(relation, "better"), rule)  # fmt: skip


def _layer_cell(cell: Cell, layer: str) -> Cell:
    """A cell whose metric is one layer's mean underflow rate (in %), one value per run."""
    runs = [RunSummary(cell.method, r.seed, False, 100 * r.underflow[layer]) for r in cell.runs
            if layer in r.underflow]  # fmt: skip
    return Cell(cell.method, runs)


def claim_less_underflow(task: Task) -> Claim | None:
    """Claim 5: per layer, the underflow rate (mean over the telemetry steps) of adaptive against fixed 128.
    Counting only layers where either underflows: reproduced if adaptive is lower (disjoint intervals) in
    more layers than it is higher, and in at least half of them; not reproduced if the reverse; else
    inconclusive."""
    adaptive, fixed = task.cells.get("adaptive"), task.cells.get("fixed128")
    if adaptive is None or fixed is None:
        return None
    layers = sorted({k for r in adaptive.runs + fixed.runs for k in r.underflow})
    counts = {"better": 0, "worse": 0, "overlap": 0, "unknown": 0}
    active = 0
    for layer in layers:
        a, f = _layer_cell(adaptive, layer), _layer_cell(fixed, layer)
        if not any(a.values) and not any(f.values):
            continue  # neither underflows in this layer: no evidence either way
        active += 1
        counts[compare(a, f, higher_is_better=False)] += 1
    fewer, more = counts["better"], counts["worse"]
    if fewer > more and 2 * fewer >= active:
        verdict = REPRODUCED
    elif more > fewer and 2 * more >= active:
        verdict = NOT_REPRODUCED
    else:
        verdict = INCONCLUSIVE
    mean_a, mean_f = _mean_rate_cell(adaptive), _mean_rate_cell(fixed)
    result = (
        f"of {active} layers that underflow (of {len(layers)}), adaptive leaves less in {fewer}, more in "
        f"{more}, not separable in {counts['overlap'] + counts['unknown']}; mean over layers (%): adaptive "
        f"{mean_a.describe(3)}, fixed 128 {mean_f.describe(3)}"
    )
    rule = "adaptive lower in more layers than higher, and in at least half of the layers that underflow"
    return Claim(5, "adaptive scaling leaves less underflow than fixed 128, layer by layer", "Figure 4b",
                 task.label, result, verdict, rule)  # fmt: skip


def _mean_rate_cell(cell: Cell) -> Cell:
    runs = [RunSummary(cell.method, r.seed, False, 100 * statistics.fmean(r.underflow.values()))
            for r in cell.runs if r.underflow]  # fmt: skip
    return Cell(cell.method, runs)


def claim_scales_below_128(task: Task) -> Claim | None:
    """Claim 6: per adaptive run, the geometric mean of every layer's alpha over the telemetry steps after the
    first. Reproduced if its 95% interval (over runs, in log2) lies below 128 / :data:`FAR_BELOW`, not
    reproduced if above, inconclusive if it straddles it."""
    adaptive = task.cells.get("adaptive")
    runs = [r for r in adaptive.runs if r.alphas] if adaptive is not None else []
    if not runs:
        return None
    logs = [statistics.fmean(math.log2(max(a, 2.0**-126)) for a in r.alphas) for r in runs]
    ci = interval(logs)
    limit = math.log2(128 / FAR_BELOW)
    if ci is None:
        verdict = INCONCLUSIVE
    elif ci[2] < limit:
        verdict = REPRODUCED
    elif ci[1] > limit:
        verdict = NOT_REPRODUCED
    else:
        verdict = INCONCLUSIVE
    every = [a for r in runs for a in r.alphas]
    below = 100 * sum(a < 128 for a in every) / len(every)
    spread = f"[{2 ** ci[1]:.3g}, {2 ** ci[2]:.3g}]" if ci else "(n=1)"
    result = (
        f"geometric mean of the layers' alpha: {2 ** statistics.fmean(logs):.3g} {spread} (n={len(runs)}); "
        f"{below:.1f}% of the layer-steps below 128; range {min(every):.3g} to {max(every):.3g}"
    )
    rule = f"the geometric mean's 95% CI below 128/{FAR_BELOW:g} = {128 / FAR_BELOW:g}"
    return Claim(6, "the adaptive loss scales stay far below 128", "Figure 4a", task.label, result, verdict,
                 rule)  # fmt: skip


CLAIMS: tuple[Callable[[Task], Claim | None], ...] = (
    claim_none_diverges,
    claim_non_monotonic,
    claim_dynamic_poor,
    claim_adaptive_vs_best_fixed,
    claim_less_underflow,
    claim_scales_below_128,
)


def evaluate(tasks: Sequence[Task]) -> list[Claim]:
    """Every claim on every task that has the cells it needs, in claim order."""
    return [claim for check in CLAIMS for task in tasks if (claim := check(task)) is not None]


# ---------------------------------------------------------------------------------------------- output


def cells_table(tasks: Sequence[Task]) -> str:
    """A Markdown table of every cell: its metric's mean and 95% CI, mAP, diverged runs, mean underflow."""
    rows = []
    for task in tasks:
        order = sorted(task.cells, key=lambda m: (m != "fp32", m != "none", _scale_key(m), m))
        for method in order:
            cell = task.cells[method]
            maps = Cell(method, [RunSummary(method, r.seed, r.diverged, r.map) for r in cell.runs])
            under = _mean_rate_cell(cell)
            rows.append([task.label, method, task.metric_name, cell.describe(),
                         maps.describe(2) if task.is_detection else "",
                         under.describe(3) if under.runs else "",
                         f"{cell.n_diverged} of {len(cell.runs)}"])  # fmt: skip
    headers = ["task", "method", "metric", "mean [95% CI]", "mAP (%)", "underflow, mean over layers (%)",
               "diverged"]  # fmt: skip
    return markdown_table(headers, rows, left=3)


#: The per-layer profile's columns: FP32 (what FP16 would flush, Figure 1a) and the methods of Figure 4b.
PROFILE_METHODS = ("fp32", "none", "fixed128", "adaptive")


def profile_table(task: Task) -> str | None:
    """Per layer (in the runs' order: input side first), the mean activation-gradient underflow rate (%) over
    the telemetry steps and the seeds, for FP32 and the methods of Figure 4b; None without telemetry."""
    cells = [(m, task.cells[m]) for m in PROFILE_METHODS if m in task.cells]
    layers: list[str] = []
    for _, cell in cells:
        for run in cell.runs:
            layers.extend(k for k in run.underflow if k not in layers)
    if not layers:
        return None
    rows = []
    for layer in layers:
        row = [layer]
        for _, cell in cells:
            values = _layer_cell(cell, layer).values
            row.append(f"{statistics.fmean(values):.2f}" if values else "")
        rows.append(row)
    headers = ["layer", *(f"{m} (n={len(c.runs)})" for m, c in cells)]
    return markdown_table(headers, rows)


def _scale_key(method: str) -> float:
    return float(method[5:]) if method.startswith("fixed") and method[5:] != "?" else math.inf


def write_claims(claims: Sequence[Claim], tasks: Sequence[Task], out: Path) -> dict[str, Path]:
    """``claims.md``, ``claims.csv`` and ``claims.json`` under ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [[c.number, f"{c.claim} ({c.source})", c.task, c.result, f"**{c.verdict}**"] for c in claims]
    headers = ["#", "claim (paper)", "task", "result (mean [95% CI] over seeds)", "verdict"]
    table = markdown_table(headers, rows, left=5)
    rules = "\n".join(f"- Claim {c.number}: {c.rule}." for c in {c.number: c for c in claims}.values())
    text = (
        "# The paper's claims on the mini reproduction\n\n"
        f"{table}\n\nVerdict rules (two cells that ran the same seeds differ when the 95% t-interval of "
        "their per-seed differences excludes 0; other cells only when their own 95% t-intervals do not "
        "overlap):\n\n"
        f"{rules}\n\n## The cells\n\n{cells_table(tasks)}\n"
    )
    for task in tasks:
        profile = profile_table(task)
        if profile is not None:
            text += (
                f"\n## Underflow per layer: {task.label}\n\nThe share (%) of each layer's activation "
                "gradient flushed to zero, mean over the telemetry steps and seeds; under FP32, what FP16 "
                "would flush (the paper's Figure 1a), under the others what their FP16 gradients lost."
                f"\n\n{profile}\n"
            )
    paths = {"md": out / "claims.md", "csv": out / "claims.csv", "json": out / "claims.json"}
    paths["md"].write_text(text, encoding="utf-8")
    with open(paths["csv"], "w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(Claim.__dataclass_fields__))
        writer.writeheader()
        writer.writerows(asdict(c) for c in claims)
    paths["json"].write_text(json.dumps([asdict(c) for c in claims], indent=2) + "\n", encoding="utf-8")
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The paper's claims, checked on finished runs.")
    parser.add_argument(
        "folders", nargs="+", type=Path, help="folders holding the runs (searched recursively)"
    )
    parser.add_argument("--out", type=Path, default=Path("results/mini/claims"), help="output folder")
    args = parser.parse_args(argv)
    try:
        tasks = tasks_of(args.folders)
    except ReportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    claims = evaluate(tasks)
    if not claims:
        print("error: no claim can be checked: the runs lack the cells the claims compare "
              "(run `python scripts/reproduce_mini.py --claims-only`)", file=sys.stderr)  # fmt: skip
        return 2
    paths = write_claims(claims, tasks, args.out)
    for claim in claims:
        print(f"claim {claim.number} ({claim.task}): {claim.verdict}")
    print(f"wrote {paths['md']}, {paths['csv']}, {paths['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
