"""The paper's Figures 1 and 4, and per-layer underflow and loss-scale figures of any sweep, from the
telemetry of finished runs.

    python scripts/make_figures.py results/sweeps/<time> [more folders ...] [--out results/figures] [--wandb]

**Input.** Finished runs (:mod:`adaloss.lab.reports.runs`). A run's ``config`` (the resolved config) says
model, dataset, precision and scaler; ``.hydra/hydra.yaml`` (or ``.hydra/overrides.yaml``) says which
experiment launched it. The curves come from ``<run>/telemetry.jsonl``: one JSON object per telemetry step,
``{"step": n, "underflow_rate": {layer: r}, "loss_scale": float or {layer: alpha}, "expected_loss_scale":
{layer: s}}``, layers in network order; the last line is the run's last iteration.

**The paper's figures** (PNG, in ``--out``; ``--iterations`` curves each, spread over the run, first and
last included):

* ``fig1a.png`` per-layer activation-gradient underflow rate of an FP32 detector (what FP16 would flush to
  zero), one curve per iteration; ``fig1b.png`` the per-layer expected loss scale of the same run (log2
  axis). Source: the FP32 detection run, one with ``telemetry.expected_loss_scale=true`` first
  (``experiment=fig1_ssd_stats``).
* ``fig4a.png`` per-layer adaptive loss scale alpha of an adaptive classification run (log2 axis), one curve
  per iteration, with the fixed scale 128 of Table 2 as a reference line (``experiment=fig4_scales
  model=resnet18 dataset=imagenet variant=adaptive``).
* ``fig4b.png`` per-layer underflow-rate difference, fixed minus adaptive loss scaling, of two detection runs
  of the same model and dataset, at iterations both recorded (``experiment=fig4_scales``: SSD512 on VOC,
  fixed 128 against adaptive; the paper does not say which fixed scale its Figure 4b used, 128 is ours).

As in the paper's Figure 1, the x axis is the layer ID in backpropagation order: ID 0 is the layer nearest
the loss (the last in network order), the highest ID the layer nearest the input; tick labels name the
layers. Every figure uses the same order, so one ID means one layer in fig1a and fig1b.

**Which runs.** Each paper figure takes the runs whose config fits (a detection run is an ``ssd*`` model or
a detection dataset). Among several, it prefers the paper's model and dataset (SSD512 on VOC, ResNet-18 on
ImageNet), then the runs of the figure's experiment, then (fig4b) the fixed scale 128 and pairs of equal
batch size and seed, then path order; it prints the runs it used. So the mini reproduction's runs (SSD512
at a small input size on ``shapes``, ResNet-20 or the MLP on ``digits``) make the figures too, and their
titles name the model, dataset and run, and say when the setting is not the paper's. A paper figure whose
runs are missing is skipped with one line on stderr saying what is missing (when no paper figure could be
made at all, one line names them; ``--all`` gives each its line).

**Sweep figures**, for any runs with telemetry, in ``<out>/sweeps/``: for each sweep (the runs of one
folder, :mod:`adaloss.lab.reports.sweeps`) and each model and dataset in it, ``<sweep>_underflow.png``, the
per-layer underflow rate at each run's last telemetry step (the end of training), one curve per
configuration (the mean over its runs, seeds pooled), and ``<sweep>_loss_scale.png``, the loss scale over
the iterations, one curve per configuration (the geometric mean over its runs; a layer-wise scaler's curve
is the geometric mean over layers, shaded from its smallest to its largest layer's scale). A plain
fixed-scale sweep thus gets its figures too.

``<out>/figures.md`` and ``<out>/figures.json`` list each figure and its source runs. Exit status 0 if at
least one figure was written, else 2 with an ``error:`` line.

``--wandb`` logs each PNG as a ``wandb.Image`` to a W&B run (offline unless ``WANDB_MODE`` says otherwise;
project from the runs' ``logger.wandb.project``). W&B failures print a warning; the PNGs are still written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaloss.lab.reports.common import (
    DATASET_LABELS,
    MODEL_LABELS,
    ReportError,
    fmt_num,
    markdown_table,
    number,
)
from adaloss.lab.reports.runs import Records, RunInfo, read_records, read_telemetry, run_infos
from adaloss.lab.reports.sweeps import configuration_labels, diverged, group_by_sweep

__all__ = [
    "FIGURES",
    "LayerSeries",
    "NoData",
    "ReportError",
    "RunInfo",
    "ScaleCurve",
    "fig1a_data",
    "fig1b_data",
    "fig4a_data",
    "fig4b_data",
    "main",
    "network_order",
    "pick_steps",
    "read_runs",
    "read_telemetry",
    "select_all",
    "short_layer",
    "sweep_scale_data",
    "sweep_underflow_data",
]

FIGURES = ("fig1a", "fig1b", "fig4a", "fig4b")
#: The paper's (model, dataset) of each figure, and the experiment config that launches its runs.
PAPER_SETTING = {
    "fig1a": ("ssd512", "voc"),
    "fig1b": ("ssd512", "voc"),
    "fig4a": ("resnet18", "imagenet"),
    "fig4b": ("ssd512", "voc"),
}
EXPERIMENT = {
    "fig1a": "fig1_ssd_stats",
    "fig1b": "fig1_ssd_stats",
    "fig4a": "fig4_scales",
    "fig4b": "fig4_scales",
}
HOW_TO_RUN = {
    "fig1a": "python train.py -m experiment=fig1_ssd_stats",
    "fig1b": "python train.py -m experiment=fig1_ssd_stats",
    "fig4a": "python train.py -m experiment=fig4_scales model=resnet18 dataset=imagenet variant=adaptive",
    "fig4b": "python train.py -m experiment=fig4_scales",
}
#: The fixed scale Figure 4b compares with (the paper does not name it; 128 is Table 2's fixed scale).
FIG4B_FIXED_SCALE = 128.0
DEFAULT_ITERATIONS = 6


class NoData(Exception):
    """The chosen runs' telemetry lacks what a figure plots; the message says what."""


