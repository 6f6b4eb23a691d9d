"""Write the sample run records under ``tests/data/tables/runs/`` (run once; the output is committed).

The second command regenerates the expected output of ``tests/test_make_tables.py``; read the diff before
committing it: it is what the golden-file test holds the script to.

    .venv/bin/python tests/data/tables/make_sample_runs.py
    .venv/bin/python scripts/make_tables.py tests/data/tables/runs --out tests/data/tables/expected --all

The records look like the trainer's ``metrics.json`` (same keys; classification configs composed from the
real ``configs/`` with ``hydra.compose``, detection configs written out here) with invented but realistic
values, laid out as Hydra writes sweeps and runs. What the sample exercises:

* a Table 1 sweep with two seeds of most cells, one seed of some, whole configurations missing, and one
  crashed job (a ``.hydra/`` folder without ``metrics.json``);
* a later Table 4 sweep that repeats one configuration and seed (the later one counts), adds scale 1 (lowest
  mean of its row, yet not Table 1's "worst": not one of Table 1's candidates), and a seed flagged
  ``"diverged": true`` next to a finite one;
* ImageNet runs with one column missing and a fixed scale Table 2 has no column for;
* SSD runs: no scaling diverged (``map`` written as ``null``, as the trainer writes NaN), a fixed scale
  flagged diverged, batch 32 mostly missing;
* runs in no table (BF16) and rows the paper does not have (the bundled ``digits``, as in the mini
  reproduction), and a row whose runs differ in ``trainer.max_steps``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
OUT = HERE / "runs"
os.environ["ADALOSS_ROOT"] = "/home/user/adaloss"  # what the resolved paths say in the records

from omegaconf import open_dict  # noqa: E402

from adaloss.runner.engine.config import resolved_config  # noqa: E402
from adaloss.runner.schemas import compose_train  # noqa: E402


def classification_config(dataset: str, model: str, variant: str, seed: int, extra: list[str]) -> dict:
    overrides = [f"dataset={dataset}", f"model={model}", f"+variant={variant}", f"seed={seed}", *extra]
    cfg = compose_train(REPO / "configs", overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = "/home/user/adaloss/results/sweeps/<job>"
    return resolved_config(cfg)


def detection_config(variant: str, batch: int, seed: int = 0) -> dict:
    precision = "fp32" if variant == "fp32" else "fp16"
    if variant.startswith("fixed"):
        scaler: dict[str, Any] = {"name": "fixed", "scale": int(variant[5:])}
    elif variant in ("fp32", "none"):
        scaler = {"name": "none"}
    elif variant == "dynamic":
        scaler = {
            "name": "dynamic",
            "init_scale": 65536,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 2000,
            "min_scale": 1.0,
            "max_scale": None,
            "hysteresis": 1,
        }
    else:
        scaler = {
            "name": "adaptive",
            "t_uf": 0.001,
            "update_every": 100,
            "init_scale": 1.0,
            "allow_below_one": False,
            "growth_interval": 2000,
        }
    name = f"ssd512_voc_batch{batch}_{precision}_{scaler['name']}{scaler.get('scale', '')}_seed{seed}"
    return {
        "seed": seed,
        "device": "auto",
        "name": name,
        "trainer": {
            "batch_size": batch,
            "steps": 120000,
            "epochs": None,
            "max_steps": None,
            "eval_every": 10000,
            "eval_batch_size": 32,
            "log_every": 50,
            "grad_clip": None,
            "num_workers": 8,
            "progress_bar": True,
        },
        "telemetry": {"every": 100, "format": "fp16"},
        "paths": {
            "root_dir": "/home/user/adaloss",
            "data_dir": "/home/user/adaloss/runner/data",
            "results_dir": "/home/user/adaloss/results",
            "output_dir": "/home/user/adaloss/results/sweeps/<job>",
        },
        "optimizer": {"name": "sgd", "lr": 0.001, "momentum": 0.9, "weight_decay": 0.0005, "nesterov": False},
        "schedule": {
            "name": "multistep",
            "milestones": [0.6666666667, 0.8333333333],
            "gamma": 0.1,
            "warmup_fraction": 0.0,
            "warmup_factor": 0.1,
        },
        "model": {"name": "ssd512", "image_size": 512, "backbone_weights": None},
        "dataset": {
            "name": "voc",
            "num_classes": 20,
            "image_size": 512,
            "train_sets": [[2007, "trainval"], [2012, "trainval"]],
            "test_set": [2007, "test"],
            "augment": True,
            "use_difficult": False,
        },
        "scaler": scaler,
        "precision": {"name": precision},
        "logger": {"wandb": None},
    }


def metrics(config: dict, value: float | None, key: str = "test_accuracy", **extra: Any) -> dict:
    scaler = config["scaler"]["name"]
    scale: Any = {"fixed": config["scaler"].get("scale", 1.0), "dynamic": 8192.0}.get(scaler, 1.0)
    if scaler == "adaptive":
        scale = {"conv1": 4.0, "layer1.0.conv1": 8.0, "fc": 1.0}
    trainer = config["trainer"]
    steps = int(
        trainer["max_steps"] or trainer["steps"] or trainer["epochs"] * 5004
    )  # ImageNet: 5004 / epoch
    record: dict[str, Any] = {key: value}
    if key == "test_accuracy":
        record["best_test_accuracy"] = None if value is None else round(value + 0.12, 2)
    else:
        record["ap_per_class"] = None if value is None else {"aeroplane": value + 1.5, "bicycle": value - 2.0}
    record.update(
        {
            "steps": steps,
            "skipped_steps": 3 if scaler in ("none", "fixed") else (12 if scaler == "dynamic" else 0),
            "overflow_count": 3 if scaler in ("none", "fixed") else (12 if scaler == "dynamic" else 0),
            "loss_scale": scale,
            "underflow_rate": {"conv1": 0.0012, "layer1.0.conv1": 0.0203, "fc": 0.0},
            "mean_underflow_rate": 0.0072,
            "train_loss": 0.0213,
            "train_accuracy": 99.9,
            "lr": 0.001,
            "wall_time_s": 1843.2,
            "images_per_s": 4551.0,
        }
    )
    record.update(extra)
    record["config"] = config
    return record


def write(folder: Path, record: dict | None, overrides: list[str]) -> None:
    """A Hydra job folder: ``.hydra/overrides.yaml`` and, for a finished run, ``metrics.json``."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if record is not None:
        (folder / "metrics.json").write_text(json.dumps(record, indent=2) + "\n")


