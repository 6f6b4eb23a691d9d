"""Algorithm 3 of Zhao et al. (2019): backpropagation that carries the pair ``<alpha, delta>``.

The paper, for a layer ``i`` whose output ``j`` receives ``<alpha_j, delta_j>`` (``delta_j`` is the gradient
already multiplied by the accumulated scale ``alpha_j``)::

    W_i += GetWeightGradient(delta_j) / alpha_j
    beta_i = GetLossScale(OP(i), <alpha_j, delta_j>)                      # Algorithm 4
    <alpha_i, delta_i> = <alpha_j * beta_i, Backprop(OP(i), beta_i * delta_j)>

and here, once, in torch ops:

* :func:`gemm_backward`, a GEMM point (conv, linear, grouped GEMM): ``beta_i`` from Algorithm 4
  (:func:`gemm_beta`, which calls :func:`adaloss.adaptive.rules.gemm_loss_scale`); the input gradient is
  ``Backprop(beta_i * delta_j)``, the scaled gradient stored in the gradient format first (so an FP16
  overflow of ``beta * delta_j`` is an overflow, as in FP16 training); the weight gradient is computed from
  ``delta_j`` and multiplied by ``alpha_{N+1} / alpha_j`` instead of divided by ``alpha_j``
  (:func:`to_root`): every parameter gradient leaves the backward pass carrying the root scale
  ``alpha_{N+1}``, as under ``torch.amp.GradScaler``, whose ``unscale_`` divides by it (exact: powers of
  two).
* :func:`product_backward`, an activation-by-activation product (``a @ b``, attention): the same
  ``Backprop(beta_i * delta_j)`` with the beta of :func:`product_beta` (Algorithm 4 with the other operand in
  the weight's place); no weight gradient.
* :func:`params_to_root`, any other use of a parameter (a batch norm's affine parameters, a tied
  embedding): its gradient brought to the root scale by its own alpha.
* The alpha a point emits, ``alpha_j * beta_i``, is written by :func:`point_beta` (:func:`emit`); a branch
  (section 3.2.2, Algorithm 5) is :mod:`adaloss.adaptive.algorithm5`.

What this module is given and does not decide: how the GEMM's numbers are computed and stored (autocast,
emulated FP16/FP8 rounding, FP8 quantizer sites, FP4 GEMMs, telemetry probes), a
:class:`~adaloss.adaptive.gemm_numerics.GemmNumerics`; the kind of pass (``"recompute"``: Algorithm 4 runs
and the scales are written; ``"reuse"``: the last recompute's scales are read; ``"plain"``: no scaling),
read by the autograd front ends in :mod:`adaloss.adaptive.ops`; and which slot's alpha each point reads,
the static wiring that :mod:`adaloss.adaptive.transform` works out (``_Rewrite.slots``).

Autograd passes only gradients, so the alphas travel beside them in the device tensors of
:class:`~adaloss.adaptive.state.ScaleBuffers`: every point writes the alpha it emits into its slot
(``alpha[slot]``, with ``to_root[slot] = alpha_{N+1} / alpha[slot]``), and reads the alpha it receives from
the slot of whichever point emitted it. Element-wise ops between points pass alpha through unchanged
(section 3.2.2), so they need no code. Every scale is a 0-dim device tensor: no host sync, no host-to-device
copy and no Python float from a scale in any backward pass.
"""

from __future__ import annotations

from typing import Any

import torch

from adaloss.adaptive.rules import ScaleRule, Statistics, gemm_bounds, gemm_loss_scale, statistics
from adaloss.adaptive.state import AdaptiveState, GemmPoint, UnscalePoint

__all__ = [
    "emit",
    "gemm_backward",
    "gemm_beta",
    "params_to_root",
    "point_beta",
    "product_backward",
    "product_beta",
    "root_factor",
    "root_over",
    "to_root",
]


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (a model spread over devices reads the scale buffers from another one)."""
    return t if t.device == device else t.to(device)


def read_scale(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A scale read from the buffers for use in this backward pass: a view of the buffer, or a copy in a
    pass that builds a graph (``create_graph=True``), which saves what it multiplies by: the buffer is
    written in place later (autograd would refuse the changed tensor)."""
    t = on_device(t, device)
    return t.clone() if torch.is_grad_enabled() else t


def is_unit(state: AdaptiveState, part: int, index: int) -> bool:
    """Whether an eager reuse pass may skip a multiplication: the scale (``part`` 0: a beta, 1: a branch
    factor, 2: a ``to_root`` factor) is exactly 1 by the host's flags, read once after the last recompute
    (``AdaptiveState.note_units``). Never traced: a compiled pass multiplies by every scale."""
    if torch.compiler.is_compiling():  # first: a traced read of ``units`` would guard the graph on it
        return False
    units = state.units
    return units is not None and units[part][index]


