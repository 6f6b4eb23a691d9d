"""The reruns of :mod:`.samples`, each through the code its lab runs, at its committed settings; run in a
child process of its own (``python -m adaloss.lab.results_check.reruns FAMILY NAME OUT``, which writes
``OUT/rerun.json``: the numbers, in the form :func:`.samples.committed` reads, and the kernel path).

Each kind calls what the lab's script calls (``adaloss.lab.*``' ``run_one``), or runs the script itself into
``OUT`` (``lm_runs.py``, ``lm_underflow.py``, ``attention_betas.py``, ``underflow_table.py``, the mini
reproduction's ``train.py -m`` launch and ``make_tables.py``), so a rerun is what the command would make.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from adaloss.lab.results_check.samples import (
    FAMILIES,
    Sample,
    claims_cells,
    markdown_rows,
    read_csv,
    strip_timing,
)


def _root() -> Path:
    from adaloss.lab.reports.measurement import ROOT

    return ROOT


def _script(args: list[str], out: Path) -> None:
    """``python <args>`` in the checkout (this process's environment: its threads and kernel caps), its
    output kept in ``out/log.txt``; raises on failure."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_root() / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, *args], cwd=_root(), env=env, capture_output=True, text=True)
    (out / "log.txt").write_text(done.stdout + done.stderr, encoding="utf-8")
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-10:])
        raise RuntimeError(f"{' '.join(args[:2])} failed (exit {done.returncode}):\n{tail}")


def _lab_run(p: dict[str, Any], out: Path) -> Any:
    import torch

    from adaloss.lab.fp8 import runs
    from adaloss.lab.fp8.cells import all_cells
    from adaloss.lab.fp8.fp4 import fp4_cells

    torch.set_num_threads(1)
    cells = {c.name: c for c in (all_cells() if p["lab"] == "fp8" else fp4_cells())}
    return strip_timing(runs.run_one(p["model"], cells[p["cell"]], p["seed"], False, out / "runs"))


def _root_run(p: dict[str, Any], out: Path) -> Any:
    import torch

    from adaloss.lab.root_scale.runs import run_one

    torch.set_num_threads(1)
    return strip_timing(run_one(p["task"], p["root"], p["seed"], out))


def _lm_run(p: dict[str, Any], out: Path) -> Any:
    committed = json.loads((_root() / FAMILIES[f"lm-{p['folder']}"].folder / "lm_runs.json").read_text())
    args = ["--seeds", str(p["seed"]), "--variants", p["variant"], "--out", str(out), *committed["overrides"]]
    _script(["scripts/lm_runs.py", *args], out)
    (row,) = json.loads((out / "lm_runs.json").read_text())["runs"]
    return strip_timing(row)


def _script_files(p: dict[str, Any], out: Path) -> Any:
    _script([p["script"], *(a.replace("{out}", str(out)) for a in p["args"])], out)
    if "file" in p:
        data = json.loads((out / p["file"]).read_text(encoding="utf-8"))
        return strip_timing({k: data[k] for k in p["keys"]})
    return {f.name: read_csv(f) for f in sorted(out.glob(f"{p.get('only', '')}*.csv"))}


def _mini_cell(p: dict[str, Any], out: Path) -> Any:
    sys.path.insert(0, str(_root() / "scripts"))
    import reproduce_mini

    index, (experiment, overrides) = next(
        (i, launch) for i, launch in enumerate(reproduce_mini.LAUNCHES) if launch[0] == p["table"]
    )
    variant = (*overrides, "seed=0,1,2", f"variant={p['variant']}")
    command = reproduce_mini.launch_command(experiment, variant, out / f"{index}_{experiment}", 1)
    _script(command[1:], out)
    _script(["scripts/make_tables.py", str(out), "--out", str(out / "tables"), "--found-only"], out)
    row = read_csv(out / "tables" / f"{p['table']}.csv")[0]
    return {k: v for k, v in row.items() if k.startswith(p["column"] + " ")}


def _claims_cell(p: dict[str, Any], out: Path) -> Any:
    sys.path.insert(0, str(_root() / "scripts"))
    import reproduce_mini
    from adaloss.lab.reports.claims import tasks_of

    experiment, overrides = reproduce_mini.CLAIM_LAUNCHES[p["launch"]]
    launch = (*overrides, f"variant={p['variant']}", "seed=0,1,2,3,4")
    _script(reproduce_mini.launch_command(experiment, launch, out / "claims", 1)[1:], out)
    (task,) = tasks_of([out / "claims"])
    (cell,) = task.cells.values()
    fake = [{"task": task.label, "result": f"{p['label']} {cell.describe()}"}]
    return claims_cells(fake, p["label"])


def _demo_row(p: dict[str, Any], out: Path) -> Any:
    _script(["scripts/demo.py", "--out", str(out), "--logger", "none", "--only", p["label"]], out)
    return strip_timing(markdown_rows((out / "table.md").read_text(encoding="utf-8"))[p["label"]])


KINDS = {
    "lab_run": _lab_run,
    "root_run": _root_run,
    "lm_run": _lm_run,
    "script_json": _script_files,
    "script_csv": _script_files,
    "mini_cell": _mini_cell,
    "claims_cell": _claims_cell,
    "demo_row": _demo_row,
}


def rerun(sample: Sample, out: Path) -> dict[str, Any]:
    """Rerun ``sample`` into the folder ``out``: ``{"values": ..., "kernel_path": ...}``, the kernel path
    this process ran on (the caller sets its threads and caps: :func:`.compare.child_env`)."""
    from adaloss.runner.provenance import kernel_path

    out.mkdir(parents=True, exist_ok=True)
    values = KINDS[sample.kind](sample.params, out)
    return {"values": json.loads(json.dumps(values)), "kernel_path": kernel_path()}


def main(argv: list[str] | None = None) -> int:
    """``FAMILY NAME OUT``: rerun that sample, write ``OUT/rerun.json``."""
    from adaloss.lab.results_check.samples import SAMPLES

    family, name, out = argv if argv is not None else sys.argv[1:]
    (sample,) = [s for s in SAMPLES if (s.family, s.name) == (family, name)]
    result = rerun(sample, Path(out))
    (Path(out) / "rerun.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
