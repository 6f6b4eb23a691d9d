"""The package beside the user's torch: torch is its one required dependency (``pyproject.toml``).

* the library (``import adaloss``, the scalers, the adaptive core, numerics, precision, telemetry) imports
  with the runner's packages (Hydra, OmegaConf, W&B) and the optional ones (torchvision, Lightning,
  transformers) unimportable, and imports none of them;
* ``train.py`` without torchvision says in one line what to install;
* (slow) a fresh virtual environment holding torch 2.13.0 (the CPU wheel on the lab machines' disk, older than
  the 2.14.1 CI runs) takes the package without extras, keeps its torch, gains no other package, and the
  library imports and scales a step there.
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

#: The runner's packages and the optional integrations: the library must import without any of them.
NOT_THE_LIBRARYS = ("hydra", "omegaconf", "wandb", "torchvision", "lightning", "transformers")

#: Makes every package of ``NOT_THE_LIBRARYS`` unimportable in a child process, as if it were not installed
#: (a meta-path finder first in line that raises ModuleNotFoundError for them and their submodules).
ONLY_TORCH = f"""import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {NOT_THE_LIBRARYS!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Absent())
"""

#: The library's modules, and a check that none of ``NOT_THE_LIBRARYS`` came with them.
LIBRARY_IMPORTS = f"""import sys
import adaloss, adaloss.scalers, adaloss.adaptive, adaloss.numerics, adaloss.precision, adaloss.telemetry
import adaloss.errors, adaloss.distributed
from adaloss import AdaptiveLossScaler, DynamicLossScaler, FixedLossScaler, NoLossScaler
loaded = sorted({{n.split(".")[0] for n in sys.modules}} & set({NOT_THE_LIBRARYS!r}))
print("loaded:", *loaded)
"""


def _child(code: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_core_imports_without_torchvision() -> None:
    code = NO_TORCHVISION + (
        "import adaloss, adaloss.scalers, adaloss.distributed, adaloss.precision\n"
        "from adaloss import AdaptiveLossScaler\n"
        "try:\n"
        "    import torchvision\n"
        "except ImportError:\n"
        "    print('no torchvision')\n"
    )
    proc = _child(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["no torchvision"]  # the block worked, and nothing needed it


def test_the_library_imports_with_torch_alone() -> None:
    """With Hydra, OmegaConf, W&B, torchvision, Lightning and transformers unimportable, the library imports,
    and ``sys.modules`` then holds none of them."""
    proc = _child(ONLY_TORCH + LIBRARY_IMPORTS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["loaded:"], proc.stdout
    blocked = _child(ONLY_TORCH + "import omegaconf")  # the finder itself works
    assert blocked.returncode == 1 and "No module named 'omegaconf'" in blocked.stderr, blocked.stderr[-3000:]


def test_the_library_imports_none_of_the_runners_packages_even_when_installed() -> None:
    """In this environment, where they are installed, the library still imports none of the runner's
    packages (torchvision aside: the adaptive core recognises its modules when it is installed)."""
    proc = _child(LIBRARY_IMPORTS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() in (["loaded:"], ["loaded:", "torchvision"]), proc.stdout


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
    """torch 2.13.0 installs from the wheel on disk (pip's find-links); the package without extras adds
    nothing to it (torch is its one requirement), and the library imports and scales a step there. No
    --system-site-packages: the venv must not see this one's torch 2.14.1 nor its Hydra."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")

    def pip(*args: str) -> None:
        proc = subprocess.run([python, "-m", "pip", "install", "-q", *args], capture_output=True, text=True,
                              timeout=1500)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]

    pip("torch==2.13.0")  # the user's torch
    before = set(_distributions(python))
    pip(str(_sources(tmp_path / "adaloss")))  # the package, with every dependency it declares
    assert set(_distributions(python)) - before == {"adaloss"}  # no Hydra, W&B, numpy, ...: torch is enough
    code = LIBRARY_IMPORTS + (
        "import importlib.metadata as md, torch\n"
        "print(torch.__version__, md.version('adaloss'))\n"
        "model = torch.nn.Linear(3, 2)\n"
        "scaler = FixedLossScaler(scale=8.0)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "scaler.scale(model(torch.ones(4, 3)).sum()).backward()\n"
        "scaler.step(optimizer)\n"
        "scaler.update()\n"
        "print(model.weight.grad.tolist() == [[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]])\n"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "loaded:", lines  # none of the runner's packages, nor torchvision
    torch_version, adaloss_version = lines[1].split()
    assert torch_version.startswith("2.13.0"), lines  # still the user's torch, not replaced
    assert adaloss_version == "0.1.0", lines
    assert lines[2] == "True", lines  # the gradients are unscaled: the library works, not only imports


def _distributions(python: str) -> list[str]:
    """The names of the distributions installed in the environment of ``python``."""
    code = "import importlib.metadata as md\nfor d in md.distributions(): print(d.metadata['Name'].lower())"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return proc.stdout.split()
