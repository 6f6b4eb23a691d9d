"""Algorithm 5 of Zhao et al. (2019), loss scaling for branches, at a branch point of the backward pass.

A tensor read by several consumers (a residual connection, a split) receives several gradients, each
carrying the alpha of the point that made it (section 3.2.2). Before they are summed they are brought to
one common alpha::

    GetBranchLossScale({<alpha_i, delta_i>}):
        for alpha_i in DescSort({alpha_i}):
            if alpha_i * max|delta_k| < u_max for every k:
                return {<alpha_i, (alpha_i / alpha_k) delta_k>}

The choice of the common alpha is :func:`adaloss.adaptive.rules.branch_loss_scale`, once; this module
applies it at a point: :func:`branch_scales` gathers the incoming alphas and the gradients' maxima, calls
the rule, writes the factors ``alpha / alpha_k`` into the scale buffers and emits the common alpha
(:func:`adaloss.adaptive.algorithm3.emit`); :func:`branch_factors` gives the factors of a pass of any kind;
:func:`rescale` multiplies the gradients by them, fused into their sum for a shared tensor. The autograd
front end is :class:`adaloss.adaptive.ops.Rescale`. No host sync.
"""

from __future__ import annotations

import torch

from adaloss.adaptive.algorithm3 import emit, is_unit, on_device, read_scale
from adaloss.adaptive.rules import branch_loss_scale, max_magnitude
from adaloss.adaptive.state import AdaptiveState, BranchPoint

__all__ = ["branch_factors", "branch_scales", "rescale"]


def branch_factors(
    state: AdaptiveState, kind: str, point: BranchPoint, grads: tuple, present: list[int]
) -> list[torch.Tensor | None]:
    """The factors that bring branch ``point``'s present incoming gradients to its common alpha: Algorithm
    5 on a recompute pass (:func:`branch_scales`), the buffers' on a reuse pass, None (1) on a plain pass;
    0-dim device tensors on the gradients' device."""
    if kind == "plain":
        return [None] * len(present)
    device = grads[present[0]].device
    if kind == "recompute":
        with torch.no_grad():
            return list(on_device(branch_scales(state, point, grads, present), device).unbind(0))
    factors, start = state.buffers.branch_factors, point.offset
    return [None if is_unit(state, 1, start + i) else read_scale(factors[start + i], device) for i in present]


def branch_scales(state: AdaptiveState, point: BranchPoint, grads: tuple, present: list[int]) -> torch.Tensor:
    """Algorithm 5 (:func:`adaloss.adaptive.rules.branch_loss_scale`) at branch ``point`` on a recompute
    pass: the common alpha of its present incoming gradients and the factor of each, written into the
    buffers (common alpha, factors, whether they differ) and emitted; returns the factors. No host sync."""
    buf = state.buffers
    a = torch.stack([buf.alpha[point.in_slots[i]] for i in present])
    m = torch.stack([on_device(max_magnitude(grads[i]), buf.device) for i in present]).float()
    if state.reduce_fn is not None:
        m = state.reduce_fn(None, m)[1]
    common = branch_loss_scale(a, m, state.u_max, state.rule.name)
    vec = common / a
    k, start = point.index, point.offset
    buf.branch_alpha[k].copy_(common)
    buf.rescaled[k].copy_((a != common).any())
    if len(present) == len(grads):
        buf.branch_factors[start : start + len(grads)].copy_(vec)
    else:  # element by element: indexing with a list would copy host data to the device
        for i, v in zip(present, vec.unbind(0), strict=True):
            buf.branch_factors[start + i].copy_(v)
    emit(state, point.out_slot, common)
    return vec


def rescale(
    state: AdaptiveState,
    kind: str,
    point: BranchPoint,
    grads: tuple,
    present: list[int],
    shared: bool,
    owned: int | None,
) -> list[torch.Tensor | None]:
    """The gradients of branch ``point`` at its common alpha: each present one times its factor (several
    outputs of one op, ``shared`` False), or their sum (one tensor's consumers, ``shared``: one gradient).
    ``owned``: the index of a gradient made for this branch alone, which may be written in place (eager
    passes; see :class:`adaloss.adaptive.ops.Rescale`), or None."""
    factor = dict(zip(present, branch_factors(state, kind, point, grads, present), strict=True))
    if not shared:
        out: list[torch.Tensor | None] = list(grads)
        for i in present:
            if factor[i] is not None:
                out[i] = grads[i].mul_(factor[i]) if i == owned else grads[i] * factor[i]
        return out
    order = present if owned is None else [owned, *(i for i in present if i != owned)]
    total, fresh = None, False
    if owned is not None:
        total, fresh = grads[owned], True
        if factor[owned] is not None:
            total = total.mul_(factor[owned])
    for i in order[1 if owned is not None else 0 :]:
        total, fresh = _accumulate(total, fresh, grads[i], factor[i])
    return [total]


def _accumulate(
    total: torch.Tensor | None, fresh: bool, grad: torch.Tensor, factor: torch.Tensor | None
) -> tuple[torch.Tensor, bool]:
    """``total + factor * grad`` in one pass (``total`` is None for the first term; ``factor`` None: 1);
    never writes ``grad``.

    ``fresh`` says whether ``total`` was made here (then it is updated in place). ``factor`` is a power of
    two, so ``factor * grad`` is exact and the fused op rounds once, as a separate multiply and add would.
    Returns the new total and whether it is fresh.
    """
    if factor is None:
        if total is None:
            return grad, False
        return (total.add_(grad), True) if fresh else (total + grad, True)
    if total is None:
        return grad * factor, True
    if fresh:
        return total.addcmul_(grad, factor), True
    return torch.addcmul(total, grad, factor), True