def read_runs(folders: Sequence[str | Path]) -> tuple[list[RunInfo], Records]:
    """Every finished run under ``folders`` that has a config, in path order, and what was read.

    Raises:
        ReportError: if a folder does not exist.
    """
    records = read_records(folders)
    return run_infos(records), records


# --------------------------------------------------------------------------------------------------------
# Figure data (no matplotlib): what each figure plots
# --------------------------------------------------------------------------------------------------------


@dataclass
class LayerSeries:
    """One figure's data. ``layers`` is the plotting order: layer ID 0 first, i.e. backpropagation order
    (network order, as in the telemetry file, reversed). ``values[step][i]`` is layer ``layers[i]``'s value at
    that step (NaN where the step did not record the layer)."""

    layers: list[str]
    steps: list[int]
    values: dict[int, list[float]]

    @property
    def network_order(self) -> list[str]:
        return self.layers[::-1]


def _per_layer(row: Mapping[str, Any], key: str) -> dict[str, float] | None:
    value = row.get(key)
    if not isinstance(value, Mapping):
        return None
    out = {}
    for layer, x in value.items():
        finite = number(x)
        out[str(layer)] = finite if finite is not None else math.nan
    return out


def network_order(maps: Sequence[Mapping[str, float]]) -> list[str]:
    """The layers in the order the telemetry lists them (first appearance across steps)."""
    seen: dict[str, None] = {}
    for m in maps:
        seen.update(dict.fromkeys(m))
    return list(seen)


def pick_steps(steps: Sequence[int], n: int) -> list[int]:
    """``n`` steps spread evenly over ``steps`` (sorted), the first and the last included; all if fewer."""
    steps = sorted(set(steps))
    if n <= 0 or len(steps) <= n:
        return steps
    if n == 1:
        return [steps[-1]]
    idx = sorted({round(i * (len(steps) - 1) / (n - 1)) for i in range(n)})
    return [steps[i] for i in idx]


def layer_series(
    rows: Sequence[Mapping[str, Any]], key: str, iterations: int = DEFAULT_ITERATIONS
) -> LayerSeries:
    """The per-layer ``key`` (``underflow_rate``, ``expected_loss_scale``, ``loss_scale``) at ``iterations``
    steps spread over the run (among the steps that record it), on every layer the telemetry names.

    Raises:
        NoData: if no step records ``key`` per layer.
    """
    maps = {int(r["step"]): m for r in rows if (m := _per_layer(r, key))}
    if not maps:
        raise NoData(f"its telemetry has no per-layer {key}")
    # every layer the run reports (underflow_rate lists them all; a layer whose gradient was all zeros has
    # no expected loss scale), so the layer IDs of fig1a and fig1b agree
    everything = [m for r in rows if (m := _per_layer(r, "underflow_rate"))]
    layers = network_order([*everything, *maps.values()])[::-1]
    steps = pick_steps(list(maps), iterations)
    values = {s: [maps[s].get(layer, math.nan) for layer in layers] for s in steps}
    return LayerSeries(layers=layers, steps=steps, values=values)


def fig1a_data(run: RunInfo, iterations: int = DEFAULT_ITERATIONS) -> LayerSeries:
    return layer_series(run.telemetry, "underflow_rate", iterations)


