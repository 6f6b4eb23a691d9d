"""The pages and their generated regions: which pages hold regions, each region filled anew, the files the
render writes (pages and figures), which of them differ from the committed ones, and writing them."""

from __future__ import annotations

import re
from pathlib import Path

from adaloss.lab.docgen.regions import FIGURE_ASSETS, MINI_FIGURES, REGIONS
from adaloss.lab.reports.measurement import ROOT

BEGIN = re.compile(r"<!-- generated: (?P<name>[\w-]+) -->\n")


def _end(name: str) -> str:
    return f"<!-- end generated: {name} -->"


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
