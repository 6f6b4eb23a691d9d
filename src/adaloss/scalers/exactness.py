"""Whether the adaptive scaler leaves a model's gradients as plain backprop computes them, in float64.

Adaptive loss scaling multiplies gradients by powers of two and divides them out again, so in exact
arithmetic every parameter gradient after ``unscale_`` equals plain backprop's. In floating point the two
computations add the same terms in other orders (a branch sums its inputs' gradients in place, a
convolution's input and weight gradients come from separate calls) and so round differently. Where a
gradient is large that difference is a few float64 ulps; where the terms cancel, it is all there is. The
bias of a batch norm followed by a 1x1 convolution and another batch norm in training mode has a
gradient that is zero in exact arithmetic (the second norm's input gradient sums to zero per channel);
float64 gives about 1e-25 where its terms are about 1e-9, and the two computations disagree in every
digit. Plain backprop disagrees with itself that way too, with the batch in the other order.

So an error counts only if it exceeds what rounding can explain (:class:`ParamCheck`):
``|got - ref| <= RTOL * max|ref| + NOISE_FACTOR * max|ref32 - ref| + GLOBAL_RTOL * G``, where ``ref32`` is
plain backprop in float32 on the same weights and inputs and ``G`` the largest gradient of any parameter
of the model. Float64 rounds 2**-29 (about 1.9e-9) as coarsely as float32, so float64's rounding
differences are about 1e-9 of the float32 ones; ``NOISE_FACTOR = 1e-6`` leaves a margin of about 500 for
the adaptive computation's extra operations. Float32 can cancel exactly where float64 does (a gradient of
exactly 0 in both, but not in a third order of the same sums), so the last term bounds float64's rounding
by the model's gradient scale: differences below ``GLOBAL_RTOL = 1e-12`` of the largest gradient are not
told apart from rounding, which also means a gradient that small is checked only to that absolute
accuracy. A real error (a gradient off by a power of two, a missing contribution) is the size of the
gradient itself, far above every term.

:func:`check_gradients` runs the comparison on a user's model: a recompute step and a reuse step per
rule, each against plain backprop on the same batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adaloss.scalers.adaptive import AdaptiveLossScaler

__all__ = [
    "GLOBAL_RTOL",
    "NOISE_FACTOR",
    "RTOL",
    "ExactnessReport",
    "ParamCheck",
    "check_gradients",
    "compare",
]

#: An error below this fraction of a parameter's largest gradient is float64 rounding wherever it is.
RTOL = 1e-10
#: An error below this multiple of float32's deviation from float64 is float64 rounding (module docstring).
NOISE_FACTOR = 1e-6
#: An error below this fraction of the model's largest parameter gradient is not told from rounding.
GLOBAL_RTOL = 1e-12


@dataclass(frozen=True)
class ParamCheck:
    """One parameter's gradient against plain backprop's: ``error = max|got - ref|``, ``scale =
    max|ref|``, ``noise = max|ref32 - ref|`` (float32's deviation), ``model_scale`` the largest gradient
    of any parameter. ``got`` None: no gradient arrived where plain backprop has one (``error`` is then
    infinite unless ``ref`` is all zeros)."""

    name: str
    error: float
    scale: float
    noise: float
    model_scale: float = 0.0

    @property
    def bound(self) -> float:
        return RTOL * self.scale + NOISE_FACTOR * self.noise + GLOBAL_RTOL * self.model_scale

    @property
    def ok(self) -> bool:
        return self.error <= self.bound

    def __str__(self) -> str:
        return f"{self.name}: error {self.error:.3g}, bound {self.bound:.3g} (max |grad| {self.scale:.3g})"


def compare(
    reference: dict[str, torch.Tensor],
    noise_reference: dict[str, torch.Tensor],
    got: dict[str, torch.Tensor | None],
) -> list[ParamCheck]:
    """A :class:`ParamCheck` for every parameter with a reference gradient (float64 ``reference``, float32
    ``noise_reference``, the checked ``got``); a gradient where plain backprop has none is an error too."""
    checks = []
    model_scale = max((float(r.abs().max()) for r in reference.values() if r.numel()), default=0.0)
    for name in sorted(set(reference) | {n for n, g in got.items() if g is not None}):
        ref, g = reference.get(name), got.get(name)
        if ref is None:  # a gradient where plain backprop has none
            error = float(g.abs().max()) if g.numel() else 0.0
            checks.append(ParamCheck(name, error, 0.0, 0.0, model_scale))
            continue
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        noise = float((noise_reference[name].to(ref.dtype) - ref).abs().max()) if ref.numel() else 0.0
        if g is None:
            checks.append(ParamCheck(name, float("inf") if scale > 0 else 0.0, scale, noise, model_scale))
        else:
            error = float((g.to(ref.dtype) - ref).abs().max()) if ref.numel() else 0.0
            checks.append(ParamCheck(name, error, scale, noise, model_scale))
    return checks


@dataclass
class ExactnessReport:
    """The checks of :func:`check_gradients`, per (rule, step kind): ``failures()`` lists the parameters
    outside their bound; ``alphas`` holds each step's ``layer_scales()``, ``rescaled`` per rule whether
    some branch point's inputs had different alphas (Algorithm 5 did something)."""

    checks: dict[tuple[str, str], list[ParamCheck]] = field(default_factory=dict)
    alphas: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    outputs_equal: dict[tuple[str, str], bool] = field(default_factory=dict)
    rescaled: dict[str, bool] = field(default_factory=dict)  # per rule: a branch met different alphas

    def failures(self) -> list[tuple[tuple[str, str], ParamCheck]]:
        return [(key, c) for key, checks in self.checks.items() for c in checks if not c.ok]

    @property
    def ok(self) -> bool:
        return not self.failures() and all(self.outputs_equal.values())

    def format(self) -> str:
        lines = []
        for key, equal in self.outputs_equal.items():
            if not equal:
                lines.append(f"{key[0]} rule, {key[1]} step: the forward pass differs from the plain model's")
        lines += [f"{key[0]} rule, {key[1]} step: {check}" for key, check in self.failures()]
        return "\n".join(lines) if lines else "every gradient equals plain backprop's (float64)"


def _gradients(model: nn.Module, batch: Any, loss_fn: Callable, seed: int, scale: Any = None) -> Any:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # dropout and other random ops draw the same numbers in every run
    out = model(**batch) if isinstance(batch, dict) else model(*batch)
    loss = loss_fn(out)
    (scale(loss) if scale is not None else loss).backward()
    return out


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}


