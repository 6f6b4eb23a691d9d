"""Dispatched ops per training step, a GPU-cost proxy: :class:`OpCounter` (a ``TorchDispatchMode``) counts
the ATen ops of one dynamic step and of adaptive reuse and recompute steps under real FP16 autocast on the
CPU, by op and by the adaloss code that called them; :func:`measure_op_counts` adds the batch-size check."""

from __future__ import annotations

import contextlib
import copy
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from adaloss.lab.bench.specs import LR, MOMENTUM
from adaloss.lab.reports.measurement import model_cfg


@dataclass(frozen=True)
class OpKind:
    """One counted step: which scaler, which kind of adaptive step, and the goal for its ratio to dynamic."""

    key: str
    label: str
    goal: float | None  # the bound on ops(this) / ops(dynamic) (issue 22); None for the baseline
    init_scale: float | None = None  # the adaptive scaler's alpha_{N+1}; None: the dynamic scaler
    recompute: bool | None = None  # the adaptive step kind to count (read back from scaler.state)


#: ``2**-24`` is FP16's smallest subnormal: with the loss scaled that far down, Algorithm 4 must raise the
#: scale layer by layer, so many betas differ from 1 (at ``alpha_{N+1} = 1`` a freshly initialized ResNet's
#: gradients need none, and every beta is 1). A reuse step costs more ops for every beta that is not 1.
LOW_INIT_SCALE = 2.0**-24
OP_KINDS: tuple[OpKind, ...] = (
    OpKind("dynamic", "dynamic", None),
    OpKind("adaptive_reuse", "adaptive reuse", 1.05, init_scale=1.0, recompute=False),
    OpKind("adaptive_reuse_low", "adaptive reuse, alpha_{N+1}=2^-24", 1.05, LOW_INIT_SCALE, False),
    OpKind("adaptive_recompute", "adaptive recompute", 2.0, init_scale=1.0, recompute=True),
)
OP_MODELS = ("resnet20", "resnet110")
OP_BATCH = 2
_SRC = str(Path(__file__).resolve().parents[2]) + "/"  # src/adaloss/
#: Left out of the sites and origins: the models (see ``_origin_and_site``) and this package, the loop itself.
_NOT_COUNTED = (_SRC + "runner/models/", _SRC + "lab/bench/")


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops that reach a kernel while it is active, by op and by the adaloss code calling it.

    Why a ``TorchDispatchMode`` rather than ``torch.profiler``: the mode sits below autograd and autocast,
    so it sees each op exactly once, as the backend receives it, backward ops and autocast's casts included;
    an op that a kernel calls internally is not seen again (the mode is off while its handler runs the op),
    so nothing is counted twice, where the profiler records every nesting level (``aten::conv2d`` over
    ``aten::convolution`` over ``aten::_convolution`` ...) and its counts need a top-level filter. It also
    names the Python line each op came from, which the per-origin breakdown needs, at no cost to ops
    outside a counted step. On a GPU each counted op is one kernel launch from the host (more for a few
    composite kernels, equally for every configuration); views (``func.is_view``: ``view``, ``t``,
    ``detach``, ...) launch nothing but still cost a dispatch, so both are reported.
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.by_origin: Counter[str] = Counter()
        self.by_site: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_op[func.overloadpacket.__name__] += 1
        if func.is_view:
            self.views += 1
        origin, site = _origin_and_site(sys._getframe(1))
        self.by_origin[origin] += 1
        self.by_site[site] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, Any]:
        total = sum(self.by_op.values())
        return {
            "ops": total,
            "kernels": total - self.views,
            "views": self.views,
            "by_op": dict(self.by_op.most_common()),
            "by_origin": dict(self.by_origin.most_common()),
            "by_site": dict(self.by_site.most_common()),
        }


#: Sites (see ``_origin_and_site``) that run once per GEMM point or once per branch point of a pass.
_PER_POINT = {
    "gemm": ("AdaptiveGEMM.", "ScaledGEMM.", "GradRound."),
    "branch": ("BranchModule.", "Rescale."),
}
_NO_FRAME = "torch or a model's forward (no adaloss frame)"


