"""Comparing a rerun with its committed numbers, and reading what each result records (``record.json``).

Bit for bit: every value equal (floats as the same double; a number a file stores as text, as the same
text), when the kernel path of the rerun is the one the result was recorded on. Otherwise the sample's
headline number within its tolerance, with the largest difference of any number reported (the spread)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaloss.lab.results_check.samples import FAMILIES, Family, Sample
from adaloss.runner.provenance import KERNEL_CAPS


def differences(committed: Any, rerun: Any, where: str = "") -> list[tuple[str, Any, Any]]:
    """Every place ``rerun`` differs from ``committed``: ``(path, committed value, rerun value)``."""
    if isinstance(committed, dict) and isinstance(rerun, dict):
        out = []
        for key in sorted(set(committed) | set(rerun), key=str):
            a, b = committed.get(key, "<absent>"), rerun.get(key, "<absent>")
            out += differences(a, b, f"{where}.{key}" if where else str(key))
        return out
    if isinstance(committed, list) and isinstance(rerun, list) and len(committed) == len(rerun):
        return [
            d
            for i, (a, b) in enumerate(zip(committed, rerun, strict=True))
            for d in differences(a, b, f"{where}[{i}]")
        ]
    same = committed == rerun or (
        isinstance(committed, float)
        and isinstance(rerun, float)
        and math.isnan(committed)
        and math.isnan(rerun)
    )
    return [] if same else [(where, committed, rerun)]


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.replace("%", "").strip())
        except ValueError:
            return None
    return None


def spread(diffs: list[tuple[str, Any, Any]]) -> float:
    """The largest absolute difference among the numbers that differ (0 when none does)."""
    gaps = [
        abs(a - b) for _, x, y in diffs if (a := _number(x)) is not None and (b := _number(y)) is not None
    ]
    return max((g for g in gaps if math.isfinite(g)), default=0.0)


@dataclass
class Verdict:
    """One sample's outcome: ``ok``, how it was compared, what differs, and the line the report prints."""

    sample: Sample
    ok: bool
    mode: str
    diffs: list[tuple[str, Any, Any]]
    line: str


def judge(sample: Sample, committed: Any, rerun: dict[str, Any], recorded_key: str | None) -> Verdict:
    """Compare; bit for bit when ``recorded_key`` (the result's kernel path) is the rerun's or not recorded
    (nothing says the numbers came from elsewhere), and for samples without a headline number."""
    key = rerun["kernel_path"]["key"]
    diffs = differences(committed, rerun["values"])
    name = f"{sample.family}: {sample.name}"
    regenerate = sample.regenerate or FAMILIES[sample.family].command
    if sample.kind == "claims_cell":  # the rerun holds one task of the claims: compare that one
        diffs = differences({k: committed.get(k) for k in rerun["values"]}, rerun["values"])
    if recorded_key in (key, None) or not sample.headline:
        mode = "bit for bit" + (
            f" on {key}" if recorded_key == key else f" (kernel path recorded: {recorded_key}, here {key})"
        )
        ok = not diffs
    else:
        a, b = _number(committed.get(sample.headline)), _number(rerun["values"].get(sample.headline))
        ok = a is not None and b is not None and abs(a - b) <= sample.tolerance
        where = "not recorded" if recorded_key == "not recorded" else f"recorded: {recorded_key}"
        mode = (
            f"within ±{sample.tolerance:g} on {sample.headline} (kernel path {where}, here {key}; "
            f"spread {spread(diffs):.4g})"
        )
    if ok:
        return Verdict(sample, True, mode, diffs, f"ok    {name}: {mode}")
    shown = "; ".join(f"{path}: committed {a!r}, rerun {b!r}" for path, a, b in diffs[:4])
    more = f" (and {len(diffs) - 4} more)" if len(diffs) > 4 else ""
    line = (
        f"STALE {name} ({FAMILIES[sample.family].folder}, on {FAMILIES[sample.family].page}): {mode}: "
        f"{shown}{more}\n      regenerate: {regenerate}"
    )
    return Verdict(sample, False, mode, diffs, line)


def read_record(family: Family, root: Path) -> dict[str, Any] | None:
    """The family's ``record.json`` (:func:`adaloss.runner.provenance.result_record`), or None if it has none;
    for the bench and GPU records, each JSON's own ``record`` block."""
    path = root / family.folder / "record.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    return None


def file_records(family: Family, root: Path) -> list[tuple[str, dict[str, Any]]]:
    """The records kept inside a folder's JSON files (``make bench``'s ``record``; ``make gpu-check``'s
    ``record`` or ``code.git_commit``), as ``(file, {"commit", "command"})``, for folders without
    ``record.json``."""
    out = []
    for path in sorted((root / family.folder).glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            continue
        record = dict(data.get("record") or {})
        record.setdefault("commit", (data.get("code") or {}).get("git_commit"))
        out.append((path.relative_to(root).as_posix(), record))
    return out


def code_changed_since(commit: str | None, root: Path) -> str:
    """Whether the code (``src``, ``configs``, ``scripts``, ``train.py``) changed between ``commit`` and the
    checkout: ``no``, ``yes (N files)``, or why it cannot tell."""
    if not commit:
        return "unknown (no commit recorded)"
    try:
        done = subprocess.run(
            ["git", "diff", "--name-only", commit, "--", "src", "configs", "scripts", "train.py"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unknown ({type(error).__name__})"
    if done.returncode != 0:
        return f"unknown (git: {' '.join(done.stderr.split())[:80]})"
    files = done.stdout.split()
    return f"yes ({len(files)} files)" if files else "no"


def child_env(sample: Sample, root: Path) -> dict[str, str]:
    """The environment a sample's rerun runs in: its threads, and its kernel path pinned
    (:data:`adaloss.runner.provenance.KERNEL_CAPS`) or the machine's own (every cap removed)."""
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_CAPS}
    if sample.pinned:
        env.update(KERNEL_CAPS)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(sample.threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src"), os.environ.get("PYTHONPATH")]))
    return env