def fig1b_data(run: RunInfo, iterations: int = DEFAULT_ITERATIONS) -> LayerSeries:
    try:
        return layer_series(run.telemetry, "expected_loss_scale", iterations)
    except NoData:
        raise NoData(
            "its telemetry has no expected_loss_scale (run with telemetry.expected_loss_scale=true)"
        ) from None


def fig4a_data(run: RunInfo, iterations: int = DEFAULT_ITERATIONS) -> LayerSeries:
    try:
        return layer_series(run.telemetry, "loss_scale", iterations)
    except NoData:
        raise NoData("its telemetry has no per-layer loss_scale (alpha)") from None


def fig4b_data(fixed: RunInfo, adaptive: RunInfo, iterations: int = DEFAULT_ITERATIONS) -> LayerSeries:
    """Fixed minus adaptive underflow rate per layer, at steps both runs recorded, on the layers both have
    (in the adaptive run's order).

    Raises:
        NoData: if either run lacks underflow telemetry, or they share no step or no layer.
    """
    f = {int(r["step"]): m for r in fixed.telemetry if (m := _per_layer(r, "underflow_rate"))}
    a = {int(r["step"]): m for r in adaptive.telemetry if (m := _per_layer(r, "underflow_rate"))}
    if not f or not a:
        which = " and ".join(n for n, d in (("the fixed", f), ("the adaptive", a)) if not d)
        raise NoData(f"{which} run's telemetry has no per-layer underflow_rate")
    common = sorted(set(f) & set(a))
    if not common:
        raise NoData("the fixed and adaptive runs recorded telemetry at no common step")
    in_fixed = set(network_order(list(f.values())))
    layers = [layer for layer in network_order(list(a.values())) if layer in in_fixed][::-1]
    if not layers:
        raise NoData("the fixed and adaptive runs have no layer in common")
    steps = pick_steps(common, iterations)
    values = {s: [f[s].get(layer, math.nan) - a[s].get(layer, math.nan) for layer in layers] for s in steps}
    return LayerSeries(layers=layers, steps=steps, values=values)


# --------------------------------------------------------------------------------------------------------
# Sweep figure data: a curve per configuration of a sweep
# --------------------------------------------------------------------------------------------------------


@dataclass
class SweepGroup:
    """The runs of one sweep with one model and dataset, and the configuration each belongs to."""

    sweep: str
    model: str
    dataset: str
    runs: list[RunInfo]
    labels: dict[str, str]  # run folder -> configuration ("" when the sweep has one)
    stem: str  # file name stem

    def configurations(self) -> dict[str, list[RunInfo]]:
        """``{configuration label: its runs}`` in job order."""
        out: dict[str, list[RunInfo]] = {}
        for run in self.runs:
            out.setdefault(self.labels[str(run.path)] or "(every run)", []).append(run)
        return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", text).strip("_") or "sweep"


def sweep_groups(runs: Sequence[RunInfo]) -> list[SweepGroup]:
    """The runs that have telemetry, by sweep and then by (model, dataset); within a group, each run is
    labelled by what sets it apart from the group's other runs."""
    run_of = {r.record.source: r for r in runs if r.record is not None and r.telemetry_path.is_file()}
    groups = []
    for sweep, records in group_by_sweep(r.record for r in run_of.values() if r.record is not None).items():
        members = [run_of[record.source] for record in records]  # job order
        settings = list(dict.fromkeys((r.model, r.dataset) for r in members))
        for model, dataset in settings:
            chosen = [r for r in members if (r.model, r.dataset) == (model, dataset)]
            _, labels = configuration_labels([r.record for r in chosen if r.record is not None])
            stem = _slug(sweep if len(settings) == 1 else f"{sweep}_{model}_{dataset}")
            by_path = {str(r.path): labels[r.record.source] for r in chosen if r.record is not None}
            groups.append(SweepGroup(sweep, model, dataset, chosen, by_path, stem))
    return groups


def _nan_mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def sweep_underflow_data(group: SweepGroup) -> tuple[list[str], dict[str, list[float]]]:
    """``(layers, {configuration: rates})``: each configuration's per-layer underflow rate at its runs' last
    telemetry step (the last iteration), averaged over its runs that did not diverge (a diverged run stopped
    early: its last step is not the end of training; a configuration whose runs all diverged gets an empty
    curve, so the legend still names it); layers in backpropagation order (ID 0 first), NaN where no run of
    the configuration recorded the layer.

    Raises:
        NoData: if no run records per-layer underflow.
    """
    finals: dict[str, list[dict[str, float]]] = {}
    for label, runs in group.configurations().items():
        finished = [run for run in runs if run.record is None or not diverged(run.record)]
        left_out = len(runs) - len(finished)
        if not finished:
            finals[f"{label} (diverged)"] = []
            continue
        key = f"{label} ({left_out} diverged left out)" if left_out else label
        for run in finished:
            rows = [m for r in run.telemetry if (m := _per_layer(r, "underflow_rate"))]
            if rows:
                finals.setdefault(key, []).append(rows[-1])
    if not any(finals.values()):
        raise NoData("its runs' telemetry has no per-layer underflow_rate")
    layers = network_order([m for maps in finals.values() for m in maps])[::-1]
    curves = {
        label: [_nan_mean([m.get(layer, math.nan) for m in maps]) for layer in layers]
        for label, maps in finals.items()
    }
    return layers, curves


