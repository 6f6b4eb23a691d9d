"""Step-time ratios of the training configurations, measured interleaved in one process (``make bench``).

What it answers: how much does emulated FP16 cost over FP32, each loss scaler over no scaling, underflow
telemetry over none, and the adaptive scaler over the dynamic one (at ``update_every`` 1 and 100, the
paper's 27% and 0.27%), for the CIFAR ResNets 20/56/110 on synthetic 32x32 inputs.

Why ratios, and why interleaved: the lab machines are shared (other test suites compete for the 2 cores),
so an absolute step time says more about the neighbours than about the code, and two numbers taken minutes
apart are not comparable. Every configuration of one model is therefore built in this process and they take
turns step by step: a *round* is a few cycles in which every configuration runs one step, each cycle in a
fresh random order (seeded; never the same model twice in a row), plus one cycle of the extra step kinds;
each ratio is formed from the round's mean step times, and the table reports the median of the per-round
ratios with its interquartile range. A load change mid-run then moves numerator and denominator together.
An A/A row (two identical FP16 configurations) shows the noise floor of a ratio between two
configurations: a target tighter than that spread is not resolved by one run, and the table prints the
measurement as it is rather than rounding it to fit. (The amortized telemetry row is far less noisy: both
its step kinds run on one configuration and the telemetry step weighs 1%.)

Copies (``--replicas N``): N separately built copies of every configuration take turns like the others,
and all copies' steps enter each round's mean. A model's step time might depend on where its tensors
landed in memory, which more rounds of the same model would not average out; more copies would. The table
then adds each copy's A/A ratio to copy 0, so a run shows how far two identical models differ (ResNet-110,
2 copies, 20 rounds: medians 0.999x and 1.003x, inside the per-round noise).

A *step* is forward + loss + scaled backward + ``scaler.step`` + ``scaler.update`` + ``zero_grad``, timed
with ``time.perf_counter`` (the CPU runs synchronously; ``--clock cpu``: ``time.process_time``, see below)
after warm-up steps. Amortized ratios combine two
step kinds measured in the same round: telemetry at ``every=100`` is ``(t_tel + 99 t) / (100 t)`` and
adaptive at ``update_every=100`` is ``(t_recompute + 99 t_reuse) / (100 t_dynamic)``; the recompute step is
requested through the scaler's own "recompute on the next step" flag (the one an overflow sets), and each
adaptive step's actual kind is read back from ``scaler.state.recompute``, so a natural recompute step is
never counted as a reuse step.

Threads: one by default (``--threads 0`` keeps torch's default, ``--threads 2`` uses both cores). On a
shared 2-core machine a 2-thread OpenMP region stalls whenever either thread is preempted: measured here at
load 5, ResNet-20 FP16 steps took 0.5-4 s with 2 threads against 0.33-0.35 s with 1, and the per-round
ratios spread from 1.02x to 2.95x (dynamic / none). One thread keeps the ratios reproducible. Its ratios are
somewhat *lower* than a 2-thread run on an idle machine would give: the emulation's per-op Python overhead
is fixed while the arithmetic it is compared with runs on one core instead of two. The header names the
thread count so a reader knows which one was measured.

Clock: ``--clock wall`` (default) times steps with ``time.perf_counter``; ``--clock cpu`` with
``time.process_time``, the CPU time of this process. With one thread and synchronous CPU kernels the two
agree on an idle machine, but under load the CPU clock leaves out the time the process waited for a core,
the largest source of noise here. Both clocks timed the same steps of one 12-round ResNet-20 run at load
~3.5: the per-round adaptive update_every=1 / dynamic ratio had p25-p75 1.043-1.186 by the wall clock and
1.053-1.074 by the CPU clock. The CPU clock still includes the slowdown from sharing caches and memory
bandwidth with the neighbours, so it does not make a loaded machine an idle one.

Allocator and kernels: ``main`` first applies :func:`adaloss.utils.allocator.tune_cpu_allocator` (as the
trainer does on the CPU), so no configuration pays for glibc's malloc giving memory back to the kernel and
faulting it in again every step; without it, which configuration took those faults (up to 1.4 million per
step) depended on heap layout and moved ratios by several percent. The FP16 rounding and Algorithm 4's
statistics use the native kernels (:mod:`adaloss.numerics.native`) when they could be built, and every
configuration's conv layers (and the adaptive scaler's branch points) run as the fused C++ autograd nodes of
:mod:`adaloss.numerics.fused` when those could be built; the JSON's settings record all three.

Paired runs: ``--configs fp16_dynamic fp16_adaptive_u100`` measures only those configurations (and reports
only the ratios between them), so a comparison of two configurations gets more rounds in the same time and
does not share the heap with five unrelated models.

Cost: the default run keeps to ``--budget`` seconds (840 s), shared among the models; deeper models get
fewer rounds and fewer steps per round. ``--quick`` is a seconds-long smoke run. Raw per-step timings (with
their kinds and cycles) and every ratio go to ``--out`` (``results/bench/bench.json``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import _common as C  # noqa: E402  (needs the path above)

DEFAULT_MODELS = ("resnet20", "resnet56", "resnet110")
#: Per model: rounds, timed plain steps (cycles) per configuration per round, warm-up steps, budget share.
PLAN = {
    "resnet20": {"rounds": 25, "steps": 3, "warmup": 3, "weight": 0.25},
    "resnet56": {"rounds": 12, "steps": 2, "warmup": 2, "weight": 0.30},
    "resnet110": {"rounds": 8, "steps": 2, "warmup": 2, "weight": 0.45},
}
MIN_ROUNDS = 3  # the budget never cuts a model below this many rounds
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_CLOCK = time.perf_counter  # the step timer; set from --clock by main()
LR, MOMENTUM = 0.01, 0.9
N_BATCHES = 4  # synthetic batches cycled through, the same sequence for every configuration


@dataclass(frozen=True)
class Spec:
    """One configuration: precision, scaler config, and which extra step kind its block ends with."""

    key: str
    precision: str
    scaler: dict[str, Any]
    extra: str | None = None  # "telemetry" | "recompute" | None


SPECS: tuple[Spec, ...] = (
    Spec("fp32_none", "fp32", {"name": "none"}),
    Spec("fp16_none", "fp16", {"name": "none"}, extra="telemetry"),
    Spec("fp16_none_b", "fp16", {"name": "none"}),  # A/A control: the same configuration twice
    Spec("fp16_fixed", "fp16", {"name": "fixed", "scale": 128}),
    Spec("fp16_dynamic", "fp16", {"name": "dynamic"}),
    Spec("fp16_adaptive_u1", "fp16", {"name": "adaptive", "update_every": 1}),
    Spec("fp16_adaptive_u100", "fp16", {"name": "adaptive", "update_every": 100}, extra="recompute"),
)


@dataclass(frozen=True)
class RatioDef:
    """A ratio formed inside each round from the per-round mean step times ``t(config, kind)``."""

    key: str
    label: str
    target: float | None  # None: informational, no PASS/over-target verdict
    fn: Callable[[Callable[[str, str], float]], float]
    paper: str = ""


RATIOS: tuple[RatioDef, ...] = (
    RatioDef(
        "fp16_over_fp32",
        "emulated FP16 / FP32 (scaler none)",
        1.15,
        lambda t: t("fp16_none", "plain") / t("fp32_none", "plain"),
    ),
    RatioDef(
        "fixed_over_none",
        "fixed 128 / none (FP16)",
        1.02,
        lambda t: t("fp16_fixed", "plain") / t("fp16_none", "plain"),
    ),
    RatioDef(
        "dynamic_over_none",
        "dynamic / none (FP16)",
        1.02,
        lambda t: t("fp16_dynamic", "plain") / t("fp16_none", "plain"),
    ),
    RatioDef(
        "telemetry100_over_none",
        "telemetry every=100 / none, amortized (FP16)",
        1.01,
        lambda t: (
            (t("fp16_none", "telemetry") + 99 * t("fp16_none", "plain")) / (100 * t("fp16_none", "plain"))
        ),
    ),
    RatioDef(
        "adaptive_u1_over_dynamic",
        "adaptive update_every=1 / dynamic (FP16)",
        1.05,
        lambda t: t("fp16_adaptive_u1", "recompute") / t("fp16_dynamic", "plain"),
        paper="1.27x",
    ),
    RatioDef(
        "adaptive_u100_over_dynamic",
        "adaptive update_every=100 / dynamic, amortized (FP16)",
        1.005,
        lambda t: (
            (t("fp16_adaptive_u100", "recompute") + 99 * t("fp16_adaptive_u100", "reuse"))
            / (100 * t("fp16_dynamic", "plain"))
        ),
        paper="1.0027x",
    ),
    # Informational: the noise floor and the two step kinds the amortized rows are built from.
    RatioDef(
        "aa_control",
        "A/A control: FP16 none / identical FP16 none",
        None,
        lambda t: t("fp16_none_b", "plain") / t("fp16_none", "plain"),
    ),
    RatioDef(
        "telemetry_step_over_step",
        "one telemetry step / one plain step (FP16)",
        None,
        lambda t: t("fp16_none", "telemetry") / t("fp16_none", "plain"),
    ),
    RatioDef(
        "adaptive_recompute_over_dynamic",
        "adaptive recompute step / dynamic step",
        None,
        lambda t: t("fp16_adaptive_u100", "recompute") / t("fp16_dynamic", "plain"),
    ),
    RatioDef(
        "adaptive_reuse_over_dynamic",
        "adaptive reuse step (update_every=100) / dynamic step",
        None,
        lambda t: t("fp16_adaptive_u100", "reuse") / t("fp16_dynamic", "plain"),
    ),
)
RATIO_KEYS = tuple(r.key for r in RATIOS)


def ratio_configs(r: RatioDef) -> set[str]:
    """The configurations a ratio reads (found by evaluating it on a recording timer)."""
    seen: set[str] = set()

    def t(config: str, kind: str) -> float:
        seen.add(config)
        return 1.0

    r.fn(t)
    return seen


def selected_ratios(configs: Sequence[str]) -> tuple[RatioDef, ...]:
    """The ratios whose configurations were all measured."""
    return tuple(r for r in RATIOS if ratio_configs(r) <= set(configs))


def request_recompute(scaler: Any) -> None:
    """Make the adaptive scaler recompute its betas on the next step, as it does after an overflow
    (``AdaptiveLossScaler.recompute_next``; the only way to get a recompute step on demand without running
    100 steps per round). Called before the step's forward pass. The step's actual kind is checked
    afterwards anyway."""
    scaler.recompute_next()


class Runner:
    """One configuration's model, precision, scaler, optimizer and monitor; ``step(kind)`` times a step.

    The model is a deep copy of the same initial model for every configuration, so all configurations do
    the same arithmetic; only the precision and scaler differ.
    """

    def __init__(
        self, spec: Spec, base_model: torch.nn.Module, batches: Sequence[tuple], replica: int = 0
    ) -> None:
        from adaloss.precision import Precision
        from adaloss.scalers import build_scaler
        from adaloss.telemetry import UnderflowMonitor

        self.spec = spec
        self.replica = replica
        self.precision = Precision(spec.precision, "cpu")
        self.scaler = build_scaler(OmegaConf.create(spec.scaler), self.precision.grad_format)
        model = copy.deepcopy(base_model)
        self.model = self.precision.prepare(self.scaler.attach(model))
        self.model.train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        self.monitor = (
            UnderflowMonitor(every=100, fmt=self.precision.telemetry_format)
            if spec.extra == "telemetry"
            else None
        )
        self.batches = batches
        self.n = 0
        self.skipped_timed = 0

    def step(self, kind: str = "plain") -> tuple[str, float]:
        """Run one training step of ``kind`` (plain | telemetry | recompute); returns (actual kind, seconds).

        For the adaptive scaler the actual kind is ``recompute`` or ``reuse`` as the scaler decided it.
        """
        x, y = self.batches[self.n % len(self.batches)]
        self.n += 1
        if kind == "recompute":
            request_recompute(self.scaler)
        monitor = self.monitor if kind == "telemetry" else None
        t0 = _CLOCK()
        with self.precision.autocast(monitor=monitor):
            loss = F.cross_entropy(self.model(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        if monitor is not None:
            monitor.underflow_rates()
        dt = _CLOCK() - t0
        actual = kind
        state = getattr(self.scaler, "state", None)
        if kind != "telemetry" and state is not None and hasattr(state, "recompute"):
            actual = "recompute" if state.recompute else "reuse"
        if self.scaler.last_step_skipped:
            actual += "+skipped"
        return actual, dt


def shuffled_order(runners: Sequence[Runner], rng: random.Random, previous: Runner | None) -> list[Runner]:
    """``runners`` in a random order whose first element is not ``previous`` (when there is a choice).

    Random rather than a fixed rotation or alternation: with A B C / C B A the end runners run twice in a
    row (on caches they warmed themselves), and a fixed rotation gives every runner the same predecessor
    each time."""
    order = list(runners)
    rng.shuffle(order)
    if len(order) > 1 and order[0] is previous:
        k = rng.randrange(1, len(order))
        order[0], order[k] = order[k], order[0]
    return order


@dataclass
class ModelResult:
    model: str
    rounds: list[dict[str, dict[str, list[float]]]] = field(default_factory=list)  # [round][config][kind]
    raw: list[list[dict[str, Any]]] = field(default_factory=list)  # [round] -> step records
    warmup_seconds: float = 0.0
    seconds: float = 0.0
    cut_by_budget: bool = False
    skipped: dict[str, int] = field(default_factory=dict)  # timed steps skipped on Inf/NaN, per config


def _round_mean(rd: dict[str, dict[str, list[float]]], config: str, kind: str) -> float:
    xs = rd.get(config, {}).get(kind, [])
    return sum(xs) / len(xs) if xs else float("nan")


def per_round_ratios(result: ModelResult, ratios: Sequence[RatioDef] = RATIOS) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {r.key: [] for r in ratios}
    for rd in result.rounds:

        def t(config: str, kind: str, rd=rd) -> float:
            return _round_mean(rd, config, kind)

        for r in ratios:
            try:
                out[r.key].append(float(r.fn(t)))
            except ZeroDivisionError:
                out[r.key].append(float("nan"))
    return out


def measure_model(
    name: str,
    batch: int,
    rounds: int,
    steps: int,
    warmup: int,
    budget_s: float,
    seed: int,
    log: Callable[[str], None],
    specs: Sequence[Spec] = SPECS,
    replicas: int = 1,
) -> ModelResult:
    """Build every configuration of ``name`` and time them in interleaved rounds (see module docstring)."""
    from adaloss.models import build_model

    t_start = time.perf_counter()
    torch.manual_seed(seed)
    base = build_model(C.model_cfg(name), 10)
    gen = torch.Generator().manual_seed(seed)
    batches = [
        (torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
        for _ in range(N_BATCHES)
    ]
    # ``replicas`` separately built copies of every configuration (see the module docstring).
    runners = [Runner(spec, base, batches, replica=i) for i in range(replicas) for spec in specs]
    rng = random.Random(seed)
    previous: Runner | None = None
    result = ModelResult(name)
    for runner in runners:  # warm-up: allocator, fx-traced graphs, the dynamic scale settling
        for _ in range(warmup):
            runner.step("plain")
        if runner.spec.extra:
            runner.step(runner.spec.extra)
    result.warmup_seconds = time.perf_counter() - t_start
    log(f"[bench] {name}: built and warmed up in {result.warmup_seconds:.0f}s")

    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # no collector pauses inside timed blocks; refcounting frees the tensors anyway
    try:
        for r in range(rounds):
            elapsed = time.perf_counter() - t_start
            if r >= MIN_ROUNDS and r > 0:
                per_round = (elapsed - result.warmup_seconds) / r
                if elapsed + per_round > budget_s:
                    result.cut_by_budget = True
                    log(f"[bench] {name}: budget of {budget_s:.0f}s reached after {r} rounds")
                    break
            rd: dict[str, dict[str, list[float]]] = {rn.spec.key: {} for rn in runners}
            records: list[dict[str, Any]] = []
            # ``steps`` cycles of one plain step per runner, then one cycle of the extra steps; every cycle
            # in a fresh random order, re-drawn so that no runner runs twice in a row across cycles.
            for cycle in range(steps + 1):
                extra_cycle = cycle == steps
                members = [rn for rn in runners if rn.spec.extra] if extra_cycle else runners
                order = shuffled_order(members, rng, previous)
                for runner in order:
                    kind = runner.spec.extra if extra_cycle else "plain"
                    actual, dt = runner.step(kind)
                    if actual.endswith("+skipped"):
                        runner.skipped_timed += 1
                    rd[runner.spec.key].setdefault(actual, []).append(dt)
                    records.append(
                        {
                            "config": runner.spec.key,
                            "replica": runner.replica,
                            "kind": actual,
                            "cycle": cycle,
                            "s": dt,
                        }
                    )
                    previous = runner
            result.rounds.append(rd)
            result.raw.append(records)
            gc.collect()
            log(f"[bench] {name}: round {r + 1}/{rounds} done at {time.perf_counter() - t_start:.0f}s")
    finally:
        if gc_was_enabled:
            gc.enable()
    result.seconds = time.perf_counter() - t_start
    result.skipped = {rn.spec.key: rn.skipped_timed for rn in runners}
    return result


# ---------------------------------------------------------------------------------------------- report


def replica_ratios(result: ModelResult) -> dict[str, list[dict[str, float]]]:
    """Per configuration with several copies: each copy's step time over copy 0's (A/A between copies).

    Per round, the mean of a copy's plain (adaptive: reuse) steps over copy 0's; median and p25-p75 over
    the rounds. How far identical copies differ within one run."""
    out: dict[str, list[dict[str, float]]] = {}
    per: dict[tuple[str, int], dict[int, float]] = {}  # (config, copy) -> {round: mean step time}
    for r, records in enumerate(result.raw):
        sums: dict[tuple[str, int], list[float]] = {}
        for rec in records:
            if rec["kind"] in ("plain", "reuse"):
                sums.setdefault((rec["config"], rec.get("replica", 0)), []).append(rec["s"])
        for key, ts in sums.items():
            per.setdefault(key, {})[r] = sum(ts) / len(ts)
    for config in sorted({c for c, _ in per}):
        copies = sorted(i for c, i in per if c == config)
        if len(copies) < 2 or copies[0] != 0:
            continue
        base = per[(config, 0)]
        rows = []
        for i in copies[1:]:
            vals = [t / base[r] for r, t in per[(config, i)].items() if r in base]
            rows.append(
                {
                    "replica": i,
                    "median": C.median(vals),
                    "p25": C.quantile(vals, 0.25),
                    "p75": C.quantile(vals, 0.75),
                }
            )
        out[config] = rows
    return out


def summarize(results: Sequence[ModelResult], defs: Sequence[RatioDef] = RATIOS) -> dict[str, dict[str, Any]]:
    """``{"<ratio>/<model>": {median, p25, p75, per_round, target, pass, ...}}`` for the ratios ``defs``."""
    ratios: dict[str, dict[str, Any]] = {}
    for res in results:
        per = per_round_ratios(res, defs)
        for r in defs:
            vals = per[r.key]
            med = C.median(vals)
            ratios[f"{r.key}/{res.model}"] = {
                "ratio": r.key,
                "model": res.model,
                "label": r.label,
                "median": med,
                "p25": C.quantile(vals, 0.25),
                "p75": C.quantile(vals, 0.75),
                "rounds": len(vals),
                "per_round": vals,
                "target": r.target,
                "pass": (med <= r.target) if (r.target is not None and math.isfinite(med)) else None,
                "paper": r.paper or None,
            }
    return ratios


def _fmt_x(v: float, digits: int = 3) -> str:
    return f"{v:.{digits}f}x" if math.isfinite(v) else "n/a"


def _verdict(entry: dict[str, Any]) -> str:
    if entry["pass"] is None:
        return "n/a"
    return "PASS" if entry["pass"] else "over target"


def _resolved(entry: dict[str, Any]) -> str:
    """``yes`` when the target lies outside the per-round ratios' p25-p75: the verdict does not hinge on
    noise; ``no`` when it lies inside, so another run on this machine could well flip it."""
    lo, hi, target = entry["p25"], entry["p75"], entry["target"]
    if target is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return "n/a"
    return "no" if lo <= target <= hi else "yes"


def depth_trend(ratios: dict[str, dict[str, Any]], key: str, models: Sequence[str]) -> str | None:
    """One line saying whether ``key``'s median grows with depth across the ResNets measured."""
    depth_models = [m for m in ("resnet20", "resnet56", "resnet110") if m in models]
    if len(depth_models) < 2:
        return None
    meds = [ratios[f"{key}/{m}"]["median"] for m in depth_models]
    chain = " -> ".join(f"{_fmt_x(v)} ({C.PRETTY[m]})" for v, m in zip(meds, depth_models, strict=True))
    if not all(math.isfinite(v) for v in meds):
        verdict = "undetermined"
    elif all(b > a for a, b in zip(meds, meds[1:], strict=False)):
        verdict = "yes, monotonically"
    elif meds[-1] > meds[0]:
        verdict = "overall yes, not monotonically"
    else:
        verdict = "no"
    # Whether the difference is resolved: do the end points' interquartile ranges overlap?
    first, last = ratios[f"{key}/{depth_models[0]}"], ratios[f"{key}/{depth_models[-1]}"]
    overlap = not (first["p75"] < last["p25"] or last["p75"] < first["p25"])
    note = " (the shallowest and deepest IQRs overlap: within noise)" if overlap else ""
    return f"{chain}: grows with depth: {verdict}{note}"