def root_over(alpha_root: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """``alpha_{N+1} / alpha``: the factor that brings a gradient carrying ``alpha`` to the root scale, the
    paper's ``/ alpha_j`` on the weight gradient taken to ``alpha_{N+1}`` (``to_root`` in the buffers;
    ``alpha`` a slot's alpha or all of them). Exact: powers of two."""
    return alpha_root / alpha


def emit(state: AdaptiveState, slot: int, alpha: torch.Tensor) -> None:
    """A recompute pass's point emits ``alpha`` into ``slot``: ``alpha[slot]`` and ``to_root[slot]`` are
    written in place (two small device ops; readers of the slot run later in the same backward pass)."""
    buf = state.buffers
    alpha = on_device(alpha, buf.device)
    buf.alpha[slot].copy_(alpha)
    buf.to_root[slot].copy_(root_over(buf.alpha[0], alpha))


def root_factor(state: AdaptiveState, kind: str, slot: int, device: torch.device) -> torch.Tensor | None:
    """``alpha_{N+1} / alpha`` of slot ``slot`` (a 0-dim device tensor), or None where it is 1 by
    construction (slot 0, and every slot of a plain pass): what brings a gradient carrying that alpha to
    the root scale, as every parameter gradient leaves the backward pass (exact: powers of two)."""
    if kind == "plain" or slot == 0 or (kind == "reuse" and is_unit(state, 2, slot)):
        return None
    return read_scale(state.buffers.to_root[slot], device)


def to_root(grad: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """A parameter gradient computed from ``delta_j``, times ``alpha_{N+1} / alpha_j`` (None: 1): the
    paper's ``/ alpha_j``, to the root scale. In place where the tensor is fresh (not a view)."""
    if factor is None:
        return grad
    if grad._base is not None:  # a view (e.g. of a reshaped matmul): do not write into its base
        return grad * factor
    return grad.mul_(factor)


def point_beta(
    state: AdaptiveState, kind: str, point: GemmPoint, device: torch.device, compute: Any
) -> torch.Tensor | None:
    """GEMM point ``point``'s beta in a pass of ``kind``: on a recompute pass ``compute(alpha_j)``
    (Algorithm 4), written into ``beta[k]`` and emitted as ``alpha_j * beta``; on a reuse pass ``beta[k]``
    as the last recompute wrote it; None (1) on a plain pass. A 0-dim float32 device tensor. The scales
    are constants of the backward pass (powers of two): computed without a graph even under
    ``create_graph=True``."""
    if kind == "plain":
        return None
    buf = state.buffers
    if kind == "reuse":
        return None if is_unit(state, 0, point.index) else read_scale(buf.beta[point.index], device)
    with torch.no_grad():
        alpha_j = on_device(buf.alpha[point.in_slot], device)
        beta = compute(alpha_j)
        buf.beta[point.index].copy_(on_device(beta, buf.device))
        emit(state, point.out_slot, alpha_j * beta)
    return beta


def gemm_backward(
    numerics: Any,
    state: AdaptiveState,
    kind: str,
    point: GemmPoint,
    delta: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    need: tuple[bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Algorithm 3 at GEMM point ``point``: the input, weight and bias gradients from ``delta`` (``delta_j``,
    carrying ``alpha_j``) and the operands ``x``, ``w`` the forward pass saved. ``need``: whether the input
    gradient and the parameter gradients are asked for. ``numerics``
    (:class:`~adaloss.adaptive.gemm_numerics.GemmNumerics`) computes and stores the numbers.

    The input gradient carries ``alpha_j * beta`` (emitted on a recompute pass); the weight and bias
    gradients carry the root scale. Per call beyond the plain layer: on a recompute pass Algorithm 4 (four
    reductions, about ten 0-dim ops) and the writes of beta and the emitted alpha; on every pass one
    multiply of ``delta`` by beta and one of each parameter gradient by ``alpha_{N+1} / alpha_j`` (none
    where that is 1 by construction, or on a plain pass). No host sync."""
    need_x, need_w = need
    delta = numerics.received(delta, w)
    beta = point_beta(state, kind, point, delta.device, lambda a: gemm_beta(state, point, w, delta, a))
    factor = root_factor(state, kind, point.in_slot, delta.device)
    scaled = delta
    if need_x and beta is not None:
        scaled = numerics.store_scaled(delta * beta)  # a 0-dim float32 beta: the product keeps delta's dtype
    grad_x, grad_w, grad_b = numerics.backprop(delta, scaled, x, w, need_x, need_w)
    if need_x:
        grad_x = numerics.input_grad(grad_x)
    if need_w:
        grad_w = to_root(numerics.param_grad(grad_w, 0), factor)
        if grad_b is not None:
            grad_b = to_root(numerics.param_grad(grad_b, 1), factor)
    return grad_x, grad_w, grad_b


def gemm_beta(
    state: AdaptiveState, point: GemmPoint, w: torch.Tensor, delta: torch.Tensor, alpha_j: torch.Tensor
) -> torch.Tensor:
    """Algorithm 4 at GEMM point ``point``: :func:`adaloss.adaptive.rules.gemm_loss_scale` with the point's
    constants, the gradient's statistics all-reduced under DDP. No host sync and no host-to-device copy."""
    return gemm_loss_scale(
        w, delta, state.rule, alpha_in=alpha_j, constants=point.constants, reduce_fn=state.reduce_fn
    )


def product_backward(
    state: AdaptiveState, kind: str, point: GemmPoint, delta: torch.Tensor, operands: Any
) -> torch.Tensor:
    """Algorithm 3 at an activation-by-activation product: ``beta * delta``, which the product's own
    backward turns into input gradients carrying ``alpha_j * beta`` (they are linear in ``delta``; exact:
    beta is a power of two). ``operands`` (:class:`~adaloss.adaptive.ops.MatmulOperands` or
    :class:`~adaloss.adaptive.ops.AttentionOperands`) gives Algorithm 4's ``(operand, multiplier, F,
    delta)`` pairs and records the attention scores' gradient on a telemetry step. No host sync."""
    pairs: list = []

    def compute(alpha: torch.Tensor) -> torch.Tensor:
        pairs.extend(operands.pairs(delta))
        return product_beta(pairs, state.rule, alpha, state.reduce_fn)

    beta = point_beta(state, kind, point, delta.device, compute)
    operands.record(delta, beta, pairs)
    return delta if beta is None else delta * beta


def product_beta(
    pairs: list[tuple[torch.Tensor, float, int, torch.Tensor]],
    rule: ScaleRule,
    alpha_in: torch.Tensor | float,
    reduce_fn: Any = None,
) -> torch.Tensor:
    """The beta of an activation-by-activation product: Algorithm 4's bounds for each input gradient the
    product makes, with the other operand in the weight's place (:func:`adaloss.adaptive.rules.statistics`,
    :func:`~adaloss.adaptive.rules.gemm_bounds`), combined into one scale for all of them
    (:meth:`~adaloss.adaptive.rules.ScaleRule.beta`).

    ``pairs``: per input gradient ``(operand, multiplier, F, delta)``: the operand it is multiplied by (times
    the Python float ``multiplier``, e.g. attention's ``1/sqrt(d)``), its backward fan-in, and the gradient it
    is computed from. Each gives Algorithm 4's underflow bound ``lower_i`` and overflow bound ``upper_i``
    (module docstring of :mod:`adaloss.adaptive.rules`; the layer constants come from the operand's size, so
    they are Python floats, constants of a traced graph, not scales). The product's beta is the rule's beta
    for ``lower = max_i lower_i`` and ``upper = min_i upper_i``: as large as the most demanding input asks, as
    long as no input passes its own overflow bound (the branch point all of them would otherwise need,
    Algorithm 5, decided with the bounds instead of the gradients, which exist only after the product's
    backward). Bounded, rounded down to a power of two and 1 for an all-zero or non-finite gradient, as every
    beta. Under ``torch.distributed`` (``reduce_fn``) every tensor's second moment and max are combined over
    the ranks first, as the activations differ between ranks. Cost: two reductions per tensor and a few scalar
    ops; no host sync.
    """
    lowers, uppers = [], []
    seen: dict[int, Statistics] = {}  # a tensor in several pairs is read once

    def stats(t: torch.Tensor) -> Statistics:
        if id(t) not in seen:
            seen[id(t)] = statistics(_dense_on_cpu(t), reduce_fn)
        return seen[id(t)]

    for w, multiplier, fan_in, delta in pairs:
        a_const, b_const = rule.layer_constants(w.numel(), fan_in)
        lower_constant = rule.lower_constant(a_const / multiplier, delta.numel())
        lower, upper = gemm_bounds(stats(w), stats(delta), lower_constant, b_const / multiplier)
        lowers.append(lower)
        uppers.append(upper)
    return rule.beta(torch.stack(lowers).amax(), torch.stack(uppers).amin(), alpha_in)


def _dense_on_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied first if it is a strided view on the CPU (the heads of a split projection): the norm's
    strided CPU path takes 3.5x the copy and the norm together (tiny GPT's keys, 131,072 floats: 117 us
    against 33 us, one core). Elsewhere the view is reduced as it is (unmeasured there, and the copy would
    be one more pass)."""
    return t.contiguous() if t.device.type == "cpu" and not t.is_contiguous() else t


def params_to_root(
    state: AdaptiveState,
    kind: str,
    points: tuple[UnscalePoint, ...],
    grads: tuple[torch.Tensor | None, ...],
) -> list[torch.Tensor | None]:
    """Each parameter gradient of a use outside a GEMM point times ``alpha_{N+1} / alpha`` of its point, in
    its own dtype (none where the factor is 1 by construction; None stays None), so it joins the other
    contributions in ``.grad`` at the root scale. Call with torch-function modes off."""
    out: list[torch.Tensor | None] = []
    for point, grad in zip(points, grads, strict=True):
        if grad is not None:
            factor = root_factor(state, kind, point.in_slot, grad.device)
            if factor is not None:
                grad = grad * factor
        out.append(grad)
    return out
