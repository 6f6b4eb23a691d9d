"""Per-layer activation-gradient underflow of the tiny GPT under none, fixed, dynamic and adaptive scaling.

    .venv/bin/python scripts/lm_underflow.py [--seed 0] [--steps 400] [--fixed-scale 1024] [--batch N]
        [--out results/lm/underflow] [overrides]

The README's transformer underflow table. The model and data are what ``python train.py model=gpt
dataset=pystdlib <overrides>`` builds (composed as ``scripts/lm_runs.py`` does): the model at initialization
(the trainer's seed and build order), and the same model after ``--steps`` FP32 steps of the dataset's recipe
(``train()`` with ``precision=fp32``, so AdamW, warm-up and cosine, clipping; 400 steps is the whole recipe).
From each set of weights, one telemetry step (forward, loss, scaled backward, no optimizer step; the
``measure`` of ``scripts/underflow_table.py``) on one fixed training batch, in emulated FP16 and with FP8 e5m2
gradients (``precision=fp16`` / ``precision=fp8_e5m2``), under each scaler:

* ``none``: alpha 1 everywhere;
* ``fixed``: ``--fixed-scale`` (default 1024: the adaptive recipe's ``accum_upper_bound`` on this task, the
  largest scale the adaptive scaler may give any layer, applied to all of them alike);
* ``dynamic``: GradScaler's rule from its initial 2**16 (``configs/scaler/dynamic.yaml``), halved while the
  step overflows on these weights and this batch: the scale a run from here would train with;
* ``adaptive``: ``configs/scaler/adaptive.yaml`` (reference rule, the task's bounds 16 / 1024, attention's
  product betas) with ``update_every=1``, so its betas come from this batch.

The underflow rate of a layer is the share of the non-zero elements of the gradient with respect to its
output that the gradient format flushes to zero (``adaloss.telemetry``), measured on the scaled gradient,
which is what is stored. Attention's products (``<block>.attn.scores``: the recomputed ``dS``;
``<block>.attn.values``) have telemetry only through the adaptive transform's points, so only the adaptive
column has them. The table gives each kind of layer's mean over the blocks; ``<out>/underflow.json`` every
layer's rate, the adaptive alphas, the scales and the training run's validation loss; ``<out>/table.md`` the
table. Cost: the FP32 training (about a minute on one busy core for 400 steps) and 16-20 steps of a batch.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import _common as C  # noqa: E402  (needs the path above)
from lm_runs import compose_run  # noqa: E402
from underflow_table import _pct, measure, measurement_batch  # noqa: E402

SCALERS = ("none", "fixed", "dynamic", "adaptive")
PRECISIONS = ("fp16", "fp8_e5m2")
#: The kinds of layer the table has a row for: (label, the end of the layer's telemetry name).
KINDS: tuple[tuple[str, str], ...] = (
    ("attention QKV (`attn.c_attn`)", "attn.c_attn"),
    ("attention scores (`attn.scores`, dS)", "attn.scores"),
    ("attention values (`attn.values`)", "attn.values"),
    ("attention out-projection (`attn.c_proj`)", "attn.c_proj"),
    ("MLP fc (`mlp.c_fc`)", "mlp.c_fc"),
    ("MLP projection (`mlp.c_proj`)", "mlp.c_proj"),
    ("output head (`lm_head`, tied to `wte`)", "lm_head"),
)
PRODUCTS = ("attn.scores", "attn.values")
#: Halvings of the dynamic scale tried before giving up (2**16 down to 2**-24).
MAX_BACKOFFS = 40


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The language-model task's loss: cross-entropy over every position (``LanguageModelTask.loss``)."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _kind(layer: str, suffix: str) -> bool:
    return layer == suffix or layer.endswith("." + suffix)


def dynamic_step(model: torch.nn.Module, precision: str, cfg: dict[str, Any], x, y) -> dict[str, Any]:  # noqa: ANN001
    """GradScaler's rule on these weights: from ``cfg``'s initial scale, multiplied by its backoff factor
    while the step's gradients are not finite; the first step that goes through, with its ``scale``."""
    scale = float(cfg.get("init_scale") or 2.0**16)  # null in the config: GradScaler's start
    for _ in range(MAX_BACKOFFS):
        result = measure(model, precision, {**cfg, "init_scale": scale}, x, y, lm_loss)
        if result["grads_finite"]:
            return {**result, "scale": scale}
        scale *= float(cfg.get("backoff_factor", 0.5))
    raise RuntimeError(f"the dynamic scale overflows {precision} down to {scale:g}: the model diverged")