@dataclass
class ScaleCurve:
    """One configuration's loss scale over the iterations: ``value`` the scale (a layer-wise scaler: the
    geometric mean over layers), geometric mean over its runs; ``low``/``high`` the smallest and largest
    layer's scale over its runs (None for a scalar scale)."""

    label: str
    steps: list[int]
    value: list[float]
    low: list[float] | None = None
    high: list[float] | None = None


def _geomean(values: Sequence[float]) -> float:
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if not positive:
        return math.nan
    if min(positive) == max(positive):
        return positive[0]  # exact, where logarithms would round
    return math.exp(sum(map(math.log, positive)) / len(positive))


def _scale_at(row: Mapping[str, Any]) -> tuple[float, float, float] | None:
    """(center, low, high) of a telemetry line's loss scale; None if it has none."""
    scale = row.get("loss_scale")
    if isinstance(scale, Mapping):
        values = [v for v in (number(x) for x in scale.values()) if v is not None]
        return (_geomean(values), min(values), max(values)) if values else None
    value = number(scale)
    return None if value is None else (value, value, value)


def sweep_scale_data(group: SweepGroup) -> list[ScaleCurve]:
    """A :class:`ScaleCurve` per configuration, at every telemetry step one of its runs recorded (over the
    runs that recorded it: a diverged run's part ends where it stopped).

    Raises:
        NoData: if no run records its loss scale.
    """
    curves = []
    for label, runs in group.configurations().items():
        per_run = [{int(r["step"]): s for r in run.telemetry if (s := _scale_at(r))} for run in runs]
        steps = sorted({step for scales in per_run for step in scales})
        if not steps:
            continue
        at = {step: [scales[step] for scales in per_run if step in scales] for step in steps}
        value = [_geomean([s[0] for s in at[step]]) for step in steps]
        layerwise = any(s[1] != s[2] for step in steps for s in at[step])
        low = [min(s[1] for s in at[step]) for step in steps] if layerwise else None
        high = [max(s[2] for s in at[step]) for step in steps] if layerwise else None
        curves.append(ScaleCurve(label, steps, value, low, high))
    if not curves:
        raise NoData("its runs' telemetry has no loss_scale")
    return curves


# --------------------------------------------------------------------------------------------------------
# Choosing the runs
# --------------------------------------------------------------------------------------------------------


@dataclass
class Selection:
    """The runs a figure uses (empty with ``missing`` set when it cannot be made) and how many could have."""

    figure: str
    runs: tuple[RunInfo, ...] = ()
    candidates: int = 0
    missing: str | None = None


def _paper_rank(figure: str, run: RunInfo) -> tuple[int, int, int]:
    """Lower is better: the paper's model and dataset, the paper's model, the figure's experiment."""
    model, dataset = PAPER_SETTING[figure]
    return (
        0 if (run.model, run.dataset) == (model, dataset) else 1,
        0 if run.model == model else 1,
        0 if run.experiment == EXPERIMENT[figure] else 1,
    )


def _with_telemetry(runs: Sequence[RunInfo]) -> list[RunInfo]:
    return [r for r in runs if r.telemetry_path.is_file()]


def _none_found(what: str, pool: Sequence[RunInfo], figure: str) -> str:
    no_file = " (found some, but without telemetry.jsonl)" if pool else ""
    model, dataset = PAPER_SETTING[figure]
    paper = f"{MODEL_LABELS.get(model, model)} on {DATASET_LABELS.get(dataset, dataset)}"
    return f"no finished {what} with telemetry{no_file}; the paper's is {paper}: {HOW_TO_RUN[figure]}"


def select_fig1(runs: Sequence[RunInfo], figure: str = "fig1a") -> Selection:
    """The FP32 detection run, those recording the expected loss scale first."""
    pool = [r for r in runs if r.is_detection and r.precision == "fp32"]
    found = _with_telemetry(pool)
    if not found:
        return Selection(figure, missing=_none_found("FP32 detection run", pool, figure))

    def rank(item: tuple[int, RunInfo]) -> tuple[Any, ...]:
        i, r = item
        expected = r.cfg("telemetry.expected_loss_scale") is True
        return (0 if expected else 1, *_paper_rank(figure, r), i)

    best = min(enumerate(found), key=rank)[1]
    return Selection(figure, runs=(best,), candidates=len(found))