def render(
    info: dict[str, Any], settings: dict[str, Any], results: Sequence[ModelResult], ratios: dict[str, Any]
) -> str:
    models = [r.model for r in results]
    lines = [
        f"### Step-time ratios (batch {settings['batch']}, synthetic 32x32 inputs, CPU, emulated FP16, "
        f"{settings.get('clock', 'wall')} clock)",
        "",
        C.header_line(info),
        "",
        f"malloc tuned: {'yes' if settings.get('malloc_tuned') else 'no'}; native FP16 kernels: "
        f"{settings.get('native_kernels', 'unknown')}; fused autograd nodes: "
        f"{settings.get('fused_nodes', 'unknown')}.",
        "",
        "Each ratio is the median over interleaved rounds of the per-round ratio of mean step times, all "
        "configurations in one process (p25-p75 of the per-round ratios beside it; Resolved: no when the "
        "target lies inside that range). A step is forward + loss + scaled backward + scaler.step + update "
        "+ zero_grad; SGD lr 0.01 momentum 0.9.",
        "",
    ]
    present = [r for r in RATIOS if f"{r.key}/{models[0]}" in ratios] if models else []
    rows = []
    for r in present:
        if r.target is None:
            continue
        for m in models:
            e = ratios[f"{r.key}/{m}"]
            rows.append(
                [
                    r.label,
                    C.PRETTY.get(m, m),
                    _fmt_x(e["median"]),
                    f"{e['p25']:.3f}-{e['p75']:.3f}",
                    f"<= {r.target:g}x",
                    _verdict(e),
                    _resolved(e),
                    r.paper or "",
                    e["rounds"],
                ]
            )
    lines.append(
        C.markdown_table(
            ["Ratio", "Model", "Median", "p25-p75", "Target", "Result", "Resolved", "Paper", "Rounds"],
            rows,
            left=2,
        )
    )
    lines += ["", "Context (no target): the noise floor and the step kinds behind the amortized rows.", ""]
    rows = []
    for r in present:
        if r.target is not None:
            continue
        for m in models:
            e = ratios[f"{r.key}/{m}"]
            rows.append([r.label, C.PRETTY.get(m, m), _fmt_x(e["median"]), f"{e['p25']:.3f}-{e['p75']:.3f}"])
    lines.append(C.markdown_table(["Ratio", "Model", "Median", "p25-p75"], rows, left=2))
    trends = [
        (key, depth_trend(ratios, key, models))
        for key in ("adaptive_u1_over_dynamic", "adaptive_u100_over_dynamic")
        if models and f"{key}/{models[0]}" in ratios
    ]
    trends = [(k, t) for k, t in trends if t]
    if trends:
        lines.append("")
        for key, text in trends:
            lines.append(f"- {key}: {text}")

    lines += ["", "Median step time in seconds in this run (for scale only; compare ratios, not these):", ""]
    measured = {c["key"] for c in settings.get("configs", [])} or {s.key for s in SPECS}
    cols = [(s.key, "plain") for s in SPECS] + [
        ("fp16_none", "telemetry"),
        ("fp16_adaptive_u1", "recompute"),
        ("fp16_adaptive_u100", "recompute"),
        ("fp16_adaptive_u100", "reuse"),
    ]
    adaptive_plain = {("fp16_adaptive_u1", "plain"), ("fp16_adaptive_u100", "plain")}
    cols = [c for c in cols if c[0] in measured and c not in adaptive_plain]
    rows = []
    for res in results:
        row: list[Any] = [C.PRETTY.get(res.model, res.model)]
        for config, kind in cols:
            xs = [t for rd in res.rounds for t in rd.get(config, {}).get(kind, [])]
            row.append(f"{C.median(xs):.3f}" if xs else "n/a")
        rows.append(row)
    lines.append(C.markdown_table(["Model", *(f"{c} {k}" for c, k in cols)], rows))
    notes = []
    for res in results:
        skipped = {k: v for k, v in res.skipped.items() if v}
        if skipped:
            notes.append(f"{res.model}: timed steps skipped on Inf/NaN gradients: {skipped}")
        if res.cut_by_budget:
            notes.append(f"{res.model}: stopped after {len(res.rounds)} rounds by the time budget")
    if notes:
        lines += [""] + [f"- note: {n}" for n in notes]
    kernels = settings.get("kernel_timings")
    if kernels:
        lines += [
            "",
            f"FP16 rounding of {KERNEL_NUMEL} float32 values, one thread, median microseconds over "
            f"{KERNEL_REPEATS} calls (torch ops vs the native kernels of adaloss.numerics.native):",
            "",
            C.markdown_table(
                ["Operation", "torch (us)", "native (us)", "torch / native"],
                [
                    [
                        k["op"],
                        f"{k['torch_us']:.0f}",
                        f"{k['native_us']:.0f}",
                        f"{k['torch_us'] / k['native_us']:.2f}x",
                    ]
                    for k in kernels
                ],
            ),
        ]
    spread = [(res.model, replica_ratios(res)) for res in results]
    spread = [(m, sp) for m, sp in spread if sp]
    if spread:
        lines += [
            "",
            f"A/A between copies ({settings.get('replicas', 1)} per configuration, averaged in every ratio "
            "above): each copy's plain step time over copy 0's, median (p25-p75) over the rounds:",
            "",
        ]
        rows = []
        for m, sp in spread:
            for config, entries in sp.items():
                cells = ", ".join(
                    f"#{e['replica']}: {_fmt_x(e['median'])} ({e['p25']:.3f}-{e['p75']:.3f})" for e in entries
                )
                rows.append([C.PRETTY.get(m, m), config, cells])
        lines.append(C.markdown_table(["Model", "Configuration", "Copy / copy 0"], rows, left=3))
    total = sum(r.seconds for r in results)
    lines += ["", f"Total measurement time {total:.0f}s."]
    return "\n".join(lines)


