"""`make demo`: ResNet-20 on the bundled digits, FP32 and FP16 under every loss scaler, side by side.

Runs the digits recipe (configs/dataset/digits.yaml) five times in this process, each by composing the
same config `python train.py` uses and calling `adaloss.runner.engine.train`:

    fp32 (no scaling) | fp16 none | fp16 fixed (S=128) | fp16 dynamic | fp16 adaptive

then prints test accuracy, skipped steps, the mean activation-gradient underflow rate (last telemetry
step, averaged over layers) and wall time. Each run's folder is results/demo/<label>/ (metrics.json and
offline W&B files). About 5 minutes on 2 idle CPU cores; `--max-steps 50` for a quicker look.

The kernel path is pinned, so every CPU prints the same table: torch's, oneDNN's and MKL's kernels capped at
AVX2 (:func:`adaloss.runner.provenance.pin_kernel_path`; a variable you set yourself wins) and 2 threads.
Without the pin, the table depends on the CPU's vector instructions and the thread count (a 30-step FP32 run:
26.11% test accuracy on AVX-512 with 1 thread, 22.50% with 2, 23.61% capped at AVX2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("ADALOSS_ROOT", str(ROOT))

from _env import require_project_python  # noqa: E402 - standard library only; scripts/ is on sys.path

require_project_python()  # a shell without .venv activated: one error: line naming the fix

sys.path.insert(0, str(ROOT / "src"))  # this checkout's adaloss, before torch is imported
from adaloss.runner.provenance import pin_kernel_path, result_record  # noqa: E402 - standard library only

pin_kernel_path()  # before torch: ATen reads its cap when it starts
#: The threads every demo run uses (the thread count splits the parallel reductions: part of the path).
THREADS = 2

from omegaconf import open_dict  # noqa: E402

from adaloss.runner.engine import train  # noqa: E402
from adaloss.runner.schemas import compose_train  # noqa: E402

#: (label, overrides) of each run, in table order.
RUNS: list[tuple[str, list[str]]] = [
    ("fp32", ["precision=fp32", "scaler=none"]),
    ("fp16-none", ["precision=fp16", "scaler=none"]),
    ("fp16-fixed128", ["precision=fp16", "scaler=fixed", "scaler.scale=128"]),
    ("fp16-dynamic", ["precision=fp16", "scaler=dynamic"]),
    ("fp16-adaptive", ["precision=fp16", "scaler=adaptive"]),
]


def compose_run(label: str, overrides: list[str], out: Path, max_steps: int | None, logger: str) -> object:
    """The digits config for one demo run, writing to ``out/label``."""
    common = ["dataset=digits", "model=resnet20", "device=cpu", f"logger={logger}"]
    if max_steps is not None:
        common.append(f"trainer.max_steps={max_steps}")
    cfg = compose_train(ROOT / "configs", [*common, *overrides])
    with open_dict(cfg):
        cfg.paths.output_dir = str(out / label)
    return cfg


def format_table(rows: list[dict[str, object]]) -> str:
    """A Markdown table of the demo results, padded so it also reads well as plain text."""
    header = ["run", "test acc (%)", "skipped steps", "mean underflow (%)", "wall time (s)"]
    body = [
        [
            str(r["run"]),
            f"{r['test_accuracy']:.2f}",
            str(r["skipped_steps"]),
            f"{100 * float(r['mean_underflow_rate']):.2f}",
            f"{r['wall_time_s']:.0f}",
        ]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        return (
            "| "
            + " | ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))])
            + " |"
        )

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule, *(line(cells) for cells in body)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--max-steps", type=int, default=None, help="cap each run (default: the recipe's 200)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "demo", help="output folder")
    parser.add_argument("--logger", default="wandb", choices=["wandb", "none"], help="W&B (offline) or none")
    parser.add_argument("--only", default="", help="comma-separated run labels (default: every run)")
    args = parser.parse_args()
    labels = [label for label, _ in RUNS]
    only = [name for name in args.only.split(",") if name]
    if any(name not in labels for name in only):
        parser.error(f"--only takes labels of {', '.join(labels)}, got {args.only!r}")

    import torch

    torch.set_num_threads(THREADS)
    runs = [(label, overrides) for label, overrides in RUNS if not only or label in only]
    started = time.perf_counter()
    rows: list[dict[str, object]] = []
    for label, overrides in runs:
        shutil.rmtree(args.out / label, ignore_errors=True)  # a fresh folder: one W&B run, one metrics.json
        cfg = compose_run(label, overrides, args.out, args.max_steps, args.logger)
        metrics = train(cfg)
        rows.append({"run": label, **metrics})
        print(
            f"{label:>14}: test accuracy {metrics['test_accuracy']:.2f}%, "
            f"skipped {metrics['skipped_steps']}, {metrics['wall_time_s']:.0f} s",
            flush=True,
        )

    table = format_table(rows)
    steps = rows[0]["steps"] if rows else 0
    print(f"\nResNet-20 on digits, {steps} iterations per run, CPU (FP16 emulated):\n")
    print(table)
    print(f"\ntotal {time.perf_counter() - started:.0f} s; run folders under {args.out}")
    (args.out / "table.md").write_text(table + "\n")
    if not only and args.max_steps is None:  # the page's table: what made it (docs/index.md shows it)
        record = result_record(" ".join(["python scripts/demo.py", *sys.argv[1:]]).strip())
        (args.out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
