"""``render_docs.py stamp``: what produced a measurement-of-record JSON (``scripts/bench.py``'s output), the
commit it measured and the command, recorded in it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from adaloss.reports.measurement import ROOT


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def stamp(path: Path, command: str, commit: str | None = None, root: Path = ROOT) -> dict[str, Any]:
    """Add ``record: {commit, dirty, command}`` to a bench JSON; returns the record."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if commit is None:
        commit = _git(root, "rev-parse", "--short", "HEAD")
        dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no", "--", "src", "scripts"))
    else:
        dirty = False
    data["record"] = {"commit": commit, "dirty": dirty, "command": command}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, allow_nan=True)
        f.write("\n")
    return data["record"]
