"""The paper's Figures 1 and 4 from the per-layer telemetry of finished runs.

    python scripts/make_figures.py results/sweeps/<time> [more folders ...] [--out results/figures] [--wandb]

**Input.** A run is a folder holding ``metrics.json`` (written last, so it marks a finished run; found with
``make_tables.read_folders``). Its ``config`` (the resolved config) says model, dataset, precision and scaler;
``.hydra/hydra.yaml`` (or ``.hydra/overrides.yaml``) says which experiment launched it. The curves come from
``<run>/telemetry.jsonl``: one JSON object per telemetry step, ``{"step": n, "underflow_rate": {layer: r},
"loss_scale": float or {layer: alpha}, "expected_loss_scale": {layer: s}}``, layers in network order.

**Figures** (PNG, in ``--out``; ``--iterations`` curves each, spread over the run, first and last included):

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

**Which runs.** Each figure takes the runs whose config fits (a detection run is an ``ssd*`` model or a
detection dataset). Among several, it prefers the paper's model and dataset (SSD512 on VOC, ResNet-18 on
ImageNet), then the runs of the figure's experiment, then (fig4b) the fixed scale 128 and pairs of equal
batch size and seed, then path order; it prints the runs it used. So the mini reproduction's runs (SSD512
at a small input size on ``shapes``, ResNet-20 or the MLP on ``digits``) make the figures too, and their
titles name the model, dataset and run, and say when the setting is not the paper's. A figure whose runs
are missing is skipped with one line on stderr saying what is missing. ``<out>/figures.md`` and
``<out>/figures.json`` list each figure and its source runs. Exit status 0 if at least one figure was
written, else 2 with an ``error:`` line.

``--wandb`` logs each PNG as a ``wandb.Image`` to a W&B run (offline unless ``WANDB_MODE`` says otherwise;
project from the runs' ``logger.wandb.project``). W&B failures print a warning; the PNGs are still written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402  (needs the path above)
import make_tables as mt  # noqa: E402

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
DETECTION_DATASETS = ("voc", "shapes", "coco")
NATIVE_IMAGE_SIZE = {"ssd300": 300, "ssd512": 512}
MODEL_LABELS = {**mt.MODEL_LABELS, "mlp": "MLP", "vgg_nobn": "VGG (no BN)"}
DATASET_LABELS = {**mt.DATASET_LABELS, "digits": "digits", "shapes": "shapes", "synthetic": "synthetic"}
DEFAULT_ITERATIONS = 6


class FiguresError(Exception):
    """Bad input (a missing folder, no finished run, no figure possible): ``error: ...``, exit status 2."""


class NoData(Exception):
    """The chosen runs' telemetry lacks what a figure plots; the message says what."""


# --------------------------------------------------------------------------------------------------------
# Reading runs
# --------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class RunInfo:
    """One finished run: where it is, what its config says, and (read on first use) its telemetry."""

    path: Path  # the run folder
    config: Mapping[str, Any]
    experiment: str | None = None
    _telemetry: list[dict[str, Any]] | None = field(default=None, repr=False)

    def _cfg(self, dotted: str, default: Any = None) -> Any:
        try:
            return mt._get(self.config, dotted)
        except mt.Skip:
            return default

    @property
    def model(self) -> str:
        return str(self._cfg("model.name", "?"))

    @property
    def dataset(self) -> str:
        return str(self._cfg("dataset.name", "?"))

    @property
    def precision(self) -> str:
        return str(self._cfg("precision.name", "?"))

    @property
    def scaler(self) -> str:
        return str(self._cfg("scaler.name", "?"))

    @property
    def scale(self) -> float | None:
        return mt._number(self._cfg("scaler.scale"))

    @property
    def batch_size(self) -> Any:
        return self._cfg("trainer.batch_size")

    @property
    def seed(self) -> Any:
        return self._cfg("seed")

    @property
    def name(self) -> str:
        return str(self._cfg("name") or self.path.name)

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
            return f"{precision}, fixed scale {_fmt_num(self.scale)}"
        return f"{precision}, {self.scaler} scaling"

    def label(self) -> str:
        """``SSD512 (128 px) on shapes``: model (input size when not the native one) and dataset."""
        model = MODEL_LABELS.get(self.model, self.model)
        size = self._cfg("model.image_size")
        native = NATIVE_IMAGE_SIZE.get(self.model)
        if native is not None and isinstance(size, int) and size != native:
            model += f" ({size} px)"
        return f"{model} on {DATASET_LABELS.get(self.dataset, self.dataset)}"

    def describe(self) -> str:
        """One line for the console and the index: setting, method, batch, seed and folder."""
        exp = f", experiment {self.experiment}" if self.experiment else ""
        return f"{self.label()}, {self.method}, batch {self.batch_size}, seed {self.seed}{exp} ({self.path})"