def measure_all(model: torch.nn.Module, configs: dict[str, dict[str, Any]], x, y) -> dict[str, Any]:  # noqa: ANN001
    """Every scaler in every precision on ``model``: ``{precision: {scaler: measure() + "scale"}}``."""
    out: dict[str, Any] = {}
    for precision in PRECISIONS:
        out[precision] = {}
        for name in SCALERS:
            if name == "dynamic":
                result = dynamic_step(model, precision, configs[name], x, y)
            else:
                result = measure(model, precision, configs[name], x, y, lm_loss)
                result["scale"] = float(configs[name].get("scale", 1.0))
            out[precision][name] = result
    return out


def _scale_cell(name: str, result: dict[str, Any]) -> str:
    if name == "adaptive":
        alphas = list(result["alphas"].values())
        return f"alpha {min(alphas):g}-{max(alphas):g}"
    return f"{result['scale']:g}"


def _rate_cell(result: dict[str, Any], suffix: str | None) -> str:
    rates = result["rates"]
    layers = [
        k for k in rates if (suffix is None and not _kind_of_product(k)) or (suffix and _kind(k, suffix))
    ]
    if not layers:
        return "—"
    cell = _pct(sum(rates[k] for k in layers) / len(layers))
    return cell if result["grads_finite"] else f"{cell} (overflow)"


def _kind_of_product(layer: str) -> bool:
    return any(_kind(layer, p) for p in PRODUCTS)


