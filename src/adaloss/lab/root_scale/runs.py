"""The root-scale lab's measurements: one training run per task, root and seed, and the cost per step of
each root (the three models taking turns on the same weights and batch)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from adaloss.lab.root_scale.tasks import ROOTS, TASKS, compose


def run_one(task: str, root: str, seed: int, out: Path) -> dict[str, Any]:
    """One training run; its metric, per-layer underflow at the last step, alpha_{N+1}, recomputes."""
    import shutil

    from adaloss.runner.engine import train

    cfg = compose(task, root, seed, out)
    shutil.rmtree(cfg.paths.output_dir, ignore_errors=True)  # a rerun starts fresh
    seen = {"recomputes": 0, "roots": []}

    def watch(step, model, optimizer, scaler) -> None:  # noqa: ANN001 - the trainer's StepCallback
        seen["recomputes"] += int(getattr(scaler, "last_pass", None) == "recompute")
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

    from adaloss.runner.data import build_datasets, make_loader
    from adaloss.runner.engine.optim import build_optimizer
    from adaloss.runner.engine.tasks import build_task
    from adaloss.runner.utils import seed_everything
    from adaloss.runner.utils.targets import build_precision, build_scaler

    setups = {}
    for root in ROOTS:
        cfg = compose(task, root, 0, Path("/nonexistent"), ("scaler.update_every=1",))
        seed_everything(0)
        if not setups:
            train_set, _, info = build_datasets(cfg.dataset, cfg.paths.data_dir)
            base = build_task(cfg.task, cfg.model, info, torch.device("cpu"))
            base.initialize(train_set)
            loader = make_loader(
                train_set, cfg.trainer.batch_size, train=True, seed=0, collate_fn=base.collate_fn
            )
            batch = base.to_device(next(iter(loader)))
            weights = copy.deepcopy(base.model)
        task_obj = copy.copy(base)
        precision = build_precision(cfg.precision, torch.device("cpu"))
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
