"""Markdown rewriting for the generated regions: headings demoted, prose lines kept as paragraphs, ``<``
escaped outside code spans."""

from __future__ import annotations

import re


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
