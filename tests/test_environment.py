"""A shell where ``.venv`` is not activated: ``python train.py`` (and every script) with a Python that lacks
the project's dependencies stops with one ``error:`` line naming the fix (``scripts/_env.py``), not a
``ModuleNotFoundError`` traceback, and makes no run folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, load_script


def _without_site_packages(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # -S: no site-packages, so neither torch nor hydra can be imported, as with a system Python
    return subprocess.run(
        [sys.executable, "-S", *args], cwd=cwd, capture_output=True, text=True, timeout=60, env={}
    )


@pytest.mark.parametrize(
    "entry", ["train.py", "scripts/make_tables.py", "scripts/bench.py", "scripts/demo.py"]
)
def test_a_python_without_the_dependencies_gets_one_error_line(entry: str, tmp_path: Path) -> None:
    runs = ROOT / "results" / "runs"
    before = sorted(runs.iterdir()) if runs.exists() else []
    done = _without_site_packages([str(ROOT / entry), "dataset=digits"], cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    line = done.stderr
    assert line.startswith("error: ") and "no module named 'torch'" in line and "Traceback" not in line
    if (ROOT / ".venv" / "bin" / "python").exists():  # the fix names this checkout's environment
        assert f"source {ROOT / '.venv'}/bin/activate" in line
    assert (sorted(runs.iterdir()) if runs.exists() else []) == before


def test_the_line_says_make_setup_where_there_is_no_venv(monkeypatch, tmp_path: Path) -> None:
    env = load_script("_env")
    monkeypatch.setattr(env, "ROOT", tmp_path)
    monkeypatch.chdir(tmp_path)
    line = env.missing_message("hydra", ["train.py", "dataset=digits"])
    assert line.startswith("error: ") and "'hydra'" in line
    assert f"run `make setup` in {tmp_path}" in line and "`source .venv/bin/activate`" in line
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").touch()
    line = env.missing_message("hydra", ["train.py", "dataset=digits"])
    assert "or run `.venv/bin/python train.py dataset=digits`" in line and "make setup" not in line
