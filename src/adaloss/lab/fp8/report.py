"""The lab's report: every finished run read back into the table (md, csv, json), the figures, and the
fp8-lab region of a docs page."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from adaloss.lab.fp8.cells import COMMON, MODELS, SMOKE_CELLS, all_cells, settings_digest
from adaloss.lab.fp8.figures import plot
from adaloss.lab.fp8.runs import read_rows
from adaloss.lab.fp8.stats import common_layers, scaler_effects, summarize
from adaloss.lab.fp8.tables import report_markdown, write_csv
from adaloss.lab.reports.measurement import machine_info

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
