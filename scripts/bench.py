"""Step-time ratios of the training configurations, measured interleaved in one process (``make bench``).

What it answers: how much does emulated FP16 cost over FP32, each loss scaler over no scaling, underflow
telemetry over none, and the adaptive scaler over the dynamic one (at ``update_every`` 1 and 100, the
paper's 27% and 0.27%), for the CIFAR ResNets 20/56/110 on synthetic 32x32 inputs; and, informational, what
each gradient quantizer (``precision.grad_scaling``: tensor_current, tensor_delayed, mx_block) costs over
the global-scale FP8 E4M3 emulation, all under dynamic scaling (``fp8_*_over_global``).

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
adaptive step's actual kind is read back from ``scaler.last_pass``, so a natural recompute step is
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
step) depended on heap layout and moved ratios by several percent.

Paired runs: ``--configs fp16_dynamic fp16_adaptive_u100`` measures only those configurations (and reports
only the ratios between them), so a comparison of two configurations gets more rounds in the same time and
does not share the heap with five unrelated models.

The tiny GPT (``--gpt on|off|only``): after the ResNets, ``model=gpt`` (4 blocks, width 64, the head tied
to the embedding) on random 64-byte windows takes the same interleaved rounds with dynamic scaling, an
identical copy of it (A/A), and the adaptive scaler at ``update_every=100`` with and without attention's own
betas (``product_betas``). Its goals (issue 22): the amortized adaptive step at most 1.02x a dynamic step,
a recompute step at most 1.25x.
About a minute (``--gpt-budget``); ``--gpt only`` runs it alone (``results/bench/gpt.json``).

Dispatched ops per step, a GPU-cost proxy (``--opcounts on|off|only``): no GPU is available here, and on
a GPU a step's host cost is largely one kernel launch per dispatched op, so after the timing the script
counts the ATen ops of one dynamic step and of adaptive reuse and recompute steps (ResNet-20 and -110),
under real FP16 autocast on the CPU (the code a GPU runs), and prints them
with their ratios to the dynamic step against issue 22's goals (reuse at most 1.05x, recompute at most
2x), and where the extra ops come from, by op and by calling line. Counts are exact and do not depend on
the batch size or the machine's load, so one small batch suffices (checked each run). See
:func:`count_step_ops` and :class:`OpCounter` for what is counted and how.

Cost: the default run keeps to ``--budget`` seconds (840 s), shared among the models; deeper models get
fewer rounds and fewer steps per round; the op counts add about a minute. ``--quick`` is a seconds-long
smoke run (no op counts). Raw per-step timings (with their kinds and cycles), every ratio and the op
counts go to ``--out`` (``results/bench/bench.json``; ``--opcounts only``: ``results/bench/opcounts.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import math
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

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
    grad_scaling: str = "none"  # precision.grad_scaling (FP8 precisions): the gradient quantizer's recipe


SPECS: tuple[Spec, ...] = (
    Spec("fp32_none", "fp32", {"name": "none"}),
    Spec("fp16_none", "fp16", {"name": "none"}, extra="telemetry"),
    Spec("fp16_none_b", "fp16", {"name": "none"}),  # A/A control: the same configuration twice
    Spec("fp16_fixed", "fp16", {"name": "fixed", "scale": 128}),
    Spec("fp16_dynamic", "fp16", {"name": "dynamic"}),
    Spec("fp16_adaptive_u1", "fp16", {"name": "adaptive", "update_every": 1}),
    Spec("fp16_adaptive_u100", "fp16", {"name": "adaptive", "update_every": 100}, extra="recompute"),
    # FP8 E4M3 gradients under dynamic scaling: the global scale only, and each gradient quantizer
    Spec("fp8_dynamic", "fp8_e4m3", {"name": "dynamic"}),
    *(
        Spec(f"fp8_{short}_dynamic", "fp8_e4m3", {"name": "dynamic"}, grad_scaling=recipe)
        for short, recipe in (
            ("current", "tensor_current"),
            ("delayed", "tensor_delayed"),
            ("mx", "mx_block"),
        )
    ),
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
        1.20,
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
        1.10,
        lambda t: t("fp16_adaptive_u1", "recompute") / t("fp16_dynamic", "plain"),
        paper="1.27x",
    ),
    RatioDef(
        "adaptive_u100_over_dynamic",
        "adaptive update_every=100 / dynamic, amortized (FP16)",
        1.02,
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
    # Informational: what each gradient quantizer costs over the global-scale FP8 emulation (same scaler)
    RatioDef(
        "fp8_over_fp16",
        "emulated FP8 E4M3 gradients / FP16 (dynamic, global scale)",
        None,
        lambda t: t("fp8_dynamic", "plain") / t("fp16_dynamic", "plain"),
    ),
    *(
        RatioDef(
            f"fp8_{short}_over_global",
            f"FP8 E4M3 grad_scaling={recipe} / global scale (dynamic)",
            None,
            lambda t, short=short: t(f"fp8_{short}_dynamic", "plain") / t("fp8_dynamic", "plain"),
        )
        for short, recipe in (
            ("current", "tensor_current"),
            ("delayed", "tensor_delayed"),
            ("mx", "mx_block"),
        )
    ),
)
RATIO_KEYS = tuple(r.key for r in RATIOS)

#: The tiny GPT (issue 18): ``model=gpt``'s sizes on byte windows as long as ``dataset=pystdlib``'s, random
#: bytes (a step's time does not depend on which). Only the configurations its goal compares, an A/A control,
#: and the adaptive scaler without attention's own betas, to show what they cost.
GPT_MODEL = "gpt"
GPT_BLOCK = 64
GPT_VOCAB = 256
GPT_PLAN = {"rounds": 40, "steps": 3, "warmup": 3}
GPT_SPECS: tuple[Spec, ...] = (
    Spec("fp16_dynamic", "fp16", {"name": "dynamic"}),
    Spec("fp16_dynamic_b", "fp16", {"name": "dynamic"}),  # A/A control: the same configuration twice
    Spec("fp16_adaptive_u100", "fp16", {"name": "adaptive", "update_every": 100}, extra="recompute"),
    Spec(
        "fp16_adaptive_u100_noprod",
        "fp16",
        {"name": "adaptive", "update_every": 100, "product_betas": False},
        extra="recompute",
    ),
)
_BY_KEY = {r.key: r for r in RATIOS}
GPT_RATIOS: tuple[RatioDef, ...] = (
    # issue 22's goals for the tiny GPT: amortized update_every=100 at most 1.02x, a recompute step (what
    # update_every=1 runs every step) at most 1.25x (the paper measured 1.27x)
    dataclasses.replace(_BY_KEY["adaptive_u100_over_dynamic"], target=1.02, paper=""),
    RatioDef(
        "adaptive_u1_over_dynamic",
        "adaptive update_every=1 (a recompute step) / dynamic (FP16)",
        1.25,
        lambda t: t("fp16_adaptive_u100", "recompute") / t("fp16_dynamic", "plain"),
        paper="1.27x",
    ),
    RatioDef(
        "adaptive_u100_noprod_over_dynamic",
        "the same without attention's betas (scaler.product_betas=false)",
        None,
        lambda t: (
            (t("fp16_adaptive_u100_noprod", "recompute") + 99 * t("fp16_adaptive_u100_noprod", "reuse"))
            / (100 * t("fp16_dynamic", "plain"))
        ),
    ),
    RatioDef(
        "aa_control",
        "A/A control: FP16 dynamic / identical FP16 dynamic",
        None,
        lambda t: t("fp16_dynamic_b", "plain") / t("fp16_dynamic", "plain"),
    ),
    _BY_KEY["adaptive_recompute_over_dynamic"],
    _BY_KEY["adaptive_reuse_over_dynamic"],
    RatioDef(
        "adaptive_noprod_reuse_over_dynamic",
        "adaptive reuse step without attention's betas / dynamic step",
        None,
        lambda t: t("fp16_adaptive_u100_noprod", "reuse") / t("fp16_dynamic", "plain"),
    ),
)


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
        self,
        spec: Spec,
        base_model: torch.nn.Module,
        batches: Sequence[tuple],
        replica: int = 0,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    ) -> None:
        from adaloss.precision import Precision
        from adaloss.scalers import build_scaler
        from adaloss.telemetry import UnderflowMonitor

        self.spec = spec
        self.replica = replica
        self.precision = Precision(spec.precision, "cpu", grad_scaling=spec.grad_scaling)
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
        self.loss_fn = loss_fn
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
            loss = self.loss_fn(self.model(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        if monitor is not None:
            monitor.underflow_rates()
        dt = _CLOCK() - t0
        actual = kind
        last_pass = getattr(self.scaler, "last_pass", None)
        if kind != "telemetry" and last_pass is not None:
            actual = "recompute" if last_pass == "recompute" else "reuse"
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
    gen = torch.Generator().manual_seed(seed)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy
    if name == GPT_MODEL:
        base = build_model(
            OmegaConf.load(C.ROOT / "configs" / "model" / "gpt.yaml"),
            vocab_size=GPT_VOCAB,
            block_size=GPT_BLOCK,
        )
        windows = [
            torch.randint(0, GPT_VOCAB, (batch, GPT_BLOCK + 1), generator=gen) for _ in range(N_BATCHES)
        ]
        batches = [(w[:, :-1], w[:, 1:]) for w in windows]

        def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # the language model's
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    else:
        base = build_model(C.model_cfg(name), 10)
        batches = [
            (torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
            for _ in range(N_BATCHES)
        ]
    # ``replicas`` separately built copies of every configuration (see the module docstring).
    runners = [Runner(spec, base, batches, i, loss_fn) for i in range(replicas) for spec in specs]
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


def ratio_tables(
    ratios: dict[str, Any],
    present: Sequence[RatioDef],
    models: Sequence[str],
    context: str = "the noise floor and the step kinds behind the amortized rows",
) -> list[str]:
    """The lines of the two ratio tables: those with a target (median, p25-p75, verdict, whether it is
    resolved), then the context rows without one."""
    lines: list[str] = []
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
    lines += ["", f"Context (no target): {context}.", ""]
    rows = []
    for r in present:
        if r.target is not None:
            continue
        for m in models:
            e = ratios[f"{r.key}/{m}"]
            rows.append([r.label, C.PRETTY.get(m, m), _fmt_x(e["median"]), f"{e['p25']:.3f}-{e['p75']:.3f}"])
    lines.append(C.markdown_table(["Ratio", "Model", "Median", "p25-p75"], rows, left=2))
    return lines


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
        f"malloc tuned: {'yes' if settings.get('malloc_tuned') else 'no'}.",
        "",
        "Each ratio is the median over interleaved rounds of the per-round ratio of mean step times, all "
        "configurations in one process (p25-p75 of the per-round ratios beside it; Resolved: no when the "
        "target lies inside that range). A step is forward + loss + scaled backward + scaler.step + update "
        "+ zero_grad; SGD lr 0.01 momentum 0.9.",
        "",
    ]
    present = [r for r in RATIOS if f"{r.key}/{models[0]}" in ratios] if models else []
    lines += ratio_tables(ratios, present, models)
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


def render_gpt(
    info: dict[str, Any], settings: dict[str, Any], result: ModelResult, ratios: dict[str, Any]
) -> str:
    """The tiny GPT's table: adaptive ``update_every=100`` against dynamic, with and without attention's
    own betas, and the step kinds behind them."""
    lines = [
        f"### Tiny GPT step-time ratios (model=gpt, batch {settings['batch']} x {GPT_BLOCK} tokens, CPU, "
        f"emulated FP16, {settings.get('clock', 'wall')} clock)",
        "",
        C.header_line(info),
        "",
        "Interleaved rounds and steps as for the ResNets (SGD lr 0.01, momentum 0.9; the language model's "
        "cross-entropy). Amortized: (one recompute step + 99 reuse steps) / (100 dynamic steps).",
        "",
        *ratio_tables(
            ratios, GPT_RATIOS, [GPT_MODEL], "without attention's betas, the noise floor, the step kinds"
        ),
    ]
    skipped = {k: v for k, v in result.skipped.items() if v}
    if skipped:
        lines += ["", f"- note: timed steps skipped on Inf/NaN gradients: {skipped}"]
    if result.cut_by_budget:
        lines += ["", f"- note: stopped after {len(result.rounds)} rounds by the time budget"]
    lines += ["", f"Total measurement time {result.seconds:.0f}s."]
    return "\n".join(lines)


# ------------------------------------------------------------------- dispatched ops per step (GPU-cost proxy)


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
_SRC = str(C.ROOT / "src" / "adaloss") + "/"
_MODELS = _SRC + "models/"


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
    a difference. Ops with no adaloss frame come from torch itself (the autograd engine's built-in backward
    nodes, a model's forward, the optimizer) or from code outside adaloss."""
    origin = site = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_SRC) and not path.startswith(_MODELS):
            code = frame.f_code
            if origin is None:
                origin = f"{path[len(_SRC) :]}:{code.co_qualname}:{frame.f_lineno}"
            site = f"{path[len(_SRC) :]}:{code.co_qualname}"
        frame = frame.f_back
    if origin is None:
        return _NO_FRAME, _NO_FRAME
    return f"{origin} (in {site.rsplit(':', 1)[-1]})", site


