"""The root scale alpha_{N+1} (adaptive scaler): ``scaler.root`` = fixed (the paper's), dynamic or adaptive.

    python scripts/root_scale.py [--seeds 0,1,2,3,4] [--tasks gpt,ssd,resnet20] [--out results/root]
    python scripts/root_scale.py --from-json      # the tables again from results/root/root_scale.json

For each task, each seed and each root (interleaved: seed by seed, the three roots one after the other), one
short run of ``python train.py <task> precision=fp16 scaler=adaptive scaler.root=<root>`` (composed as
``train.py`` composes it, run by ``adaloss.engine.train`` in this process, single-threaded), then a cost
benchmark in the same process. Recorded per run: the task's validation metric, the per-layer underflow of
the last telemetry step (the runs' own telemetry), alpha_{N+1} at the end, skipped steps, and how many steps
recomputed the betas. The tasks (short reductions of the dataset recipes, chosen to fit a CPU budget):

* ``gpt``: ``model=gpt dataset=pystdlib``, 100 of its 400 steps (validation loss, lower is better), the
  betas recomputed every 10 steps (the dataset has no ``update_every`` of its own; the generic 100 would
  leave one recompute in the run, and ``root=adaptive`` no measurement that acts within it);
* ``ssd``: ``model=ssd512 dataset=shapes`` at 128x128 and 1/8 width, 30 of its 1500 steps, 64 test
  images (VOC07 mAP %);
* ``resnet20``: ``model=resnet20 dataset=digits``, 40 of its 200 steps (test accuracy %).

``root=dynamic`` starts at GradScaler's 2**16 (``scaler.init_scale=65536``) with its growth interval 2000
(no growth within these runs: it backs off to the largest scale that does not overflow); the other two start
at 1. Every other setting is the task's (``adaptive_recipe``: bounds, ``update_every``).

Cost per step: for each task, the three roots' models (same weights, same batch) take turns, ``--bench-steps``
steps each, ``--bench-rounds`` times, with ``update_every=1`` (every step recomputes the betas and, under
``adaptive``, measures the loss gradient: the root options' largest cost); the median step time of each
root divided by fixed's. The extra recomputes a root causes at the task's own ``update_every`` are in the
runs' recompute counts.

Writes ``<out>/root_scale.json`` (every run, the benchmark, the machine) and ``<out>/root_scale.md`` (the
tables: mean and 95% t-interval over the seeds; the difference to fixed paired by seed with its 95%
t-interval, and whether the interval excludes 0).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("ADALOSS_ROOT", str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _common import header_line, machine_info, markdown_table  # noqa: E402

ROOTS = ("fixed", "dynamic", "adaptive")
#: task -> (overrides, metric key, higher is better, metric label, output layers: the names' endings)
TASKS: dict[str, tuple[tuple[str, ...], str, bool, str, tuple[str, ...]]] = {
    "gpt": (
        (
            "model=gpt",
            "dataset=pystdlib",
            "trainer.max_steps=100",
            "trainer.eval_every=100",
            "scaler.update_every=10",
        ),
        "val_loss",
        False,
        "validation loss",
        ("lm_head",),
    ),
    "ssd": (
        (
            "model=ssd512",
            "dataset=shapes",
            "trainer.max_steps=30",
            "trainer.eval_every=30",
            "dataset.test_size=64",
        ),
        "map",
        True,
        "mAP (%)",
        ("head.",),
    ),
    "resnet20": (
        ("model=resnet20", "dataset=digits", "trainer.max_steps=40", "trainer.eval_every=40"),
        "test_accuracy",
        True,
        "test accuracy (%)",
        ("fc",),
    ),
}
PRETTY = {"gpt": "tiny GPT, pystdlib", "ssd": "SSD512, shapes", "resnet20": "ResNet-20, digits"}
ROOT_OVERRIDES = {"fixed": (), "dynamic": ("scaler.init_scale=65536",), "adaptive": ()}
COMMON = (
    "device=cpu",
    "logger=none",
    "trainer.progress_bar=false",
    "trainer.checkpoint_every=null",
    "precision=fp16",
    "scaler=adaptive",
)
# Student's t, 97.5% quantile, by degrees of freedom (1-30): the 95% two-sided interval
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145)
_T975 += (2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048)
_T975 += (2.045, 2.042)


def compose(task: str, root: str, seed: int, out: Path, extra: tuple[str, ...] = ()):  # noqa: ANN201
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import open_dict

    overrides, *_ = TASKS[task]
    steps = next(o.split("=")[1] for o in overrides if o.startswith("trainer.max_steps="))
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = hydra_compose(
            config_name="train",
            overrides=[
                *COMMON, *overrides, f"telemetry.every={steps}", f"scaler.root={root}",
                *ROOT_OVERRIDES[root], f"seed={seed}", *extra,
            ],
        )  # fmt: skip
    with open_dict(cfg):
        cfg.paths.output_dir = str(out / "runs" / f"{task}_{root}_seed{seed}")
    return cfg


def run_one(task: str, root: str, seed: int, out: Path) -> dict[str, Any]:
    """One training run; its metric, per-layer underflow at the last step, alpha_{N+1}, recomputes."""
    import shutil

    from adaloss.engine import train

    cfg = compose(task, root, seed, out)
    shutil.rmtree(cfg.paths.output_dir, ignore_errors=True)  # a rerun starts fresh
    seen = {"recomputes": 0, "roots": []}

    def watch(step, model, optimizer, scaler) -> None:  # noqa: ANN001 - the trainer's StepCallback
        seen["recomputes"] += int(bool(getattr(scaler, "_recomputing", False)))
        seen["roots"].append(scaler.get_scale())

    began = time.perf_counter()
    metrics = train(cfg, callbacks=[watch])
    _, key, *_ = TASKS[task]
    return {
        "task": task,
        "root": root,
        "seed": seed,
        "metric": metrics[key],
        "diverged": metrics["diverged"],
        "skipped_steps": metrics["skipped_steps"],
        "recomputes": seen["recomputes"],
        "root_scale_end": seen["roots"][-1] if seen["roots"] else None,
        "root_scale_max": max(seen["roots"]) if seen["roots"] else None,
        "underflow_rate": metrics["underflow_rate"],
        "wall_time_s": time.perf_counter() - began,
    }


def bench(task: str, steps: int, rounds: int) -> dict[str, Any]:
    """Median seconds per step of each root, the models taking turns (see the module docstring)."""
    import copy

    import torch

    from adaloss.data import build_datasets, make_loader
    from adaloss.engine.optim import build_optimizer
    from adaloss.engine.tasks import build_task
    from adaloss.precision import Precision
    from adaloss.scalers import build_scaler
    from adaloss.utils import seed_everything

    setups = {}
    for root in ROOTS:
        cfg = compose(task, root, 0, Path("/nonexistent"), ("scaler.update_every=1",))
        seed_everything(0)
        if not setups:
            train_set, _, info = build_datasets(cfg.dataset, cfg.paths.data_dir)
            base = build_task(cfg, info, torch.device("cpu"))
            base.initialize(train_set)
            loader = make_loader(
                train_set, cfg.trainer.batch_size, train=True, seed=0, collate_fn=base.collate_fn
            )
            batch = base.to_device(next(iter(loader)))
            weights = copy.deepcopy(base.model)
        task_obj = copy.copy(base)
        precision = Precision.from_config(cfg.precision, torch.device("cpu"))
        scaler = build_scaler(cfg.scaler, precision.grad_format)
        model = precision.prepare(scaler.attach(copy.deepcopy(weights)))
        optimizer = build_optimizer(cfg.optimizer, model)
        setups[root] = (task_obj, precision, scaler, model, optimizer)
    times: dict[str, list[float]] = {r: [] for r in ROOTS}
    for k in range(rounds + 1):  # round 0 warms up and is dropped
        order = ROOTS[k % 3 :] + ROOTS[: k % 3]
        for root in order:
            task_obj, precision, scaler, model, optimizer = setups[root]
            began = time.perf_counter()
            for _ in range(steps):
                optimizer.zero_grad(set_to_none=True)
                with precision.autocast():
                    loss, _ = task_obj.loss(model, batch)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            if k:
                times[root].append((time.perf_counter() - began) / steps)
    medians = {r: statistics.median(v) for r, v in times.items()}
    return {"task": task, "steps": steps, "rounds": rounds, "median_s": medians, "samples_s": times}


# ----------------------------------------------------------------------------------------------- tables


def t_interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval); half-width NaN for one value."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    t = _T975[min(len(values) - 2, len(_T975) - 1)]
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def _ci(values: list[float], digits: int) -> str:
    mean, half = t_interval(values)
    return f"{mean:.{digits}f} ± {half:.{digits}f}" if math.isfinite(half) else f"{mean:.{digits}f}"


def _runs(rows: list[dict], task: str, root: str) -> list[dict]:
    return sorted((r for r in rows if r["task"] == task and r["root"] == root), key=lambda r: r["seed"])


def metric_table(rows: list[dict]) -> tuple[str, dict[str, dict[str, str]]]:
    """The validation metric per task and root, and each root's paired difference to fixed; verdicts."""
    headers = ["task (metric)", "seeds", *(f"{r}" for r in ROOTS), "dynamic - fixed", "adaptive - fixed"]
    body, verdicts = [], {}
    for task in [t for t in TASKS if any(r["task"] == t for r in rows)]:
        _, _, higher, label, _ = TASKS[task]
        cells = [f"{PRETTY[task]} ({label})"]
        fixed = {r["seed"]: r["metric"] for r in _runs(rows, task, "fixed")}
        cells.append(str(len(fixed)))
        digits = 3 if task == "gpt" else 2
        cells += [_ci([r["metric"] for r in _runs(rows, task, root)], digits) for root in ROOTS]
        verdicts[task] = {}
        for root in ("dynamic", "adaptive"):
            diffs = [r["metric"] - fixed[r["seed"]] for r in _runs(rows, task, root) if r["seed"] in fixed]
            mean, half = t_interval(diffs)
            separated = math.isfinite(half) and abs(mean) > half
            better = (mean > 0) == higher
            verdict = ("better" if better else "worse") if separated else "cannot separate"
            verdicts[task][root] = verdict
            cells.append(f"{mean:+.{digits}f} ± {half:.{digits}f} ({verdict})")
        body.append(cells)
    return markdown_table(headers, body), verdicts


