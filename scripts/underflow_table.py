"""Per-layer activation-gradient underflow with no scaling, fixed scale 128 and adaptive scaling (both rules).

The README's numerical-effect table. The claim checked: in emulated FP16, on ResNet-110 and on a VGG-style
network without batch normalization, the per-layer underflow rates with adaptive scaling are far below those
of no scaling, and how they compare with fixed scale 128 under each scale rule (``reference``, the authors'
code, and ``paper``, the text; see ``src/adaloss/adaptive/rules.py``).

For each model, with a fixed seed and one fixed batch of the bundled ``digits`` data, one telemetry step
(forward, loss, scaled backward; no optimizer step) is measured under each scaler (``none``, ``fixed`` 128,
``adaptive`` under the reference rule and ``adaptive_paper`` under the paper's, both with ``update_every=1``,
so their betas come from this very batch, and the reference rule with the authors' CIFAR bounds, 128 and
4096) from the same weights, in three gradient regimes:

* ``init_fp16``: the freshly initialized model, FP16. The loss is large, so are the gradients; the paper's
  Figure 4a shows adaptive scales far below 128 on ResNets here, so fixed 128 is expected to win.
* ``trained_fp16``: the model after ``--train-steps`` of FP32 SGD on digits (momentum 0.9), so the loss
  and hence the gradients are small, as late in training where underflow bites. All three scalers start
  from a deep copy of that same trained state.
* ``trained_fp8``: the same trained state with ``precision=fp8_e5m2`` (FP16 activations, FP8 e5m2
  gradients whose smallest subnormal is 2**-16), where per-layer scaling matters most.

The underflow rate of a layer is the fraction of the elements of the gradient with respect to its output
that are non-zero before rounding to the gradient format and zero after (``adaloss.telemetry``); with a
scaler it is measured on the *scaled* gradient, which is what is stored.

Writes ``results/underflow/<model>_<regime>.csv`` (per layer: the three rates and the adaptive alpha) and
``results/underflow/underflow.json``; prints one Markdown summary table. Whatever the numbers say is printed,
including regimes where adaptive scaling loses.

Cost: dominated by the FP32 training: about 4 minutes in all on a busy 2-core machine with one thread
(ResNet-110: 80 steps, about 140 s; VGG: 150 steps, about 55 s); the nine measured steps per model take
seconds.
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import _common as C  # noqa: E402  (needs the path above)

DEFAULT_MODELS = ("resnet110", "vgg_nobn")
SCALERS: dict[str, dict[str, Any]] = {
    "none": {"name": "none"},
    "fixed128": {"name": "fixed", "scale": 128},
    # the reference rule with the authors' CIFAR settings (their cifar/utils.py:47-48), and the paper's rule
    "adaptive": {
        "name": "adaptive",
        "update_every": 1,
        "rule": "reference",
        "scale_upper_bound": 128,
        "accum_upper_bound": 4096,
    },
    "adaptive_paper": {"name": "adaptive", "update_every": 1, "rule": "paper"},
}
#: The adaptive variants, with the label the table gives each.
ADAPTIVE = {"adaptive": "adaptive (reference)", "adaptive_paper": "adaptive (paper)"}
REGIMES: dict[str, tuple[str, str]] = {  # regime -> (weights, precision)
    "init_fp16": ("init", "fp16"),
    "trained_fp16": ("trained", "fp16"),
    "trained_fp8": ("trained", "fp8_e5m2"),
}
#: FP32 training per model: steps and learning rate. VGG without BN diverges at lr 0.05 (NaN loss within
#: ~130 steps at batch 32 with momentum 0.9), ResNet-110 barely moves at 0.05 in 60 steps (He et al. warm it
#: up at 0.01 for the same reason); both train smoothly at 0.01.
TRAIN_PLAN = {
    "resnet110": {"steps": 80, "lr": 0.01},
    "vgg_nobn": {"steps": 150, "lr": 0.01},
}
DEFAULT_TRAIN = {"steps": 100, "lr": 0.05}
MOMENTUM = 0.9
DIGITS = {
    "name": "digits",
    "num_classes": 10,
    "image_size": 32,
    "test_fraction": 0.2,
    "split_seed": 0,
    "augment": False,
}


def load_digits(data_dir: str | Path = "data"):
    from adaloss.data import build_datasets

    train_set, _, info = build_datasets(OmegaConf.create(DIGITS), str(data_dir))
    return train_set, info


def measurement_batch(train_set, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch every measurement uses: the first batch of a loader shuffled with ``seed + 1``."""
    from adaloss.data.loaders import make_loader

    x, y = next(iter(make_loader(train_set, batch, train=True, seed=seed + 1)))
    return x, y