def _per_point(key: str) -> str | None:
    """``"gemm"`` or ``"branch"`` for a site (or an origin in a site) that runs once per such point."""
    site, _, inside = key.rpartition(" (in ")
    qualname = inside[:-1] if site else key.rsplit(":", 1)[-1]
    for point, prefixes in _PER_POINT.items():
        if qualname.startswith(prefixes):
            return point
    return None


def count_step_ops(name: str, batch: int, seed: int = 0) -> dict[str, Any]:
    """Dispatched ops of one training step of each kind in ``OP_KINDS`` for model ``name``.

    The steps run under real CPU FP16 autocast (``torch.autocast("cpu", dtype=torch.float16)``) with the
    adaptive scaler (statistics, betas and alphas as tensors on recompute steps, host copies of the betas
    in between: the code every device runs) and ``update_every=100``, so
    the ops are those a GPU step dispatches. A recompute step is requested with ``recompute_next()``. SGD
    (momentum 0.9) runs its ``foreach`` implementation, PyTorch's default for CUDA parameters (the CPU
    default is a per-parameter loop). A step is forward + loss + scaled backward + ``scaler.step`` +
    ``update`` + ``zero_grad``, after two applied warm-up steps (the first applied step creates the momentum
    buffers). The op sequence depends on the model and on which scales are 1, not on the batch size
    (``measure_op_counts`` checks this). A counted step must apply its update (a skipped step dispatches
    no optimizer ops), so an overflowing one is stepped past and the count repeated.
    """
    from adaloss.models import build_model
    from adaloss.scalers import AdaptiveLossScaler, DynamicLossScaler

    torch.manual_seed(seed)
    base = build_model(C.model_cfg(name), 10)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)

    def step(run: tuple, counter: OpCounter | None = None) -> None:
        scaler, model, opt = run
        with counter if counter is not None else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

    def make(kind: OpKind) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
        if kind.init_scale is None:
            scaler = DynamicLossScaler()
        else:
            scaler = AdaptiveLossScaler(update_every=100, init_scale=kind.init_scale)
        model = scaler.attach(copy.deepcopy(base))
        model.train()
        run = (scaler, model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, foreach=True))
        applied = 0
        for _ in range(30):  # warm-up: two applied steps (and the dynamic scale backed off below overflow)
            step(run)
            applied += not scaler.last_step_skipped
            if applied == 2:
                return run
        raise RuntimeError(f"{name}: fewer than 2 of 30 warm-up steps were applied (all overflowed)")

    def counted(run: tuple, kind: OpKind) -> dict[str, Any]:
        scaler = run[0]
        for _ in range(10):
            if kind.recompute:
                scaler.recompute_next()
            counter = OpCounter()
            step(run, counter)
            state = getattr(scaler, "state", None)
            recomputed = getattr(scaler, "last_pass", None) == "recompute"
            if not scaler.last_step_skipped and (state is None or recomputed is kind.recompute):
                out = counter.summary()
                if state is not None:  # which scales were not 1 (a reuse step's op count depends on it)
                    host = state.host
                    out["betas_not_1"] = sum(b != 1.0 for b in (host.beta if host else []))
                    factors = [f for f in (host.branch_factors if host else []) if f is not None]
                    out["branches_not_1"] = sum(any(v != 1.0 for v in f) for f in factors)
                return out
        raise RuntimeError(f"{name}: no clean {kind.key} step in 10 tries (every one overflowed)")

    runs: dict[float | None, tuple] = {}
    counts = {}
    for kind in OP_KINDS:
        if kind.init_scale not in runs:
            runs[kind.init_scale] = make(kind)
        counts[kind.key] = counted(runs[kind.init_scale], kind)
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
    step spends on scales that are not 1: ``delta * beta`` at each beta that is not 1, and ``alpha_{N+1} /
    alpha`` on every parameter gradient below such a layer (a factor of 1 is skipped on the host's cached
    copy). Which betas are 1 depends on the data, so two batch sizes may differ there and only there.
    """
    if a["by_op"] == b["by_op"]:
        return True
    if a.get("betas_not_1", 0) == b.get("betas_not_1", 0):
        return False
    ops = set(a["by_op"]) | set(b["by_op"])
    diff = {op for op in ops if a["by_op"].get(op, 0) != b["by_op"].get(op, 0)}
    return diff <= {"mul", "mul_"}


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


def _diff_table(
    base: dict[str, int], other: dict[str, int], what: str, points: dict[str, int], top: int
) -> str:
    """The ``top`` largest differences ``other - base`` of two op histograms, each also per GEMM point
    (per branch point for a site that runs once per branch point)."""
    diff = Counter(other)
    diff.subtract(base)
    rows = []
    for k, v in sorted(diff.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:top]:
        if not v:
            continue
        point = (_per_point(k) if what != "op" else None) or "gemm"
        per = f"{v / points[point]:+.2f} per {'GEMM' if point == 'gemm' else 'branch'} point"
        rows.append([k, base.get(k, 0), other.get(k, 0), f"{v:+d}", per])
    return C.markdown_table([what, "dynamic", "adaptive", "difference", "per point"], rows)


def _by_function(by_origin: dict[str, int]) -> dict[str, int]:
    """Sum ``module.py:function:line`` counts per ``module.py:function``."""
    out: Counter[str] = Counter()
    for origin, n in by_origin.items():
        out[re.sub(r":\d+ \(in ", " (in ", origin)] += n
    return dict(out)


def render_op_counts(info: dict[str, Any], op: dict[str, Any], top: int = 16) -> str:
    """The op-count table, and where the adaptive steps' extra ops come from (by op and by origin)."""
    lines = [
        "### Dispatched ATen ops per training step (GPU-cost proxy: the GPU code path run on the CPU)",
        "",
        C.header_line(info),
        "",
        "Real CPU FP16 autocast; adaptive scaler with update_every=100, a recompute step "
        f"forced with recompute_next(); SGD foreach; batch {op['batch']}. Counted with a TorchDispatchMode "
        "(each op that reaches a kernel, once). Count cells: all ops / of which not views (views launch no "
        "kernel); reuse cells add how many betas are not 1. Ratio cells: all ops / not views.",
        "",
    ]
    rows = []
    for name, res in op["models"].items():
        c, n_gemm = res["counts"], res["points"]["gemm"]
        row: list[Any] = [C.PRETTY.get(name, name), f"{n_gemm} / {res['points']['branch']}"]
        for kind in OP_KINDS:
            cell = f"{c[kind.key]['ops']} / {c[kind.key]['kernels']}"
            if kind.recompute is False:
                cell += f" ({c[kind.key]['betas_not_1']} of {n_gemm} betas not 1)"
            row.append(cell)
            if kind.goal is not None:
                r, kr = res["ratios"][kind.key], res["kernel_ratios"][kind.key]
                verdict = "PASS" if r <= kind.goal else "over goal"
                row.append(f"{_fmt_x(r)} / {_fmt_x(kr)} (<= {kind.goal:g}x: {verdict})")
        rows.append(row)
    headers = ["Model", "GEMM / branch points"]
    for kind in OP_KINDS:
        headers.append(kind.label)
        if kind.goal is not None:
            headers.append("/ dynamic")
    lines.append(C.markdown_table(headers, rows, left=2))
    check = op["batch_check"]
    same = "the same ops, op for op" if check["equal"] else "DIFFERENT op counts"
    betas = check.get("betas_not_1", {})
    if check["equal"] and any(a != b for a, b in betas.values()):
        same += " (up to one multiply per beta that is not 1, which depends on the data)"
    lines += [
        "",
        f"Batch-size check ({C.PRETTY.get(check['model'], check['model'])}, batch "
        f"{check['batches'][0]} and {check['batches'][1]}): {same} "
        f"({', '.join(f'{k} {a}/{b}' for k, (a, b) in check['ops'].items())}).",
    ]
    notes = {
        "op": "",
        "site": "; site: the outermost adaloss frame, the scaler method or autograd node that ran",
        "origin": "; origin: the function of the innermost adaloss frame, in its site",
    }
    for name, res in op["models"].items():
        c = res["counts"]
        for kind in OP_KINDS[1:]:
            extra = c[kind.key]["ops"] - c["dynamic"]["ops"]
            for what in ("op", "site", "origin"):
                if kind.recompute is False and what == "origin":
                    continue  # a reuse step's few extra ops are named by the other two
                base, other = c["dynamic"][f"by_{what}"], c[kind.key][f"by_{what}"]
                if what == "origin":  # per function: the JSON keeps the lines
                    base, other = _by_function(base), _by_function(other)
                lines += [
                    "",
                    f"{C.PRETTY.get(name, name)}, {kind.label}: {extra:+d} ops against dynamic, by {what} "
                    f"(the largest {top}{notes[what]}):",
                    "",
                    _diff_table(base, other, what, res["points"], top),
                ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ main


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
    p.add_argument(
        "--opcounts",
        choices=("on", "off", "only"),
        default=None,
        help="the dispatched-ops table (GPU-cost proxy): on (default; off with --quick), off, or only\n"
        "(no timing; default --out results/bench/opcounts.json)",
    )
    p.add_argument(
        "--opcount-models",
        nargs="+",
        default=None,
        help=f"models of the dispatched-ops table (default {' '.join(OP_MODELS)})",
    )
    p.add_argument(
        "--opcount-batch",
        type=int,
        default=OP_BATCH,
        help=f"batch of the op counts (default {OP_BATCH}; counts do not depend on it, see the table)",
    )
    p.add_argument(
        "--opcount-top", type=int, default=16, help="rows of each where-the-ops-come-from table (default 16)"
    )
    p.add_argument(
        "--gpt",
        choices=("on", "off", "only"),
        default=None,
        help="the tiny GPT's adaptive / dynamic row: on (default; off with --quick), off, or only (no\n"
        "ResNets, no op counts; default --out results/bench/gpt.json)",
    )
    p.add_argument(
        "--gpt-budget", type=float, default=240.0, help="seconds for the tiny GPT's rounds (default 240)"
    )
    p.add_argument("--out", default=None, help="JSON output (default results/bench/bench.json)")
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    models = args.models or (["resnet20"] if args.quick else list(DEFAULT_MODELS))
    args.models = [m for item in models for m in item.split(",") if m]
    op_models = args.opcount_models or list(OP_MODELS)
    args.opcount_models = [m for item in op_models for m in item.split(",") if m]
    for m in args.models + args.opcount_models:
        if m not in PLAN:
            p.error(f"unknown model '{m}': choose from {', '.join(PLAN)}")
    for name in ("opcount_batch", "opcount_top"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    args.opcounts = args.opcounts or ("off" if args.quick else "on")
    args.gpt = args.gpt or ("off" if args.quick else "on")
    if args.gpt == "only" and args.opcounts == "only":
        p.error("--gpt only and --opcounts only exclude each other: run them one at a time")
    name = {"only": "gpt.json"}.get(args.gpt, "opcounts.json" if args.opcounts == "only" else "bench.json")
    args.out = args.out or str(C.ROOT / "results" / "bench" / name)
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
    if args.opcounts == "only":
        return _run_op_counts(args, info, log)
    if args.gpt == "only":
        t0 = time.perf_counter()
        gpt = _gpt_section(args, info, log)
        settings = {"argv": args.argv, "batch": args.batch, "clock": args.clock, "threads": args.threads}
        payload = {"machine": info, "settings": settings, **gpt}
        return _write(args, payload, t0, log)
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
        "lr": LR,
        "momentum": MOMENTUM,
        "configs": [
            {
                "key": s.key,
                "precision": s.precision,
                "grad_scaling": s.grad_scaling,
                "scaler": s.scaler,
                "extra": s.extra,
            }
            for s in args.specs
        ],
        "plan": {m: PLAN[m] for m in args.models},
        "argv": args.argv,
        "total_weight": total_w,
    }
    ratios = summarize(results, selected_ratios([s.key for s in args.specs]))
    text = render(info, settings, results, ratios)
    print(text, flush=True)
    gpt = None
    if args.gpt == "on":
        print(flush=True)
        gpt = _gpt_section(args, info, log)
        text += "\n\n" + gpt["table_markdown"]
    op_counts = None
    if args.opcounts == "on":
        print(flush=True)
        op_counts, op_text = _op_count_section(args, info, log)
        text += "\n\n" + op_text
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
        "gpt": gpt,
        "op_counts": op_counts,
        "table_markdown": text,
    }
    return _write(args, payload, t0, log)


