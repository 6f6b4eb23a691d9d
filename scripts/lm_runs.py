"""The tiny GPT on the standard library corpus under FP32 and FP16 loss scalers, over seeds (README table).

    .venv/bin/python scripts/lm_runs.py [--seeds 0,1,2] [--variants fp32,none,...] [overrides]

Each run composes the config ``python train.py model=gpt dataset=pystdlib <variant> <overrides>`` uses and
calls ``adaloss.runner.engine.train`` in this process (folders under ``--out``, default ``results/lm/``).
Before it, the validation loss of the run's initial model is measured: the trainer seeds, builds the data and
builds the model in that order, so doing the same here gives the weights the run starts from. Prints a
Markdown table (mean and sample standard deviation over the seeds of the validation loss at the start and at
the end, the best, the mean activation-gradient underflow rate over the layers at the last telemetry step, for
the FP32 run what FP16 would lose; skipped steps, wall time) and writes every run's numbers to
``<out>/lm_runs.json``, the table to ``<out>/table.md``.

``--merge`` keeps the runs of the variants not run now from an earlier ``<out>/lm_runs.json`` made with the
same overrides (adding one variant to a table costs that variant's runs only); the table's header then names
the machine and load of both measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("ADALOSS_ROOT", str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _common import header_line, machine_info  # noqa: E402
from adaloss.lab.lm_runs import VARIANTS, compose_run  # noqa: E402


def initial_val_loss(cfg) -> float:  # noqa: ANN001 - a DictConfig
    """The validation loss of the model the run starts from (same seed, same build order as the trainer)."""
    import torch

    from adaloss.runner.data import build_datasets, make_loader
    from adaloss.runner.engine.tasks import build_task
    from adaloss.runner.utils import seed_everything
    from adaloss.runner.utils.targets import build_precision

    seed_everything(int(cfg.seed))
    _, val_set, info = build_datasets(cfg.dataset, cfg.paths.data_dir)
    task = build_task(cfg.task, cfg.model, info, torch.device("cpu"))
    loader = make_loader(val_set, cfg.trainer.eval_batch_size, train=False, seed=cfg.seed)
    return task.evaluate(task.model, loader, build_precision(cfg.precision, "cpu")).value


def _cell(values: list[float], digits: int = 3) -> str:
    if len(values) < 2:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| run | seeds | val loss at start | val loss at end | best val loss | perplexity at end "
        "| mean underflow at end (%) | skipped steps | wall time (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        lines.append(
            f"| {variant} | {','.join(str(r['seed']) for r in mine)} | {_cell([r['start'] for r in mine])} "
            f"| {_cell([r['val_loss'] for r in mine])} | {_cell([r['best_val_loss'] for r in mine])} "
            f"| {_cell([r['perplexity'] for r in mine], 2)} "
            f"| {_cell([100 * r['mean_underflow_rate'] for r in mine], 2)} "
            f"| {sum(r['skipped_steps'] for r in mine)} "
            f"| {_cell([r['wall_time_s'] for r in mine], 0)} |"
        )
    return "\n".join(lines)


def kept_runs(path: Path, variants: list[str], overrides: list[str]) -> list[dict]:
    """The earlier runs at ``path`` of variants other than ``variants``, each with its machine (``--merge``).

    Nothing if there is no earlier file; one ``error:`` line (``SystemExit``) if it was made with other
    overrides, as its rows would not be comparable."""
    if not path.is_file():
        return []
    try:
        earlier = json.loads(path.read_text(encoding="utf-8"))
        runs, made_with = earlier["runs"], earlier["overrides"]
        kept = [{"machine": earlier["machine"], **r} for r in runs if r["variant"] not in variants]
    except (ValueError, KeyError, TypeError) as error:
        raise SystemExit(
            f"error: {path} is not an lm_runs.json ({error}); remove it or drop --merge"
        ) from None
    if made_with != overrides:
        raise SystemExit(
            f"error: {path} was made with overrides {made_with}, not {overrides}: "
            "give the same overrides or drop --merge"
        )
    return kept


def headers(rows: list[dict]) -> str:
    """One header line per machine measurement, naming its variants when the rows come from more than one."""
    by_machine: dict[str, list[str]] = {}
    for row in rows:
        names = by_machine.setdefault(header_line(row["machine"]), [])
        if row["variant"] not in names:
            names.append(row["variant"])
    if len(by_machine) == 1:
        return next(iter(by_machine))
    return "\n".join(f"{', '.join(names)}: {line}" for line, names in by_machine.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "lm")
    parser.add_argument(
        "--merge", action="store_true", help="keep the other variants' runs from <out>/lm_runs.json"
    )
    parser.add_argument(
        "overrides", nargs="*", help="more overrides for every run, e.g. model.tie_weights=false"
    )
    args = parser.parse_args(argv)
    from adaloss.runner.engine import train

    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"error: unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    kept = kept_runs(args.out / "lm_runs.json", variants, args.overrides) if args.merge else []
    machine = machine_info()
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for variant in variants:
            cfg = compose_run(variant, seed, args.overrides, args.out)
            start = initial_val_loss(cfg)
            began = time.perf_counter()
            metrics = train(cfg)
            row = {
                "variant": variant,
                "seed": seed,
                "start": start,
                **{
                    k: metrics[k]
                    for k in ("val_loss", "best_val_loss", "perplexity", "skipped_steps", "steps")
                },
                "mean_underflow_rate": metrics["mean_underflow_rate"],  # the last telemetry step's
                "wall_time_s": time.perf_counter() - began,
                "machine": machine,
            }
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "machine"}), flush=True)
    order = list(VARIANTS)
    rows = sorted(kept + rows, key=lambda r: (order.index(r["variant"]), r["seed"]))
    summary = {"machine": machine, "overrides": args.overrides, "runs": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lm_runs.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    text = f"{headers(rows)}\n\n{table(rows)}\n"
    (args.out / "table.md").write_text(text, encoding="utf-8")
    print(f"\n{text}")


if __name__ == "__main__":
    main()