def underflow_table(rows: list[dict]) -> str:
    """Per task and root: the output layers' and the other layers' mean underflow at the last step (mean
    over seeds), the worst layer, alpha_{N+1} at the end, skipped steps and recomputes per run."""
    headers = [
        "task", "root", "output layers' underflow (%)", "other layers' underflow (%)", "worst layer (%)",
        "alpha_{N+1} at the end", "skipped steps / run", "recomputes / run",
    ]  # fmt: skip
    body = []
    for task in [t for t in TASKS if any(r["task"] == t for r in rows)]:
        outputs = TASKS[task][4]
        for root in ROOTS:
            runs = _runs(rows, task, root)
            if not runs:
                continue
            out_rates, other_rates, worst = [], [], []
            for r in runs:
                rates = r["underflow_rate"]
                mine = [v for k, v in rates.items() if any(k == o or k.startswith(o) for o in outputs)]
                rest = [v for k, v in rates.items() if not any(k == o or k.startswith(o) for o in outputs)]
                out_rates.append(100 * statistics.fmean(mine) if mine else math.nan)
                other_rates.append(100 * statistics.fmean(rest) if rest else math.nan)
                name = max(rates, key=rates.get)
                worst.append((100 * rates[name], name))
            top = max(worst)
            scales = sorted(r["root_scale_end"] for r in runs)
            body.append([
                PRETTY[task], root, _ci(out_rates, 2), _ci(other_rates, 3), f"{top[0]:.1f} ({top[1]})",
                f"{scales[0]:g}" if scales[0] == scales[-1] else f"{scales[0]:g} to {scales[-1]:g}",
                f"{statistics.fmean(r['skipped_steps'] for r in runs):.1f}",
                f"{statistics.fmean(r['recomputes'] for r in runs):.1f}",
            ])  # fmt: skip
    return markdown_table(headers, body, left=2)