KERNEL_NUMEL = 524_288  # one ResNet-20 first-stage activation at batch 32 (32 x 16 x 32 x 32)
KERNEL_REPEATS = 200


def kernel_timings() -> list[dict[str, Any]]:
    """Torch ops against the native kernels for the emulation's two hot operations (about a second).

    Empty when the kernels are not available. Both sides produce the same values (``tests/test_native.py``).
    """
    from adaloss.numerics import native

    if not native.enabled():
        return []
    x = torch.randn(KERNEL_NUMEL, generator=torch.Generator().manual_seed(0)) * 1e-3

    def torch_stats() -> Any:
        r = x.to(torch.float16).to(torch.float32)
        return r, torch.linalg.vector_norm(r), torch.aminmax(r)

    pairs = [
        ("round to FP16", lambda: x.to(torch.float16).to(torch.float32), lambda: native.round_f16(x)),
        (
            "round to FP16 + norm, min, max",
            torch_stats,
            lambda: native.grad_stats(x, round_fp16=True),
        ),
    ]
    out = []
    for op, ref, fast in pairs:
        times: dict[str, list[float]] = {"torch": [], "native": []}
        for _ in range(10):
            ref(), fast()
        for _ in range(KERNEL_REPEATS):  # alternate, so a load change hits both
            for name, fn in (("torch", ref), ("native", fast)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        out.append(
            {
                "op": op,
                "torch_us": C.median(times["torch"]) * 1e6,
                "native_us": C.median(times["native"]) * 1e6,
            }
        )
    return out


# ------------------------------------------------------------------------------------------------ main


def _native_status() -> str:
    from adaloss.numerics import native

    return native.status()


def _fused_status() -> str:
    from adaloss.numerics import fused

    return fused.status()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--models", nargs="+", default=None, help="resnet20 resnet56 resnet110 (space or comma)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 32; --quick: 8)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per model (default: 25/12/8 by depth)")
    p.add_argument("--steps", type=int, default=None, help="timed plain steps per configuration per round")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per configuration")
    p.add_argument("--budget", type=float, default=840.0, help="seconds for the whole run (default 840)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 0 keeps torch's default (default 1: see the module docstring)",
    )
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="step timer: wall (perf_counter, default) or cpu (process_time; see the module docstring)",
    )
    p.add_argument(
        "--configs",
        nargs="+",
        default=None,
        help="measure only these configurations (space or comma; default all), e.g. a paired run of\n"
        "fp16_dynamic fp16_adaptive_u100; only the ratios between measured ones are reported",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="separately built copies of each configuration, timed in turn (default 1); the table\n"
        "adds each copy's A/A ratio to copy 0",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="seconds-long smoke run: resnet20, batch 8, 2 rounds")
    p.add_argument("--out", default=str(C.ROOT / "results" / "bench" / "bench.json"))
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    models = args.models or (["resnet20"] if args.quick else list(DEFAULT_MODELS))
    args.models = [m for item in models for m in item.split(",") if m]
    for m in args.models:
        if m not in PLAN:
            p.error(f"unknown model '{m}': choose from {', '.join(PLAN)}")
    keys = [s.key for s in SPECS]
    chosen = [c for item in (args.configs or keys) for c in item.split(",") if c]
    for c in chosen:
        if c not in keys:
            p.error(f"unknown configuration '{c}': choose from {', '.join(keys)}")
    args.specs = tuple(s for s in SPECS if s.key in chosen)
    if not selected_ratios(chosen):
        p.error(f"no ratio can be formed from {', '.join(chosen)}: measure both sides of one")
    if args.batch is None:
        args.batch = 8 if args.quick else 32
    for name in ("batch", "rounds", "steps", "warmup", "replicas"):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "warmup" else 1):
            p.error(f"--{name} must be positive, got {v}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the tables to stdout (progress to stderr), write the JSON; returns it."""
    args = parse_args(argv)
    from adaloss.utils.allocator import tune_cpu_allocator

    args.malloc_tuned = tune_cpu_allocator()  # before any model is built: see the module docstring
    if args.threads < 0:
        raise SystemExit(f"error: --threads must be >= 0, got {args.threads}")
    global _CLOCK
    threads_before, clock_before = torch.get_num_threads(), _CLOCK
    if args.threads:
        torch.set_num_threads(args.threads)
    _CLOCK = CLOCKS[args.clock]
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads_before)  # main() is importable: leave the caller's setting alone
        _CLOCK = clock_before


