"""The FP8 scaling-recipes lab: loss scalers crossed with gradient quantizers, against FP32 and BF16.

    python scripts/fp8_lab.py                 # every cell, 5 seeds (make fp8-lab), then the table and figures
    python scripts/fp8_lab.py --report-only   # rebuild the table and figures from the finished runs
    python scripts/fp8_lab.py --smoke --out /tmp/fp8   # seconds: two tiny runs per cell of a few cells

Two tasks (``--models``): the tiny GPT on the standard-library corpus (``model=gpt dataset=pystdlib``, final
validation loss, lower is better) and ResNet-20 on digits (``model=resnet20 dataset=digits``, test accuracy
in %, higher is better). For each, the cells are FP32, BF16 and, for gradients stored in E5M2 and in E4M3
(``precision=fp8_e5m2``, ``fp8_e4m3``), every loss scaler in {none, dynamic, adaptive} crossed with every
gradient quantizer in {global (``precision.grad_scaling=none``: the loss scale only), tensor_current,
tensor_delayed, mx_block with ceil rounding}. Each run is short (:data:`MODELS` lists the overrides; the
docs page states them) and runs in this process through ``adaloss.engine.train``, so torch starts once.

Every finished run appends one line to ``<out>/runs_<model>.jsonl``; a later call skips the runs it finds
there (resumable; the two models can run in two processes at once). A file made with other run settings is
an ``error:`` line, as its rows would not be comparable. Run folders go to ``--runs-dir`` (not committed).

The report (``<out>/fp8_lab.md``, ``.csv``, ``.json``, ``<out>/fp8_gap.png``, ``<out>/fp8_layers.png``):
each cell's final metric minus FP32's with the same seed (the runs pair by seed: same initial weights, same
data order), its mean and 95% t-interval over the seeds; the effect of each loss scaler against none under
the same quantizer (paired by seed, the paper's question: does a scale on top of the quantizer's help?); and
the per-layer activation-gradient underflow and saturation rates of the last training step (mean over seeds).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("ADALOSS_ROOT", str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _common import header_line, machine_info  # noqa: E402

#: Overrides every run gets: the CPU, no logger or bar, no checkpoints, a diverged run recorded (not raised),
#: telemetry on the first and the last step only.
COMMON = [
    "device=cpu",
    "logger=none",
    "trainer.progress_bar=false",
    "trainer.checkpoint_every=null",
    "trainer.on_divergence=record",
    "telemetry.every=100000",
]


@dataclass(frozen=True)
class Model:
    """One task of the lab: its overrides (full and ``--smoke``), its metric and that metric's direction."""

    label: str
    metric: str
    unit: str
    higher_is_better: bool
    overrides: tuple[str, ...]
    smoke: tuple[str, ...]


MODELS = {
    "gpt": Model(
        "tiny GPT, pystdlib",
        "val_loss",
        "validation loss",
        False,
        # 40 of the 400-step recipe (the cosine schedule squeezed to fit), batch 16, 128 validation windows;
        # adaptive betas every 10 steps
        ("model=gpt", "dataset=pystdlib", "trainer.max_steps=40", "trainer.eval_every=40")
        + ("trainer.batch_size=16", "dataset.val_windows=128", "adaptive_recipe.update_every=10"),
        ("model=gpt", "dataset=pystdlib", "trainer.max_steps=2", "trainer.eval_every=2", "model.n_layer=1")
        + ("trainer.batch_size=4", "dataset.val_windows=8", "adaptive_recipe.update_every=1"),
    ),
    "resnet20": Model(
        "ResNet-20, digits",
        "test_accuracy",
        "test accuracy (%)",
        True,
        # 16x16 images, batch 32, 60 of the 200-step recipe (lr steps squeezed); adaptive every 3 (digits')
        ("model=resnet20", "dataset=digits", "dataset.image_size=16", "trainer.batch_size=32")
        + ("trainer.max_steps=60", "trainer.eval_every=60"),
        ("model=resnet20", "dataset=digits", "dataset.image_size=8", "trainer.batch_size=4")
        + ("trainer.max_steps=2", "trainer.eval_every=2", "adaptive_recipe.update_every=1"),
    ),
}
FORMATS = {"fp8_e5m2": "E5M2", "fp8_e4m3": "E4M3"}
SCALERS = ("none", "dynamic", "adaptive")
#: Quantizer label -> ``precision.grad_scaling``.
QUANTIZERS = {
    "global": "none",
    "tensor_current": "tensor_current",
    "tensor_delayed": "tensor_delayed",
    "mx_block_ceil": "{name:mx_block,rounding:ceil}",
}
#: The cells ``--smoke`` runs (every code path: both baselines, a quantizer with state, MX, every scaler).
SMOKE_CELLS = (
    "fp32",
    "bf16",
    "E4M3/none/global",
    "E4M3/adaptive/mx_block_ceil",
    "E5M2/dynamic/tensor_delayed",
)