@dataclass
class _Records(mt.Collection):
    """``make_tables.read_folders`` with every record kept (not only the paper tables' runs)."""

    records: list[tuple[str, Mapping[str, Any]]] = field(default_factory=list)

    def add(self, record: Mapping[str, Any], source: str) -> None:
        self.records.append((source, record))


def _experiment_of(run_dir: Path, config: Mapping[str, Any]) -> str | None:
    """The experiment that launched the run: the config's ``experiment`` if it records one, else Hydra's
    ``runtime.choices.experiment`` in ``.hydra/hydra.yaml``, else ``experiment=`` in
    ``.hydra/overrides.yaml``."""
    if isinstance(config.get("experiment"), str):
        return config["experiment"]
    import yaml

    try:
        hydra = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text(encoding="utf-8"))
        choice = hydra["hydra"]["runtime"]["choices"].get("experiment")
        if choice:
            return str(choice)
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        pass
    try:
        overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    for item in overrides if isinstance(overrides, list) else ():
        key, _, value = str(item).lstrip("+~").partition("=")
        if key == "experiment" and value:
            return value
    return None


def read_runs(folders: Sequence[str | Path]) -> tuple[list[RunInfo], _Records]:
    """Every finished run under ``folders``, in path order.

    Raises:
        FiguresError: if a folder does not exist.
    """
    try:
        collection = mt.read_folders(folders, _Records())
    except mt.TablesError as error:
        raise FiguresError(str(error)) from None
    assert isinstance(collection, _Records)
    runs = []
    for source, record in collection.records:
        config = record.get("config")
        if not isinstance(config, Mapping):
            collection.skipped.append((source, "it has no config"))
            continue
        run_dir = Path(source).parent
        runs.append(RunInfo(path=run_dir, config=config, experiment=_experiment_of(run_dir, config)))
    return runs, collection


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
        number = mt._number(x)
        out[str(layer)] = number if number is not None else math.nan
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
        expected = r._cfg("telemetry.expected_loss_scale") is True
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


def _fmt_num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


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


def _step_label(step: int) -> str:
    return f"iteration {step:,}"


