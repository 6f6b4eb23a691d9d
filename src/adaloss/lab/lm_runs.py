"""The tiny GPT's runs on the standard library corpus: the variants (FP32 and the FP16 loss scalers) and the
config ``python train.py model=gpt dataset=pystdlib <variant> <overrides>`` composes for each
(``scripts/lm_runs.py``, ``scripts/lm_underflow.py``)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import open_dict

from adaloss.lab.reports.measurement import ROOT
from adaloss.runner.schemas import compose_train

#: What each variant adds to ``model=gpt dataset=pystdlib``.
VARIANTS = {
    "fp32": ["precision=fp32", "scaler=none"],
    "none": ["precision=fp16", "scaler=none"],
    # 1024: the adaptive recipe's accum_upper_bound on this task (the largest scale it may give a layer),
    # the same fixed scale as scripts/lm_underflow.py's table
    "fixed": ["precision=fp16", "scaler=fixed", "scaler.scale=1024"],
    "dynamic": ["precision=fp16", "scaler=dynamic"],
    "adaptive": ["precision=fp16", "scaler=adaptive"],
}


def compose_run(variant: str, seed: int, overrides: list[str], out: Path):  # noqa: ANN201 - a DictConfig
    """The run's config, its folder ``<out>/<variant>_seed<seed>``."""
    common = ["model=gpt", "dataset=pystdlib", "device=cpu", "logger=none", "trainer.progress_bar=false"]
    cfg = compose_train(ROOT / "configs", [*common, *VARIANTS[variant], f"seed={seed}", *overrides])
    with open_dict(cfg):
        cfg.paths.output_dir = str(out / f"{variant}_seed{seed}")
    return cfg