@dataclass(frozen=True)
class Cell:
    """One column of the lab: ``name`` (``fp32``, ``bf16`` or ``<format>/<scaler>/<quantizer>``)."""

    name: str
    overrides: tuple[str, ...]
    fmt: str = ""
    scaler: str = ""
    quantizer: str = ""


def all_cells() -> list[Cell]:
    """FP32, BF16, then format x scaler x quantizer."""
    cells = [Cell("fp32", ("precision=fp32", "scaler=none")), Cell("bf16", ("precision=bf16", "scaler=none"))]
    for precision, fmt in FORMATS.items():
        for scaler in SCALERS:
            for label, recipe in QUANTIZERS.items():
                overrides = (f"precision={precision}", f"scaler={scaler}", f"precision.grad_scaling={recipe}")
                cells.append(Cell(f"{fmt}/{scaler}/{label}", overrides, fmt, scaler, label))
    return cells


def settings_digest(model: str, smoke: bool) -> str:
    """What makes two runs of a cell comparable: the overrides every run of ``model`` gets."""
    spec = MODELS[model]
    text = json.dumps([*COMMON, *(spec.smoke if smoke else spec.overrides)])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------------------------- running


def compose_run(model: str, cell: Cell, seed: int, smoke: bool, runs_dir: Path):  # noqa: ANN201 - DictConfig
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    spec = MODELS[model]
    overrides = [*COMMON, *(spec.smoke if smoke else spec.overrides), *cell.overrides, f"seed={seed}"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(runs_dir / model / f"{cell.name.replace('/', '_')}_seed{seed}")
    return cfg


def run_one(model: str, cell: Cell, seed: int, smoke: bool, runs_dir: Path) -> dict[str, Any]:
    """Train one run in this process; the row the report reads."""
    from adaloss.engine import train

    cfg = compose_run(model, cell, seed, smoke, runs_dir)
    shutil.rmtree(cfg.paths.output_dir, ignore_errors=True)  # an unfinished earlier attempt
    began = time.perf_counter()
    metrics = train(cfg)
    value = metrics.get(MODELS[model].metric)
    return {
        "model": model,
        "cell": cell.name,
        "seed": seed,
        "settings": settings_digest(model, smoke),
        "value": None if value is None or not math.isfinite(value) else float(value),
        "diverged": bool(metrics["diverged"]),
        "steps": metrics["steps"],
        "skipped_steps": metrics["skipped_steps"],
        "underflow_rate": metrics.get("underflow_rate", {}),
        "saturation_rate": metrics.get("saturation_rate", {}),
        "sqnr_db": metrics.get("sqnr_db", {}),
        "wall_time_s": round(time.perf_counter() - began, 2),
    }


def read_rows(path: Path, digest: str) -> list[dict[str, Any]]:
    """The finished runs in ``path`` (none if it does not exist); an ``error:`` line if they were made with
    other settings or the file is not a runs file."""
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            row = json.loads(line)
            made_with = row["settings"]
        except (ValueError, KeyError, TypeError):
            raise SystemExit(
                f"error: {path}:{number} is not a run of scripts/fp8_lab.py; remove it"
            ) from None
        if made_with != digest:
            raise SystemExit(
                f"error: {path} holds runs made with other settings ({made_with}, now {digest}): remove it "
                "or give another --out"
            )
        rows.append(row)
    return rows


def run_all(models: list[str], cells: list[Cell], seeds: list[int], args: argparse.Namespace) -> None:
    """Every (model, cell, seed) not yet in its model's runs file, appended as each finishes; seed by seed,
    so a lab stopped early holds whole seeds of every cell."""
    paths = {m: args.out / f"runs_{m}.jsonl" for m in models}
    done = {
        (m, r["cell"], r["seed"]) for m in models for r in read_rows(paths[m], settings_digest(m, args.smoke))
    }
    todo = [(m, c, s) for s in seeds for m in models for c in cells if (m, c.name, s) not in done]
    print(f"[fp8_lab] {len(done)} runs found, {len(todo)} to run", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for number, (model, cell, seed) in enumerate(todo, 1):
        row = run_one(model, cell, seed, args.smoke, args.runs_dir)
        with open(paths[model], "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"[fp8_lab] {number}/{len(todo)} {model} {cell.name} seed {seed}: {row['value']} "
            f"({row['wall_time_s']:.1f} s)",
            flush=True,
        )


# ------------------------------------------------------------------------------------------- statistics


def t_interval(values: list[float]) -> tuple[float, float, int]:
    """``(mean, half-width of the two-sided 95% t-interval, n)``: ``t(0.975, n-1) * s / sqrt(n)`` with ``s``
    the sample standard deviation; the half-width is NaN below two values, everything NaN for none."""
    from scipy.stats import t

    n = len(values)
    if n == 0:
        return math.nan, math.nan, 0
    mean = statistics.fmean(values)
    if n < 2:
        return mean, math.nan, 1
    return mean, float(t.ppf(0.975, n - 1)) * statistics.stdev(values) / math.sqrt(n), n


def paired_differences(rows: list[dict], cell: str, baseline: str) -> list[float]:
    """``value(cell) - value(baseline)`` for each seed where both runs finished with a finite value."""
    base = {r["seed"]: r["value"] for r in rows if r["cell"] == baseline and r["value"] is not None}
    return [
        r["value"] - base[r["seed"]]
        for r in sorted(rows, key=lambda r: r["seed"])
        if r["cell"] == cell and r["value"] is not None and r["seed"] in base
    ]


def per_layer(rows: list[dict], key: str) -> dict[str, float]:
    """Each layer's ``key`` rate (last training step) averaged over the runs that report it."""
    sums: dict[str, list[float]] = {}
    for row in rows:
        for layer, rate in (row.get(key) or {}).items():
            if rate is not None and math.isfinite(rate):
                sums.setdefault(layer, []).append(rate)
    return {layer: statistics.fmean(v) for layer, v in sums.items()}


def common_layers(rows: list[dict], model: str) -> set[str]:
    """The layers every FP8 run of ``model`` reports. The adaptive scaler's runs also measure the attention
    products it scales (``attn.scores``, ``attn.values``: ``scaler.product_betas``), which the other
    scalers' runs do not, so only the common layers make the cells' mean and worst layer comparable."""
    sets = [set(r["underflow_rate"]) for r in rows if r["model"] == model and "/" in r["cell"]]
    return set.intersection(*sets) if sets else set()


def summarize(rows: list[dict], model: str, cell: Cell, layers: set[str] | None = None) -> dict[str, Any]:
    """One row of the main table: the metric over seeds, its gap to FP32 with the CI, the per-layer rates
    (the table's mean and worst layer over ``layers``, default all; every layer in the ``*_by_layer``)."""
    mine = [r for r in rows if r["model"] == model and r["cell"] == cell.name]
    values = [r["value"] for r in mine if r["value"] is not None]
    gap, half, n = t_interval(paired_differences([r for r in rows if r["model"] == model], cell.name, "fp32"))
    fp8 = bool(cell.fmt)  # FP32's and BF16's underflow is of another format: not shown beside FP8's
    by_layer = {k: per_layer(mine, k) if fp8 else {} for k in ("underflow_rate", "saturation_rate")}
    underflow, saturation = (
        {n: v for n, v in by_layer[k].items() if layers is None or n in layers}
        for k in ("underflow_rate", "saturation_rate")
    )
    return {
        "model": model,
        "cell": cell.name,
        "format": cell.fmt or cell.name,
        "scaler": cell.scaler,
        "quantizer": cell.quantizer,
        "seeds": len(mine),
        "diverged": sum(r["diverged"] for r in mine),
        "mean": statistics.fmean(values) if values else math.nan,
        "sd": statistics.stdev(values) if len(values) > 1 else math.nan,
        "gap": gap if cell.name != "fp32" else 0.0,
        "gap_ci": half if cell.name != "fp32" else 0.0,
        "pairs": n,
        "separated": cell.name != "fp32" and math.isfinite(half) and abs(gap) > half,
        "skipped_steps": statistics.fmean(r["skipped_steps"] for r in mine) if mine else math.nan,
        "underflow_mean": statistics.fmean(underflow.values()) if underflow else math.nan,
        "underflow_max": max(underflow.values(), default=math.nan),
        "underflow_max_layer": max(underflow, key=underflow.get, default=""),
        "saturation_mean": statistics.fmean(saturation.values()) if saturation else math.nan,
        "saturation_max": max(saturation.values(), default=math.nan),
        "saturation_max_layer": max(saturation, key=saturation.get, default=""),
        "underflow_by_layer": by_layer["underflow_rate"],
        "saturation_by_layer": by_layer["saturation_rate"],
    }


def scaler_effects(rows: list[dict], model: str) -> list[dict[str, Any]]:
    """Per format and quantizer: dynamic - none, adaptive - none, adaptive - dynamic, paired by seed."""
    mine = [r for r in rows if r["model"] == model]
    out = []
    for fmt in FORMATS.values():
        for quantizer in QUANTIZERS:
            for a, b in (("dynamic", "none"), ("adaptive", "none"), ("adaptive", "dynamic")):
                cell_a, cell_b = f"{fmt}/{a}/{quantizer}", f"{fmt}/{b}/{quantizer}"
                diff, half, n = t_interval(paired_differences(mine, cell_a, cell_b))
                if n == 0:
                    continue
                separated = math.isfinite(half) and abs(diff) > half
                out.append(
                    {"model": model, "format": fmt, "quantizer": quantizer, "contrast": f"{a} - {b}"}
                    | {"diff": diff, "ci": half, "pairs": n, "separated": separated}
                )
    return out


# ---------------------------------------------------------------------------------------------- the report


def _num(x: float, digits: int) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _pct(x: float) -> str:
    return "—" if not math.isfinite(x) else f"{100 * x:.2f}"


def _gap(row: dict[str, Any], digits: int) -> str:
    if row["cell"] == "fp32":
        return "(baseline)"
    if not math.isfinite(row["gap"]):
        return "—"
    mark = "" if row["separated"] else " ~"
    return f"{row['gap']:+.{digits}f} ± {_num(row['gap_ci'], digits)}{mark}"


def main_table(summary: list[dict[str, Any]], model: str) -> str:
    """The Markdown table of one model: metric, gap to FP32 (95% CI), divergences, per-layer rates."""
    spec, digits = MODELS[model], 3 if model == "gpt" else 2
    lines = [
        f"| cell | seeds | {spec.unit} | gap to FP32, 95% CI | diverged | skipped steps "
        "| underflow: mean / worst layer (%) | saturation: mean / worst layer (%) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in (r for r in summary if r["model"] == model):
        worst_uf = f" ({row['underflow_max_layer']})" if row["underflow_max_layer"] else ""
        worst_sat = f" ({row['saturation_max_layer']})" if row["saturation_max"] > 0 else ""
        lines.append(
            f"| {row['cell']} | {row['seeds']} | {_num(row['mean'], digits)} ± {_num(row['sd'], digits)} "
            f"| {_gap(row, digits)} | {row['diverged']} | {_num(row['skipped_steps'], 1)} "
            f"| {_pct(row['underflow_mean'])} / {_pct(row['underflow_max'])}{worst_uf} "
            f"| {_pct(row['saturation_mean'])} / {_pct(row['saturation_max'])}{worst_sat} |"
        )
    return "\n".join(lines)


def effects_table(effects: list[dict[str, Any]], model: str) -> str:
    """Scaler contrasts under each quantizer, one row per format and quantizer."""
    digits = 3 if model == "gpt" else 2
    contrasts = ("dynamic - none", "adaptive - none", "adaptive - dynamic")
    lines = [
        f"| format | quantizer | {' | '.join(contrasts)} |",
        "| --- | --- | --- | --- | --- |",
    ]
    keys = dict.fromkeys((e["format"], e["quantizer"]) for e in effects if e["model"] == model)
    for fmt, quantizer in keys:
        cells = []
        for contrast in contrasts:
            found = [
                e
                for e in effects
                if (e["model"], e["format"], e["quantizer"], e["contrast"])
                == (model, fmt, quantizer, contrast)
            ]
            e = found[0] if found else None
            text = "—" if e is None else f"{e['diff']:+.{digits}f} ± {_num(e['ci'], digits)}"
            cells.append(text + ("" if e is None or e["separated"] else " ~"))
        lines.append(f"| {fmt} | {quantizer} | {' | '.join(cells)} |")
    return "\n".join(lines)


def report_markdown(summary: list[dict], effects: list[dict], models: list[str], info: dict) -> str:
    """The whole ``fp8_lab.md``: settings, then per model the main table and the scaler contrasts."""
    parts = [
        f"{header_line(info['machine'])}",
        "",
        "Gap to FP32: the cell's final metric minus FP32's with the same seed, mean over the seeds and the "
        "half-width of the two-sided 95% t-interval (t(0.975, n-1) s / sqrt(n)); `~` marks an interval that "
        "contains 0 (the table cannot tell the cell from FP32). Underflow and saturation: the share of each "
        "layer's activation-gradient elements flushed to zero / clamped at the format's largest value on the "
        "last training step, averaged over the seeds; mean over the layers and the worst layer, over the "
        "layers every FP8 cell measures (adaptive runs also measure the attention products they scale: those "
        "are in fp8_lab_layers.csv).",
    ]
    for model in models:
        spec = MODELS[model]
        better = "higher" if spec.higher_is_better else "lower"
        parts += [
            "",
            f"### {spec.label}: {spec.unit}, {better} is better",
            "",
            f"Run settings: `{' '.join(info['settings'][model])}`.",
            "",
            main_table(summary, model),
            "",
            f"Loss scalers under each quantizer ({spec.unit}, paired by seed, 95% CI; `~`: contains 0):",
            "",
            effects_table(effects, model),
        ]
    return "\n".join(parts) + "\n"


def write_csv(path: Path, summary: list[dict[str, Any]]) -> None:
    """One line per (model, cell): the table's numbers (per-layer rates in ``fp8_lab_layers.csv``)."""
    import csv

    keys = [k for k in summary[0] if not k.endswith("_by_layer")] if summary else []
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(summary)
    with open(path.with_name(path.stem + "_layers.csv"), "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "cell", "layer", "underflow_rate", "saturation_rate"])
        for row in summary:
            for layer, rate in row["underflow_by_layer"].items():
                writer.writerow(
                    [row["model"], row["cell"], layer, rate, row["saturation_by_layer"].get(layer)]
                )


def plot(summary: list[dict[str, Any]], models: list[str], out: Path) -> list[Path]:
    """``fp8_gap.png`` (each cell's gap to FP32 with its CI) and ``fp8_layers.png`` (per-layer underflow
    and saturation of every FP8 cell)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(
        zip(["", *QUANTIZERS], ["black", "tab:gray", "tab:blue", "tab:green", "tab:red"], strict=True)
    )
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 9), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = [r for r in summary if r["model"] == model and r["cell"] != "fp32"]
        for y, row in enumerate(rows):
            ci = row["gap_ci"] if math.isfinite(row["gap_ci"]) else 0.0
            ax.errorbar(row["gap"], y, xerr=ci, fmt="o", color=colors[row["quantizer"]], capsize=3)
        ax.axvline(0.0, color="black", lw=0.8)
        for label, color in colors.items():
            ax.plot([], [], "o", color=color, label=label or "BF16")
        ax.legend(fontsize=8, loc="best")
        ax.set_yticks(range(len(rows)), [r["cell"] for r in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"{MODELS[model].unit} minus FP32's (same seed), 95% CI")
        ax.set_title(MODELS[model].label)
    fig.tight_layout()
    paths = [out / "fp8_gap.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(2, len(models), figsize=(7 * len(models), 12), squeeze=False)
    for col, model in enumerate(models):
        rows = [r for r in summary if r["model"] == model and r["underflow_by_layer"]]
        layers = list(rows[0]["underflow_by_layer"]) if rows else []
        for ax, key, name in zip(
            axes[:, col], ("underflow", "saturation"), ("underflow", "saturation"), strict=True
        ):
            grid = [[100 * r[f"{key}_by_layer"].get(layer, math.nan) for layer in layers] for r in rows]
            image = ax.imshow(grid or [[math.nan]], aspect="auto", cmap="viridis")
            ax.set_yticks(range(len(rows)), [r["cell"] for r in rows], fontsize=7)
            ax.set_xticks(range(len(layers)), layers, rotation=90, fontsize=6)
            ax.set_title(f"{MODELS[model].label}: {name} rate per layer (%), last step")
            fig.colorbar(image, ax=ax)
    fig.tight_layout()
    paths.append(out / "fp8_layers.png")
    fig.savefig(paths[1], dpi=90)
    plt.close(fig)
    return paths


#: The region of docs/fp8.md this script fills with the report.
DOCS_BEGIN, DOCS_END = "<!-- fp8-lab: table -->\n", "<!-- end fp8-lab: table -->"


def fill_docs(page: Path, markdown: str, figures: list[Path]) -> None:
    """Put the report into ``page``'s fp8-lab region and copy the figures to ``docs/assets/fp8/``."""
    text = page.read_text(encoding="utf-8")
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise SystemExit(f"error: {page} has no '{DOCS_BEGIN.strip()}' ... '{DOCS_END}' region to fill")
    head, rest = text.split(DOCS_BEGIN, 1)
    tail = rest.split(DOCS_END, 1)[1]
    page.write_text(f"{head}{DOCS_BEGIN}{markdown}{DOCS_END}{tail}", encoding="utf-8")
    assets = page.parent / "assets" / "fp8"
    assets.mkdir(parents=True, exist_ok=True)
    for figure in figures:
        shutil.copyfile(figure, assets / figure.name)


def report(models: list[str], args: argparse.Namespace) -> str:
    """Read every finished run of ``models`` and write the table (md, csv, json) and the figures."""
    cells = [c for c in all_cells() if not args.smoke or c.name in SMOKE_CELLS]
    rows = [
        r for m in models for r in read_rows(args.out / f"runs_{m}.jsonl", settings_digest(m, args.smoke))
    ]
    present = {(r["model"], r["cell"]) for r in rows}
    layers = {m: common_layers(rows, m) for m in models}
    summary = [summarize(rows, m, c, layers[m]) for m in models for c in cells if (m, c.name) in present]
    effects = [e for m in models for e in scaler_effects(rows, m)]
    info = {
        "machine": machine_info(),
        "settings": {m: [*COMMON, *(MODELS[m].smoke if args.smoke else MODELS[m].overrides)] for m in models},
        "cpu_seconds_of_runs": round(sum(r["wall_time_s"] for r in rows), 1),
    }
    markdown = report_markdown(summary, effects, models, info)
    (args.out / "fp8_lab.md").write_text(markdown, encoding="utf-8")
    write_csv(args.out / "fp8_lab.csv", summary)
    payload = {**info, "summary": summary, "scaler_effects": effects}
    (args.out / "fp8_lab.json").write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    figures = plot(summary, models, args.out)
    if args.docs is not None:
        fill_docs(args.docs, markdown, figures)
    return markdown


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated (default 0-4; --smoke: 0,1)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "fp8")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "outputs" / "fp8_lab", help="run folders")
    parser.add_argument("--smoke", action="store_true", help="tiny runs of a few cells (a test)")
    parser.add_argument("--report-only", action="store_true", help="no runs: the report of the finished ones")
    parser.add_argument("--docs", type=Path, default=None, help="also fill this page's fp8-lab region")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"error: unknown model(s) {', '.join(unknown)}: choose from {', '.join(MODELS)}")
    try:
        seeds = [
            int(s) for s in ("0,1" if args.smoke and args.seeds == "0,1,2,3,4" else args.seeds).split(",")
        ]
    except ValueError:
        raise SystemExit(f"error: --seeds must be comma-separated integers, got {args.seeds!r}") from None
    if not args.report_only:
        import torch

        torch.set_num_threads(1)
        cells = [c for c in all_cells() if not args.smoke or c.name in SMOKE_CELLS]
        run_all(models, cells, seeds, args)
    args.out.mkdir(parents=True, exist_ok=True)
    print(report(models, args))


if __name__ == "__main__":
    main()