def select_fig4a(runs: Sequence[RunInfo]) -> Selection:
    """The adaptive-scaling classification run."""
    pool = [r for r in runs if not r.is_detection and r.scaler == "adaptive"]
    found = _with_telemetry(pool)
    if not found:
        return Selection("fig4a", missing=_none_found("adaptive-scaling classification run", pool, "fig4a"))
    best = min(enumerate(found), key=lambda item: (*_paper_rank("fig4a", item[1]), item[0]))[1]
    return Selection("fig4a", runs=(best,), candidates=len(found))


def select_fig4b(runs: Sequence[RunInfo]) -> Selection:
    """A fixed-scaling and an adaptive-scaling detection run of the same model, dataset and precision."""
    fixed = _with_telemetry([r for r in runs if r.is_detection and r.scaler == "fixed"])
    adaptive = _with_telemetry([r for r in runs if r.is_detection and r.scaler == "adaptive"])
    if not fixed or not adaptive:
        what = " and ".join(
            w
            for w, found in (
                ("fixed-scaling detection run", fixed),
                ("adaptive-scaling detection run", adaptive),
            )
            if not found
        )
        return Selection("fig4b", missing=_none_found(what, [], "fig4b"))
    order = {id(r): i for i, r in enumerate(runs)}
    pairs = [
        (f, a)
        for a in adaptive
        for f in fixed
        if (f.model, f.dataset, f.precision) == (a.model, a.dataset, a.precision)
    ]
    if not pairs:
        return Selection(
            "fig4b",
            missing="no fixed-scaling and adaptive-scaling detection runs of the same model, dataset and "
            f"precision; the paper's are SSD512 on VOC: {HOW_TO_RUN['fig4b']}",
        )

    def rank(pair: tuple[RunInfo, RunInfo]) -> tuple[Any, ...]:
        f, a = pair
        return (
            *_paper_rank("fig4b", a),
            0 if f.scale == FIG4B_FIXED_SCALE else 1,
            0 if f.experiment == EXPERIMENT["fig4b"] else 1,
            0 if f.batch_size == a.batch_size else 1,
            0 if f.seed == a.seed else 1,
            order[id(a)],
            order[id(f)],
        )

    best = min(pairs, key=rank)
    return Selection("fig4b", runs=best, candidates=len(pairs))


def select_all(runs: Sequence[RunInfo]) -> dict[str, Selection]:
    return {
        "fig1a": select_fig1(runs, "fig1a"),
        "fig1b": select_fig1(runs, "fig1b"),
        "fig4a": select_fig4a(runs),
        "fig4b": select_fig4b(runs),
    }


# --------------------------------------------------------------------------------------------------------
# Plotting
# --------------------------------------------------------------------------------------------------------


def short_layer(name: str) -> str:
    """A tick label: ``backbone.conv4_3`` -> ``conv4_3``, ``head.classification_head.module_list.2`` ->
    ``cls.2``, ``head.regression_head.module_list.2`` -> ``reg.2``; other names unchanged."""
    for prefix, short in (
        ("head.classification_head.module_list.", "cls."),
        ("head.regression_head.module_list.", "reg."),
        ("head.classification_head.", "cls."),
        ("head.regression_head.", "reg."),
        ("backbone.", ""),
        ("net.", ""),
    ):
        if name.startswith(prefix):
            name = short + name[len(prefix) :]
    return name


def _not_paper(figure: str, runs: Sequence[RunInfo]) -> str:
    model, dataset = PAPER_SETTING[figure]
    if all((r.model, r.dataset) == (model, dataset) for r in runs):
        return ""
    paper = f"{MODEL_LABELS.get(model, model)} on {DATASET_LABELS.get(dataset, dataset)}"
    return f"\n[not the paper's setting, which is {paper}]"


