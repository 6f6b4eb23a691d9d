"""The README's table of promises names tests that exist: a renamed or deleted test fails here."""

from __future__ import annotations

import ast
import re

from conftest import ROOT

SECTION = "## What the tests hold us to"


def _section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return text[start:end]


def test_every_test_the_promises_name_exists() -> None:
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", _section())
    assert len(named) >= 25, named  # one row per promise, each with its tests
    for path, name in named:
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in functions, f"README names {path}::{name}, which does not exist"