def plot_layers(
    series: LayerSeries,
    path: Path,
    title: str,
    ylabel: str,
    *,
    log2: bool = False,
    percent: bool = False,
    hline: tuple[float, str] | None = None,
) -> Path:
    """One curve per step over the layer IDs; layer names as rotated tick labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    n = len(series.layers)
    fig, ax = plt.subplots(figsize=(max(8.0, 3.5 + 0.24 * n), 5.2), dpi=150)
    cmap = plt.get_cmap("viridis")
    x = list(range(n))
    for k, step in enumerate(series.steps):
        ys = [v * 100 if percent else v for v in series.values[step]]
        if log2:
            ys = [v if v > 0 else math.nan for v in ys]
        color = cmap(0.9 * k / max(1, len(series.steps) - 1))
        ax.plot(x, ys, marker="o", markersize=3, linewidth=1.3, color=color, label=_step_label(step))
    if hline is not None:
        ax.axhline(hline[0], color="black", linestyle="--", linewidth=1, label=hline[1])
    if log2:
        ax.set_yscale("log", base=2)
    stride = max(1, math.ceil(n / 60))
    ticks = x[::stride]
    ax.set_xticks(ticks)
    ax.set_xticklabels(
        # name, then ID: the IDs line up under the axis, the names hang below them
        [f"{short_layer(series.layers[i])} {i:>{len(str(n - 1))}}" for i in ticks],
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
    ax.grid(True, which="major", alpha=0.3)
    width_chars = int((fig.get_figwidth() - 3.0) * 13)  # the axes' width at 10 pt, legend and labels aside
    ax.set_title(
        "\n".join(textwrap.fill(line, width_chars) for line in title.split("\n")), fontsize=10, loc="left"
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
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
    fmt = str(run._cfg("telemetry.format", "fp16")).upper()
    who = f"{run.label()}, {run.method}, batch {run.batch_size} (run {run.name})"
    if figure == "fig1a":
        series = fig1a_data(run, iterations)
        title = f"Activation-gradient underflow rate per layer in {fmt}\n{who}"
        kwargs: dict[str, Any] = {"percent": True, "ylabel": f"elements flushed to zero in {fmt} (%)"}
    elif figure == "fig1b":
        series = fig1b_data(run, iterations)
        q = mt._number(run._cfg("telemetry.quantile", 0.01)) or 0.01
        title = f"Expected loss scale per layer (1 / the {q:g}-quantile of non-zero |gradient|)\n{who}"
        kwargs = {"log2": True, "ylabel": "expected loss scale (log2 axis)"}
    elif figure == "fig4a":
        series = fig4a_data(run, iterations)
        title = f"Adaptive loss scale alpha per layer\n{who}"
        kwargs = {
            "log2": True,
            "ylabel": "loss scale alpha (log2 axis)",
            "hline": (FIG4B_FIXED_SCALE, f"fixed scale {_fmt_num(FIG4B_FIXED_SCALE)}"),
        }
    else:
        fixed, adaptive = runs
        series = fig4b_data(fixed, adaptive, iterations)
        scale = _fmt_num(fixed.scale) if fixed.scale is not None else "?"
        title = (
            f"Underflow rate per layer: fixed loss scale {scale} minus adaptive loss scaling "
            f"({fixed.precision.upper()})\n{adaptive.label()}, batch {adaptive.batch_size} "
            f"(runs {fixed.name} and {adaptive.name})"
        )
        kwargs = {"percent": True, "ylabel": "fixed − adaptive underflow rate (percentage points)"}
        kwargs["hline"] = (0.0, "no difference")
    title += _not_paper(figure, runs)
    path = plot_layers(series, out / f"{figure}.png", title, **kwargs)
    return Made(figure, path, title, runs, series.steps, len(series.layers))


# --------------------------------------------------------------------------------------------------------
# Index, W&B, command line
# --------------------------------------------------------------------------------------------------------


def write_index(out: Path, made: Sequence[Made], skipped: Mapping[str, str]) -> None:
    """``figures.md`` (for people) and ``figures.json`` (for scripts): each figure, its runs and steps."""
    rows = [
        [
            f"[{m.figure}]({m.path.name})",
            "<br>".join(r.describe() for r in m.runs),
            str(m.layers),
            ", ".join(f"{s:,}" for s in m.steps),
        ]
        for m in made
    ]
    text = "# Figures\n\n" + C.markdown_table(
        ["figure", "runs", "layers", "iterations plotted"], rows, left=4
    )
    if skipped:
        text += "\n\nSkipped:\n\n" + "\n".join(f"- {fig}: {why}" for fig, why in skipped.items())
    (out / "figures.md").write_text(text + "\n", encoding="utf-8")
    C.write_json(
        out / "figures.json",
        {
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
        },
    )


def log_to_wandb(made: Sequence[Made], out: Path) -> None:
    """Log each PNG as a ``wandb.Image`` to one W&B run; any failure prints one warning."""
    try:
        import wandb

        projects = (r._cfg("logger.wandb.project") or r._cfg("logger.project") for m in made for r in m.runs)
        project = str(next((p for p in projects if p), "adaloss"))
        run = wandb.init(
            project=project,
            job_type="figures",
            name="figures",
            mode=os.environ.get("WANDB_MODE", "offline"),
            dir=str(out),
            config={m.figure: [str(r.path) for r in m.runs] for m in made},
        )
        run.log({m.figure: wandb.Image(str(m.path), caption=m.title) for m in made})
        run.finish()
        print(f"W&B: logged {len(made)} figures to project {project}")
    except Exception as error:  # noqa: BLE001 - the PNGs are written; W&B is optional
        print(f"warning: W&B logging failed ({type(error).__name__}: {error})", file=sys.stderr)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("folders", nargs="+", help="folders to search for finished runs (metrics.json)")
    p.add_argument("--out", default=str(C.ROOT / "results" / "figures"), help="where the PNGs go")
    p.add_argument(
        "--iterations",
        type=int,
        default=DEFAULT_ITERATIONS,
        help="how many iterations (spread over the run) each figure draws as curves; "
        f"default {DEFAULT_ITERATIONS}",
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
    except FiguresError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    runs, collection = read_runs(args.folders)
    if collection.unfinished:
        print(
            f"{len(collection.unfinished)} unfinished run folders (no metrics.json) passed over",
            file=sys.stderr,
        )
    if not runs:
        raise FiguresError(f"no finished run (metrics.json with a config) in {', '.join(args.folders)}")
    out = Path(args.out)
    made: list[Made] = []
    skipped: dict[str, str] = {}
    for figure, selection in select_all(runs).items():
        if selection.missing:
            skipped[figure] = selection.missing
        else:
            try:
                m = make_figure(selection, out, args.iterations)
            except NoData as why:
                skipped[figure] = f"{why}: {'; '.join(str(r.path) for r in selection.runs)}"
            else:
                made.append(m)
                others = f" (chosen among {selection.candidates})" if selection.candidates > 1 else ""
                print(f"{figure}: {m.path}{others}")
                for r in m.runs:
                    print(f"    {r.describe()}")
        if figure in skipped:
            print(f"{figure} skipped: {skipped[figure]}", file=sys.stderr)
    if not made:
        raise FiguresError(
            f"no figure could be made from the {len(runs)} finished runs in {', '.join(args.folders)} "
            "(see the skipped lines above)"
        )
    write_index(out, made, skipped)
    print(f"index: {out / 'figures.md'}")
    if args.wandb:
        log_to_wandb(made, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
