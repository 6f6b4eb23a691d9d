"""The command line of ``scripts/render_docs.py``: rewrite the regions and figures, ``--check`` them, or
``stamp`` a bench JSON."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from adaloss.lab.docgen.pages import differences, write
from adaloss.lab.docgen.stamp import stamp
from adaloss.lab.reports.measurement import ROOT

#: ``--help``'s first line.
DESCRIPTION = "Render the documentation's tables and figures from the committed result files."


def main(argv: Sequence[str] | None = None, root: Path = ROOT) -> int:
    """``stamp`` a bench JSON, or ``--check`` / rewrite the pages and figures of the checkout ``root`` (the
    script's own)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["stamp"]:
        p = argparse.ArgumentParser(
            prog="render_docs.py stamp", description="record what produced a bench JSON"
        )
        p.add_argument("json", type=Path, help="a bench JSON, or a result folder (writes its record.json)")
        p.add_argument("--command", required=True, help="the command that wrote it, e.g. 'make bench'")
        p.add_argument("--commit", default=None, help="the commit it measured (default: HEAD)")
        p.add_argument("--note", default=None, help="a folder's record: how its kernel path is known")
        p.add_argument(
            "--path-unknown",
            action="store_true",
            help="a folder's record: the kernel path it ran on is unknown",
        )
        args = p.parse_args(argv[1:])
        record = stamp(
            args.json, args.command, args.commit, root=root, note=args.note, path_known=not args.path_unknown
        )
        print(f"stamped {args.json}: {record}")
        return 0
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument(
        "--check", action="store_true", help="list the files that differ and exit 1; write nothing"
    )
    args = p.parse_args(argv)
    if args.check:
        stale = differences(root)
        for path in stale:
            print(f"out of date: {path.relative_to(root)}")
        if stale:
            print("run: python scripts/render_docs.py", file=sys.stderr)
        return 1 if stale else 0
    for path in write(root):
        print(f"wrote {path.relative_to(root)}")
    return 0