def _origin_and_site(frame: Any) -> tuple[str, str]:
    """Where an op comes from: its *site*, ``module.py:Class.method`` of the outermost adaloss frame (the
    scaler method the loop called, or the autograd node or module the engine ran: ``ScaledGEMM.backward``
    runs once per GEMM point), and its *origin*, ``module.py:function:line`` of the innermost one, followed
    by its site's ``(in Class.method)`` (the printed table sums the lines of each function and site).

    The models' own code is left out: the adaptive scaler trains an fx-traced copy whose forward runs
    generated code, so naming the plain model's forward ops by its source lines would show the same ops as
    a difference; so is the bench's own loop (this package), which calls the scaler. Ops with no adaloss
    frame come from torch itself (the autograd engine's built-in backward nodes, a model's forward, the
    optimizer) or from code outside adaloss."""
    origin = site = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_SRC) and not path.startswith(_NOT_COUNTED):
            code = frame.f_code
            if origin is None:
                origin = f"{path[len(_SRC) :]}:{code.co_qualname}:{frame.f_lineno}"
            site = f"{path[len(_SRC) :]}:{code.co_qualname}"
        frame = frame.f_back
    if origin is None:
        return _NO_FRAME, _NO_FRAME
    return f"{origin} (in {site.rsplit(':', 1)[-1]})", site


def per_point(key: str) -> str | None:
    """``"gemm"`` or ``"branch"`` for a site (or an origin in a site) that runs once per such point."""
    site, _, inside = key.rpartition(" (in ")
    qualname = inside[:-1] if site else key.rsplit(":", 1)[-1]
    for point, prefixes in _PER_POINT.items():
        if qualname.startswith(prefixes):
            return point
    return None


Run = tuple[Any, torch.nn.Module, torch.optim.Optimizer]  # (scaler, model, optimizer)


def _step(run: Run, x: torch.Tensor, y: torch.Tensor, counter: OpCounter | None = None) -> None:
    """One training step under FP16 autocast, its ops counted by ``counter`` when one is given."""
    scaler, model, opt = run
    with counter if counter is not None else contextlib.nullcontext():
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def _warmed_up_run(name: str, kind: OpKind, base: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Run:
    """``kind``'s scaler on a copy of ``base`` with SGD foreach, after two applied warm-up steps."""
    from adaloss.scalers import AdaptiveLossScaler, DynamicLossScaler

    if kind.init_scale is None:
        scaler = DynamicLossScaler()
    else:
        scaler = AdaptiveLossScaler(update_every=100, init_scale=kind.init_scale)
    model = scaler.attach(copy.deepcopy(base))
    model.train()
    run = (scaler, model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, foreach=True))
    applied = 0
    for _ in range(30):  # warm-up: two applied steps (and the dynamic scale backed off below overflow)
        _step(run, x, y)
        applied += not scaler.last_step_skipped
        if applied == 2:
            return run
    raise RuntimeError(f"{name}: fewer than 2 of 30 warm-up steps were applied (all overflowed)")