def plot_layers(
    layers: Sequence[str],
    curves: Sequence[tuple[str, Sequence[float]]],
    path: Path,
    title: str,
    ylabel: str,
    *,
    log2: bool = False,
    percent: bool = False,
    hline: tuple[float, str] | None = None,
) -> Path:
    """One curve (``(legend label, a value per layer)``) over the layer IDs; layer names as rotated tick
    labels. ``layers`` in plotting order (ID 0 first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    n = len(layers)
    fig, ax = plt.subplots(figsize=(max(10.0, 3.5 + 0.24 * n), 5.2), dpi=150)
    cmap = plt.get_cmap("viridis")
    x = list(range(n))
    for k, (label, values) in enumerate(curves):
        ys = [v * 100 if percent else v for v in values]
        if log2:
            ys = [v if v > 0 else math.nan for v in ys]
        color = cmap(0.9 * k / max(1, len(curves) - 1))
        ax.plot(x, ys, marker="o", markersize=3, linewidth=1.3, color=color, label=label)
    if hline is not None:
        ax.axhline(hline[0], color="black", linestyle="--", linewidth=1, label=hline[1])
    if log2:
        ax.set_yscale("log", base=2)
    stride = max(1, math.ceil(n / 60))
    ticks = x[::stride]
    ax.set_xticks(ticks)
    ax.set_xticklabels(
        # name, then ID: the IDs line up under the axis, the names hang below them
        [f"{short_layer(layers[i])} {i:>{len(str(n - 1))}}" for i in ticks],
        rotation=90,
        fontsize=7,
        family="monospace",
    )
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_xlabel(
        "layer and layer ID (0 = nearest the loss, in backpropagation order; "
        "higher IDs are closer to the input)"
    )
    ax.set_ylabel(ylabel)
    if percent:
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}%"))
    _finish(fig, ax, title, path)
    return path


def _finish(fig: Any, ax: Any, title: str, path: Path) -> None:
    """Grid, wrapped title, legend beside the axes; save and close."""
    import matplotlib.pyplot as plt

    ax.grid(True, which="major", alpha=0.3)
    width_chars = int((fig.get_figwidth() - 3.0) * 13)  # the axes' width at 10 pt, legend and labels aside
    ax.set_title(
        "\n".join(textwrap.fill(line, width_chars) for line in title.split("\n")), fontsize=10, loc="left"
    )
    handles, labels = ax.get_legend_handles_labels()
    labels = [textwrap.fill(label, 40) for label in labels]  # long configurations wrap, not widen the figure
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def plot_steps(curves: Sequence[ScaleCurve], path: Path, title: str, ylabel: str) -> Path:
    """One line per curve over the iterations (log2 axis), its ``low``-``high`` band shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10.0, 5.2), dpi=150)
    cmap = plt.get_cmap("viridis")
    for k, curve in enumerate(curves):
        color = cmap(0.9 * k / max(1, len(curves) - 1))
        ax.plot(
            curve.steps, curve.value, marker="o", markersize=3, linewidth=1.3, color=color, label=curve.label
        )
        if curve.low is not None and curve.high is not None:
            ax.fill_between(curve.steps, curve.low, curve.high, color=color, alpha=0.15, linewidth=0)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    _finish(fig, ax, title, path)
    return path


@dataclass
class Made:
    figure: str
    path: Path
    title: str
    runs: tuple[RunInfo, ...]
    steps: list[int]
    layers: int


def make_figure(selection: Selection, out: Path, iterations: int) -> Made:
    """Extract the data of ``selection.figure`` from its runs and plot it.

    Raises:
        NoData: if the runs' telemetry lacks what the figure needs.
    """
    figure, runs = selection.figure, selection.runs
    run = runs[0]
    fmt = str(run.cfg("telemetry.format", "fp16")).upper()
    who = f"{run.label()}, {run.method}, batch {run.batch_size} (run {run.name})"
    if figure == "fig1a":
        series = fig1a_data(run, iterations)
        title = f"Activation-gradient underflow rate per layer in {fmt}\n{who}"
        kwargs: dict[str, Any] = {"percent": True, "ylabel": f"elements flushed to zero in {fmt} (%)"}
    elif figure == "fig1b":
        series = fig1b_data(run, iterations)
        q = number(run.cfg("telemetry.quantile", 0.01)) or 0.01
        title = f"Expected loss scale per layer (1 / the {q:g}-quantile of non-zero |gradient|)\n{who}"
        kwargs = {"log2": True, "ylabel": "expected loss scale (log2 axis)"}
    elif figure == "fig4a":
        series = fig4a_data(run, iterations)
        title = f"Adaptive loss scale alpha per layer\n{who}"
        kwargs = {
            "log2": True,
            "ylabel": "loss scale alpha (log2 axis)",
            "hline": (FIG4B_FIXED_SCALE, f"fixed scale {fmt_num(FIG4B_FIXED_SCALE)}"),
        }
    else:
        fixed, adaptive = runs
        series = fig4b_data(fixed, adaptive, iterations)
        scale = fmt_num(fixed.scale) if fixed.scale is not None else "?"
        title = (
            f"Underflow rate per layer: fixed loss scale {scale} minus adaptive loss scaling "
            f"({fixed.precision.upper()})\n{adaptive.label()}, batch {adaptive.batch_size} "
            f"(runs {fixed.name} and {adaptive.name})"
        )
        kwargs = {"percent": True, "ylabel": "fixed − adaptive underflow rate (percentage points)"}
        kwargs["hline"] = (0.0, "no difference")
    title += _not_paper(figure, runs)
    curves = [(f"iteration {step:,}", series.values[step]) for step in series.steps]
    path = plot_layers(series.layers, curves, out / f"{figure}.png", title, **kwargs)
    return Made(figure, path, title, runs, series.steps, len(series.layers))


