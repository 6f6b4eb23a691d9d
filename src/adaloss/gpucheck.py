"""``make gpu-check``: what this project can only learn on a CUDA GPU, in one command of under ten minutes.

1. The CUDA tests (``tests/test_cuda.py``, and the CUDA cases of ``tests/test_gpu_path.py``): a training step
   of every scaler under ``torch.cuda.set_sync_debug_mode("error")``, and autocast FP16/BF16 gradients
   against FP32's.
2. The same gradient comparison, recorded: per precision, the smallest cosine similarity between a
   parameter's autocast gradient (adaptive scaler, unscaled) and its FP32 gradient on one batch.
3. Step times measured with CUDA events: the adaptive scaler at ``update_every`` 1 and 100 against the
   dynamic scaler, on ResNet-20 and ResNet-110 at batch 128 (CIFAR-sized synthetic images) and on the tiny
   GPT (``configs/model/gpt.yaml``'s sizes, random tokens), interleaved in rounds so that a change in the
   GPU's clock hits every configuration alike.

It writes ``results/gpu/<gpu name>.json`` and prints a table. It runs on the torch already installed
(a CUDA build older than the one CI pins, 2.11 say): ``make gpu-check`` does not install or replace torch.
Without CUDA it prints one line saying so and exits 0. The functions take a ``device``, so the tests run
them on the CPU (with host timers instead of CUDA events).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["compare_gradients", "main", "step_ratios", "time_steps"]

ROOT = Path(__file__).resolve().parents[2]
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_gpu_path.py"]
#: (scaler class in :mod:`adaloss.scalers`, options) of the timed configurations
CONFIGS = {
    "dynamic": ("DynamicLossScaler", {}),
    "adaptive_u1": ("AdaptiveLossScaler", {"update_every": 1}),
    "adaptive_u100": ("AdaptiveLossScaler", {"update_every": 100}),
}


def _model(name: str, device: str) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    """A model and a batch maker (synthetic data on ``device``)."""
    if name == "gpt":
        from adaloss.models.gpt import GPT

        model = GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)

        def tokens(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randint(0, 256, (batch, 64), device=device)
            return x, torch.roll(x, -1, dims=1)

        return model.to(device), tokens
    from adaloss.models.cifar_resnet import cifar_resnet

    model = cifar_resnet(int(name.removeprefix("resnet")), 10)

    def images(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 3, 32, 32, device=device), torch.randint(0, 10, (batch,), device=device)

    return model.to(device), images


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2).float(), y.flatten())


def _scaler(class_name: str, options: dict[str, Any], device: str) -> Any:
    import adaloss.scalers

    return getattr(adaloss.scalers, class_name)(device, **options)


class _Timer:
    """Elapsed milliseconds of a block: CUDA events on a GPU (no sync until read), else the host clock."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def __enter__(self) -> _Timer:
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3

    def elapsed(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end)
        return self.ms


def time_steps(
    model_name: str,
    batch: int,
    device: str,
    rounds: int = 5,
    steps: int = 10,
    dtype: torch.dtype = torch.float16,
) -> dict[str, dict[str, float]]:
    """Median milliseconds per training step of each configuration of :data:`CONFIGS` (and, for the
    adaptive ones, of a recompute step and of a reuse step), interleaved over ``rounds`` rounds."""
    runs = {}
    for key, (class_name, options) in CONFIGS.items():
        torch.manual_seed(0)
        model, make = _model(model_name, device)
        scaler = _scaler(class_name, options, device)
        model = scaler.attach(model)
        runs[key] = (scaler, model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), make)
    times: dict[str, dict[str, list[float]]] = {k: {"step": [], "recompute": [], "reuse": []} for k in runs}
    for round_ in range(rounds + 1):  # round 0 warms up (cuDNN autotuning, the allocator) and is dropped
        for key, run in runs.items():
            for i in range(steps):
                recompute = key == "adaptive_u100" and i == 0
                ms = _timed_step(run, batch, device, dtype, recompute)
                if round_ > 0:
                    times[key]["step"].append(ms)
                    times[key]["recompute" if recompute else "reuse"].append(ms)
    return {k: {kind: statistics.median(v) for kind, v in t.items() if v} for k, t in times.items()}


def _timed_step(run: tuple, batch: int, device: str, dtype: torch.dtype, recompute: bool) -> float:
    """One training step's milliseconds (``recompute``: the adaptive scaler recomputes its scales)."""
    scaler, model, opt, make = run
    x, y = make(batch)
    if recompute:
        scaler.recompute_next()
    with _Timer(device) as timer:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.split(":")[0], dtype=dtype):
            loss = _loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return timer.elapsed()


