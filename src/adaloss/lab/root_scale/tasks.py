"""The root-scale lab's settings: the roots compared, the tasks (their overrides, metric and output layers),
the overrides every run gets, and the config of one run as ``train.py`` composes it."""

from __future__ import annotations

from pathlib import Path

from adaloss.lab.reports.measurement import ROOT

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


def compose(task: str, root: str, seed: int, out: Path, extra: tuple[str, ...] = ()):  # noqa: ANN201
    """One run of ``task`` under ``root``: its config, its folder ``<out>/runs/<task>_<root>_seed<seed>``."""
    from omegaconf import open_dict

    from adaloss.runner.schemas import compose_train

    overrides, *_ = TASKS[task]
    steps = next(o.split("=")[1] for o in overrides if o.startswith("trainer.max_steps="))
    cfg = compose_train(
        ROOT / "configs",
        [
            *COMMON, *overrides, f"telemetry.every={steps}", f"scaler.root={root}",
            *ROOT_OVERRIDES[root], f"seed={seed}", *extra,
        ],
    )  # fmt: skip
    with open_dict(cfg):
        cfg.paths.output_dir = str(out / "runs" / f"{task}_{root}_seed{seed}")
    return cfg
