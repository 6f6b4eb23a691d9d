"""The mini reproduction: every experiment of configs/experiment/ in reduced form, then tables and figures.

    python scripts/reproduce_mini.py [--out results/mini] [--jobs 2] [--only table1_cifar,fig1_ssd_stats]
    python scripts/reproduce_mini.py --claims-only      # the claims stage alone (make reproduce-claims)
    make reproduce-mini

Each experiment is launched exactly as on a cluster (``python train.py -m experiment=<name> ...``), with
overrides that swap the paper's data for the bundled data and shrink the runs so that the whole set fits in
about an hour on 2 CPU cores (111 runs with the default 3 seeds):

* classification (Tables 1, 2, 4, Figure 4a): scikit-learn's ``digits`` instead of CIFAR / ImageNet, the
  experiment's model (ResNet-20 for the CIFAR tables, ResNet-18 for ImageNet's), ``--seeds`` (default three:
  toy-scale results vary from seed to seed, so the tables show mean and spread), a shortened digits recipe
  (``trainer.max_steps``);
* detection (Tables 3, 5, Figures 1, 4b): the generated ``shapes`` data instead of PASCAL VOC, with its
  recipe (SSD512 with its seven branches at 128x128 and 1/8 width: the CPU knobs ``model.image_size``,
  ``model.width_multiplier``) cut to 200 iterations, and batch sizes 8 and 16 instead of 8 and 32.

Runs that two experiments share are launched once: Table 4 adds only the scale-1 run to Table 1's fixed
scales and Table 5 only scales 1 and 16 to Table 3's batch-8 runs (``make_tables.py`` takes every run from
every folder). Launches run one after the other; within one, Hydra's joblib launcher runs ``--jobs`` runs
side by side, each on one thread.

Then the **claims stage** (``--claims-only`` runs it alone and keeps the other runs; ``--no-claims`` skips
it): ``experiment=claims_ssd``, SSD512 on shapes at batch 8 with its gradients calibrated by
``trainer.loss_multiplier`` to the paper's underflow regime (the config says how and why), 7 methods x
``--claims-seeds`` (default five), 100 iterations each, at two calibrations (gradients x 2^-12 and x 2^-16):
70 runs, about 40 minutes of one core. Then
``python -m adaloss.lab.reports.claims`` turns them into a verdict per claim of the paper (``claims/``).

Output, under ``--out``: one sweep folder per experiment, ``tables/`` (``tables.md`` and the CSVs of
``scripts/make_tables.py``), ``figures/`` (the PNGs of ``scripts/make_figures.py``), ``claims/``
(``claims.md``, ``claims.csv``, ``claims.json``) and ``timing.json`` (seconds per launch). The tables and
figures are a smoke test of the whole pipeline at toy scale, not the paper's: every table and figure says
which data and model it comes from.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Shared by every classification launch: the digits recipe cut to 100 iterations (``--seeds`` added).
DIGITS = ("dataset=digits", "trainer.max_steps=100", "trainer.eval_every=100")
#: Shared by every detection launch: the shapes recipe (SSD512 with its 7 branches at 128x128 and 1/8 width)
#: cut to 200 iterations: far from its 75% mAP at 1500, but every method trains through the same pipeline.
SHAPES = (
    "dataset=shapes",
    "trainer.max_steps=200",
    "trainer.eval_every=200",
    "dataset.test_size=128",
)

#: (experiment, overrides): what each launch runs. Overrides of a swept key replace the experiment's grid.
LAUNCHES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("table1_cifar", (*DIGITS, "model=resnet20")),  # 9 variants
    ("table4_fixed_scales", (*DIGITS, "model=resnet20", "variant=fixed1")),  # + Table 1's fixed scales
    ("table2_imagenet", (*DIGITS, "model=resnet18")),  # 5 variants
    ("table3_ssd", (*SHAPES, "trainer.batch_size=8,16")),  # 2 batch sizes (paper: 8, 32) x 8 variants
    ("table5_ssd_fixed", (*SHAPES, "variant=fixed1,fixed16")),  # + Table 3's batch-8 fixed scales
    ("fig1_ssd_stats", (*SHAPES, "telemetry.every=10")),
    ("fig4_scales", (*SHAPES, "telemetry.every=10")),  # (b): fixed 128 and adaptive on SSD
    ("fig4_scales", (*DIGITS, "model=resnet18", "variant=adaptive", "telemetry.every=10")),  # (a)
)

#: The claims stage: (experiment, overrides), each launched with ``--claims-seeds``; its runs are judged by
#: ``adaloss.lab.reports.claims`` (the experiment config holds the calibration and the methods).
CLAIM_LAUNCHES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("claims_ssd", ()),  # the calibration: gradients x 2^-12
    # gradients 16 times smaller still (x 2^-16): lr x 2^16, weight decay and clipping norm x 2^-16
    ("claims_ssd", ("trainer.loss_multiplier=1.52587890625e-05", "optimizer.lr=655.36",
                    "optimizer.weight_decay=7.62939453125e-09", "trainer.grad_clip=7.62939453125e-05")),
)  # fmt: skip
#: Label of the claims launch folders: after the main launches' ``0_`` to ``7_``.
CLAIM_INDEX = len(LAUNCHES)

#: ``--smoke``: the same launches cut to 2 iterations each (a check of the pipeline, for tests).
SMOKE = ("trainer.max_steps=2", "trainer.eval_every=2", "telemetry.every=1")
SMOKE_SHAPES = ("dataset.test_size=8", "model.image_size=64")

#: Settings that do not change results: CPU, no W&B, no progress bars, the joblib launcher.
COMMON = (
    "device=cpu",
    "logger=none",
    "trainer.progress_bar=false",
    "trainer.num_workers=0",  # DataLoader workers cannot start inside joblib's worker processes
    "hydra/launcher=joblib",
)


def launch_command(experiment: str, overrides: Sequence[str], sweep_dir: Path, jobs: int) -> list[str]:
    """The ``train.py -m`` command of one launch (what a user would type, plus the output folder)."""
    return [
        sys.executable,
        str(ROOT / "train.py"),
        "-m",
        f"experiment={experiment}",
        *overrides,
        *COMMON,
        f"hydra.launcher.n_jobs={jobs}",
        f"hydra.sweep.dir={sweep_dir}",
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "mini", help="output folder")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel per launch (default 2)")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated experiment names to launch (default: all); skips the claims",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep an existing --out folder's runs (default: start clean)"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="2 iterations per run: checks the pipeline in a few minutes"
    )
    parser.add_argument(
        "--seeds", default="0,1,2", help="comma-separated seeds of every run (default 0,1,2; --smoke: 0)"
    )
    stage = parser.add_mutually_exclusive_group()
    stage.add_argument(
        "--claims-only", action="store_true", help="only the claims stage (keeps the other runs in --out)"
    )
    stage.add_argument("--no-claims", action="store_true", help="skip the claims stage")
    parser.add_argument(
        "--claims-seeds", default="0,1,2,3,4", help="seeds of the claims stage (default 0-4; --smoke: 0)"
    )
    return parser.parse_args(argv)


def _seeds(text: str, option: str) -> list[str] | None:
    """The seeds of a comma-separated list, or None (after one error line) if one is not an integer."""
    seeds = [s.strip() for s in text.split(",")]
    if all(s.lstrip("-").isdigit() for s in seeds):
        return seeds
    print(f"error: {option} must be integers separated by commas (e.g. 0,1,2), got {text!r}", file=sys.stderr)
    return None


def _launch(label: str, experiment: str, overrides: Sequence[str], args: argparse.Namespace, out: Path,
            env: dict[str, str], started: float) -> float | None:  # fmt: skip
    """One ``train.py -m`` launch into ``out/label``: its seconds, or None (after the error) if it failed."""
    if args.smoke:
        shapes = "dataset=shapes" in overrides or experiment.startswith("claims_")
        overrides = (*overrides, *SMOKE, *(SMOKE_SHAPES if shapes else ()))
    command = launch_command(experiment, overrides, out / label, args.jobs)
    print(f"[{time.perf_counter() - started:6.0f} s] {label}: {' '.join(command[2:])}", flush=True)
    tick = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
        print(f"{tail}\nerror: launch {label} failed (exit {result.returncode}); see above", file=sys.stderr)
        return None
    return round(time.perf_counter() - tick, 1)


def _main_stage(args, seeds, selected, out, env, started, timing) -> int:  # type: ignore[no-untyped-def]
    """The launches of the paper's tables and figures, then ``tables/`` and ``figures/``."""
    for index, (experiment, overrides) in enumerate(LAUNCHES):
        if selected and experiment not in selected:
            continue
        label = f"{index}_{experiment}"
        seconds = _launch(label, experiment, (*overrides, f"seed={','.join(seeds)}"), args, out, env, started)
        if seconds is None:
            return 1
        timing[label] = seconds
        (out / "timing.json").write_text(json.dumps(timing, indent=2) + "\n")
    print(f"[{time.perf_counter() - started:6.0f} s] tables", flush=True)
    tables = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tables.py"), str(out), "--out", str(out / "tables"),
         "--found-only"],
        cwd=ROOT, env=env,
    )  # fmt: skip
    print(f"[{time.perf_counter() - started:6.0f} s] figures", flush=True)
    figures = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_figures.py"), str(out), "--out", str(out / "figures")],
        cwd=ROOT, env=env,
    )  # fmt: skip
    return 0 if tables.returncode == 0 and figures.returncode == 0 else 1


