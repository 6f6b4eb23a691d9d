"""The composed config is read in one place: the runner's composition root and the schemas.

``train(cfg)`` hands ``cfg`` to the root (``engine/compose.py``, with its check ``engine/config.py``), which
reads every setting and passes plain values (and each group's node, to that group's builder) to the other
modules; the schemas (``schemas.py``) validate it. Anywhere else, a read of the config (``cfg.trainer``,
``cfg_trainer.get("keep_checkpoints")``, ``cfg["seed"]``) would be a second, unchecked place a setting is
interpreted: this test scans the runner's sources for one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import adaloss.runner

RUNNER = Path(adaloss.runner.__file__).parent
#: The composition root and the schemas: the modules that may read the config object.
READERS = {"engine/compose.py", "engine/config.py", "schemas.py"}


def _config_names(tree: ast.AST) -> set[str]:
    """The names that hold a config object: ``cfg``, ``cfg_<section>``, and parameters typed DictConfig."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            if "DictConfig" in ast.unparse(node.annotation):
                names.add(node.arg)
        if isinstance(node, ast.Name) and (node.id == "cfg" or node.id.startswith("cfg_")):
            names.add(node.id)
    return names


def config_reads(source: str) -> list[str]:
    """``line: code`` of every read of a config object in ``source``: an attribute (``cfg.trainer``,
    ``cfg.get(...)``), an index (``cfg["seed"]``), ``getattr(cfg, ...)`` or ``OmegaConf.select(cfg, ...)``.
    Passing the object on (a call's argument, a return) is not a read."""
    tree = ast.parse(source)
    names = _config_names(tree)

    def held(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in names

    found = []
    for node in ast.walk(tree):
        read = (isinstance(node, ast.Attribute | ast.Subscript) and held(node.value)) or (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("getattr", "OmegaConf.select", "OmegaConf.to_container")
            and node.args
            and held(node.args[0])
        )
        if read:
            found.append((node.lineno, node.col_offset, f"{node.lineno}: {ast.unparse(node)}"))
    return [text for *_, text in sorted(found)]


def test_only_the_composition_root_and_the_schemas_read_the_config() -> None:
    modules = sorted(p for p in RUNNER.rglob("*.py") if p.relative_to(RUNNER).as_posix() not in READERS)
    assert len(modules) > 30  # the scan sees the runner
    reads = {
        p.relative_to(RUNNER).as_posix(): found
        for p in modules
        if (found := config_reads(p.read_text(encoding="utf-8")))
    }
    assert reads == {}, (
        "these modules read the config object; read the setting in adaloss/runner/engine/compose.py and pass "
        f"the value: {reads}"
    )


def test_the_scan_finds_the_reads_it_is_named_for() -> None:
    source = """
def build(cfg_trainer, node: DictConfig, other):
    keep = cfg_trainer.get("keep_checkpoints")
    seed = node["seed"]
    every = getattr(cfg_trainer, "checkpoint_every")
    return other.trainer, helper(cfg_trainer), node
"""
    assert [line.split(": ", 1)[1] for line in config_reads(source)] == [
        "cfg_trainer.get",
        "node['seed']",
        "getattr(cfg_trainer, 'checkpoint_every')",
    ]