def _gpt_section(
    args: argparse.Namespace, info: dict[str, Any], log: Callable[[str], None]
) -> dict[str, Any]:
    """Time the tiny GPT's configurations, print its table; returns its ratios, step times and table."""
    rounds = args.rounds or (2 if args.quick else GPT_PLAN["rounds"])
    steps = args.steps or (1 if args.quick else GPT_PLAN["steps"])
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else GPT_PLAN["warmup"])
    result = measure_model(
        GPT_MODEL,
        args.batch,
        rounds,
        steps,
        warmup,
        args.gpt_budget,
        args.seed,
        log,
        GPT_SPECS,
        args.replicas,
    )
    ratios = summarize([result], GPT_RATIOS)
    text = render_gpt(info, {"batch": args.batch, "clock": args.clock}, result, ratios)
    print(text, flush=True)
    return {
        "ratios": ratios,
        "rounds": len(result.rounds),
        "cut_by_budget": result.cut_by_budget,
        "seconds": result.seconds,
        "skipped_timed_steps": result.skipped,
        "step_times": result.rounds,
        "configs": [{"key": s.key, "scaler": s.scaler, "extra": s.extra} for s in GPT_SPECS],
        "table_markdown": text,
    }


def _op_count_section(
    args: argparse.Namespace, info: dict[str, Any], log: Callable[[str], None]
) -> tuple[dict[str, Any], str]:
    """Count, print and return the dispatched-ops table (about a minute for ResNet-20 and -110)."""
    op_counts = measure_op_counts(args.opcount_models, args.opcount_batch, args.seed, log)
    text = render_op_counts(info, op_counts, args.opcount_top)
    print(text, flush=True)
    return op_counts, text


def _run_op_counts(args: argparse.Namespace, info: dict[str, Any], log: Callable[[str], None]) -> dict:
    """``--opcounts only``: the dispatched-ops table alone."""
    t0 = time.perf_counter()
    op_counts, text = _op_count_section(args, info, log)
    settings = {"argv": args.argv, "opcount_models": args.opcount_models, "threads": args.threads}
    payload = {"machine": info, "settings": settings, "op_counts": op_counts, "table_markdown": text}
    return _write(args, payload, t0, log)


def _write(args: argparse.Namespace, payload: dict[str, Any], t0: float, log: Callable[[str], None]) -> dict:
    payload["wall_seconds"] = time.perf_counter() - t0
    path = C.write_json(args.out, payload)
    log(f"[bench] wrote {path} ({payload['wall_seconds']:.0f}s)")
    return payload


if __name__ == "__main__":
    main()