def _claims_stage(args, seeds, out, env, started, timing) -> int:  # type: ignore[no-untyped-def]
    """The claims launches (a clean folder each), then ``claims/`` from their runs."""
    folders = []
    for offset, (experiment, overrides) in enumerate(CLAIM_LAUNCHES):
        label = f"{CLAIM_INDEX + offset}_{experiment}"
        shutil.rmtree(out / label, ignore_errors=True)
        seconds = _launch(label, experiment, (*overrides, f"seed={','.join(seeds)}"), args, out, env, started)
        if seconds is None:
            return 1
        timing[label] = seconds
        folders.append(str(out / label))
    print(f"[{time.perf_counter() - started:6.0f} s] claims", flush=True)
    claims = subprocess.run(
        [sys.executable, "-m", "adaloss.lab.reports.claims", *folders, "--out", str(out / "claims")],
        cwd=ROOT, env=env,
    )  # fmt: skip
    return claims.returncode


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.jobs < 1:
        print(f"error: --jobs must be at least 1, got {args.jobs}", file=sys.stderr)
        return 2
    seeds = _seeds("0" if args.smoke and args.seeds == "0,1,2" else args.seeds, "--seeds")
    claim_seeds = _seeds("0" if args.smoke and args.claims_seeds == "0,1,2,3,4" else args.claims_seeds,
                         "--claims-seeds")  # fmt: skip
    if seeds is None or claim_seeds is None:
        return 2
    selected = set(args.only.split(",")) if args.only else None
    known = {name for name, _ in LAUNCHES}
    if selected and not selected <= known:
        unknown = ", ".join(sorted(selected - known))
        print(
            f"error: unknown experiment(s) {unknown}: choose from {', '.join(sorted(known))}", file=sys.stderr
        )
        return 2
    out: Path = args.out.resolve()
    if out.exists() and not (args.keep or args.claims_only):
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    timing_path = out / "timing.json"
    timing: dict[str, float] = (
        json.loads(timing_path.read_text()) if args.claims_only and timing_path.exists() else {}
    )
    started = time.perf_counter()
    status = 0
    if not args.claims_only:
        status = _main_stage(args, seeds, selected, out, env, started, timing)
    if status == 0 and not args.no_claims and not selected:
        status = _claims_stage(args, claim_seeds, out, env, started, timing)
    total = time.perf_counter() - started
    timing["claims_total" if args.claims_only else "total"] = round(total, 1)
    timing_path.write_text(json.dumps(timing, indent=2) + "\n")
    print(f"mini reproduction done in {total / 60:.1f} min: {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
