"""``make gpu-check``: what this project can only learn on a CUDA GPU, in one command of under ten minutes.

1. The CUDA tests (``tests/test_cuda.py``, and the CUDA cases of ``tests/test_gpu_path.py``): a training step
   of every scaler under ``torch.cuda.set_sync_debug_mode("error")``, and autocast FP16/BF16 gradients
   against FP32's.
2. The same gradient comparison, recorded: per precision, the smallest and the median cosine similarity
   between a parameter's autocast gradient (unscaled) and its FP32 gradient (TF32 off) on one batch, for
   the adaptive scaler and for plain autocast at a fixed scale, the baseline it must match.
3. Step times measured with CUDA events: the adaptive scaler at ``update_every`` 1 and 100 against the
   dynamic scaler, on ResNet-20 and ResNet-110 at batch 128 (CIFAR-sized synthetic images) and on the tiny
   GPT (``configs/model/gpt.yaml``'s sizes, random tokens), interleaved in rounds so that a change in the
   GPU's clock hits every configuration alike; and the same steps' kernel time (``torch.profiler``), which
   a host-bound step's wall time hides.

Each part is recorded even when another raises. It writes ``results/gpu/<gpu name>.json`` (with pytest's
log beside it) and prints a table. It runs on the torch already installed
(a CUDA build older than the one CI pins, 2.11 say): ``make gpu-check`` does not install or replace torch.
Without CUDA it prints one line saying so and exits 0. The functions take a ``device``, so the tests run
them on the CPU (with host timers instead of CUDA events).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from adaloss.provenance import git_state

__all__ = ["collect", "compare_gradients", "failed", "main", "step_ratios", "time_steps"]

ROOT = Path(__file__).resolve().parents[2]
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_gpu_path.py"]
#: (scaler class in :mod:`adaloss.scalers`, options) of the timed configurations
CONFIGS = {
    "dynamic": ("DynamicLossScaler", {}),
    "adaptive_u1": ("AdaptiveLossScaler", {"update_every": 1}),
    "adaptive_u100": ("AdaptiveLossScaler", {"update_every": 100}),
}
#: the timed models and their batch sizes (issue 22: the ResNets at batch 128, the tiny GPT)
TIMING = {"resnet20": 128, "resnet110": 128, "gpt": 64}


def _model(
    name: str, device: str, image_size: int = 32
) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    """A model and a batch maker (synthetic data on ``device``; a ResNet's images ``image_size`` square)."""
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
        x = torch.randn(batch, 3, image_size, image_size, device=device)
        return x, torch.randint(0, 10, (batch,), device=device)

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
    dtype: torch.dtype | None = torch.float16,
    image_size: int = 32,
) -> dict[str, dict[str, float]]:
    """Median milliseconds per training step of each configuration of :data:`CONFIGS` (and, for the
    adaptive ones, of a recompute step and of a reuse step), interleaved over ``rounds`` rounds; under
    autocast ``dtype`` (None: FP32). :mod:`adaloss.bench.hostbound` times tiny CPU steps with it."""
    runs = {}
    for key, (class_name, options) in CONFIGS.items():
        torch.manual_seed(0)
        model, make = _model(model_name, device, image_size)
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
    ms = {k: {kind: statistics.median(v) for kind, v in t.items() if v} for k, t in times.items()}
    if device.startswith("cuda"):
        for key, run in runs.items():
            ms[key]["kernel_reuse"] = _kernel_ms(run, batch, device, dtype, recompute=False)
            if key == "adaptive_u100":
                ms[key]["kernel_recompute"] = _kernel_ms(run, batch, device, dtype, recompute=True)
    return ms


def _kernel_ms(
    run: tuple, batch: int, device: str, dtype: torch.dtype, recompute: bool, steps: int = 3
) -> float:
    """Milliseconds per step the GPU spends running kernels and copies (the profiler's device time): the
    step's cost once the host keeps ahead of the GPU, without the launch gaps a host-bound step has."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():  # the profiler's note that it keeps one cycle's events (we use one)
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                _timed_step(run, batch, device, dtype, recompute)
    return sum(e.self_device_time_total for e in prof.key_averages()) / steps / 1e3


def _timed_step(run: tuple, batch: int, device: str, dtype: torch.dtype | None, recompute: bool) -> float:
    """One training step's milliseconds (``recompute``: the adaptive scaler recomputes its scales)."""
    scaler, model, opt, make = run
    x, y = make(batch)
    if recompute:
        scaler.recompute_next()
    with _Timer(device) as timer:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.split(":")[0], dtype=dtype or torch.float16, enabled=dtype is not None):
            loss = _loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return timer.elapsed()


