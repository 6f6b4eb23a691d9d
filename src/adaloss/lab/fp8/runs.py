"""Running the lab: one run in this process (``adaloss.runner.engine.train``), the resumable runs files
(``<out>/runs_<model>.jsonl``, one line per finished run) and the loop over every missing run."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

from adaloss.lab.fp8.cells import COMMON, MODELS, Cell, settings_digest
from adaloss.lab.reports.measurement import ROOT


def compose_run(model: str, cell: Cell, seed: int, smoke: bool, runs_dir: Path):  # noqa: ANN201 - DictConfig
    from omegaconf import open_dict

    from adaloss.runner.schemas import compose_train

    spec = MODELS[model]
    overrides = [*COMMON, *(spec.smoke if smoke else spec.overrides), *cell.overrides, f"seed={seed}"]
    cfg = compose_train(ROOT / "configs", overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(runs_dir / model / f"{cell.name.replace('/', '_')}_seed{seed}")
    return cfg


def run_one(model: str, cell: Cell, seed: int, smoke: bool, runs_dir: Path) -> dict[str, Any]:
    """Train one run in this process; the row the report reads."""
    from adaloss.runner.engine import train

    cfg = compose_run(model, cell, seed, smoke, runs_dir)
    shutil.rmtree(cfg.paths.output_dir, ignore_errors=True)  # an unfinished earlier attempt
    began = time.perf_counter()
    metrics = train(cfg)
    value = metrics.get(MODELS[model].metric)
    return {
        "model": model,
        "cell": cell.name,
        "seed": seed,
        "settings": settings_digest(model, smoke),
        "value": None if value is None or not math.isfinite(value) else float(value),
        "diverged": bool(metrics["diverged"]),
        "steps": metrics["steps"],
        "skipped_steps": metrics["skipped_steps"],
        "underflow_rate": metrics.get("underflow_rate", {}),
        "saturation_rate": metrics.get("saturation_rate", {}),
        "sqnr_db": metrics.get("sqnr_db", {}),
        **({"fp4_grad_to_noise": metrics["fp4_grad_to_noise"]} if "fp4_grad_to_noise" in metrics else {}),
        "wall_time_s": round(time.perf_counter() - began, 2),
    }


def read_rows(path: Path, digest: str) -> list[dict[str, Any]]:
    """The finished runs in ``path`` (none if it does not exist); an ``error:`` line if they were made with
    other settings or the file is not a runs file."""
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            row = json.loads(line)
            made_with = row["settings"]
        except (ValueError, KeyError, TypeError):
            raise SystemExit(
                f"error: {path}:{number} is not a run of scripts/fp8_lab.py; remove it"
            ) from None
        if made_with != digest:
            raise SystemExit(
                f"error: {path} holds runs made with other settings ({made_with}, now {digest}): remove it "
                "or give another --out"
            )
        rows.append(row)
    return rows


def run_all(models: list[str], cells: list[Cell], seeds: list[int], args: argparse.Namespace) -> None:
    """Every (model, cell, seed) not yet in its model's runs file, appended as each finishes; seed by seed,
    so a lab stopped early holds whole seeds of every cell."""
    paths = {m: args.out / f"runs_{m}.jsonl" for m in models}
    done = {
        (m, r["cell"], r["seed"]) for m in models for r in read_rows(paths[m], settings_digest(m, args.smoke))
    }
    todo = [(m, c, s) for s in seeds for m in models for c in cells if (m, c.name, s) not in done]
    print(f"[fp8_lab] {len(done)} runs found, {len(todo)} to run", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for number, (model, cell, seed) in enumerate(todo, 1):
        row = run_one(model, cell, seed, args.smoke, args.runs_dir)
        with open(paths[model], "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"[fp8_lab] {number}/{len(todo)} {model} {cell.name} seed {seed}: {row['value']} "
            f"({row['wall_time_s']:.1f} s)",
            flush=True,
        )
