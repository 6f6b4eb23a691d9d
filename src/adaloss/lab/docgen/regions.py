"""What fills each generated region (:data:`REGIONS`): a renderer per region, reading the committed result
files under a checkout's root."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path

from adaloss.lab.docgen.markdown import demote, escape_html, paragraphs

#: The mini reproduction's figures shown on the pages, copied to docs/assets/mini/.
MINI_FIGURES = ("fig1a", "fig1b", "fig4a", "fig4b")
FIGURE_ASSETS = Path("docs") / "assets" / "mini"


def _pct(value: float) -> str:
    return f"{value:.2%}"


def mini_tables(root: Path) -> str:
    """The five tables of ``make reproduce-mini``, as ``scripts/make_tables.py`` wrote them."""
    files = sorted((root / "results" / "mini" / "tables").glob("table[1-5]_*.md"))
    if len(files) != 5:
        raise SystemExit(f"error: expected 5 tables in results/mini/tables/, found {len(files)}")
    return "\n\n".join(paragraphs(demote(f.read_text(encoding="utf-8"), 2)) for f in files)


def mini_figures(root: Path) -> str:
    """One image per figure, its alt text the first line of the title make_figures.py gave it."""
    meta = json.loads((root / "results" / "mini" / "figures" / "figures.json").read_text(encoding="utf-8"))
    lines = []
    for name in MINI_FIGURES:
        title = meta["figures"][name]["title"].splitlines()[0]
        label = f"Figure {name[3:]}"
        src = f"{FIGURE_ASSETS.relative_to('docs').as_posix()}/{name}.png"
        lines.append(f"![{label}, mini reproduction: {title}]({src})")
    return "\n\n".join(lines)


def mini_claims(root: Path) -> str:
    """The claims table of ``make reproduce-mini``'s claims stage, as ``adaloss.lab.reports.claims`` wrote it
    (its title left out: the page has its own heading)."""
    text = (root / "results" / "mini" / "claims" / "claims.md").read_text(encoding="utf-8")
    return paragraphs(demote(escape_html(text.split("\n", 1)[1]), 2))


def root_scale(root: Path) -> str:
    """``results/root/root_scale.md`` as ``scripts/root_scale.py`` wrote it (the root-scale options)."""
    text = (root / "results" / "root" / "root_scale.md").read_text(encoding="utf-8")
    return paragraphs(escape_html(text))


def demo_table(root: Path) -> str:
    """``results/demo/table.md`` as ``make demo`` wrote it, after a line naming what made it (its
    ``record.json``: commit, command, kernel path)."""
    folder = root / "results" / "demo"
    record = json.loads((folder / "record.json").read_text(encoding="utf-8"))
    path = record["kernel_path"]
    made = (
        f"Made by `{record['command']}` at commit {record['commit']} on {record['cpu']} (torch "
        f"{record['torch']}), kernel path pinned: `{path['key']}`."
    )
    return made + "\n\n" + (folder / "table.md").read_text(encoding="utf-8").strip()


def lm_table(folder: str) -> Callable[[Path], str]:
    def render(root: Path) -> str:
        return paragraphs((root / "results" / "lm" / folder / "table.md").read_text(encoding="utf-8"))

    render.__doc__ = f"``results/lm/{folder}/table.md`` as ``scripts/lm_*.py`` wrote it."
    return render


def underflow_table(root: Path) -> str:
    """The table ``scripts/underflow_table.py`` wrote into ``results/underflow/underflow.json``."""
    data = json.loads((root / "results" / "underflow" / "underflow.json").read_text(encoding="utf-8"))
    return paragraphs(demote(escape_html(data["table_markdown"]), 1))


#: ``scripts/attention_betas.py``'s output layer (the tied projection), left out of its means.
ATTENTION_OUTPUT_LAYER = "wte"


def attention_betas(root: Path) -> str:
    """``scripts/attention_betas.py``'s summary, recomputed from its per-layer CSVs: for each regime, gradient
    format and rule, the mean underflow over all layers but the output, over the attention products, over
    the QKV projections, and how many layers the product betas made better or worse (off -> on)."""
    folder = root / "results" / "attention_betas"
    rows = [
        "| regime | gradients | rule | mean underflow, all layers but the output | attention products "
        "| QKV projection | layers better / worse |",
        "|:--|:--|:--|--:|--:|--:|--:|",
    ]
    for regime in ("init", "trained"):
        for fmt in ("fp16", "fp8_e5m2"):
            for rule in ("reference", "paper"):
                path = folder / f"{regime}_{fmt}_{rule}.csv"
                with open(path, newline="", encoding="utf-8") as f:
                    table = {
                        r["layer"]: (
                            float(r["underflow_product_betas_off"]),
                            float(r["underflow_product_betas_on"]),
                        )
                        for r in csv.DictReader(f)
                    }
                layers = [k for k in table if k != ATTENTION_OUTPUT_LAYER]

                def mean(
                    keep: Callable[[str], bool], side: int, layers: list[str] = layers, table: dict = table
                ) -> float:
                    values = [table[k][side] for k in layers if keep(k)]
                    return sum(values) / len(values)

                cells = []
                for keep in (
                    lambda k: True,
                    lambda k: k.endswith((".scores", ".values")),
                    lambda k: k.endswith("c_attn"),
                ):
                    cells.append(f"{_pct(mean(keep, 0))} -> {_pct(mean(keep, 1))}")
                better = sum(table[k][1] < table[k][0] for k in layers)
                worse = sum(table[k][1] > table[k][0] for k in layers)
                counts = f"{better} / {worse} of {len(layers)}"
                rows.append(f"| {regime} | {fmt} | {rule} | {' | '.join(cells)} | {counts} |")
    return "\n".join(rows)


def bench(root: Path) -> str:
    """A section per measurement of record in ``results/bench/*.json``: what produced it, then its tables."""
    files = sorted((root / "results" / "bench").glob("*.json"))
    if not files:
        return "No measurement of record is committed yet: run `make bench`, then stamp and render as above."
    sections = []
    for path in files:
        data = json.loads(path.read_text(encoding="utf-8"))
        machine = data.get("machine", {})
        record = data.get("record") or {}
        commit = record.get("commit", "not recorded")
        if record.get("dirty"):
            commit += " (with uncommitted changes)"
        command = record.get("command") or "scripts/bench.py " + " ".join(
            data.get("settings", {}).get("argv", [])
        )
        threads = machine.get("threads")
        cpu = f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, {threads} thread" + (
            "s" if threads != 1 else ""
        )
        load = machine.get("load_avg_at_start")
        load_text = "/".join(f"{x:.2f}" for x in load) if load else "not recorded"
        rel = path.relative_to(root).as_posix()
        sections.append(
            "\n".join(
                [
                    f"### `{rel}`",
                    "",
                    "| machine | load at start | torch | commit | date | command |",
                    "| --- | --- | --- | --- | --- | --- |",
                    f"| {cpu} | {load_text} | {machine.get('torch', '?')} | {commit} "
                    f"| {machine.get('date', '?')} | `{command}` |",
                    "",
                    paragraphs(demote(escape_html(data["table_markdown"]), 1)),
                ]
            )
        )
    return "\n\n".join(sections)


def gpu_check(root: Path) -> str:
    """A section per ``make gpu-check`` result in ``results/gpu/*.json``: the machine and the commit, the
    CUDA tests, the gradient comparison, and the step-time ratios in wall time and in kernel time."""
    files = sorted((root / "results" / "gpu").glob("*.json"))
    if not files:
        return "No `make gpu-check` result is committed yet: run it on a machine with a CUDA GPU."
    return "\n\n".join(_gpu_section(path, root) for path in files)


def _gpu_section(path: Path, root: Path) -> str:
    data = json.loads(path.read_text(encoding="utf-8"))
    machine, record, tests = data["machine"], data.get("record") or {}, data["tests"]
    commit = record.get("commit") or (data.get("code") or {}).get("git_commit") or "not recorded"
    rows = [
        f"### `{path.relative_to(root).as_posix()}`",
        "",
        "| GPU | torch | CUDA | commit | date | command |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {machine['gpu']} | {machine['torch']} | {machine['cuda']} | {commit} | {data['date']} "
        f"| `{record.get('command', 'make gpu-check')}` |",
        "",
        f"CUDA tests: {tests.get('status')} ({tests.get('line', tests.get('error'))}).",
        "",
        "| autocast | adaptive: smallest cosine with FP32 | median | fixed scale 1024: smallest | median |",
        "| --- | --- | --- | --- | --- |",
    ]
    for prec, g in data["gradients"].items():
        rows.append(
            f"| {prec.upper()} | {g['min_cosine']:.4f} (`{g['where']}`) | {g['median_cosine']:.4f} "
            f"| {g['baseline_min_cosine']:.4f} (`{g['baseline_where']}`) "
            f"| {g['baseline_median_cosine']:.4f} |"
        )
    rows += [
        "",
        "| model | batch | dynamic ms/step | u=1 / dynamic | u=100 / dynamic (amortized) "
        "| dynamic kernel ms/step | kernel time: u=1 / dynamic | kernel time: u=100 / dynamic |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, t in data["timing"].items():
        r, dyn = t["ratios"], t["ms"]["dynamic"]
        rows.append(
            f"| {model} | {t['batch']} | {dyn['step']:.2f} | {r['adaptive_u1_over_dynamic']:.3f}x "
            f"| {r['adaptive_u100_over_dynamic']:.3f}x | {dyn['kernel_reuse']:.2f} "
            f"| {r['kernel_u1_over_dynamic']:.3f}x | {r['kernel_u100_over_dynamic']:.3f}x |"
        )
    if any(t.get("compiled") for t in data["timing"].values()):
        rows += ["", *_gpu_compiled_rows(data["timing"])]
    return "\n".join(rows)


def _gpu_compiled_rows(timing: dict) -> list[str]:
    """The compiled steps of a ``make gpu-check`` result (``adaloss.lab.gpucheck``, issue 34): per model and
    ``torch.compile`` mode, the ratios in wall and kernel time, the compiled dynamic step against the
    eager one, and what Dynamo made (graphs of the dynamic, u=1 and u=100 steps; breaks; recompiles)."""
    rows = [
        'Compiled (`torch.compile(attached model, fullgraph=True, backend="inductor", mode=...)`), in the '
        "same rounds as the eager steps:",
        "",
        "| model | mode | dynamic ms/step | compiled / eager dynamic | u=1 / dynamic | u=100 / dynamic "
        "(amortized) | dynamic kernel ms/step | kernel time: u=1 / dynamic | kernel time: u=100 / dynamic "
        "| graphs (dynamic, u=1, u=100) | graph breaks | recompiles |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, t in timing.items():
        for mode, c in t.get("compiled", {}).items():
            if "error" in c:
                rows.append(f"| {model} | {mode} | error: {c['error'].strip().splitlines()[0]} |" + " |" * 9)
                continue
            r, dyn, counts = c["ratios"], c["ms"]["dynamic"], c["compile"]
            kernel = (
                f"{dyn['kernel_reuse']:.2f} | {r['kernel_u1_over_dynamic']:.3f}x "
                f"| {r['kernel_u100_over_dynamic']:.3f}x"
                if "kernel_reuse" in dyn
                else "n/a | n/a | n/a"
            )
            rows.append(
                f"| {model} | {mode} | {dyn['step']:.2f} | {dyn['step'] / t['ms']['dynamic']['step']:.3f}x "
                f"| {r['adaptive_u1_over_dynamic']:.3f}x | {r['adaptive_u100_over_dynamic']:.3f}x | {kernel} "
                f"| {', '.join(str(n['graphs']) for n in counts.values())} "
                f"| {sum(n['graph_breaks'] for n in counts.values())} "
                f"| {sum(n['recompiles'] for n in counts.values())} |"
            )
    return rows


#: region name -> what renders it. A page may hold any of them; every one must appear on some page.
REGIONS: dict[str, Callable[[Path], str]] = {
    "mini-tables": mini_tables,
    "mini-figures": mini_figures,
    "mini-claims": mini_claims,
    "root-scale": root_scale,
    "demo-table": demo_table,
    "lm-untied": lm_table("untied"),
    "lm-tied": lm_table("tied"),
    "lm-underflow": lm_table("underflow"),
    "underflow-table": underflow_table,
    "attention-betas": attention_betas,
    "bench": bench,
    "gpu-check": gpu_check,
}
