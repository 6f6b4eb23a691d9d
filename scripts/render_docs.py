"""Render the documentation's tables and figures from the committed result files.

The pages (``README.md``, ``docs/**/*.md``) hold *generated regions*::

    <!-- generated: NAME -->
    ...
    <!-- end generated: NAME -->

and this script fills each one from the files named in ``REGIONS``, and copies the mini reproduction's figures
into ``docs/assets/mini/``. ``tests/test_docs_render.py`` checks the committed pages against what it renders,
so a page cannot drift from its results.

    python scripts/render_docs.py            # rewrite the regions and the figures
    python scripts/render_docs.py --check    # exit 1 and list what differs, writing nothing
    python scripts/render_docs.py stamp results/bench/bench.json --command "make bench"

``stamp`` records in a measurement-of-record JSON (``scripts/bench.py``'s output) what the bench itself does
not: the commit it measured (default: ``HEAD``; ``dirty`` when tracked files differ from it) and the command
that produced it. The performance page shows both beside the machine, torch version and date the JSON holds.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: The mini reproduction's figures shown on the pages, copied to docs/assets/mini/.
MINI_FIGURES = ("fig1a", "fig1b", "fig4a", "fig4b")
FIGURE_ASSETS = Path("docs") / "assets" / "mini"

BEGIN = re.compile(r"<!-- generated: (?P<name>[\w-]+) -->\n")


def _end(name: str) -> str:
    return f"<!-- end generated: {name} -->"


# --------------------------------------------------------------------------------------------- helpers


def demote(markdown: str, levels: int) -> str:
    """Push every ATX heading down by ``levels`` (``## x`` -> ``#### x`` for 2), outside code fences."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,6} ", line):
            line = "#" * levels + line
        out.append(line)
    return "\n".join(out)


def paragraphs(markdown: str) -> str:
    """Separate consecutive prose lines with blank lines, so each stays its own paragraph, and leave
    tables (runs of ``|`` lines) together; trailing blank lines are dropped."""
    out: list[str] = []
    for line in markdown.strip().splitlines():
        if out and out[-1] and line and not (line.startswith("|") and out[-1].startswith("|")):
            out.append("")
        out.append(line)
    return "\n".join(out)


def escape_html(markdown: str) -> str:
    """``<`` outside code spans as ``&lt;``: what the scripts wrote (``<locals>``, ``<= 1.05x``) is text."""
    out = []
    for line in markdown.splitlines():
        parts = line.split("`")
        out.append("`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts)))
    return "\n".join(out)


def _pct(value: float) -> str:
    return f"{value:.2%}"


# --------------------------------------------------------------------------------------------- regions


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
    """The claims table of ``make reproduce-mini``'s claims stage, as ``adaloss.reports.claims`` wrote it
    (its title left out: the page has its own heading)."""
    text = (root / "results" / "mini" / "claims" / "claims.md").read_text(encoding="utf-8")
    return paragraphs(demote(escape_html(text.split("\n", 1)[1]), 2))


def root_scale(root: Path) -> str:
    """``results/root/root_scale.md`` as ``scripts/root_scale.py`` wrote it (the root-scale options)."""
    text = (root / "results" / "root" / "root_scale.md").read_text(encoding="utf-8")
    return paragraphs(escape_html(text))


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


#: region name -> what renders it. A page may hold any of them; every one must appear on some page.
REGIONS: dict[str, Callable[[Path], str]] = {
    "mini-tables": mini_tables,
    "mini-figures": mini_figures,
    "mini-claims": mini_claims,
    "root-scale": root_scale,
    "lm-untied": lm_table("untied"),
    "lm-tied": lm_table("tied"),
    "lm-underflow": lm_table("underflow"),
    "underflow-table": underflow_table,
    "attention-betas": attention_betas,
    "bench": bench,
}


# --------------------------------------------------------------------------------------------- pages


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def fill(text: str, root: Path, where: str = "page") -> str:
    """``text`` with every generated region rendered anew."""
    out, pos = [], 0
    for m in BEGIN.finditer(text):
        name = m.group("name")
        if name not in REGIONS:
            raise SystemExit(
                f"error: {where}: unknown generated region {name!r} (known: {', '.join(REGIONS)})"
            )
        end = text.find(_end(name), m.end())
        if end < 0:
            raise SystemExit(f"error: {where}: region {name!r} has no '{_end(name)}'")
        out.append(text[pos : m.end()])
        out.append("\n" + REGIONS[name](root).strip() + "\n\n")
        pos = end
    out.append(text[pos:])
    return "".join(out)


def render(root: Path = ROOT) -> dict[Path, str | bytes]:
    """Every file this script writes, with the content it writes: the pages holding regions, and the
    figures. Raises ``SystemExit`` when a region is unknown, unclosed, or on no page."""
    expected: dict[Path, str | bytes] = {}
    seen: set[str] = set()
    for page in pages(root):
        text = page.read_text(encoding="utf-8")
        names = BEGIN.findall(text)
        if names:
            seen.update(names)
            expected[page] = fill(text, root, str(page.relative_to(root)))
    missing = sorted(set(REGIONS) - seen)
    if missing:
        raise SystemExit(f"error: no page holds the generated regions {', '.join(missing)}")
    for name in MINI_FIGURES:
        source = root / "results" / "mini" / "figures" / f"{name}.png"
        expected[root / FIGURE_ASSETS / f"{name}.png"] = source.read_bytes()
    return expected


def differences(root: Path = ROOT) -> list[Path]:
    """The files whose committed content differs from what :func:`render` gives."""
    out = []
    for path, content in render(root).items():
        current = (
            (path.read_bytes() if isinstance(content, bytes) else path.read_text(encoding="utf-8"))
            if (path.exists())
            else None
        )
        if current != content:
            out.append(path)
    return out


def write(root: Path = ROOT) -> list[Path]:
    changed = differences(root)
    for path, content in render(root).items():
        if path in changed:
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content, encoding="utf-8")
    return changed


# --------------------------------------------------------------------------------------------- stamp


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def stamp(path: Path, command: str, commit: str | None = None, root: Path = ROOT) -> dict[str, Any]:
    """Add ``record: {commit, dirty, command}`` to a bench JSON; returns the record."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if commit is None:
        commit = _git(root, "rev-parse", "--short", "HEAD")
        dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no", "--", "src", "scripts"))
    else:
        dirty = False
    data["record"] = {"commit": commit, "dirty": dirty, "command": command}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, allow_nan=True)
        f.write("\n")
    return data["record"]


# --------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["stamp"]:
        p = argparse.ArgumentParser(
            prog="render_docs.py stamp", description="record what produced a bench JSON"
        )
        p.add_argument("json", type=Path)
        p.add_argument("--command", required=True, help="the command that wrote it, e.g. 'make bench'")
        p.add_argument("--commit", default=None, help="the commit it measured (default: HEAD)")
        args = p.parse_args(argv[1:])
        record = stamp(args.json, args.command, args.commit)
        print(f"stamped {args.json}: {record}")
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--check", action="store_true", help="list the files that differ and exit 1; write nothing"
    )
    args = p.parse_args(argv)
    if args.check:
        stale = differences()
        for path in stale:
            print(f"out of date: {path.relative_to(ROOT)}")
        if stale:
            print("run: python scripts/render_docs.py", file=sys.stderr)
        return 1 if stale else 0
    for path in write():
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
