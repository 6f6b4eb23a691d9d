"""The package beside the user's torch: torch is a range and torchvision an extra (``pyproject.toml``).

* ``import adaloss`` and the scalers need no torchvision, and ``train.py`` without it says in one line what
  to install;
* (slow) a fresh virtual environment holding torch 2.13.0 (the CPU wheel on the lab machines' disk, older than
  the 2.14.1 CI runs) takes the package and its dependencies, and keeps its torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, TINY

#: Blocks ``import torchvision`` in a child process, as if it were not installed.
NO_TORCHVISION = "import sys; sys.modules['torchvision'] = None\n"


def _child(code: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_core_imports_without_torchvision() -> None:
    code = NO_TORCHVISION + (
        "import adaloss, adaloss.scalers, adaloss.distributed, adaloss.precision\n"
        "from adaloss import AdaptiveLossScaler, build_scaler\n"
        "try:\n"
        "    import torchvision\n"
        "except ImportError:\n"
        "    print('no torchvision')\n"
    )
    proc = _child(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["no torchvision"]  # the block worked, and nothing needed it


def test_train_py_without_torchvision_is_one_error_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code = NO_TORCHVISION + (
        "import runpy\nsys.argv[0] = 'train.py'\nrunpy.run_path('train.py', run_name='__main__')\n"
    )
    proc = _child(code, *TINY, "model=mlp", f"hydra.run.dir={run}")
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: torchvision is not installed"), proc.stderr
    assert "pip install -e '.[vision]'" in lines[0] and "Traceback" not in proc.stderr + proc.stdout
    assert not run.exists()  # the folder Hydra made for the refused run is gone


def _sources(to: Path) -> Path:
    """A copy of what pip builds the package from (no build outputs), so the repository stays untouched."""
    to.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, to / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build")
    shutil.copytree(ROOT / "src", to / "src", ignore=ignore)
    return to


@pytest.mark.slow
def test_a_fresh_venv_with_an_older_torch_installs_the_package_and_keeps_its_torch(tmp_path: Path) -> None:
    """torch 2.13.0 installs from the wheel on disk (pip's find-links); the other dependencies come from the
    package index or pip's cache. No --system-site-packages: the venv must not see this one's torch 2.14.1."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")

    def pip(*args: str) -> None:
        proc = subprocess.run([python, "-m", "pip", "install", "-q", *args], capture_output=True, text=True,
                              timeout=1500)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]

    pip("torch==2.13.0")  # the user's torch
    pip(str(_sources(tmp_path / "adaloss")))  # the package, with every dependency it declares
    code = (
        "import importlib.metadata as md, torch, adaloss, adaloss.scalers\n"
        "from adaloss import AdaptiveLossScaler\n"
        "print(torch.__version__, md.version('adaloss'), md.version('hydra-core'))\n"
        "try:\n"
        "    md.version('torchvision')\n"
        "except md.PackageNotFoundError:\n"
        "    print('no torchvision')\n"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    torch_version, adaloss_version, hydra_version = lines[0].split()
    assert torch_version.startswith("2.13.0"), lines  # still the user's torch, not replaced
    assert adaloss_version == "0.1.0" and hydra_version.startswith("1.3."), lines
    assert lines[1:] == ["no torchvision"], lines  # pip pulled in no torchvision (and no torch with it)