def step_ratios(ms: dict[str, dict[str, float]]) -> dict[str, float]:
    """Issue 22's ratios from :func:`time_steps`: update_every=1 / dynamic, and update_every=100 amortized
    (one recompute and 99 reuse steps) / dynamic; on a GPU also both in kernel time (``kernel_*``).
    (``adaptive_u1``'s every step recomputes, so its ``kernel_reuse`` is a recompute step's.)"""
    dynamic = ms["dynamic"]["step"]
    u100 = ms["adaptive_u100"]
    ratios = {
        "adaptive_u1_over_dynamic": ms["adaptive_u1"]["step"] / dynamic,
        "adaptive_u100_over_dynamic": (u100["recompute"] + 99 * u100["reuse"]) / (100 * dynamic),
    }
    if "kernel_reuse" in ms["dynamic"]:  # on a GPU: the same ratios in kernel time
        kernel = ms["dynamic"]["kernel_reuse"]
        ratios["kernel_u1_over_dynamic"] = ms["adaptive_u1"]["kernel_reuse"] / kernel
        ratios["kernel_u100_over_dynamic"] = (u100["kernel_recompute"] + 99 * u100["kernel_reuse"]) / (
            100 * kernel
        )
    return ratios


def compare_gradients(device: str, dtype: torch.dtype, batch: int = 32) -> dict[str, Any]:
    """One batch of ResNet-20 under autocast ``dtype``, against true FP32 (TF32 off) without scaling: the
    smallest and the median cosine similarity of a parameter's (unscaled) gradient with its FP32
    gradient, and where the smallest is, for the adaptive scaler and, as the baseline it must match, a
    fixed loss scale of 1024 (plain autocast as GradScaler runs it). Measured on the CPU at batch 8:
    FP16 0.995 smallest, BF16 0.924 smallest and 0.979 median (its 8-bit significand)."""
    from adaloss.scalers import AdaptiveLossScaler, FixedLossScaler

    torch.manual_seed(0)
    reference, make = _model("resnet20", device)
    x, y = make(batch)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    with _no_tf32():
        _loss(reference(x), y).backward()
    want = {name: p.grad for name, p in reference.named_parameters() if p.grad.abs().max() > 0}
    result: dict[str, Any] = {}
    for key, scaler in (
        ("", AdaptiveLossScaler(device, update_every=1)),
        ("baseline_", FixedLossScaler(device, scale=1024.0)),
    ):
        model, _ = _model("resnet20", device)
        model.load_state_dict(state)
        got = _autocast_grads(scaler, model, x, y, device, dtype)
        cosines = {
            name: F.cosine_similarity(got[name].flatten().double(), g.flatten().double(), dim=0).item()
            for name, g in want.items()
        }
        where = min(cosines, key=cosines.get)
        result |= {
            f"{key}min_cosine": cosines[where],
            f"{key}median_cosine": statistics.median(cosines.values()),
            f"{key}where": where,
        }
    return result


class _no_tf32:
    """FP32 matrix products and convolutions in full FP32 on the GPU (TF32 off) inside the block."""

    def __enter__(self) -> None:
        self.saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc: Any) -> None:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved


