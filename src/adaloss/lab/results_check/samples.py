"""The result families the pages show, their records, and the samples ``make results-check`` reruns: for
each sample, where its committed numbers are and how to read them (no torch here: the parent process reads,
the child processes of :mod:`.reruns` train)."""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Keys of a run's row that measure the machine's speed, not the result: never compared.
TIMING_KEYS = frozenset({"wall_time_s", "wall_seconds", "seconds", "machine", "wall time (s)"})


@dataclass(frozen=True)
class Family:
    """A committed result shown on a page: its folder (holding ``record.json``), page and command.
    ``rerun=False``: listed with its commit, not rerun (``why`` says why)."""

    key: str
    folder: str
    page: str
    command: str
    rerun: bool = True
    why: str = ""


@dataclass(frozen=True)
class Sample:
    """One committed cell rerun at its committed settings. ``kind`` names the rerun in :mod:`.reruns` and the
    reader below; ``headline``: the number compared within ``tolerance`` when the kernel paths differ
    (everything is compared bit for bit when they match); ``pinned``: rerun with the kernel path pinned
    (:func:`adaloss.runner.provenance.pin_kernel_path`), as its command does."""

    family: str
    name: str
    kind: str
    params: dict[str, Any]
    headline: str
    tolerance: float
    tier: str = "quick"
    pinned: bool = False
    threads: int = 1
    regenerate: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    f.key: f
    for f in (
        Family("fp8", "results/fp8", "docs/fp8.md", "make fp8-lab"),
        Family("fp4", "results/fp4", "docs/fp4.md", "python scripts/fp4_lab.py"),
        Family("root", "results/root", "docs/algorithm.md", "python scripts/root_scale.py"),
        Family("lm-tied", "results/lm/tied", "README.md", "python scripts/lm_runs.py --out results/lm/tied"),
        Family(
            "lm-untied",
            "results/lm/untied",
            "docs/language-models.md",
            "python scripts/lm_runs.py --out results/lm/untied model.tie_weights=false",
        ),
        Family(
            "lm-underflow",
            "results/lm/underflow",
            "docs/language-models.md",
            "python scripts/lm_underflow.py",
        ),
        Family(
            "attention-betas",
            "results/attention_betas",
            "docs/transform.md",
            "python scripts/attention_betas.py",
        ),
        Family("underflow", "results/underflow", "docs/precision.md", "python scripts/underflow_table.py"),
        Family("mini-tables", "results/mini/tables", "docs/reproducing.md", "make reproduce-mini"),
        Family("mini-claims", "results/mini/claims", "docs/reproducing.md", "make reproduce-claims"),
        Family(
            "mini-figures",
            "results/mini/figures",
            "docs/reproducing.md",
            "make reproduce-mini",
            rerun=False,
            why="images: their numbers are the mini tables' runs' telemetry, checked through the tables",
        ),
        Family("demo", "results/demo", "docs/index.md", "make demo"),
        Family(
            "bench",
            "results/bench",
            "docs/performance.md",
            "make bench",
            rerun=False,
            why="timings of one machine's load: listed, not rerun",
        ),
        Family(
            "gpu",
            "results/gpu",
            "docs/performance.md",
            "make gpu-check",
            rerun=False,
            why="a GPU we do not have here: listed, not rerun",
        ),
    )
}


def _fp8(model: str, cell: str, seed: int, tier: str = "quick", tol: float = 0.5, lab: str = "fp8") -> Sample:
    command = "scripts/fp8_lab.py" if lab == "fp8" else "scripts/fp4_lab.py"
    flags = f"--models {model} --seeds {seed}" + (f" --cells {cell}" if lab == "fp4" else "")
    return Sample(
        lab,
        f"{model} {cell} seed {seed}",
        "lab_run",
        {"lab": lab, "model": model, "cell": cell, "seed": seed},
        "value",
        tol,
        tier,
        regenerate=f"python {command} {flags} (resumable: remove the run's line first)",
    )


def _root(task: str, root: str, seed: int, tier: str = "quick", tol: float = 10.0) -> Sample:
    return Sample(
        "root",
        f"{task} root={root} seed {seed}",
        "root_run",
        {"task": task, "root": root, "seed": seed},
        "metric",
        tol,
        tier,
        regenerate=f"python scripts/root_scale.py --tasks {task} --seeds {seed}",
    )


def _lm(folder: str, variant: str, seed: int, tier: str) -> Sample:
    return Sample(
        f"lm-{folder}",
        f"{variant} seed {seed}",
        "lm_run",
        {"folder": folder, "variant": variant, "seed": seed},
        "val_loss",
        0.1,
        tier,
        regenerate=FAMILIES[f"lm-{folder}"].command + f" --seeds {seed} --variants {variant} --merge",
    )