def render(measured: dict[str, Any], fixed_scale: float) -> str:
    """The Markdown table: per regime and gradient format, one row per kind of layer (mean over the blocks),
    one for the mean over the GEMM layers, one for the loss scales."""
    headers = ["weights", "gradients", "layer", "none", f"fixed {fixed_scale:g}", "dynamic", "adaptive"]
    rows = []
    for regime, per_precision in measured.items():
        for precision, per_scaler in per_precision.items():
            for label, suffix in KINDS:
                rows.append([regime, precision, label, *(_rate_cell(per_scaler[s], suffix) for s in SCALERS)])
            rows.append(
                [
                    regime,
                    precision,
                    "mean over the GEMM layers",
                    *(_rate_cell(per_scaler[s], None) for s in SCALERS),
                ]
            )
            rows.append([regime, precision, "loss scale", *(_scale_cell(s, per_scaler[s]) for s in SCALERS)])
    return C.markdown_table(headers, rows, left=3)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=400, help="FP32 training steps (400: the whole recipe)")
    parser.add_argument("--fixed-scale", type=float, default=1024.0)
    parser.add_argument("--batch", type=int, default=None, help="measured batch (default: the recipe's)")
    parser.add_argument("--out", type=Path, default=C.ROOT / "results" / "lm" / "underflow")
    parser.add_argument("overrides", nargs="*", help="more overrides, e.g. model.n_layer=2")
    args = parser.parse_args(argv)
    if args.steps < 1 or not args.fixed_scale > 0 or (args.batch is not None and args.batch < 1):
        raise SystemExit("error: --steps and --batch must be >= 1 and --fixed-scale > 0; e.g. --steps 400")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: the machine is shared, and one thread fixes the summation order
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from adaloss.data import build_datasets
    from adaloss.engine import train
    from adaloss.engine.tasks import build_task
    from adaloss.errors import ConfigError
    from adaloss.utils import seed_everything

    began = time.perf_counter()
    machine = C.machine_info()
    overrides = [f"trainer.steps={args.steps}", "trainer.save_final=true", *args.overrides]
    try:
        run_cfg = compose_run("fp32", args.seed, overrides, args.out)
        adaptive_cfg = compose_run("adaptive", args.seed, args.overrides, args.out).scaler
        dynamic_cfg = compose_run("dynamic", args.seed, args.overrides, args.out).scaler
    except (HydraException, OmegaConfBaseException, ConfigError) as error:
        raise SystemExit(f"error: {str(error).strip().splitlines()[0]}") from None
    configs = {
        "none": {"name": "none"},
        "fixed": {"name": "fixed", "scale": args.fixed_scale},
        "dynamic": OmegaConf.to_container(dynamic_cfg, resolve=True),
        "adaptive": {**OmegaConf.to_container(adaptive_cfg, resolve=True), "update_every": 1},
    }
    seed_everything(args.seed)  # the trainer's order: seed, data, model: the weights the run starts from
    train_set, _, info = build_datasets(run_cfg.dataset, run_cfg.paths.data_dir)
    init = build_task(run_cfg, info, torch.device("cpu")).model
    x, y = measurement_batch(train_set, args.batch or int(run_cfg.trainer.batch_size), args.seed)

    # the training run's folder is scratch: only its weights are measured, its numbers go into the JSON
    with tempfile.TemporaryDirectory(prefix="lm_underflow_") as scratch:
        OmegaConf.update(run_cfg, "paths.output_dir", scratch, force_add=True)
        print(f"[lm_underflow] training {args.steps} FP32 steps", file=sys.stderr, flush=True)
        try:
            metrics = train(run_cfg)
        except ConfigError as error:
            raise SystemExit(f"error: {str(error).strip().splitlines()[0]}") from None
        trained = build_task(run_cfg, info, torch.device("cpu")).model
        trained.load_state_dict(torch.load(Path(scratch) / "model.pt", weights_only=True))

    measured = {
        "init": measure_all(init, configs, x, y),
        f"{args.steps} FP32 steps": measure_all(trained, configs, x, y),
    }
    table = render(measured, args.fixed_scale)
    setting = " ".join(["model=gpt", "dataset=pystdlib", *args.overrides])
    text = (
        f"{C.header_line(machine)}\n\n{setting}, seed {args.seed}, one training batch of {x.shape[0]} x "
        f"{x.shape[1]} tokens; trained: validation loss {metrics['val_loss']:.3f} after {metrics['steps']} "
        f"FP32 steps. A layer's rate counts the values non-zero before its own rounding: a gradient flushed "
        f"upstream arrives as exact zeros and is not counted again. —: no telemetry point.\n\n{table}\n"
    )
    payload = {
        "machine": machine,
        "settings": {
            "seed": args.seed,
            "steps": args.steps,
            "batch": list(x.shape),
            "overrides": args.overrides,
            "scalers": configs,
            "precisions": list(PRECISIONS),
        },
        "training": {k: metrics[k] for k in ("steps", "val_loss", "best_val_loss", "perplexity")},
        "results": {
            regime: {
                precision: {
                    name: {k: r[k] for k in ("rates", "alphas", "scale", "loss", "grads_finite")}
                    for name, r in per_scaler.items()
                }
                for precision, per_scaler in per_precision.items()
            }
            for regime, per_precision in measured.items()
        },
        "table_markdown": table,
        "wall_seconds": time.perf_counter() - began,
    }
    C.write_json(args.out / "underflow.json", payload)
    (args.out / "table.md").write_text(text, encoding="utf-8")
    print(text, flush=True)
    return payload


if __name__ == "__main__":
    main()