def _counted_step(name: str, run: Run, kind: OpKind, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """The op counts of the first applied step of ``kind`` (an adaptive step: of the kind asked for)."""
    scaler = run[0]
    for _ in range(10):
        if kind.recompute:
            scaler.recompute_next()
        counter = OpCounter()
        _step(run, x, y, counter)
        state = getattr(scaler, "state", None)
        recomputed = getattr(scaler, "last_pass", None) == "recompute"
        if not scaler.last_step_skipped and (state is None or recomputed is kind.recompute):
            out = counter.summary()
            if state is not None:  # which scales were not 1 (read after the step: a sync, not counted)
                out["betas_not_1"] = sum(b not in (1.0, None) for b in scaler.layer_betas().values())
                out["branches_not_1"] = sum(scaler.branch_rescaled().values())
            return out
    raise RuntimeError(f"{name}: no clean {kind.key} step in 10 tries (every one overflowed)")


def count_step_ops(name: str, batch: int, seed: int = 0) -> dict[str, Any]:
    """Dispatched ops of one training step of each kind in ``OP_KINDS`` for model ``name``.

    The steps run under real CPU FP16 autocast (``torch.autocast("cpu", dtype=torch.float16)``) with the
    adaptive scaler (statistics, betas and alphas computed into its device buffers on recompute steps and
    read from them in between: the code every device runs) and ``update_every=100``, so
    the ops are those a GPU step dispatches. A recompute step is requested with ``recompute_next()``. SGD
    (momentum 0.9) runs its ``foreach`` implementation, PyTorch's default for CUDA parameters (the CPU
    default is a per-parameter loop). A step is forward + loss + scaled backward + ``scaler.step`` +
    ``update`` + ``zero_grad``, after two applied warm-up steps (the first applied step creates the momentum
    buffers). The op sequence depends on the model and on which scales are 1, not on the batch size
    (``measure_op_counts`` checks this). A counted step must apply its update (a skipped step dispatches
    no optimizer ops), so an overflowing one is stepped past and the count repeated.
    """
    from adaloss.runner.models import build_model

    torch.manual_seed(seed)
    base = build_model(model_cfg(name), 10)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    runs: dict[float | None, Run] = {}
    counts = {}
    for kind in OP_KINDS:
        if kind.init_scale not in runs:
            runs[kind.init_scale] = _warmed_up_run(name, kind, base, x, y)
        counts[kind.key] = _counted_step(name, runs[kind.init_scale], kind, x, y)
    state = runs[1.0][0].state
    base_ops, base_kernels = counts["dynamic"]["ops"], counts["dynamic"]["kernels"]
    return {
        "model": name,
        "batch": batch,
        "points": {"gemm": len(state.gemms), "branch": len(state.branches)},
        "counts": counts,
        "ratios": {k.key: counts[k.key]["ops"] / base_ops for k in OP_KINDS if k.goal},
        "kernel_ratios": {k.key: counts[k.key]["kernels"] / base_kernels for k in OP_KINDS if k.goal},
    }


def _same_ops_but_betas(a: dict, b: dict) -> bool:
    """Whether two counts of one step kind dispatch the same ops, op for op, up to the multiplies a reuse
    step spends on scales that are not 1: ``delta * beta`` at each beta that is not 1, ``alpha_{N+1} /
    alpha`` on every parameter gradient below such a layer, a branch's sum with factors (``addcmul``) or
    without (``add``), and the reads of those scales from the buffers (``select``): an eager reuse step
    skips a factor the host's flags say is 1. Which scales are 1
    depends on the data, so two batch sizes may differ there and only there.
    """
    if a["by_op"] == b["by_op"]:
        return True
    allowed = set()
    if a.get("betas_not_1", 0) != b.get("betas_not_1", 0):
        allowed |= {"mul", "mul_", "select"}
    if a.get("branches_not_1", 0) != b.get("branches_not_1", 0):
        allowed |= {"mul", "mul_", "select", "add", "add_", "addcmul", "addcmul_"}
    ops = set(a["by_op"]) | set(b["by_op"])
    diff = {op for op in ops if a["by_op"].get(op, 0) != b["by_op"].get(op, 0)}
    return bool(allowed) and diff <= allowed


def measure_op_counts(models: Sequence[str], batch: int, seed: int, log: Callable[[str], None]) -> dict:
    """``count_step_ops`` for each model, plus the batch-size check on the first: the same model counted
    at ``batch`` and ``2 * batch`` must dispatch the same ops, op for op."""
    results = {}
    for name in models:
        t0 = time.perf_counter()
        results[name] = count_step_ops(name, batch, seed)
        log(f"[bench] {name}: op counts at batch {batch} in {time.perf_counter() - t0:.0f}s")
    first, keys = models[0], [k.key for k in OP_KINDS]
    other = count_step_ops(first, 2 * batch, seed)
    mine = results[first]["counts"]
    theirs = other["counts"]
    check = {
        "model": first,
        "batches": [batch, 2 * batch],
        "equal": all(_same_ops_but_betas(mine[k], theirs[k]) for k in keys),
        "ops": {k: [mine[k]["ops"], theirs[k]["ops"]] for k in keys},
        "betas_not_1": {
            k: [mine[k]["betas_not_1"], theirs[k]["betas_not_1"]] for k in keys if "betas_not_1" in mine[k]
        },
    }
    return {"batch": batch, "models": results, "batch_check": check}