def train_fp32(
    model: torch.nn.Module,
    train_set,
    steps: int,
    lr: float,
    batch: int,
    seed: int,
    log: Callable[[str], None],
) -> list[float]:
    """Plain FP32 SGD (momentum 0.9) for ``steps`` steps on shuffled digits; returns the loss per step.

    Stops with ``RuntimeError`` if the loss becomes non-finite (measuring a diverged model says nothing).
    """
    from adaloss.data.loaders import make_loader

    loader = make_loader(train_set, batch, train=True, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    model.train()
    losses: list[float] = []
    it = iter(loader)
    t0 = time.perf_counter()
    for step in range(steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = float(loss.detach())
        losses.append(value)
        if not math.isfinite(value):
            raise RuntimeError(f"FP32 training diverged at step {step} (loss {value}); lower the lr")
        if (step + 1) % 25 == 0 or step + 1 == steps:
            recent = losses[-10:]
            log(
                f"[underflow]   step {step + 1}/{steps}: loss (mean of last {len(recent)}) "
                f"{sum(recent) / len(recent):.4f}, {time.perf_counter() - t0:.0f}s"
            )
    return losses


def measure(
    model: torch.nn.Module,
    precision_name: str,
    scaler_cfg: dict[str, Any],
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
) -> dict[str, Any]:
    """One telemetry step of a deep copy of ``model``: per-layer underflow rates, loss, adaptive alphas.

    ``loss_fn(output, y)``: the classifier's cross-entropy by default (``scripts/lm_underflow.py`` passes
    the language model's, over every position)."""
    from adaloss.precision import Precision
    from adaloss.scalers import build_scaler
    from adaloss.telemetry import UnderflowMonitor

    precision = Precision(precision_name, "cpu")
    scaler = build_scaler(OmegaConf.create(scaler_cfg), precision.grad_format)
    net = precision.prepare(scaler.attach(copy.deepcopy(model)))
    net.train()
    monitor = UnderflowMonitor(every=1, fmt=precision.telemetry_format)
    with precision.autocast(monitor=monitor):
        loss = loss_fn(net(x), y)
    scaler.scale(loss).backward()
    rates = monitor.underflow_rates()
    alphas = scaler.layer_scales() if hasattr(scaler, "layer_scales") else {}
    finite = all(bool(torch.isfinite(p.grad).all()) for p in net.parameters() if p.grad is not None)
    return {"rates": rates, "loss": float(loss.detach()), "alphas": alphas, "grads_finite": finite}


def compare(per_scaler: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Layer-by-layer comparison of the scalers' rates (layers in network order); per adaptive variant
    ``<name>_le_fixed``, ``<name>_lt_none`` and its alphas' min / median / max and count of ones."""
    layers = list(per_scaler["none"]["rates"])
    for name in per_scaler:
        missing = set(layers) ^ set(per_scaler[name]["rates"])
        if missing:
            raise RuntimeError(f"scaler {name} reports different layers than none: {sorted(missing)}")
    from adaloss.telemetry import UnderflowMonitor

    none, fixed = per_scaler["none"]["rates"], per_scaler["fixed128"]["rates"]
    out: dict[str, Any] = {
        "layers": len(layers),
        "mean": {s: UnderflowMonitor.mean_rate(per_scaler[s]["rates"]) for s in per_scaler},
        "none_positive": sum(none[n] > 0 for n in layers),
    }
    for name in ADAPTIVE:
        ada = per_scaler[name]["rates"]
        alphas = list(per_scaler[name]["alphas"].values())
        out[f"{name}_le_fixed"] = sum(ada[n] <= fixed[n] for n in layers)
        out[f"{name}_lt_none"] = sum(ada[n] < none[n] for n in layers)
        out[f"{name}_alpha_median"] = C.median(alphas) if alphas else float("nan")
        out[f"{name}_alpha_min"] = min(alphas) if alphas else float("nan")
        out[f"{name}_alpha_max"] = max(alphas) if alphas else float("nan")
        out[f"{name}_alpha_one"] = sum(a == 1.0 for a in alphas)
    return out


def write_csv(path: Path, per_scaler: dict[str, dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(SCALERS)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["layer", *names, *(f"{a}_alpha" for a in ADAPTIVE)])
        for layer in per_scaler["none"]["rates"]:
            w.writerow(
                [layer]
                + [repr(per_scaler[s]["rates"][layer]) for s in names]
                + [repr(per_scaler[a]["alphas"].get(layer, float("nan"))) for a in ADAPTIVE]
            )


def _pct(v: float) -> str:
    if not math.isfinite(v):
        return "n/a"
    if v == 0:
        return "0%"
    return f"{100 * v:.3g}%"


def render(info: dict[str, Any], settings: dict[str, Any], results: dict[str, Any]) -> str:
    lines = [
        f"### Per-layer activation-gradient underflow (one digits batch of {settings['batch']}, seed "
        f"{settings['seed']})",
        "",
        C.header_line(info),
        "",
        "Mean over layers of each layer's underflow rate (share of non-zero gradient elements flushed to "
        "zero when stored); the counts compare the scalers layer by layer. Adaptive: update_every=1, "
        "T_uf=1e-3, under the reference rule (the authors' code, their CIFAR bounds 128 / 4096) and the "
        "paper's (the text), each cell reference / paper. "
        "Train loss: FP32 loss of the measured weights on the measured batch. Alpha is the scale a layer's "
        "output gradient carries; it starts at alpha_{N+1} = 1 at the loss (the paper: 'normally we keep it "
        "as 1'), so a layer with alpha 1 is stored exactly as without scaling. A layer's rate counts only "
        "values non-zero before its own rounding: gradients already flushed upstream arrive as exact zeros "
        "and are not counted again.",
        "",
    ]
    rows = []
    for model, res in results.items():
        for regime, r in res["regimes"].items():
            c = r["compare"]
            n = c["layers"]
            both = list(ADAPTIVE)
            rows.append(
                [
                    C.PRETTY.get(model, model),
                    regime,
                    f"{r['fp32_loss']:.4f}",
                    n,
                    _pct(c["mean"]["none"]),
                    _pct(c["mean"]["fixed128"]),
                    " / ".join(_pct(c["mean"][a]) for a in both),
                    " / ".join(f"{c[f'{a}_le_fixed']}" for a in both) + f" of {n}",
                    " / ".join(f"{c[f'{a}_lt_none']}" for a in both) + f" of {n}",
                    f"{c['none_positive']}/{n}",
                    " ; ".join(
                        " / ".join(f"{c[f'{a}_alpha_{k}']:g}" for k in ("min", "median", "max")) for a in both
                    ),
                ]
            )
    lines.append(
        C.markdown_table(
            [
                "Model",
                "Regime",
                "Train loss",
                "Layers",
                "Mean UF none",
                "Mean UF fixed 128",
                "Mean UF adaptive (ref / paper)",
                "Layers adaptive <= fixed",
                "Layers adaptive < none",
                "Layers none > 0",
                "Adaptive alpha min / median / max (ref ; paper)",
            ],
            rows,
            left=2,
        )
    )
    notes = []
    for model, res in results.items():
        tr = res.get("training")
        if tr:
            notes.append(
                f"{C.PRETTY.get(model, model)}: trained {tr['steps']} FP32 steps at lr {tr['lr']:g}, "
                f"momentum {MOMENTUM}, batch {settings['batch']} "
                f"(last-10 mean loss {tr['final_loss_mean10']:.4f}, "
                f"{tr['seconds']:.0f}s)"
            )
        for regime, r in res["regimes"].items():
            bad = [s for s, m in r["scalers"].items() if not m["grads_finite"]]
            if bad:
                notes.append(f"{model} {regime}: non-finite gradients (overflow) with {', '.join(bad)}")
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=None, help="resnet110 vgg_nobn (space or comma separated)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 32; --quick: 8)")
    p.add_argument(
        "--train-steps",
        type=int,
        default=None,
        help="FP32 training steps before the trained regimes (default: resnet110 80, vgg_nobn 150)",
    )
    p.add_argument("--lr", type=float, default=None, help="FP32 training lr (default: 0.01 for both models)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=str(C.ROOT / "data"))
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 0 keeps torch's default (default 1: fixed summation order, and far "
        "faster than 2 threads when other jobs share the 2 cores)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: vgg_nobn, batch 8, 2 training steps")
    p.add_argument("--out-dir", default=str(C.ROOT / "results" / "underflow"))
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    models = args.models or (["vgg_nobn"] if args.quick else list(DEFAULT_MODELS))
    args.models = [m for item in models for m in item.split(",") if m]
    for m in args.models:
        if m not in C.MODEL_CFGS:
            p.error(f"unknown model '{m}': choose from {', '.join(C.MODEL_CFGS)}")
    if args.batch is None:
        args.batch = 8 if args.quick else 32
    if args.quick and args.train_steps is None:
        args.train_steps = 2
    if args.batch < 1 or (args.train_steps is not None and args.train_steps < 0):
        p.error("--batch must be >= 1 and --train-steps >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure, print the summary table, write CSVs and JSON under ``--out-dir``; returns the JSON payload."""
    args = parse_args(argv)
    if args.threads < 0:
        raise SystemExit(f"error: --threads must be >= 0, got {args.threads}")
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads_before)  # main() is importable: leave the caller's setting alone


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from adaloss.models import build_model

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    info = C.machine_info()
    out_dir = Path(args.out_dir)
    train_set, data_info = load_digits(args.data_dir)
    x, y = measurement_batch(train_set, args.batch, args.seed)
    results: dict[str, Any] = {}
    for name in args.models:
        plan = TRAIN_PLAN.get(name, DEFAULT_TRAIN)
        steps = args.train_steps if args.train_steps is not None else plan["steps"]
        lr = args.lr if args.lr is not None else plan["lr"]
        torch.manual_seed(args.seed)
        init = build_model(C.model_cfg(name), data_info.num_classes, data_info.input_shape)
        log(f"[underflow] {name}: training {steps} FP32 steps at lr {lr:g}")
        trained = copy.deepcopy(init)
        t_train = time.perf_counter()
        torch.manual_seed(args.seed)
        losses = train_fp32(trained, train_set, steps, lr, args.batch, args.seed, log)
        train_s = time.perf_counter() - t_train
        weights = {"init": init, "trained": trained}
        res: dict[str, Any] = {
            "training": {
                "steps": steps,
                "lr": lr,
                "momentum": MOMENTUM,
                "seconds": train_s,
                "losses": losses,
                "final_loss_mean10": (sum(losses[-10:]) / len(losses[-10:])) if losses else float("nan"),
            },
            "regimes": {},
        }
        for regime, (which, precision_name) in REGIMES.items():
            model = weights[which]
            with torch.no_grad():
                fp32_loss = float(F.cross_entropy(copy.deepcopy(model).train()(x), y))
            per_scaler = {}
            for sname, scfg in SCALERS.items():
                torch.manual_seed(args.seed)
                per_scaler[sname] = measure(model, precision_name, scfg, x, y)
            cmp = compare(per_scaler)
            csv_path = out_dir / f"{name}_{regime}.csv"
            write_csv(csv_path, per_scaler)
            res["regimes"][regime] = {
                "weights": which,
                "precision": precision_name,
                "fp32_loss": fp32_loss,
                "scalers": per_scaler,
                "compare": cmp,
                "csv": str(csv_path),
            }
            log(
                f"[underflow] {name} {regime}: mean rates none {cmp['mean']['none']:.3g}, fixed128 "
                f"{cmp['mean']['fixed128']:.3g}, adaptive {cmp['mean']['adaptive']:.3g} (reference), "
                f"{cmp['mean']['adaptive_paper']:.3g} (paper)"
            )
        results[name] = res
    settings = {
        "models": args.models,
        "batch": args.batch,
        "seed": args.seed,
        "scalers": SCALERS,
        "regimes": {k: {"weights": w, "precision": p} for k, (w, p) in REGIMES.items()},
        "dataset": DIGITS,
        "quick": args.quick,
        "argv": args.argv,
    }
    text = render(info, settings, results)
    print(text, flush=True)
    payload = {
        "machine": info,
        "settings": settings,
        "results": results,
        "table_markdown": text,
        "wall_seconds": time.perf_counter() - t0,
    }
    path = C.write_json(out_dir / "underflow.json", payload)
    log(f"[underflow] wrote {path} and the per-layer CSVs ({payload['wall_seconds']:.0f}s)")
    return payload


if __name__ == "__main__":
    main()