def _run(args: argparse.Namespace) -> dict[str, Any]:

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    info = C.machine_info()
    weights = {m: PLAN[m]["weight"] for m in args.models}
    total_w = sum(weights.values())
    t0 = time.perf_counter()
    results = []
    for m in args.models:
        plan = PLAN[m]
        rounds = args.rounds or (2 if args.quick else plan["rounds"])
        steps = args.steps or (1 if args.quick else plan["steps"])
        warmup = args.warmup if args.warmup is not None else (1 if args.quick else plan["warmup"])
        # Budget left for this model: its share of what remains, so an early overrun is absorbed later.
        remaining = args.budget - (time.perf_counter() - t0)
        share = remaining * weights[m] / sum(weights[x] for x in args.models[args.models.index(m) :])
        results.append(
            measure_model(
                m, args.batch, rounds, steps, warmup, share, args.seed, log, args.specs, args.replicas
            )
        )
    settings = {
        "batch": args.batch,
        "models": args.models,
        "budget_s": args.budget,
        "quick": args.quick,
        "replicas": args.replicas,
        "clock": args.clock,
        "malloc_tuned": args.malloc_tuned,
        "native_kernels": _native_status(),
        "fused_nodes": _fused_status(),
        "kernel_timings": kernel_timings(),
        "lr": LR,
        "momentum": MOMENTUM,
        "configs": [
            {"key": s.key, "precision": s.precision, "scaler": s.scaler, "extra": s.extra} for s in args.specs
        ],
        "plan": {m: PLAN[m] for m in args.models},
        "argv": args.argv,
        "total_weight": total_w,
    }
    ratios = summarize(results, selected_ratios([s.key for s in args.specs]))
    text = render(info, settings, results, ratios)
    print(text, flush=True)
    payload = {
        "machine": info,
        "settings": settings,
        "ratios": ratios,
        "models": {
            r.model: {
                "rounds": len(r.rounds),
                "cut_by_budget": r.cut_by_budget,
                "warmup_seconds": r.warmup_seconds,
                "seconds": r.seconds,
                "skipped_timed_steps": r.skipped,
                "replica_ratios": replica_ratios(r),
                "step_times": r.rounds,
                "raw": r.raw,
            }
            for r in results
        },
        "table_markdown": text,
        "wall_seconds": time.perf_counter() - t0,
    }
    path = C.write_json(args.out, payload)
    log(f"[bench] wrote {path} ({payload['wall_seconds']:.0f}s)")
    return payload


if __name__ == "__main__":
    main()