def step_ratios(ms: dict[str, dict[str, float]]) -> dict[str, float]:
    """Issue 22's ratios from :func:`time_steps`: update_every=1 / dynamic, and update_every=100 amortized
    (one recompute and 99 reuse steps) / dynamic."""
    dynamic = ms["dynamic"]["step"]
    u100 = ms["adaptive_u100"]
    return {
        "adaptive_u1_over_dynamic": ms["adaptive_u1"]["step"] / dynamic,
        "adaptive_u100_over_dynamic": (u100["recompute"] + 99 * u100["reuse"]) / (100 * dynamic),
    }


def compare_gradients(device: str, dtype: torch.dtype, batch: int = 32) -> dict[str, float]:
    """One batch of ResNet-20 under autocast ``dtype`` with the adaptive scaler, against FP32 without
    scaling: the smallest and the median cosine similarity of a parameter's (unscaled) gradient with its
    FP32 gradient, and where the smallest is. Measured on the CPU at batch 8: FP16 0.995 smallest, BF16
    0.924 smallest and 0.979 median (its 8-bit significand)."""
    from adaloss.scalers import AdaptiveLossScaler

    torch.manual_seed(0)
    reference, make = _model("resnet20", device)
    x, y = make(batch)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    _loss(reference(x), y).backward()
    model, _ = _model("resnet20", device)
    model.load_state_dict(state)
    scaler = AdaptiveLossScaler(device, update_every=1)
    attached = scaler.attach(model)
    with torch.autocast(device.split(":")[0], dtype=dtype):
        loss = _loss(attached(x), y)
    scaler.scale(loss).backward()
    opt = torch.optim.SGD(attached.parameters(), lr=0.0)
    scaler.unscale_(opt)
    grads = dict(attached.named_parameters())
    cosines = {
        name: F.cosine_similarity(
            grads[name].grad.flatten().double(), p.grad.flatten().double(), dim=0
        ).item()
        for name, p in reference.named_parameters()
        if p.grad.abs().max() > 0
    }
    where = min(cosines, key=cosines.get)
    return {
        "min_cosine": cosines[where],
        "median_cosine": statistics.median(cosines.values()),
        "where": where,
    }


def _run_tests() -> dict[str, Any]:
    """The CUDA tests, in a pytest subprocess: its exit status and closing line."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"status": "not run", "line": "pytest is not installed: pip install pytest"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.strip().splitlines() if line.strip()]
    return {"status": "passed" if done.returncode == 0 else "failed", "line": lines[-1] if lines else ""}


def _table(report: dict[str, Any]) -> str:
    rows = [f"gpu-check on {report['machine']['gpu']} (torch {report['machine']['torch']}):"]
    rows.append(f"  CUDA tests: {report['tests']['status']} ({report['tests']['line']})")
    for prec, g in report["gradients"].items():
        rows.append(
            f"  {prec} autocast vs FP32 gradients: cosine min {g['min_cosine']:.5f} ({g['where']}), "
            f"median {g['median_cosine']:.5f}"
        )
    rows.append(
        "  | model | adaptive u=1 / dynamic | adaptive u=100 / dynamic (amortized) | dynamic ms/step |"
    )
    rows.append("  |---|---|---|---|")
    for model, entry in report["timing"].items():
        r = entry["ratios"]
        rows.append(
            f"  | {model} | {r['adaptive_u1_over_dynamic']:.3f}x | {r['adaptive_u100_over_dynamic']:.3f}x "
            f"| {entry['ms']['dynamic']['step']:.2f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Run the checks on ``cuda:0``; write ``results/gpu/<gpu name>.json``; print the table."""
    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device here (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}); nothing to check: run it on a machine with an NVIDIA GPU"
        )
        return 0
    device, gpu = "cuda", torch.cuda.get_device_name(0)
    report: dict[str, Any] = {
        "machine": {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "tests": _run_tests(),
        "gradients": {
            name: compare_gradients(device, dtype)
            for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16))
        },
        "timing": {},
    }
    for model, batch in (("resnet20", 128), ("resnet110", 128), ("gpt", 64)):
        ms = time_steps(model, batch, device)
        report["timing"][model] = {"batch": batch, "ms": ms, "ratios": step_ratios(ms)}
    out = ROOT / "results" / "gpu" / (re.sub(r"[^A-Za-z0-9._-]+", "_", gpu) + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, allow_nan=False, default=_finite))
    print(_table(report))
    print(f"written: {out}")
    return 0 if report["tests"]["status"] != "failed" else 1


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)