def sweep(name: str, experiment: str, jobs: list[tuple[dict[str, Any], dict | None]]) -> None:
    for number, (overrides, record) in enumerate(jobs):
        items = [f"{k}={v}" for k, v in sorted({**overrides, "experiment": experiment}.items())]
        write(OUT / "sweeps" / name / f"{number}_{','.join(items)}", record, items)


def cifar(dataset: str, model: str, variant: str, seed: int, value: float | None, **kw: Any):
    extra = kw.pop("extra", [])
    config = classification_config(dataset, model, variant, seed, extra)
    overrides = {"dataset": dataset, "model": model, "variant": variant, "seed": seed}
    return overrides, metrics(config, value, **kw)


def ssd(variant: str, batch: int, value: float | None, **kw: Any):
    overrides = {"variant": variant, "trainer.batch_size": batch}
    return overrides, metrics(detection_config(variant, batch), value, key="map", **kw)


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    # Table 1 sweep: CIFAR, two seeds where there are two; ResNet-110 never ran; a crashed job.
    table1 = []
    for variant, values in {
        "fp32": (91.31, 91.05),
        "none": (92.02, 92.20),
        "fixed16": (92.11, 92.29),
        "fixed128": (91.98, 92.10),
        "fixed1024": (92.25, 92.31),
        "adaptive": (92.18, 92.40),
    }.items():
        table1 += [cifar("cifar10", "resnet20", variant, seed, v) for seed, v in enumerate(values)]
    for variant, values in {
        "none": (92.71,),
        "fixed16": (93.12, 93.30),
        "fixed128": (92.85, 92.61),
        "adaptive": (93.05,),
    }.items():
        table1 += [cifar("cifar10", "resnet56", variant, seed, v) for seed, v in enumerate(values)]
    table1 += [
        cifar("cifar100", "resnet20", "fp32", 0, 67.80),
        cifar("cifar100", "resnet20", "none", 0, 68.12),
        cifar("cifar100", "resnet20", "none", 1, 68.40),
        cifar("cifar100", "resnet20", "adaptive", 0, 68.35),
        # a shortened run mixed into the same row: make_tables notes it under the table
        cifar("cifar100", "resnet20", "adaptive", 1, 66.90, extra=["trainer.max_steps=32000"]),
        ({"dataset": "cifar100", "model": "resnet20", "variant": "fixed16", "seed": 0}, None),  # crashed
    ]
    sweep("2025-01-10_09-00-00", "table1_cifar", table1)

    # Table 4 sweep, later: repeats resnet20 fixed16 seed 0 (this one counts), adds scale 1, a diverged seed.
    sweep(
        "2025-01-12_18-30-00",
        "table4_fixed_scales",
        [
            cifar("cifar10", "resnet20", "fixed1", 0, 91.90),
            cifar("cifar10", "resnet20", "fixed1", 1, 92.00),
            cifar("cifar10", "resnet20", "fixed16", 0, 92.50),
            cifar("cifar10", "resnet20", "fixed4096", 0, 92.26),
            cifar("cifar10", "resnet56", "fixed16384", 0, 93.10),
            cifar("cifar10", "resnet56", "fixed16384", 1, 10.00, diverged=True),
        ],
    )

    # Table 2 sweep: ImageNet, one seed; ResNet-18 "none" missing; a fixed scale Table 2 has no column for.
    sweep(
        "2025-01-15_08-00-00",
        "table2_imagenet",
        [
            cifar("imagenet", "resnet18", "fp32", 0, 69.80),
            cifar("imagenet", "resnet18", "fixed128", 0, 71.20),
            cifar("imagenet", "resnet18", "dynamic", 0, 71.35),
            cifar("imagenet", "resnet18", "adaptive", 0, 71.50),
            cifar("imagenet", "resnet50", "adaptive", 0, 76.30),
            cifar("imagenet", "resnet50", "fixed1024", 0, 75.95),
        ],
    )

    # Table 3 and 5 sweeps: SSD512 on VOC; no scaling diverged (null mAP), scale 1 flagged diverged.
    sweep(
        "2025-01-20_07-00-00",
        "table3_ssd",
        [
            ssd("fp32", 8, 78.80),
            ssd("none", 8, None),
            ssd("fixed8", 8, 24.10),
            ssd("fixed128", 8, 78.95),
            ssd("fixed2048", 8, 79.02),
            ssd("dynamic", 8, 75.50),
            ssd("adaptive", 8, 79.30),
            ssd("fixed1024", 32, 79.90),
            ssd("adaptive", 32, 80.25),
        ],
    )
    sweep(
        "2025-01-22_07-00-00",
        "table5_ssd_fixed",
        [ssd("fixed1", 8, 0.0, diverged=True), ssd("fixed16", 8, None)],
    )

    # Single runs: the bundled digits (a row the paper does not have), and BF16 (in no table).
    for variant, value in (("fp32", 97.50), ("adaptive", 97.22)):
        config = classification_config("digits", "resnet20", variant, 0, [])
        folder = OUT / "runs" / config["name"] / "2025-01-25_10-00-00"
        write(folder, metrics(config, value), ["dataset=digits", f"+variant={variant}"])
    config = classification_config("cifar10", "resnet20", "none", 0, ["precision=bf16"])
    folder = OUT / "runs" / config["name"] / "2025-01-26_10-00-00"
    write(folder, metrics(config, 92.05), ["precision=bf16"])
    print(f"{sum(1 for _ in OUT.rglob('metrics.json'))} records under {OUT}")


if __name__ == "__main__":
    main()
