"""Timing the configurations of one model in interleaved rounds: a :class:`Runner` per configuration (and
copy) times one training step at a time, :func:`measure_model` builds them all on the same initial model and
synthetic batches and lets them take turns in shuffled cycles, within a time budget."""

from __future__ import annotations

import copy
import gc
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from adaloss.lab.bench.specs import (
    GPT_BLOCK,
    GPT_MODEL,
    GPT_VOCAB,
    LR,
    MIN_ROUNDS,
    MOMENTUM,
    N_BATCHES,
    SPECS,
    Spec,
)
from adaloss.lab.reports.measurement import model_cfg

_CLOCK = time.perf_counter  # the step timer; set from --clock by adaloss.lab.bench.cli.main()


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
        from adaloss.runner.utils.targets import build_scaler
        from adaloss.telemetry import UnderflowMonitor

        self.spec = spec
        self.replica = replica
        self.precision = Precision(spec.precision, "cpu", grad_scaling=spec.grad_scaling, **dict(spec.fp4))
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


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The language model's cross-entropy, over every position."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def build_inputs(name: str, batch: int, seed: int) -> tuple[torch.nn.Module, list[tuple], LossFn]:
    """The initial model every configuration copies, ``N_BATCHES`` synthetic batches and the loss: random
    32x32 images for a ResNet, random byte windows for the tiny GPT. Seeds torch's global generator."""
    from adaloss.runner.models import build_model

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    if name == GPT_MODEL:
        base = build_model(
            OmegaConf.create({"name": GPT_MODEL}),  # configs/model/gpt.yaml
            vocab_size=GPT_VOCAB,
            block_size=GPT_BLOCK,
        )
        windows = [
            torch.randint(0, GPT_VOCAB, (batch, GPT_BLOCK + 1), generator=gen) for _ in range(N_BATCHES)
        ]
        return base, [(w[:, :-1], w[:, 1:]) for w in windows], _lm_loss
    base = build_model(model_cfg(name), 10)
    batches = [
        (torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
        for _ in range(N_BATCHES)
    ]
    return base, batches, F.cross_entropy


def time_round(
    runners: Sequence[Runner], steps: int, rng: random.Random, previous: Runner | None
) -> tuple[dict[str, dict[str, list[float]]], list[dict[str, Any]], Runner | None]:
    """One round: ``steps`` cycles of one plain step per runner, then one cycle of the extra steps; every
    cycle in a fresh random order, re-drawn so that no runner runs twice in a row across cycles. Returns
    the step times by configuration and kind, the step records, and the last runner."""
    rd: dict[str, dict[str, list[float]]] = {rn.spec.key: {} for rn in runners}
    records: list[dict[str, Any]] = []
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
    return rd, records, previous


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
    """Build every configuration of ``name`` and time them in interleaved rounds (see
    :mod:`adaloss.lab.bench`)."""
    t_start = time.perf_counter()
    base, batches, loss_fn = build_inputs(name, batch, seed)
    # ``replicas`` separately built copies of every configuration (see :mod:`adaloss.lab.bench`).
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
            rd, records, previous = time_round(runners, steps, rng, previous)
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
