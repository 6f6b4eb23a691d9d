"""The engine stays readable: no function in ``src/adaloss/runner/engine/`` longer than 80 lines (docstring
included), so each phase of a run (build, resume, loop, evaluate, finish) reads on one screen."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

ENGINE = ROOT / "src" / "adaloss" / "engine"
MAX_LINES = 80


def _long_functions(folder: Path) -> list[str]:
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    found.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_engine_function_is_longer_than_80_lines() -> None:
    assert _long_functions(ENGINE) == []


def test_the_count_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "long.py").write_text(f"def too_long():\n{body}\n")
    assert _long_functions(tmp_path) == [f"long.py:1 too_long ({MAX_LINES + 1} lines)"]
