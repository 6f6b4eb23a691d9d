"""The command line of ``scripts/results_check.py`` (``make results-check``): rerun the samples, compare, list
the records; exit 1 when a committed result is stale."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from adaloss.lab.reports.measurement import ROOT
from adaloss.lab.results_check.compare import (
    Verdict,
    child_env,
    code_changed_since,
    file_records,
    judge,
    read_record,
)
from adaloss.lab.results_check.samples import FAMILIES, SAMPLES, Sample, committed

DESCRIPTION = (
    "Rerun a sample of every committed result shown on a page and compare it with the committed numbers."
)


def run_sample(sample: Sample, root: Path, work: Path) -> dict[str, Any]:
    """Rerun ``sample`` in a child process (its threads and kernel path: :func:`.compare.child_env`) into a
    folder under ``work``; its ``rerun.json``, or ``{"error": ...}``."""
    out = work / f"{sample.family}-{abs(hash(sample.name)) % 10**8}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "adaloss.lab.results_check.reruns",
        sample.family,
        sample.name,
        str(out),
    ]
    began = time.perf_counter()
    done = subprocess.run(command, cwd=root, env=child_env(sample, root), capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
        return {"error": f"the rerun failed (exit {done.returncode}):\n{tail}", "seconds": seconds}
    return {**json.loads((out / "rerun.json").read_text(encoding="utf-8")), "seconds": seconds}


def check(sample: Sample, root: Path, work: Path) -> Verdict:
    """Rerun and judge one sample against its committed numbers and its family's recorded kernel path."""
    record = read_record(FAMILIES[sample.family], root)
    recorded = None if record is None else (record.get("kernel_path") or {}).get("key", "not recorded")
    try:
        expected = committed(sample, root)
    except (LookupError, OSError, ValueError) as error:
        return Verdict(sample, False, "", [], f"STALE {sample.family}: {sample.name}: {error}")
    result = run_sample(sample, root, work)
    if "error" in result:
        line = (
            f"FAIL  {sample.family}: {sample.name}: {result['error']}\n      regenerate: {sample.regenerate}"
        )
        return Verdict(sample, False, "", [], line)
    verdict = judge(sample, expected, result, recorded)
    verdict.line += f" [{result['seconds']:.0f} s]"
    return verdict


def records_table(root: Path) -> str:
    """Every family (a bench or GPU folder: every JSON in it): its record's commit, whether the code changed
    since, the kernel path, the command, and whether the check reruns it."""
    lines = [
        "| result | page | commit | code changed since | kernel path | command | checked |",
        "|---" * 7 + "|",
    ]
    for family in FAMILIES.values():
        record = read_record(family, root)
        entries = [(family.folder, record or {})] if record or family.rerun else file_records(family, root)
        for where, rec in entries or [(family.folder, {})]:
            commit = rec.get("commit")
            path = rec.get("kernel_path") or {}
            key = path.get("key") or ("not recorded" if record is None else "unknown")
            checked = "rerun (samples)" if family.rerun else f"listed: {family.why}"
            lines.append(
                f"| `{where}` | {family.page} | {commit or 'not recorded'} "
                f"| {code_changed_since(commit, root)} | {key} | `{rec.get('command', family.command)}` "
                f"| {checked} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--full", action="store_true", help="also the slow samples (minutes: make test-full)")
    parser.add_argument("--jobs", type=int, default=2, help="samples rerun side by side (default 2)")
    parser.add_argument("--only", default="", help="comma-separated result families (default: all)")
    parser.add_argument("--list", action="store_true", help="list the samples and records; rerun nothing")
    parser.add_argument(
        "--work", type=Path, default=None, help="folder for the reruns (default: a temporary one)"
    )
    args = parser.parse_args(argv)
    only = [f for f in args.only.split(",") if f]
    unknown = [f for f in only if f not in FAMILIES]
    if unknown:
        raise SystemExit(
            f"error: unknown result family {', '.join(unknown)}: choose from {', '.join(FAMILIES)}"
        )
    if args.jobs < 1:
        raise SystemExit(f"error: --jobs must be at least 1, got {args.jobs}")
    chosen = [s for s in SAMPLES if (args.full or s.tier == "quick") and (not only or s.family in only)]
    print(records_table(root), flush=True)
    if args.list:
        print("\n".join(f"{s.tier:5} {s.family}: {s.name}" for s in chosen))
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="results-check-"))
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        verdicts = list(pool.map(lambda s: check(s, root, work), chosen))
    for verdict in verdicts:
        print(verdict.line)
    stale = [v for v in verdicts if not v.ok]
    print(
        f"{len(verdicts) - len(stale)} of {len(verdicts)} samples as committed "
        f"({time.perf_counter() - began:.0f} s, {args.jobs} at a time)"
    )
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if stale else 0
