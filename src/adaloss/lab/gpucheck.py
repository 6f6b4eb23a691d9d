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
4. The same steps compiled (issue 34): ``torch.compile(scaler.attach(model), fullgraph=True,
   backend="inductor")`` in each mode of :data:`COMPILE_MODES` (``default``; ``reduce-overhead``, CUDA
   graphs), taking turns with the eager steps in the same rounds (:func:`time_modes`), with their kernel
   time and what Dynamo made: graphs, graph breaks, recompiles after the warm-up round. A mode that fails
   is recorded as its error beside the others. Compiling adds minutes per model and mode (ResNet-110's
   most): ``--compile`` and ``--models`` choose what is timed.

Each part is recorded even when another raises. It writes ``results/gpu/<gpu name>.json`` (with pytest's
log beside it) and prints a table. It runs on the torch already installed
(a CUDA build older than the one CI pins, 2.11 say): ``make gpu-check`` does not install or replace torch.
Without CUDA it prints one line saying so and exits 0. The functions take a ``device``, so the tests run
them on the CPU (with host timers instead of CUDA events).
"""

from __future__ import annotations

import argparse
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
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from adaloss.runner.provenance import git_state

__all__ = ["collect", "compare_gradients", "failed", "main", "step_ratios", "time_modes", "time_steps"]

ROOT = Path(__file__).resolve().parents[3]
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_gpu_path.py"]
#: (scaler class in :mod:`adaloss.scalers`, options) of the timed configurations
CONFIGS = {
    "dynamic": ("DynamicLossScaler", {}),
    "adaptive_u1": ("AdaptiveLossScaler", {"update_every": 1}),
    "adaptive_u100": ("AdaptiveLossScaler", {"update_every": 100}),
}
#: the timed models and their batch sizes (issue 22: the ResNets at batch 128, the tiny GPT)
TIMING = {"resnet20": 128, "resnet110": 128, "gpt": 64}
#: the ``torch.compile`` modes (Inductor) whose steps a GPU's check times beside the eager ones (issue 34)
COMPILE_MODES = ("default", "reduce-overhead")


def _model(
    name: str, device: str, image_size: int = 32
) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    """A model and a batch maker (synthetic data on ``device``; a ResNet's images ``image_size`` square)."""
    if name == "gpt":
        from adaloss.runner.models.gpt import GPT

        model = GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)

        def tokens(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randint(0, 256, (batch, 64), device=device)
            return x, torch.roll(x, -1, dims=1)

        return model.to(device), tokens
    from adaloss.runner.models.cifar_resnet import cifar_resnet

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
    backend: str | None = None,
    mode: str | None = None,
) -> dict[str, dict[str, float]]:
    """Median milliseconds per training step of each configuration of :data:`CONFIGS` (and, for the
    adaptive ones, of a recompute step and of a reuse step), interleaved over ``rounds`` rounds; under
    autocast ``dtype`` (None: FP32). :mod:`adaloss.lab.bench.hostbound` times tiny CPU steps with it.

    ``backend``: each configuration's model is ``torch.compile(model, fullgraph=True, backend=backend,
    mode=mode)`` after ``scaler.attach(model)``; the warm-up round compiles every pass kind, and each
    configuration's entry adds its compile counts (:func:`time_modes`)."""
    by_mode, _ = time_modes(
        model_name, batch, device, {"": (backend, mode)}, rounds, steps, dtype, image_size
    )
    return by_mode[""]


#: A way of running the step: ``(backend, mode)`` of ``torch.compile``, or ``(None, None)``: eagerly.
Mode = tuple[str | None, str | None]
#: In a compiled mode's warm-up round, adaptive_u100's first ``WARM_RUNS`` steps recompute and at least as
#: many reuse: the first call of a pass kind compiles it; CUDA graph trees (``reduce-overhead``) run it
#: once more to warm up and record its graph on the next call, so no timed step compiles or records.
WARM_RUNS = 3
#: what a compiled configuration's entry counts (:func:`_compile_counts`), beside its ``recompiles``
COUNTS = ("graphs", "graph_breaks", "cudagraph_skips")


