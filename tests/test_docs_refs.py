"""The code the docs cite exists: every ``path::name`` and every repository path in backticks.

A page that names ``tests/test_adaptive.py::test_beta_scales_the_gradient_not_the_weight`` or
``src/adaloss/adaptive/rules.py::ScaleRule.beta`` promises that function (or class, or method) is there; a
rename or a deletion fails here and names the page. The changelog records history and may name code that is
gone, so it is not checked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_docs_blocks import ROOT, doc_files

CITED = re.compile(r"`((?:src|tests|scripts)/[\w/.-]+\.py)::([\w.]+)`")
PATH = re.compile(r"`((?:src|tests|scripts|configs)/[\w/.-]+\.(?:py|yaml|md|sh))`")
HISTORY = {ROOT / "docs" / "changelog.md"}


def _defined(tree: ast.AST, dotted: str) -> bool:
    """Whether ``dotted`` (``f``, ``Class``, ``Class.method``) is defined at module level of ``tree``."""
    scope: list[ast.stmt] = list(tree.body)  # type: ignore[attr-defined]
    for part in dotted.split("."):
        found = next(
            (
                node
                for node in scope
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                and node.name == part
            ),
            None,
        )
        if found is None:
            return False
        scope = list(found.body)
    return True


def cited(paths: list[Path]) -> list[tuple[Path, str, str]]:
    return [(page, f, name) for page in paths for f, name in CITED.findall(page.read_text(encoding="utf-8"))]


def missing(root: Path, citations: list[tuple[Path, str, str]]) -> list[str]:
    out = []
    for page, file, name in citations:
        source = root / file
        if not source.is_file():
            out.append(f"{page.name}: `{file}::{name}`: no file {file}")
        elif not _defined(ast.parse(source.read_text(encoding="utf-8")), name):
            out.append(f"{page.name}: `{file}::{name}`: {file} defines no {name}")
    return out


def test_every_cited_name_exists() -> None:
    pages = [p for p in doc_files() if p not in HISTORY]
    citations = cited(pages)
    assert len(citations) >= 60, len(citations)  # the promises table alone cites more: the regex sees them
    assert not missing(ROOT, citations), "\n".join(missing(ROOT, citations))


def test_every_cited_path_exists() -> None:
    problems = []
    for page in doc_files():
        if page in HISTORY:
            continue
        for file in PATH.findall(page.read_text(encoding="utf-8")):
            if not (ROOT / file).exists():
                problems.append(f"{page.relative_to(ROOT)}: `{file}` does not exist")
    assert not problems, "\n".join(problems)


def test_a_renamed_function_is_reported(tmp_path: Path) -> None:
    """The check itself: a citation of a method that is not there is caught, one that is there is not."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text("class A:\n    def b(self):\n        pass\n\ndef f():\n    pass\n")
    page = tmp_path / "page.md"
    page.write_text("`src/m.py::A.b` `src/m.py::f` `src/m.py::A.c` `src/m.py::g` `src/n.py::f`\n")
    assert missing(tmp_path, cited([page])) == [
        "page.md: `src/m.py::A.c`: src/m.py defines no A.c",
        "page.md: `src/m.py::g`: src/m.py defines no g",
        "page.md: `src/n.py::f`: no file src/n.py",
    ]
