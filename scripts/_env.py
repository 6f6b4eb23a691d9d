"""Run before any third-party import of ``train.py`` and the scripts (standard library only): a Python
without the project's dependencies stops with one ``error:`` line that names the fix, not a traceback.

The usual cause is a new shell where ``.venv`` (``make setup``) is not activated: ``python`` is then the
system's, which has no hydra or torch.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: What every entry point imports first; adaloss itself comes from src/ (the scripts put it on sys.path).
REQUIRED = ("torch", "hydra", "omegaconf")
#: Exit status for bad input (train.py's too).
BAD_INPUT = 2


def missing_message(missing: str, argv: list[str]) -> str:
    """The line for a Python that lacks ``missing``, naming the fix for this checkout (paths as the user
    can type them from the folder they are in)."""
    venv = ROOT / ".venv"
    if Path.cwd().resolve() == ROOT:
        venv = Path(".venv")
    here = f"this Python ({sys.executable}) has no module named {missing!r}"
    if (ROOT / ".venv" / "bin" / "python").exists():
        command = " ".join([str(venv / "bin" / "python"), *argv])
        fix = f"activate the project's environment (`source {venv}/bin/activate`) or run `{command}`"
    else:
        fix = f"run `make setup` in {ROOT} (it makes .venv), then `source {venv}/bin/activate`"
    return f"error: {here}: {fix}"


def require_project_python(argv: list[str] | None = None) -> None:
    """Exit with status 2 and one ``error:`` line if a required module cannot be imported."""
    for name in REQUIRED:
        if importlib.util.find_spec(name) is None:
            print(missing_message(name, list(sys.argv if argv is None else argv)), file=sys.stderr)
            sys.exit(BAD_INPUT)
