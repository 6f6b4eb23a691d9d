"""``render_docs.py stamp``: what produced a committed result, recorded beside it: the commit it was made at,
the command that regenerates it and the CPU kernel path it ran on
(:func:`adaloss.runner.provenance.result_record`).

A bench JSON (``scripts/bench.py``'s output) keeps its record inside it (``record``); a result folder gets
``record.json``, which ``make results-check`` reads (whether a rerun must match bit for bit, and whether the
code changed since the commit)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from adaloss.lab.reports.measurement import ROOT


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def stamp(
    path: Path,
    command: str,
    commit: str | None = None,
    root: Path = ROOT,
    note: str | None = None,
    path_known: bool = True,
) -> dict[str, Any]:
    """Record what produced ``path``; returns the record. A JSON file gets ``record: {commit, dirty,
    command}``; a folder gets ``record.json``: :func:`adaloss.runner.provenance.result_record` (this process's
    kernel path: stamp in the environment the result ran in, its threads and caps; ``path_known=False``: the
    path it ran on is not known, recorded as ``null``) and ``note`` (how the path is known) if given."""
    if path.is_dir():
        from adaloss.runner.provenance import result_record

        record = result_record(command, commit, root)
        if not path_known:
            record["kernel_path"] = None
        if note:
            record["kernel_path_note"] = note
        (path / "record.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        return record
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