def _outputs_equal(got: Any, expected: Any) -> bool:
    """Whether the forward outputs agree to float64 rounding (``RTOL`` of the largest output): the same
    ops, but a convolution may pick another algorithm for an input of other strides."""
    detach = lambda v: v.detach() if isinstance(v, torch.Tensor) else v  # noqa: E731
    la = [detach(v) for v in torch.utils._pytree.tree_leaves(got)]
    lb = [detach(v) for v in torch.utils._pytree.tree_leaves(expected)]
    if len(la) != len(lb):
        return False
    tensors = [y for y in lb if isinstance(y, torch.Tensor) and y.numel()]
    scale = max((float(y.abs().max()) for y in tensors if y.is_floating_point()), default=0.0)
    for x, y in zip(la, lb, strict=True):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if x != y:
                return False
        elif x.shape != y.shape or (x.numel() and float((x - y).abs().max()) > RTOL * scale):
            return False
    return True


def _cast(batch: Sequence[Any] | dict[str, Any], dtype: torch.dtype) -> tuple[Any, ...] | dict[str, Any]:
    """A fresh copy of the batch (a model may write into its input), floating tensors in ``dtype``."""

    def cast(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.to(dtype, copy=True) if t.is_floating_point() else t.clone()

    if isinstance(batch, dict):
        return {k: cast(v) for k, v in batch.items()}
    return tuple(cast(t) for t in batch)


def _copy(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, also for a model with the old ``nn.utils.weight_norm`` / ``spectral_norm``
    hooks, whose computed weight (not a graph leaf) deepcopy refuses: it is left out of the copy, where the
    hook computes it again at the first forward pass."""
    computed = []
    for m in model.modules():
        for hook in m._forward_pre_hooks.values():
            name = getattr(hook, "name", None)
            if hasattr(hook, "compute_weight") and name in m.__dict__:
                computed.append((m, name, m.__dict__.pop(name)))
    try:
        return copy.deepcopy(model)
    finally:
        for m, name, value in computed:
            m.__dict__[name] = value


def check_gradients(
    model: nn.Module,
    batches: Sequence[Sequence[Any]],
    loss_fn: Callable[[Any], torch.Tensor],
    rules: Sequence[str] = ("reference", "paper"),
    seed: int = 0,
    **scaler_options: Any,
) -> ExactnessReport:
    """Attach a float64 copy of ``model`` to an ``AdaptiveLossScaler`` per rule and compare, step by step,
    its unscaled gradients with plain backprop's on the same batches (``model`` itself is not changed).

    ``batches``: the positional inputs of each step (or a dict of keyword inputs); the first step
    recomputes the scales, the others reuse them (``update_every=len(batches)``), reading them from the
    scale buffers. ``loss_fn(output)``
    makes the loss; scale it down (e.g. by 1e-9) so that the betas exceed 1 and the alphas differ between
    branches, or the check checks little. ``scaler_options`` go to ``AdaptiveLossScaler``. Every forward
    pass is seeded with ``seed`` (dropout draws the same masks). Runs on the CPU; float64 and float32
    copies of the model are made. No optimizer step is taken: the weights stay as given. A model torch.fx
    cannot trace is captured with ``torch.export`` on the first batch (``AdaptiveLossScaler.attach``)."""
    reference, noisy = _copy(model).double(), _copy(model).float()
    # the attached copies start from the buffers the reference started from (a parametrization's state,
    # such as spectral norm's power iteration vectors, moves with every training-mode forward pass)
    pristine = _copy(reference)
    expected = []
    for batch in batches:
        out = _gradients(reference, _cast(batch, torch.float64), loss_fn, seed)
        _gradients(noisy, _cast(batch, torch.float32), lambda o: loss_fn(o).float(), seed)
        expected.append((out, _grads(reference), _grads(noisy)))
    report = ExactnessReport()
    for rule in rules:
        scaler = AdaptiveLossScaler(update_every=len(batches), rule=rule, **scaler_options)
        example = _cast(batches[0], torch.float64)  # captured with torch.export if fx cannot trace it
        if isinstance(example, dict):
            attached = scaler.attach(_copy(pristine), **example)
        else:
            attached = scaler.attach(_copy(pristine), *example)
        optimizer = torch.optim.SGD(attached.parameters(), lr=0.0)
        for step, (batch, (out, ref, ref32)) in enumerate(zip(batches, expected, strict=True)):
            key = (rule, "recompute" if step == 0 else "reuse")
            got_out = _gradients(attached, _cast(batch, torch.float64), loss_fn, seed, scaler.scale)
            scaler.unscale_(optimizer)
            report.outputs_equal[key] = _outputs_equal(got_out, out)
            report.checks[key] = compare(
                {n: g for n, g in ref.items() if g is not None},
                {n: g for n, g in ref32.items() if g is not None},
                _grads(attached),
            )
            report.alphas[key] = scaler.layer_scales()
            if step == 0:
                report.rescaled[rule] = any(scaler.branch_rescaled().values())
            scaler.step(optimizer)
            scaler.update()
    return report
