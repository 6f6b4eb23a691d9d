"""Divergence: when a run stops instead of silently skipping steps forever, and what it reports.

A loss scaler skips a step whose gradients hold Inf/NaN, which is right for the occasional overflow but
hides a run that can no longer train (a fixed scale far too large, weights already damaged). The
:class:`DivergenceGuard` ends such a run: after ``max_consecutive_overflows`` skipped steps in a row, or as
soon as the loss itself is not finite. Its message names the first layers, in network order, whose
gradients (or weights) held non-finite values on the last step, which is where to start looking.

Every skipped step is reported (:class:`SkippedStepReport`): a log line and W&B metrics. To test all of
this on purpose, :class:`GradientFaults` (the ``faults.inject`` config, empty by default) writes Inf or NaN
into chosen gradients at chosen iterations.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from adaloss.errors import ConfigError
from adaloss.runner.logging.progress import format_scale

log = logging.getLogger(__name__)

__all__ = [
    "DivergenceGuard",
    "FaultSpec",
    "GradientFaults",
    "SkippedStepReport",
    "TrainingDiverged",
    "nonfinite_layers",
]


class TrainingDiverged(RuntimeError):
    """The run cannot go on: the loss is not finite, or too many steps in a row overflowed.

    ``train.py`` prints the message as one ``error:`` line and exits with status 1. ``step`` is the number
    of iterations completed; ``layers`` the first layers with non-finite gradients or weights.
    """

    def __init__(self, message: str, step: int, layers: list[str]) -> None:
        super().__init__(message)
        self.step = step
        self.layers = layers


def nonfinite_layers(model: nn.Module, limit: int = 3) -> list[str]:
    """Up to ``limit`` module names, in network (registration) order, whose parameters or gradients hold
    Inf/NaN. Cost: one ``isfinite`` reduction per parameter and a host sync per parameter; call it only
    once a run has failed."""
    found: list[str] = []
    for name, module in model.named_modules():
        tensors = [p for p in module.parameters(recurse=False)]
        tensors += [p.grad for p in tensors if p.grad is not None]
        if any(not bool(torch.isfinite(t).all()) for t in tensors):
            found.append(name or type(model).__name__)
            if len(found) >= limit:
                break
    return found


class DivergenceGuard:
    """Counts consecutive skipped steps and checks the loss of skipped steps.

    ``observe(skipped, loss, step)`` after each ``scaler.update()``; it raises :class:`TrainingDiverged`
    when the run must stop. Cost: nothing on applied steps (the scaler already synced to decide); one host
    sync (``isfinite(loss)``) on skipped steps only. ``max_consecutive_overflows=None`` disables the count
    (the loss check stays).
    """

    def __init__(self, max_consecutive_overflows: int | None = 100) -> None:
        limit = max_consecutive_overflows
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigError(
                "trainer.max_consecutive_overflows must be a positive integer or null (no limit), "
                f"got {limit!r}"
            )
        self.limit = max_consecutive_overflows
        self.consecutive = 0

    def observe(self, skipped: bool, loss: Tensor, step: int, model: nn.Module) -> None:
        if not skipped:
            self.consecutive = 0
            return
        self.consecutive += 1
        if not bool(torch.isfinite(loss.detach()).all()):  # note: host sync, skipped steps only
            self._fail(f"the loss is not finite ({float(loss.detach()):g}) at iteration {step}", step, model)
        if self.limit is not None and self.consecutive >= self.limit:
            self._fail(
                f"{self.consecutive} steps in a row had Inf/NaN gradients and were skipped (iterations "
                f"{step - self.consecutive + 1}-{step}; trainer.max_consecutive_overflows={self.limit})",
                step,
                model,
            )

    @staticmethod
    def _fail(what: str, step: int, model: nn.Module) -> None:
        layers = nonfinite_layers(model)
        where = f"; first non-finite values in {', '.join(layers)}" if layers else ""
        raise TrainingDiverged(
            f"training diverged: {what}{where}. Try a smaller loss scale, scaler=dynamic or "
            "scaler=adaptive, or a lower learning rate",
            step,
            layers,
        )


class SkippedStepReport:
    """Reports every skipped step (an Inf/NaN gradient): a log line and W&B metrics.

    W&B gets ``skipped_step: 1`` plus the ``skipped_steps`` and ``overflow_count`` counters at the step's
    iteration, every time. The log line (INFO) names the iteration, the counters and the loss scale after
    the scaler's update; the first ``verbose`` skipped steps get one each, then every ``every``-th, so a run
    with a scale that often overflows does not flood ``train.log``. Cost: only on skipped steps, one
    ``loss_scale_metric()`` (a host sync for the adaptive scaler).
    """

    def __init__(self, logger: Any, verbose: int = 20, every: int = 100) -> None:
        self.logger = logger
        self.verbose = verbose
        self.every = every

    def __call__(self, step: int, scaler: Any) -> None:
        skipped, overflows = scaler.skipped_steps, scaler.overflow_count
        self.logger.log({"skipped_step": 1, "skipped_steps": skipped, "overflow_count": overflows}, step=step)
        if skipped <= self.verbose or skipped % self.every == 0:
            log.info(
                "iteration %d: Inf/NaN gradient, update skipped (%d skipped steps, %d overflows; loss scale "
                "now %s)%s",
                step, skipped, overflows, format_scale(scaler.loss_scale_metric()),
                f"; further skipped steps are logged every {self.every}th" if skipped == self.verbose else "",
            )  # fmt: skip


# ------------------------------------------------------------------------------------------ fault injection


@dataclass(frozen=True)
class FaultSpec:
    """One ``faults.inject`` entry: write ``value`` into the gradient of every parameter of ``layer`` (its
    first element) in iterations ``step`` .. ``step + count - 1`` (1-based, as the logs count; ``count``
    ``None``: every iteration from ``step`` on)."""

    step: int
    layer: str
    value: float
    count: int | None = 1

    def active(self, iteration: int) -> bool:
        return iteration >= self.step and (self.count is None or iteration < self.step + self.count)


_FAULT_FIELDS = ("step", "layer", "value", "count")
_FAULT_EXAMPLE = "faults.inject=[{step:3,layer:layer1.0.conv1,value:inf}]"


def parse_faults(entries: Any) -> list[FaultSpec]:
    """The ``faults.inject`` list as :class:`FaultSpec` entries; ``ConfigError`` for a malformed entry."""
    if entries is None:
        return []
    if isinstance(entries, str) or not isinstance(entries, Sequence):
        raise ConfigError(
            f"faults.inject must be a list of {{step, layer, value}} entries, e.g. {_FAULT_EXAMPLE}"
        )
    specs = []
    for i, entry in enumerate(entries):
        where = f"faults.inject[{i}]"
        if not hasattr(entry, "keys"):
            raise ConfigError(
                f"{where} must be a {{step, layer, value}} mapping, got {entry!r}; e.g. {_FAULT_EXAMPLE}"
            )
        unknown = sorted(str(k) for k in entry.keys() if k not in _FAULT_FIELDS)
        missing = [k for k in ("step", "layer", "value") if entry.get(k) is None]
        if unknown or missing:
            what = f"has no field(s) {', '.join(unknown)}" if unknown else f"needs {', '.join(missing)}"
            raise ConfigError(
                f"{where} {what}; its fields are step, layer, value, count; e.g. {_FAULT_EXAMPLE}"
            )
        step, count = entry.get("step"), entry.get("count", 1)
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ConfigError(f"{where}.step must be an iteration number >= 1, got {step!r}")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ConfigError(f"{where}.count must be a positive integer or null (to the end), got {count!r}")
        try:
            value = float(entry.get("value"))
        except (TypeError, ValueError):
            raise ConfigError(
                f"{where}.value must be a number such as inf, -inf or nan, got {entry.get('value')!r}"
            ) from None
        specs.append(FaultSpec(step=step, layer=str(entry.get("layer")), value=value, count=count))
    return specs


class GradientFaults:
    """A test hook: writes a chosen value (Inf, NaN) into chosen gradients at chosen iterations.

    For each :class:`FaultSpec` a gradient hook (``Tensor.register_hook``) is registered on every parameter
    of the named module (submodules included); while the spec is active it returns the gradient with its
    first element replaced by the value, so the scaler sees a non-finite gradient exactly as a real overflow
    would produce one. The trainer calls :meth:`arm` with the iteration about to run. Layers are named as in
    ``model.named_modules()`` (``layer1.0.conv1``; the adaptive scaler's rewritten model keeps the names).
    Cost with no entries: nothing (no hooks); with entries, one Python call per hooked parameter per
    backward pass, plus a clone of the gradient on active iterations.
    """

    def __init__(self, model: nn.Module, specs: Sequence[FaultSpec]) -> None:
        self.specs = list(specs)
        self.iteration = 0
        self._handles: list[Any] = []
        modules = dict(model.named_modules())
        for spec in self.specs:
            module = modules.get(spec.layer)
            params = list(module.parameters()) if module is not None else []
            if not params:
                names = [n for n, m in modules.items() if n and any(True for _ in m.parameters())]
                close = difflib.get_close_matches(spec.layer, names, n=3, cutoff=0.5)
                hint = (
                    f"did you mean {' or '.join(close)}?"
                    if close
                    else f"layers are e.g. {', '.join(names[:5])}"
                )
                what = "has no parameters" if module is not None else "is not a layer of the model"
                raise ConfigError(f"faults.inject layer '{spec.layer}' {what}: {hint}")
            for param in params:
                if param.requires_grad:
                    self._handles.append(param.register_hook(self._hook(spec)))
        for spec in self.specs:
            until = "on" if spec.count is None else f"to {spec.step + spec.count - 1}"
            log.warning(
                "fault injection: %s into the gradients of %s at iterations %d %s (faults.inject)",
                spec.value, spec.layer, spec.step, until,
            )  # fmt: skip

    def arm(self, iteration: int) -> None:
        """Set the iteration (1-based) whose backward pass comes next."""
        self.iteration = iteration

    def _hook(self, spec: FaultSpec) -> Callable[[Tensor], Tensor | None]:
        def hook(grad: Tensor) -> Tensor | None:
            if not spec.active(self.iteration):
                return None
            faulty = grad.clone(memory_format=torch.contiguous_format)
            faulty.view(-1)[0] = spec.value
            return faulty

        return hook

    def remove(self) -> None:
        """Unregister every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