#: Every sample, quick first. The quick ones are the cheapest committed cells (seconds each; ResNet-20's
#: adaptive FP8 cell is there because it is the cheapest run that evaluates an attached batch-norm model).
SAMPLES: tuple[Sample, ...] = (
    _fp8("gpt", "fp32", 0, tol=0.05),
    _fp8("resnet20", "E5M2/adaptive/global", 0, tol=15.0),
    _fp8("gpt", "bf16", 0, tol=0.05, lab="fp4"),
    _root("ssd", "fixed", 0, tol=2.0),
    _lm("tied", "adaptive", 0, "quick"),
    Sample(
        "lm-underflow",
        "every cell (seed 0, 400 FP32 steps)",
        "script_json",
        {
            "script": "scripts/lm_underflow.py",
            "args": ["--out", "{out}"],
            "file": "underflow.json",
            "keys": ["training", "results"],
        },
        "",
        0.0,
        "quick",
        regenerate="python scripts/lm_underflow.py",
    ),
    Sample(
        "attention-betas",
        "every cell (the trained decoder, both rules)",
        "script_csv",
        {"script": "scripts/attention_betas.py", "args": ["--out", "{out}"]},
        "",
        0.0,
        "full",
        regenerate="python scripts/attention_betas.py",
    ),
    _fp8("gpt", "E4M3/adaptive/mx_block_ceil", 1, "full", tol=0.05),
    _fp8("resnet20", "fp32", 1, "full"),
    _root("resnet20", "adaptive", 0, "full", tol=15.0),
    _lm("untied", "fp32", 0, "full"),
    Sample(
        "underflow",
        "VGG without batch norm, every regime and scaler",
        "script_csv",
        {
            "script": "scripts/underflow_table.py",
            "args": ["--models", "vgg_nobn", "--out-dir", "{out}"],
            "only": "vgg_nobn_",
        },
        "",
        0.0,
        "full",
        regenerate="python scripts/underflow_table.py",
    ),
    Sample(
        "mini-tables",
        "Table 1, Adaptive (ResNet-20 on digits, seeds 0-2)",
        "mini_cell",
        {"table": "table1_cifar", "variant": "adaptive", "column": "Adaptive"},
        "Adaptive mean",
        5.0,
        "full",
        regenerate="python scripts/reproduce_mini.py --only table1_cifar (or train.py -m as its launch, "
        "variant=adaptive), then scripts/make_tables.py",
    ),
    Sample(
        "mini-claims",
        "FP32 on SSD512, gradients x 2^-12 (seeds 0-4)",
        "claims_cell",
        {"variant": "fp32", "launch": 0, "label": "FP32"},
        "",
        0.0,
        "full",
        regenerate="make reproduce-claims",
    ),
    Sample(
        "demo",
        "the fp32 row",
        "demo_row",
        {"label": "fp32"},
        "test acc (%)",
        5.0,
        "full",
        pinned=True,
        threads=2,
        regenerate="make demo",
    ),
)


def strip_timing(value: Any) -> Any:
    """``value`` without the keys that time the machine (:data:`TIMING_KEYS`), recursively."""
    if isinstance(value, dict):
        return {k: strip_timing(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, list):
        return [strip_timing(v) for v in value]
    return value


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def markdown_rows(text: str) -> dict[str, dict[str, str]]:
    """The rows of the first Markdown table in ``text``, by their first cell."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    if len(lines) < 3:
        return {}
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells, strict=False))
    return rows


def committed(sample: Sample, root: Path) -> Any:
    """The committed numbers of ``sample`` (what :func:`.reruns.rerun` gives for it), or raises
    ``LookupError`` naming what is missing."""
    p, folder = sample.params, root / FAMILIES[sample.family].folder
    if sample.kind == "lab_run":
        rows = [
            r
            for r in _jsonl(folder / f"runs_{p['model']}.jsonl")
            if (r["cell"], r["seed"]) == (p["cell"], p["seed"])
        ]
        return strip_timing(_one(rows, sample))
    if sample.kind == "root_run":
        runs = json.loads((folder / "root_scale.json").read_text(encoding="utf-8"))["runs"]
        return strip_timing(
            _one(
                [r for r in runs if (r["task"], r["root"], r["seed"]) == (p["task"], p["root"], p["seed"])],
                sample,
            )
        )
    if sample.kind == "lm_run":
        runs = json.loads((folder / "lm_runs.json").read_text(encoding="utf-8"))["runs"]
        return strip_timing(
            _one([r for r in runs if (r["variant"], r["seed"]) == (p["variant"], p["seed"])], sample)
        )
    if sample.kind == "script_json":
        data = json.loads((folder / p["file"]).read_text(encoding="utf-8"))
        return strip_timing({k: data[k] for k in p["keys"]})
    if sample.kind == "script_csv":
        return {f.name: read_csv(f) for f in sorted(folder.glob(f"{p.get('only', '')}*.csv"))}
    if sample.kind == "mini_cell":
        row = read_csv(folder / f"{p['table']}.csv")[0]
        return {k: v for k, v in row.items() if k.startswith(p["column"] + " ")}
    if sample.kind == "claims_cell":
        return claims_cells(json.loads((folder / "claims.json").read_text(encoding="utf-8")), p["label"])
    if sample.kind == "demo_row":
        rows = markdown_rows((folder / "table.md").read_text(encoding="utf-8"))
        return strip_timing(rows[p["label"]])
    raise LookupError(f"no reader for sample kind {sample.kind!r}")  # pragma: no cover - the table above


def _one(rows: list[dict[str, Any]], sample: Sample) -> dict[str, Any]:
    if len(rows) != 1:
        raise LookupError(f"{len(rows)} committed rows for {sample.family}: {sample.name} (expected 1)")
    return rows[0]


#: ``FP32 5.971 [5.724, 6.218] (n=5)`` in a claim's result: a method's label, then its cell.
_CLAIM_CELL = r"{label} (-?\d+\.\d+ \[-?\d+\.\d+, -?\d+\.\d+\] \(n=\d+[^)]*\)|diverged \(\d+ of \d+\))"


def claims_cells(claims: list[dict[str, Any]], label: str) -> dict[str, list[str]]:
    """Per task of ``claims.json``, every cell of the method ``label`` its claims quote (sorted, unique)."""
    out: dict[str, set[str]] = {}
    pattern = re.compile(_CLAIM_CELL.format(label=re.escape(label)))
    for claim in claims:
        out.setdefault(claim["task"], set()).update(pattern.findall(claim["result"]))
    return {task: sorted(cells) for task, cells in out.items() if cells}