@dataclass
class SweepMade:
    """A sweep figure written: ``kind`` is ``underflow`` or ``loss_scale``."""

    path: Path
    kind: str
    title: str
    group: SweepGroup
    configurations: list[str]


def make_sweep_figures(group: SweepGroup, out: Path) -> list[SweepMade]:
    """The underflow and loss-scale figures of one sweep group (each skipped, with the reason raised as
    :class:`NoData` when neither can be drawn).

    Raises:
        NoData: if the runs' telemetry has neither per-layer underflow nor a loss scale.
    """
    first = group.runs[0]
    fmt = str(first.cfg("telemetry.format", "fp16")).upper()
    n = len(group.runs)
    who = f"{first.label()}, sweep {group.sweep} ({n} run{'s' if n != 1 else ''})"
    made: list[SweepMade] = []
    reasons = []
    try:
        layers, curves = sweep_underflow_data(group)
    except NoData as why:
        reasons.append(str(why))
    else:
        title = (
            f"Activation-gradient underflow rate per layer at the last iteration (in {fmt})\n{who}; each "
            "curve is a configuration, the mean over its runs"
        )
        path = plot_layers(
            layers, list(curves.items()), out / "sweeps" / f"{group.stem}_underflow.png", title,
            f"elements flushed to zero in {fmt} (%)", percent=True,
        )  # fmt: skip
        made.append(SweepMade(path, "underflow", title, group, list(curves)))
    try:
        scales = sweep_scale_data(group)
    except NoData as why:
        reasons.append(str(why))
    else:
        title = (
            f"Loss scale over the iterations\n{who}; each curve is a configuration, the geometric mean over "
            "its runs (layer-wise scalers: over layers too, shaded from the smallest to the largest)"
        )
        path = plot_steps(
            scales, out / "sweeps" / f"{group.stem}_loss_scale.png", title, "loss scale (log2 axis)"
        )
        made.append(SweepMade(path, "loss_scale", title, group, [c.label for c in scales]))
    if not made:
        raise NoData("; ".join(reasons))
    return made


# --------------------------------------------------------------------------------------------------------
# Index, W&B, command line
# --------------------------------------------------------------------------------------------------------


def write_index(
    out: Path, made: Sequence[Made], skipped: Mapping[str, str], sweep_made: Sequence[SweepMade] = ()
) -> None:
    """``figures.md`` (for people) and ``figures.json`` (for scripts): each figure, its runs and steps."""
    parts = ["# Figures"]
    if made:
        rows = [
            [
                f"[{m.figure}]({m.path.name})",
                "<br>".join(r.describe() for r in m.runs),
                str(m.layers),
                ", ".join(f"{s:,}" for s in m.steps),
            ]
            for m in made
        ]
        parts.append(markdown_table(["figure", "runs", "layers", "iterations plotted"], rows, left=4))
    if sweep_made:
        rows = [
            [
                f"[{m.path.name}]({m.path.relative_to(out)})",
                m.group.sweep,
                f"{m.group.runs[0].label()}, {len(m.group.runs)} runs",
                "<br>".join(m.configurations),
            ]
            for m in sweep_made
        ]
        table = markdown_table(["figure", "sweep", "runs", "configurations"], rows, left=4)
        parts.append("## Sweep figures\n\n" + table)
    if skipped:
        reasons = "\n".join(f"- {fig}: {why}" for fig, why in skipped.items())
        parts.append("Paper figures skipped:\n\n" + reasons)
    text = "\n\n".join(parts)
    (out / "figures.md").write_text(text + "\n", encoding="utf-8")
    index = {
        "figures": {
            m.figure: {
                "file": m.path.name,
                "title": m.title,
                "runs": [str(r.path) for r in m.runs],
                "iterations": m.steps,
                "layers": m.layers,
            }
            for m in made
        },
        "skipped": dict(skipped),
        "sweep_figures": {
            str(m.path.relative_to(out)): {
                "kind": m.kind,
                "sweep": m.group.sweep,
                "model": m.group.model,
                "dataset": m.group.dataset,
                "title": m.title,
                "runs": [str(r.path) for r in m.group.runs],
                "configurations": m.configurations,
            }
            for m in sweep_made
        },
    }
    (out / "figures.json").write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")