class _Run(NamedTuple):
    """One configuration, built: its scaler, the module a step calls (compiled or the attached model), its
    optimizer, its batch maker, and whether each step marks its start for CUDA graph trees."""

    scaler: Any
    model: nn.Module
    opt: torch.optim.Optimizer
    make: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    graphed: bool = False


def time_modes(
    model_name: str,
    batch: int,
    device: str,
    modes: dict[str, Mode],
    rounds: int = 5,
    steps: int = 10,
    dtype: torch.dtype | None = torch.float16,
    image_size: int = 32,
    budget_s: float | None = None,
    guard: bool = False,
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """:func:`time_steps` of each of ``modes`` (name -> ``(backend, mode)``), all in the same rounds: a
    round runs every mode's configurations in turn, so a change in the machine's load (or the GPU's clock)
    hits eager and compiled steps alike. Returns per mode what :func:`time_steps` returns, and
    ``{"model", "rounds", "cut_by_budget", "warmup_s", "seconds", "errors"}`` (``warmup_s``: the warm-up
    round's seconds, compiling included).

    A compiled mode's warm-up round (round 0, dropped) runs at least ``2 * WARM_RUNS`` steps of each
    configuration, adaptive_u100's first ``WARM_RUNS`` of them recomputing, so it compiles both pass kinds.
    Each of its configurations' entries adds ``graphs`` (Dynamo's graphs made for it), ``graph_breaks``,
    ``recompiles`` (graphs made in the timed rounds: 0 when the warm-up compiled every pass kind) and
    ``cudagraph_skips`` (graphs Inductor left out of CUDA graphs). ``budget_s``: no round starts once the
    timed rounds have taken that long (at least one runs). ``guard``: a mode whose building, steps or
    kernel profile raises is recorded (``{"error": ...}``, or ``errors`` for the profile) via
    :func:`_guarded` and left out of the later rounds; else the exception propagates."""
    compiled = {name for name, (backend, _) in modes.items() if backend is not None}
    if compiled:
        torch._dynamo.reset()  # this call's graphs alone, in every compiled mode
    out: dict[str, dict[str, Any]] = {}
    info: dict[str, Any] = {"model": model_name, "rounds": 0, "cut_by_budget": False, "warmup_s": 0.0}
    info["errors"] = {}
    runs: dict[str, dict[str, _Run]] = {}
    for name, (backend, mode) in modes.items():
        part = f"building {model_name}'s {name} steps"
        built = _attempt(guard, part, _build_runs, model_name, device, image_size, backend, mode)
        (out if "error" in built else runs)[name] = built
    t0 = time.perf_counter()
    times = _timed_rounds(runs, out, info, compiled, (batch, device, dtype, steps), rounds, budget_s, guard)
    info["seconds"] = time.perf_counter() - t0
    for name, run in runs.items():
        out[name] = _medians(times[name], name in compiled)
        if device.startswith("cuda"):
            part = f"{model_name}'s {name} kernel time"
            got = _attempt(guard, part, _add_kernel_ms, out[name], run, batch, device, dtype)
            if got is not None and "error" in got:
                info["errors"][name] = got["error"]
    return {name: out[name] for name in modes}, info


def _attempt(guard: bool, part: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: under ``guard`` through :func:`_guarded` (``{"error": ...}`` if it raised)."""
    return _guarded(part, fn, *args) if guard else fn(*args)


def _build_runs(
    model_name: str, device: str, image_size: int, backend: str | None, mode: str | None
) -> dict[str, _Run]:
    """Each configuration of :data:`CONFIGS`, seeded alike: a model attached to its scaler, compiled
    (``fullgraph=True``) when ``backend`` is given."""
    runs = {}
    for key, (class_name, options) in CONFIGS.items():
        torch.manual_seed(0)
        model, make = _model(model_name, device, image_size)
        scaler = _scaler(class_name, options, device)
        model = scaler.attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        if backend is not None:
            model = torch.compile(model, fullgraph=True, backend=backend, mode=mode)
        runs[key] = _Run(scaler, model, opt, make, backend is not None and mode == "reduce-overhead")
    return runs


def _timed_rounds(
    runs: dict[str, dict[str, _Run]],
    out: dict[str, Any],
    info: dict[str, Any],
    compiled: set[str],
    step_args: tuple,
    rounds: int,
    budget_s: float | None,
    guard: bool,
) -> dict[str, dict[str, dict[str, Any]]]:
    """The warm-up round and up to ``rounds`` timed rounds of every mode in ``runs``: each configuration's
    step times by kind (timed rounds only) and, for a compiled mode, its compile counts. A mode that raises
    under ``guard`` goes into ``out`` as its error and leaves ``runs``; ``info`` gets the rounds."""
    times = {name: {key: {"step": [], "recompute": [], "reuse": []} for key in CONFIGS} for name in runs}
    counts = {name: {key: Counter() for key in CONFIGS} for name in compiled & set(runs)}
    start = time.perf_counter()
    for round_ in range(rounds + 1):  # round 0 warms up (compiling, cuDNN autotuning, the allocator): dropped
        for name in list(runs):
            warm = round_ == 0 and name in compiled
            part = f"{info['model']}'s {name} steps"
            got = _attempt(guard, part, _round, runs[name], *step_args, warm)
            if "error" in got:
                out[name] = got
                del runs[name]
                continue
            for key, r in got.items():
                if round_ > 0:
                    for kind in ("step", "recompute", "reuse"):
                        times[name][key][kind] += r[kind]
                if name in compiled:
                    counts[name][key].update({k: r[k] for k in COUNTS})
                    counts[name][key]["recompiles"] += r["graphs"] if round_ > 0 else 0
        if round_ == 0:
            info["warmup_s"], start = time.perf_counter() - start, time.perf_counter()
        else:
            info["rounds"] = round_
            if budget_s is not None and round_ < rounds and time.perf_counter() - start > budget_s:
                info["cut_by_budget"] = True
                break
    for name, by_key in counts.items():
        if name in runs:
            for key, c in by_key.items():
                times[name][key]["counts"] = dict(c)
    return times


def _round(
    runs: dict[str, _Run], batch: int, device: str, dtype: torch.dtype | None, steps: int, warm: bool
) -> dict[str, dict[str, Any]]:
    """One round: each configuration's ``steps`` steps in turn (adaptive_u100's first recomputes, the
    others reuse), their milliseconds by kind; under ``warm`` (a compiled mode's warm-up) at least
    ``2 * WARM_RUNS`` steps, the first ``WARM_RUNS`` recomputing, and Dynamo's counts meanwhile."""
    out = {}
    for key, run in runs.items():
        before = _compile_counts()
        times: dict[str, Any] = {"step": [], "recompute": [], "reuse": []}
        for i in range(max(steps, 2 * WARM_RUNS) if warm else steps):
            recompute = key == "adaptive_u100" and (i == 0 or (warm and i < WARM_RUNS))
            ms = _timed_step(run, batch, device, dtype, recompute)
            times["step"].append(ms)
            times["recompute" if recompute else "reuse"].append(ms)
        out[key] = times | {k: v - before[k] for k, v in _compile_counts().items()}
    return out


def _compile_counts() -> dict[str, int]:
    """Dynamo's graphs and graph breaks so far in this process, and the graphs Inductor kept out of CUDA
    graphs (``torch._dynamo.utils.counters``, as :mod:`adaloss.lab.bench.compiled` reads them)."""
    from torch._dynamo.utils import counters

    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
    }


def _medians(times: dict[str, dict[str, Any]], compiled: bool) -> dict[str, dict[str, float]]:
    """Each configuration's median milliseconds per kind of step, and a compiled one's counts."""
    ms = {}
    for key, t in times.items():
        ms[key] = {kind: statistics.median(v) for kind, v in t.items() if kind != "counts" and v}
        if compiled:
            ms[key] |= t.get("counts", {})
    return ms


def _add_kernel_ms(
    ms: dict[str, dict[str, float]], runs: dict[str, _Run], batch: int, device: str, dtype: torch.dtype
) -> None:
    """On a GPU: each configuration's kernel time per reuse step (``kernel_reuse``; adaptive_u1's steps
    all recompute) and adaptive_u100's per recompute step (``kernel_recompute``)."""
    for key, run in runs.items():
        ms[key]["kernel_reuse"] = _kernel_ms(run, batch, device, dtype, recompute=False)
        if key == "adaptive_u100":
            ms[key]["kernel_recompute"] = _kernel_ms(run, batch, device, dtype, recompute=True)


def _kernel_ms(
    run: _Run, batch: int, device: str, dtype: torch.dtype, recompute: bool, steps: int = 3
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


def _timed_step(run: _Run, batch: int, device: str, dtype: torch.dtype | None, recompute: bool) -> float:
    """One training step's milliseconds (``recompute``: the adaptive scaler recomputes its scales)."""
    scaler, model, opt, make, graphed = run
    x, y = make(batch)
    if recompute:
        scaler.recompute_next()
    if graphed:  # a new iteration for CUDA graph trees: the last step's outputs may be overwritten
        torch.compiler.cudagraph_mark_step_begin()
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


def _timing(
    model: str,
    batch: int,
    device: str,
    compiled: tuple[str, ...] = (),
    backend: str = "inductor",
    rounds: int = 5,
    steps: int = 10,
) -> dict[str, Any]:
    """``model``'s step times at ``batch``: eagerly, and compiled by ``backend`` in each mode of ``compiled``
    in the same interleaved rounds (:func:`time_modes`), a compiled mode that fails recorded as its error
    (``compiled[mode]["error"]``) beside the others."""
    if not compiled:
        ms = time_steps(model, batch, device)
        return {"batch": batch, "ms": ms, "ratios": step_ratios(ms)}
    modes: dict[str, Mode] = {"eager": (None, None)} | {m: (backend, m) for m in compiled}
    by_mode, info = time_modes(model, batch, device, modes, rounds, steps, guard=True)
    if "error" in by_mode["eager"]:
        raise RuntimeError(f"the eager steps: {by_mode['eager']['error']}")
    if "eager" in info["errors"]:
        raise RuntimeError(f"the eager steps' kernel time: {info['errors']['eager']}")
    ms = by_mode.pop("eager")
    entry = {"batch": batch, "ms": ms, "ratios": step_ratios(ms), "compiled": {}}
    entry |= {"backend": backend, "rounds": info["rounds"], "warmup_s": info["warmup_s"]}
    for mode, got in by_mode.items():
        if "error" in got:
            entry["compiled"][mode] = got
            continue
        counts = {key: {k: t.pop(k) for k in (*COUNTS, "recompiles")} for key, t in got.items()}
        entry["compiled"][mode] = {"ms": got, "ratios": step_ratios(got), "compile": counts}
        if mode in info["errors"]:
            entry["compiled"][mode]["kernel_error"] = info["errors"][mode]
    return entry


def collect(
    device: str,
    gpu: str,
    out_dir: Path,
    timing: dict[str, int] | None = None,
    compiled: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Every part of the check on ``device``, each recorded even when another fails: the CUDA tests
    (their log in ``out_dir``), the FP16/BF16 gradient comparison, and the step times of ``timing``'s
    models at its batch sizes, eager and compiled in each ``torch.compile`` mode of ``compiled`` (default:
    :data:`COMPILE_MODES` on CUDA, none elsewhere)."""
    timing = TIMING if timing is None else timing
    if compiled is None:
        compiled = COMPILE_MODES if device.startswith("cuda") else ()
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
        "timing": {
            m: _guarded(f"{m}'s step times", _timing, m, b, device, *((compiled,) if compiled else ()))
            for m, b in timing.items()
        },
    }


def failed(report: dict[str, Any]) -> bool:
    """Whether a test failed or a part of the check raised (a compiled mode's steps or profile included)."""
    parts = [report["tests"], *report["gradients"].values(), *report["timing"].values()]
    compiled = [c for t in report["timing"].values() for c in t.get("compiled", {}).values()]
    return (
        report["tests"].get("status") == "failed"
        or any("error" in p for p in parts)
        or any("error" in c or "kernel_error" in c for c in compiled)
    )


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
        rows.append(f"  | {model} | " + _ratio_cells(entry["ms"], entry["ratios"]))
    if any(entry.get("compiled") for entry in report["timing"].values()):
        rows += _compiled_rows(report["timing"])
    return "\n".join(rows)


def _ratio_cells(ms: dict[str, dict[str, float]], r: dict[str, float]) -> str:
    """The wall- and kernel-time cells of one row of :func:`_table` (kernel cells empty off a GPU)."""
    kernel = ms["dynamic"].get("kernel_reuse")
    return (
        f"{r['adaptive_u1_over_dynamic']:.3f}x | {r['adaptive_u100_over_dynamic']:.3f}x "
        f"| {ms['dynamic']['step']:.2f} | "
        + (
            f"{r['kernel_u1_over_dynamic']:.3f}x | {r['kernel_u100_over_dynamic']:.3f}x | {kernel:.2f} |"
            if kernel is not None
            else "| | |"
        )
    )


def _compiled_rows(timing: dict[str, Any]) -> list[str]:
    """The compiled steps' table: per model and mode, the ratios of :func:`_table`, the compiled dynamic
    step against the eager one, and what Dynamo made: graphs per configuration (dynamic, u=1, u=100),
    graph breaks, recompiles after the warm-up round, graphs Inductor kept out of CUDA graphs."""
    rows = [
        "  compiled (torch.compile(attached model, fullgraph=True, mode=...)), in the same rounds as the"
        " eager steps:",
        "  | model | mode | adaptive u=1 / dynamic | adaptive u=100 / dynamic (amortized) | dynamic ms/step |"
        " kernel time: u=1 / dynamic | kernel time: u=100 / dynamic | dynamic kernel ms/step |"
        " dynamic / eager dynamic | graphs (dynamic, u=1, u=100) | graph breaks | recompiles |"
        " cudagraph skips |",
        "  |---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, entry in timing.items():
        for mode, c in entry.get("compiled", {}).items():
            if "error" in c:
                rows.append(f"  | {model} | {mode} | error: {_first_line(c['error'])} | | |")
                continue
            counts = c["compile"]
            graphs = ", ".join(str(counts[k]["graphs"]) for k in CONFIGS)
            total = {k: sum(n[k] for n in counts.values()) for k in ("graph_breaks", "recompiles")}
            speed = c["ms"]["dynamic"]["step"] / entry["ms"]["dynamic"]["step"]
            rows.append(
                f"  | {model} | {mode} | {_ratio_cells(c['ms'], c['ratios'])} {speed:.3f}x | {graphs} "
                f"| {total['graph_breaks']} | {total['recompiles']} "
                f"| {sum(n['cudagraph_skips'] for n in counts.values())} |"
            )
            if "kernel_error" in c:
                rows.append(
                    f"  | {model} | {mode} | kernel time: error: {_first_line(c['kernel_error'])} | | |"
                )
    return rows


def _first_line(text: str) -> str:
    """An error's first line, for a table row (the report keeps all of it)."""
    return text.strip().splitlines()[0] if text.strip() else text


def main(argv: list[str] | None = None) -> int:
    """Run the checks on ``cuda:0``; write ``results/gpu/<gpu name>.json``; print the table. Exit 1 when a
    test failed or a part of the check raised (the other parts are still measured and written).
    ``--compile MODE ...``: the ``torch.compile`` modes timed beside the eager steps (default
    :data:`COMPILE_MODES`; ``none``: eager only); ``--models``: the timed models (default all of
    :data:`TIMING`)."""
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--compile",
        nargs="+",
        default=list(COMPILE_MODES),
        choices=["default", "reduce-overhead", "max-autotune", "none"],
        help=f"torch.compile modes timed beside the eager steps (default {' '.join(COMPILE_MODES)})",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        default=list(TIMING),
        choices=list(TIMING),
        help=f"the timed models (default {' '.join(TIMING)}; compiling ResNet-110 takes minutes per mode)",
    )
    args = parser.parse_args(argv)
    compiled = tuple(m for m in args.compile if m != "none")
    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device here (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}); nothing to check: run it on a machine with an NVIDIA GPU"
        )
        return 0
    gpu = torch.cuda.get_device_name(0)
    out_dir = ROOT / "results" / "gpu"
    out_dir.mkdir(parents=True, exist_ok=True)
    report = collect("cuda", gpu, out_dir, {m: TIMING[m] for m in args.models}, compiled)
    out = out_dir / (re.sub(r"[^A-Za-z0-9._-]+", "_", gpu) + ".json")
    out.write_text(json.dumps(report, indent=2, allow_nan=False, default=_finite))
    print(_table(report))
    print(f"written: {out}")
    return 1 if failed(report) else 0


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)
