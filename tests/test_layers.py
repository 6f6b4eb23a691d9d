"""The three layers (``docs/architecture.md``, "Layers") are enforced by import-linter's contracts in
``pyproject.toml`` (``make lint`` runs ``lint-imports``): the lab imports the runner and the library, the
runner the library, the library neither, nor any package of the runner's.

Each test runs ``lint-imports`` on a copy of ``src/`` and ``pyproject.toml``: as they are (kept), and with one
import planted where a contract forbids it (broken, naming the import).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """``src/`` and ``pyproject.toml`` copied into ``tmp_path`` (no build outputs)."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(
        ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    return tmp_path


def lint_imports(where: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` in ``where``, analysing the ``adaloss`` of ``where/src``."""
    env = {**os.environ, "PYTHONPATH": str(where / "src")}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=where, env=env, capture_output=True, text=True, timeout=300
    )


def plant(copy: Path, module: str, line: str) -> None:
    """Append ``line`` to ``src/adaloss/<module>`` of the copy."""
    path = copy / "src" / "adaloss" / module
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_contracts_hold_on_the_sources(copy: Path) -> None:
    proc = lint_imports(copy)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 broken" in proc.stdout


def test_an_import_from_the_library_into_the_runner_breaks_the_layers(copy: Path) -> None:
    plant(copy, "scalers/base.py", "from adaloss.runner.schemas import typed  # planted")
    proc = lint_imports(copy)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "lab -> runner -> library, never upwards BROKEN" in proc.stdout
    assert "adaloss.scalers.base -> adaloss.runner.schemas" in proc.stdout


def test_an_import_from_the_runner_into_the_lab_breaks_the_layers(copy: Path) -> None:
    plant(copy, "runner/engine/optim.py", "import adaloss.lab.reports.tables  # planted")
    proc = lint_imports(copy)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "adaloss.runner.engine.optim -> adaloss.lab.reports.tables" in proc.stdout


def test_an_integration_that_reaches_into_the_runner_breaks_the_layers(copy: Path) -> None:
    """The trainers' adapters sit on the library: an engineer installs them without the runner."""
    plant(copy, "integrations/timm.py", "import adaloss.runner.engine.optim  # planted")
    proc = lint_imports(copy)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "adaloss.integrations.timm -> adaloss.runner.engine.optim" in proc.stdout


def test_a_runner_package_imported_by_the_library_breaks_its_contract(copy: Path) -> None:
    plant(copy, "numerics/formats.py", "import omegaconf  # planted")
    proc = lint_imports(copy)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "the library imports none of the runner's packages BROKEN" in proc.stdout
    assert "adaloss.numerics.formats -> omegaconf" in proc.stdout


def test_an_import_circle_between_siblings_breaks_the_acyclic_contract(copy: Path) -> None:
    """The checkpoint and the run folder once imported each other (inside functions, to dodge the circle)."""
    plant(
        copy,
        "runner/engine/run_folder.py",
        "def _planted():\n    from adaloss.runner.engine.checkpoint import save_atomic",
    )
    proc = lint_imports(copy)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "no import circle between sibling packages or modules BROKEN" in proc.stdout
    assert ".run_folder -> .checkpoint" in proc.stdout