def log_to_wandb(made: Sequence[Made], out: Path, sweep_made: Sequence[SweepMade] = ()) -> None:
    """Log each PNG as a ``wandb.Image`` to one W&B run; any failure prints one warning."""
    try:
        import wandb

        used = [r for m in made for r in m.runs] + [r for m in sweep_made for r in m.group.runs]
        projects = (r.cfg("logger.wandb.project") or r.cfg("logger.project") for r in used)
        project = str(next((p for p in projects if p), "adaloss"))
        images = {m.figure: (m.path, m.title) for m in made}
        images.update({f"sweep/{m.path.stem}": (m.path, m.title) for m in sweep_made})
        run = wandb.init(
            project=project,
            job_type="figures",
            name="figures",
            mode=os.environ.get("WANDB_MODE", "offline"),
            dir=str(out),
            config={m.figure: [str(r.path) for r in m.runs] for m in made},
        )
        run.log({key: wandb.Image(str(path), caption=title) for key, (path, title) in images.items()})
        run.finish()
        print(f"W&B: logged {len(images)} figures to project {project}")
    except Exception as error:  # noqa: BLE001 - the PNGs are written; W&B is optional
        print(f"warning: W&B logging failed ({type(error).__name__}: {error})", file=sys.stderr)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="make_figures.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("folders", nargs="+", help="folders to search for finished runs (metrics.json)")
    p.add_argument("--out", default="results/figures", help="where the PNGs go (default: results/figures)")
    p.add_argument(
        "--iterations",
        type=int,
        default=DEFAULT_ITERATIONS,
        help="how many iterations (spread over the run) each paper figure draws as curves; "
        f"default {DEFAULT_ITERATIONS}",
    )
    p.add_argument(
        "--all", action="store_true", help="say for every paper figure not made what its runs would be"
    )
    p.add_argument(
        "--wandb", action="store_true", help="also log the PNGs to W&B (offline unless WANDB_MODE)"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (0 if at least one figure was written, else 2)."""
    args = parse_args(argv)
    try:
        return _main(args)
    except ReportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _paper_figures(runs: Sequence[RunInfo], out: Path, iterations: int) -> tuple[list[Made], dict[str, str]]:
    made: list[Made] = []
    skipped: dict[str, str] = {}
    for figure, selection in select_all(runs).items():
        if selection.missing:
            skipped[figure] = selection.missing
            continue
        try:
            m = make_figure(selection, out, iterations)
        except NoData as why:
            skipped[figure] = f"{why}: {'; '.join(str(r.path) for r in selection.runs)}"
            continue
        made.append(m)
        others = f" (chosen among {selection.candidates})" if selection.candidates > 1 else ""
        print(f"{figure}: {m.path}{others}")
        for r in m.runs:
            print(f"    {r.describe()}")
    return made, skipped


def _main(args: argparse.Namespace) -> int:
    runs, records = read_runs(args.folders)
    if records.unfinished:
        print(
            f"{len(records.unfinished)} unfinished run folders (no metrics.json) passed over",
            file=sys.stderr,
        )
    if not runs:
        raise ReportError(f"no finished run (metrics.json with a config) in {', '.join(args.folders)}")
    out = Path(args.out)
    made, skipped = _paper_figures(runs, out, args.iterations)
    if made or args.all:
        for figure, why in skipped.items():
            print(f"{figure} skipped: {why}", file=sys.stderr)
    elif skipped:
        print(
            f"paper figures not made ({', '.join(skipped)}): their runs are not among these "
            "(--all says what each needs)",
            file=sys.stderr,
        )
    sweep_made: list[SweepMade] = []
    for group in sweep_groups(runs):
        try:
            sweep_made += make_sweep_figures(group, out)
        except NoData as why:
            print(
                f"sweep figures skipped: {group.sweep} ({group.model}, {group.dataset}): {why}",
                file=sys.stderr,
            )
    for m in sweep_made:
        print(f"sweep {m.group.sweep}: {m.path}")
    if not made and not sweep_made:
        with_telemetry = sum(r.telemetry_path.is_file() for r in runs)
        raise ReportError(
            f"no figure could be made from the {len(runs)} finished runs in {', '.join(args.folders)} "
            f"({with_telemetry} with telemetry.jsonl; see the lines above)"
        )
    write_index(out, made, skipped, sweep_made)
    print(f"index: {out / 'figures.md'}")
    if args.wandb:
        log_to_wandb(made, out, sweep_made)
    return 0