def cost_table(benches: list[dict]) -> str:
    headers = ["task", *(f"{r} (ms / step)" for r in ROOTS), "dynamic / fixed", "adaptive / fixed"]
    body = []
    for b in benches:
        m = b["median_s"]
        body.append([
            PRETTY[b["task"]], *(f"{1000 * m[r]:.1f}" for r in ROOTS),
            f"{m['dynamic'] / m['fixed']:.3f}", f"{m['adaptive'] / m['fixed']:.3f}",
        ])  # fmt: skip
    return markdown_table(headers, body)


def report(summary: dict[str, Any]) -> str:
    rows, benches = summary["runs"], summary["bench"]
    metrics, verdicts = metric_table(rows)
    seeds = sorted({r["seed"] for r in rows})
    parts = [
        f"{header_line(summary['machine'])}; seeds {','.join(map(str, seeds))}; emulated FP16 on the CPU",
        "",
        "Validation metric (mean ± 95% t-interval over the seeds; differences paired by seed):",
        "",
        metrics,
        "",
        "Underflow at the last step (the runs' telemetry: share of each layer's non-zero output gradient "
        "flushed to zero in FP16; mean ± 95% t-interval over the seeds):",
        "",
        underflow_table(rows),
    ]
    if benches:
        steps, rounds = benches[0]["steps"], benches[0]["rounds"]
        parts += [
            "",
            f"Cost per step with update_every=1 (median of {rounds} interleaved blocks of {steps} steps, "
            "same process, same weights and batch):",
            "",
            cost_table(benches),
        ]
    summary["verdicts"] = verdicts
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"of {', '.join(TASKS)}")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "root")
    parser.add_argument("--bench-steps", type=int, default=3)
    parser.add_argument("--bench-rounds", type=int, default=5)
    parser.add_argument("--from-json", action="store_true", help="only rebuild the tables from the json")
    args = parser.parse_args(argv)
    path = args.out / "root_scale.json"
    if args.from_json:
        if not path.is_file():
            raise SystemExit(
                f"error: {path} does not exist; run scripts/root_scale.py without --from-json first"
            )
        summary = json.loads(path.read_text(encoding="utf-8"))
    else:
        tasks = args.tasks.split(",")
        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            raise SystemExit(f"error: unknown task(s) {', '.join(unknown)}: choose from {', '.join(TASKS)}")
        try:
            seeds = [int(s) for s in args.seeds.split(",")]
        except ValueError:
            raise SystemExit(
                f"error: --seeds takes integers separated by commas, got {args.seeds!r}"
            ) from None
        import torch

        torch.set_num_threads(1)
        summary = {"machine": machine_info(), "runs": [], "bench": []}
        for task in tasks:
            for seed in seeds:
                for root in ROOTS:
                    row = run_one(task, root, seed, args.out)
                    summary["runs"].append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "underflow_rate"}), flush=True)
            summary["bench"].append(bench(task, args.bench_steps, args.bench_rounds))
            print(json.dumps(summary["bench"][-1]["median_s"]), flush=True)
    text = report(summary)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (args.out / "root_scale.md").write_text(text, encoding="utf-8")
    print(f"\n{text}")


if __name__ == "__main__":
    main()