def _autocast_grads(scaler: Any, model: nn.Module, x, y, device: str, dtype: torch.dtype) -> dict:
    """The unscaled parameter gradients of one batch under autocast ``dtype`` with ``scaler``."""
    attached = scaler.attach(model)
    with torch.autocast(device.split(":")[0], dtype=dtype):
        loss = _loss(attached(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(torch.optim.SGD(attached.parameters(), lr=0.0))
    return {name: p.grad for name, p in attached.named_parameters()}


def _run_tests(log: Path) -> dict[str, Any]:
    """The CUDA tests, in a pytest subprocess: its exit status and closing line; pytest's whole output goes
    to ``log``, and on a failure to the terminal as well."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"status": "not run", "line": "pytest is not installed: pip install pytest"}
    pythonpath = os.environ.get("PYTHONPATH")  # the tests import adaloss from this checkout, installed or not
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), pythonpath]))},
        capture_output=True,
        text=True,
        timeout=300,
    )
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        print(done.stdout + done.stderr, file=sys.stderr)
    lines = [line for line in done.stdout.strip().splitlines() if line.strip()]
    return {
        "status": "passed" if done.returncode == 0 else "failed",
        "line": lines[-1] if lines else "",
        "log": log.name,
    }


def _guarded(part: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or ``{"error": ...}`` with the traceback on stderr: one broken part of the check
    (an API the installed torch lacks, say) leaves the others measured and recorded."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - recorded in the report, and main() exits 1
        traceback.print_exc()
        print(f"gpu-check: {part} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return {"error": f"{type(exc).__name__}: {exc}"}


def _timing(model: str, batch: int, device: str) -> dict[str, Any]:
    ms = time_steps(model, batch, device)
    return {"batch": batch, "ms": ms, "ratios": step_ratios(ms)}


def collect(device: str, gpu: str, out_dir: Path, timing: dict[str, int] | None = None) -> dict[str, Any]:
    """Every part of the check on ``device``, each recorded even when another fails: the CUDA tests
    (their log in ``out_dir``), the FP16/BF16 gradient comparison, and the step times of ``timing``'s
    models at its batch sizes."""
    timing = TIMING if timing is None else timing
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", gpu)
    return {
        "machine": {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "code": git_state(ROOT),  # the commit measured (None outside a git checkout: stamp it then)
        "tests": _guarded("the CUDA tests", _run_tests, out_dir / f"{slug}-tests.log"),
        "gradients": {
            name: _guarded(f"the {name} gradient comparison", compare_gradients, device, dtype)
            for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16))
        },
        "timing": {m: _guarded(f"{m}'s step times", _timing, m, b, device) for m, b in timing.items()},
    }


def failed(report: dict[str, Any]) -> bool:
    """Whether a test failed or a part of the check raised."""
    parts = [report["tests"], *report["gradients"].values(), *report["timing"].values()]
    return report["tests"].get("status") == "failed" or any("error" in p for p in parts)


def _table(report: dict[str, Any]) -> str:
    rows = [f"gpu-check on {report['machine']['gpu']} (torch {report['machine']['torch']}):"]
    tests = report["tests"]
    rows.append(f"  CUDA tests: {tests.get('status', 'error')} ({tests.get('line', tests.get('error'))})")
    for prec, g in report["gradients"].items():
        rows.append(
            f"  {prec} autocast vs FP32 gradients: error: {g['error']}"
            if "error" in g
            else f"  {prec} autocast vs FP32 gradients: cosine min {g['min_cosine']:.5f} ({g['where']}), "
            f"median {g['median_cosine']:.5f}; a fixed scale of 1024: min {g['baseline_min_cosine']:.5f} "
            f"({g['baseline_where']}), median {g['baseline_median_cosine']:.5f}"
        )
    rows.append(
        "  | model | adaptive u=1 / dynamic | adaptive u=100 / dynamic (amortized) | dynamic ms/step |"
        " kernel time: u=1 / dynamic | kernel time: u=100 / dynamic | dynamic kernel ms/step |"
    )
    rows.append("  |---|---|---|---|---|---|---|")
    for model, entry in report["timing"].items():
        if "error" in entry:
            rows.append(f"  | {model} | error: {entry['error']} | | |")
            continue
        r = entry["ratios"]
        kernel = entry["ms"]["dynamic"].get("kernel_reuse")
        rows.append(
            f"  | {model} | {r['adaptive_u1_over_dynamic']:.3f}x | {r['adaptive_u100_over_dynamic']:.3f}x "
            f"| {entry['ms']['dynamic']['step']:.2f} | "
            + (
                f"{r['kernel_u1_over_dynamic']:.3f}x | {r['kernel_u100_over_dynamic']:.3f}x | {kernel:.2f} |"
                if kernel is not None
                else "| | |"
            )
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Run the checks on ``cuda:0``; write ``results/gpu/<gpu name>.json``; print the table. Exit 1 when a
    test failed or a part of the check raised (the other parts are still measured and written)."""
    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device here (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}); nothing to check: run it on a machine with an NVIDIA GPU"
        )
        return 0
    gpu = torch.cuda.get_device_name(0)
    out_dir = ROOT / "results" / "gpu"
    out_dir.mkdir(parents=True, exist_ok=True)
    report = collect("cuda", gpu, out_dir)
    out = out_dir / (re.sub(r"[^A-Za-z0-9._-]+", "_", gpu) + ".json")
    out.write_text(json.dumps(report, indent=2, allow_nan=False, default=_finite))
    print(_table(report))
    print(f"written: {out}")
    return 1 if failed(report) else 0


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)
