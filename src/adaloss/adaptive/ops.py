"""The numerical core of adaptive loss scaling (Zhao et al., section 3): Algorithms 3, 4, 5 as autograd ops.

Backpropagation carries the pair ``<alpha, delta>``: ``delta`` is the gradient already multiplied by the
accumulated scale ``alpha`` (Algorithm 3). Autograd only passes gradients, so the alphas travel beside them in
an :class:`AdaptiveState`: one 0-dim device tensor per *slot*. Slot 0 holds the initial scale
``alpha_{N+1}`` applied to the loss; every GEMM point and every branch point writes the alpha of the gradient
it emits into its own slot, and reads the alpha of the gradient it receives from the slot of whichever point
emitted it (that wiring is static and comes from :mod:`adaloss.adaptive.transform`). Element-wise ops sit
between points and pass alpha through unchanged (section 3.2.2), so they need no code at all.

* :class:`ScaledGEMM` (conv, linear): receives ``delta_j`` scaled by ``alpha_j``; computes the local scale
  ``beta`` from the statistics of its weight and ``delta_j`` (Algorithm 4, :func:`gemm_beta` and
  :mod:`adaloss.adaptive.rules`); computes the input gradient as ``Backprop(beta * delta_j)``, the scaled
  gradient stored in the gradient format (so an FP16 overflow of ``beta * delta_j`` is an overflow, as in
  FP16 training; scaling the weight instead would overflow wherever ``beta * W`` does) and emits
  ``alpha_j * beta``; computes the weight gradient from ``delta_j`` and multiplies it by ``alpha_{N+1} /
  alpha_j`` in FP32, so every parameter gradient leaves the backward pass carrying the root scale
  ``alpha_{N+1}``, as under ``torch.amp.GradScaler`` (``unscale_`` then divides by it).
* :class:`ScaledProduct` (an activation-by-activation product, an attention call): the same
  ``Backprop(beta * delta_j)`` with the beta of :func:`product_beta` (Algorithm 4 with the other operand in
  the weight's place); no weight gradient.
* :class:`Rescale` (branches, Algorithm 5): all gradients flowing into one tensor arrive together; they are
  brought to one common alpha (:func:`branch_scales`, :func:`~adaloss.adaptive.rules.branch_loss_scale`)
  and summed, the rescaling fused into the sum.
* :class:`ParamUnscale`: any other use of a parameter (a batch norm's affine parameters, a tied
  embedding), brought to the root scale by its own alpha; for a module fed directly by a conv or linear
  layer (a batch norm after a conv), that layer's :class:`ScaledGEMM` node does it instead.

One implementation for every device: the statistics, betas and alphas of a recompute pass are 0-dim tensors
on the gradients' device (CPU tensors on the CPU), nothing synchronizes host and device, and nothing copies
host data to a device during a backward pass (each layer's constants of Algorithm 4 are put on the device
when the scaler is armed, :class:`LayerConstants`). After a recompute step (``update_every > 1``) the
scaler copies all betas, branch factors and branch alphas to the host once (:meth:`AdaptiveState.fetch_host`,
one sync per ``update_every`` steps); the reuse passes in between run on those floats, so no scalar device
op runs then and multiplications by exactly 1 are skipped. The ops run with torch-function modes disabled
(under the CPU emulation's mode, every tensor op and even ``.dtype`` inside them would take a Python round
trip), and a branch adds its inputs' gradients in place into the gradient a GEMM point made for it, as
autograd's own accumulation would, instead of allocating a rescaled copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from adaloss.adaptive.rules import (
    ScaleRule,
    _low,
    branch_loss_scale,
    gemm_loss_scale,
    grad_stats,
    max_magnitude,
    weight_factors,
)
from adaloss.numerics.emulation import active_emulation, is_low_precision, mark_low_precision
from adaloss.numerics.formats import round_to_format
from adaloss.numerics.quantizers import quantize_grad
from adaloss.utils.device import host_to_device

__all__ = [
    "AdaptiveState",
    "AttentionOperands",
    "GemmPoint",
    "BranchPoint",
    "GradProbe",
    "ParamUnscale",
    "ScaledProduct",
    "ScaledGEMM",
    "GradRound",
    "MatmulOperands",
    "Rescale",
    "UnscalePoint",
    "product_beta",
]


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype Algorithm 4's statistics of a tensor are taken in: float64 for float64, else float32."""
    return torch.float64 if dtype is torch.float64 else torch.float32


@dataclass
class GemmPoint:
    """A scaling point at one call of a conv/linear layer (a module called twice has two points), or at an
    activation-by-activation product (``kind="product"``: a matmul of two activations, or an attention
    call; see :class:`ScaledProduct`)."""

    index: int
    name: str  # module path, with "#k" for the k-th extra call of the same module
    fan_in: int = 1  # F, the layer's backward fan-in (rules.backward_fan_in)
    constants: tuple[float, float] = (1.0, 1.0)  # (A, B) of Algorithm 4 for this layer (ScaleRule)
    in_slot: int = -1  # slot holding alpha_j of the gradient this layer receives
    out_slot: int = -1  # slot this layer writes alpha_j * beta into
    # (branch index, consumer index) when this call's input is directly one alias of a branch point, so
    # its input gradient goes straight (and only) to that branch's backward: it may add into it in place
    feeds: tuple[int, int] | None = None
    kind: str = "layer"  # "layer": a GEMM with a weight; "product": both operands are activations
    # the parameters of the module this call feeds directly (a batch norm after a conv), whose gradients
    # this point's node brings to the root scale instead of a ParamUnscale node of their own
    carried: tuple[UnscalePoint, ...] = ()


@dataclass
class BranchPoint:
    """A branch point: one tensor feeding several consumers, or several outputs of one op."""

    index: int
    name: str
    in_slots: list[int] = field(default_factory=list)  # one per consumer
    out_slot: int = -1
    # the value turned out not to be a tensor (a shape, an int, a tuple of them passed along beside the
    # activations): no gradient ever reaches it, and it counts as no point without scales
    inert: bool = False


@dataclass
class UnscalePoint:
    """A non-GEMM use of a parameter that GEMM points also use (a token embedding whose weight is the output
    projection's): the gradient this use contributes is divided by its own alpha in the backward pass
    (:class:`ParamUnscale`), as each GEMM call's contribution is, so the parameter's ``.grad`` sums true
    gradients."""

    index: int
    name: str  # the parameter's name, with "#k" for its k-th such use
    in_slot: int = -1  # slot holding the alpha of the gradient this use contributes


def unplanned_point(name: str) -> RuntimeError:
    """A reuse pass reached a point that no gradient reached in the last recompute pass, although which
    tensors need gradients looked unchanged (:class:`GradSignature` sees parameters and inputs only)."""
    return RuntimeError(
        f"adaptive loss scaling: '{name}' needs a gradient now but got none when the scales were last "
        "computed; call scaler.recompute_next() before the forward pass after changing requires_grad"
    )


class GradSignature:
    """Forward pre-hook of an attached model: records which tensors need gradients in this forward pass.

    Why: a point that no gradient reached in a recompute pass (a frozen layer, a model input used by
    two layers) has no scales, and reuse passes may go without them only while the same tensors need
    gradients (the traced graph is fixed, so then the same points are reached). The signature is the
    parameters' ``requires_grad`` flags and the forward's tensor inputs' flags. If it changed since the
    last recompute, this asks the scaler to make this step a recompute step (:class:`Reach`).
    Cost: one pass over the parameters' flags per forward pass with grad enabled (22 us for ResNet-110's
    329 tensors on the project's CPU, 0.003% of its step), read with torch-function modes off; no tensor
    data is read, no sync.
    """

    def __init__(self, state: AdaptiveState, params: list[torch.Tensor]) -> None:
        self.state = state
        self.params = params

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return None
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        # Torch-function modes off: the hook runs inside the forward pass, where under the CPU emulation's
        # mode each ``requires_grad`` read would be a Python round trip (7 us each, 0.4 ms per ResNet-20 step)
        with torch._C.DisableTorchFunction():
            sig = (tuple(p.requires_grad for p in self.params), tuple(t.requires_grad for t in inputs))
        reach = self.state.reach
        reach.latest = sig
        if reach.at_recompute is not None and sig != reach.at_recompute and self.state.has_unreached():
            reach.requested = True
        return None


@dataclass
class Reach:
    """Which tensors needed gradients (:class:`GradSignature`) in the latest forward pass with grad enabled
    (``latest``) and in the forward pass of the last recompute (``at_recompute``; None: unknown). A point
    no gradient reached in that pass will not be reached while the two are equal (a traced graph);
    ``requested``: they differ and some point has no scales, so the scaler recomputes on this step."""

    latest: tuple | None = None
    at_recompute: tuple | None = None
    requested: bool = False


@dataclass
class HostScales:
    """Host copies of a recompute pass's scales, fetched in one sync after it (``update_every > 1``), so the
    reuse passes until the next recompute multiply by Python floats: no scalar device op runs then, and a
    factor of exactly 1 is skipped. ``beta[k]`` per GEMM point (1.0 where no gradient reached it),
    ``branch_alpha[k]`` and ``branch_factors[k]`` per branch point (None where no gradient reached it)."""

    beta: list[float]
    branch_alpha: list[float | None]
    branch_factors: list[list[float] | None]


@dataclass
class Points:
    """What :func:`adaloss.adaptive.transform.attach_adaptive` wired, fixed once attached: the scaling
    points, the number of alpha slots (slot 0 is ``alpha_{N+1}``'s) and the GEMM layers' weights (their
    devices and dtypes key Algorithm 4's constants, :class:`LayerConstants`)."""

    gemms: list[GemmPoint] = field(default_factory=list)
    branches: list[BranchPoint] = field(default_factory=list)
    unscales: list[UnscalePoint] = field(default_factory=list)
    num_slots: int = 1
    gemm_weights: list[torch.Tensor] = field(default_factory=list)


@dataclass
class DeviceScales:
    """What the last recompute pass computed, as 0-dim (``beta``, ``branch_alpha``) or 1-dim
    (``branch_factors``: one per incoming gradient) device tensors, None where no gradient reached the
    point; ``branch_rescaled[k]``: (incoming alphas, common alpha) of branch ``k``."""

    beta: list[torch.Tensor | None] = field(default_factory=list)
    branch_alpha: list[torch.Tensor | None] = field(default_factory=list)
    branch_factors: list[torch.Tensor | None] = field(default_factory=list)
    branch_rescaled: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)


#: The kinds of backward pass (:class:`BackwardPass`).
PASS_KINDS = ("recompute", "reuse", "plain")


@dataclass
class BackwardPass:
    """One backward pass: its kind, and the alphas its points emit.

    ``kind``: ``recompute`` (Algorithms 4 and 5 run on device tensors; the alphas are 0-dim device
    tensors), ``reuse`` (every point applies the last recompute's scales: as the Python floats in
    ``floats`` when the host copies exist, else as the device tensors) or ``plain`` (every beta and branch
    factor is 1, ``floats`` says so: every gradient carries ``alpha_{N+1}``). ``alpha[s]`` is the scale of
    the gradient emitted into slot ``s``; ``fresh`` maps (branch, consumer) to an input gradient a GEMM
    point made for that branch alone (the branch may add into it in place, see ``GemmPoint.feeds``).
    """

    kind: str = "recompute"
    alpha: list[torch.Tensor | float | None] = field(default_factory=lambda: [None])
    floats: HostScales | None = None
    fresh: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    to_root: dict[int, torch.Tensor | float] = field(default_factory=dict)  # per slot, see ``root_over``

    @property
    def recompute(self) -> bool:
        return self.kind == "recompute"


class AdaptiveState:
    """Per-model state of the adaptive scaler, in nine attributes: ``rule`` (:class:`ScaleRule`),
    ``points`` (:class:`Points`, what the transform wired), ``constants`` (:class:`LayerConstants`,
    Algorithm 4's per-layer constants), ``last`` (:class:`DeviceScales`, the last recompute's scales as
    device tensors), ``host`` (their host copies, :class:`HostScales`, None until fetched), ``current``
    (:class:`BackwardPass`: the pass kind and its alphas), ``reach`` (:class:`Reach`), ``graph_built``
    (a backward pass of this iteration ran with ``create_graph=True``) and ``reduce_fn`` (combines
    statistics over ranks under ``torch.distributed``, else None). The same code runs on every device: on
    the CPU, device tensors are CPU tensors.
    """

    def __init__(self, rule: ScaleRule) -> None:
        self.rule = rule
        self.points = Points()
        self.constants = LayerConstants(rule)
        self.last = DeviceScales()
        self.host: HostScales | None = None
        self.current = BackwardPass()
        self.reach = Reach()
        self.graph_built = False
        self.reduce_fn: Any = None

    @property
    def gemms(self) -> list[GemmPoint]:
        return self.points.gemms

    @property
    def branches(self) -> list[BranchPoint]:
        return self.points.branches

    @property
    def u_max(self) -> float:
        return self.rule.u_max

    def new_slot(self) -> int:
        self.points.num_slots += 1
        self.current.alpha.append(None)
        return self.points.num_slots - 1

    def add_gemm(self, name: str, fan_in: int = 1, n_weights: int = 1, kind: str = "layer") -> GemmPoint:
        gemms = self.points.gemms
        point = GemmPoint(len(gemms), name, fan_in, self.rule.layer_constants(n_weights, fan_in), kind=kind)
        self.constants.add_point(point)
        point.out_slot = self.new_slot()
        gemms.append(point)
        self.last.beta.append(None)
        return point

    def add_unscale(self, name: str) -> UnscalePoint:
        point = UnscalePoint(len(self.points.unscales), name)
        self.points.unscales.append(point)
        return point

    def add_branch(self, name: str) -> BranchPoint:
        point = BranchPoint(len(self.points.branches), name)
        point.out_slot = self.new_slot()
        self.points.branches.append(point)
        last = self.last
        last.branch_alpha.append(None)
        last.branch_factors.append(None)
        last.branch_rescaled.append(None)
        return point

    def has_unreached(self) -> bool:
        """Whether some point has no scales (no gradient reached it in the last recompute pass)."""
        branches = self.points.branches
        return any(b is None for b in self.last.beta) or any(
            f is None and not branches[k].inert for k, f in enumerate(self.last.branch_factors)
        )

    def start_backward(
        self, root_alpha: torch.Tensor, recompute: bool, root_host: float | None = None, plain: bool = False
    ) -> None:
        """Called by ``scaler.scale(loss)``: choose the pass kind (:class:`BackwardPass`), set the root
        scale.

        ``recompute``: compute new betas in this backward pass (the host copies are dropped; the scaler
        fetches new ones after the step). Otherwise the existing scales are reused: as Python floats if
        the host copies and ``root_host`` (the root scale as a float) are available, else as device
        tensors (a second backward pass of a recompute iteration, under gradient accumulation). A pass
        before any betas exist, or with points that the last recompute did not reach while other tensors
        now need gradients, recomputes.

        ``plain``: every beta and branch factor is 1, so every gradient carries ``alpha_{N+1}``. The scaler
        asks for it after a backward pass of the same iteration that built a graph of its own
        (``create_graph=True``, GradScaler's gradient-penalty recipe): the gradients of the penalty reach
        the forward graph's activations at the root scale, where layer-wise alphas would not match them.
        """
        points, reach = self.points, self.reach
        alpha: list[torch.Tensor | float | None] = [None] * points.num_slots
        if plain:
            ones = HostScales(
                [1.0] * len(points.gemms),
                [float(root_host)] * len(points.branches),
                [[1.0] * len(b.in_slots) for b in points.branches],
            )
            alpha[0] = float(root_host)
            self.current = BackwardPass("plain", alpha, ones)
            return
        missing = self.has_unreached()
        # Points the last recompute pass did not reach may stay without scales while nothing else changed
        # (GradSignature); with no such pass on record, every point needs its scales first.
        if recompute or (missing and (reach.at_recompute is None or reach.latest != reach.at_recompute)):
            self.host = None
            reach.at_recompute = reach.latest
            alpha[0] = root_alpha
            self.current = BackwardPass("recompute", alpha)
            return
        self.constants.forget_weights()  # no statistics needed: drop the references
        floats = self.host if root_host is not None else None
        alpha[0] = float(root_host) if floats is not None else root_alpha
        self.current = BackwardPass("reuse", alpha, floats)

    def point_beta(self, k: int, compute: Any) -> torch.Tensor | float:
        """GEMM point ``k``'s beta in this pass: ``compute()`` (Algorithm 4) on a recompute pass or where no
        recompute has reached the point yet (kept as the last recompute's), else the last recompute's, as a
        float when this pass has them (:class:`BackwardPass`)."""
        current, last = self.current, self.last
        if current.recompute or (current.floats is None and last.beta[k] is None):
            beta = compute()
            last.beta[k] = beta
            return beta
        if current.floats is not None:
            return current.floats.beta[k]
        return last.beta[k]

    def read_alpha(self, slot: int, where: str) -> torch.Tensor | float:
        """The alpha of slot ``slot`` in this pass; notes a pass that builds a graph (``create_graph``)."""
        if torch.is_grad_enabled():
            self.graph_built = True
        a = self.current.alpha[slot]
        if a is None:
            raise RuntimeError(
                f"adaptive loss scaling: no scale reached {where}; call scaler.scale(loss).backward() rather "
                "than loss.backward() on a model returned by scaler.attach()"
            )
        return a

    def root_over(self, slot: int, where: str) -> torch.Tensor | float:
        """``alpha_{N+1} / alpha``, with ``alpha`` the scale of slot ``slot``: what brings a gradient
        carrying ``alpha`` to the root scale, as every parameter gradient leaves the backward pass (exact:
        both are powers of two). Computed once per slot and pass (a layer's weight and the batch norm
        after it share their slot)."""
        cache = self.current.to_root
        factor = cache.get(slot)
        if factor is None:
            alpha, root = self.read_alpha(slot, where), self.current.alpha[0]
            if not isinstance(alpha, torch.Tensor):
                factor = root / alpha
            elif isinstance(root, float):  # a fill on alpha's device, not a host-to-device copy
                factor = alpha.new_full((), root) / alpha
            else:
                factor = root.to(alpha.device) / alpha
            cache[slot] = factor
        return factor

    def fetch_host(self) -> None:
        """Copy the last recompute's betas, branch alphas and branch factors to the host: one host-device
        sync for all of them (the scaler calls this after a recompute step with ``update_every > 1``)."""
        last = self.last
        scalars = [b for b in last.beta if b is not None] + [a for a in last.branch_alpha if a is not None]
        vectors = [f for f in last.branch_factors if f is not None]
        if not scalars and not vectors:
            self.host = HostScales([1.0] * len(last.beta), [], [])
            return
        if len({v.device for v in scalars + vectors}) > 1:  # a model spread over devices
            device = (scalars + vectors)[0].device
            scalars, vectors = [v.to(device) for v in scalars], [v.to(device) for v in vectors]
        # a few ops for all of them (one view per 0-dim tensor would be dozens): stack, cat, one copy
        parts = [torch.stack(scalars).float()] if scalars else []
        parts += [torch.cat(vectors).float()] if vectors else []
        flat = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().tolist()
        n_beta = sum(b is not None for b in last.beta)
        betas, alphas = iter(flat[:n_beta]), iter(flat[n_beta : len(scalars)])
        factors_it = iter(flat[len(scalars) :])
        beta = [next(betas) if b is not None else 1.0 for b in last.beta]
        factors = [
            [next(factors_it) for _ in range(f.numel())] if f is not None else None
            for f in last.branch_factors
        ]
        branch_alpha = [next(alphas) if a is not None else None for a in last.branch_alpha]
        self.host = HostScales(beta, branch_alpha, factors)

    def rescaled(self, index: int) -> torch.Tensor | None:
        """Whether branch ``index``'s incoming gradients had different alphas at the last recompute."""
        entry = self.last.branch_rescaled[index]
        if entry is None:
            return None
        alphas, common = entry
        return (alphas != common).any()


class LayerConstants:
    """Algorithm 4's per-layer constants, and the weights' part of it for the current recompute pass.

    ``prepare(weights)`` puts them where the coming backward pass computes its statistics (the devices, and
    float64 for float64 weights else float32): per (device, dtype) a ``[points, 4]`` table of ``(A
    sqrt(n_g), B, scale cap, accumulation cap)`` for the output sizes ``n_g`` the forward pass recorded
    (:func:`adaloss.adaptive.rules.weight_factors`), a 0-dim 1 and the reference rule's ``[1, 0, 0, 0,
    0]``. The scaler calls it from ``scale()``, so a host-to-device copy happens there, before the backward
    pass, and only when a table is new (cached by the sizes). ``factors_for(k)`` gives point ``k``'s weight
    factors, computed for every recorded point at once on the first call of a pass.
    """

    def __init__(self, rule: ScaleRule) -> None:
        self.rule = rule
        self.points: list[GemmPoint] = []
        self.n_g: list[int] = []  # each point's output size in its latest recorded forward pass
        self.fwd_weight: list[torch.Tensor | None] = []  # the weight each point's forward used
        self._factors: list[torch.Tensor | None] | None = None
        self._table: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._tables: dict[tuple[torch.device, torch.dtype], dict[tuple, torch.Tensor]] = {}
        self._one: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def add_point(self, point: GemmPoint) -> None:
        self.points.append(point)
        self.n_g.append(1)
        self.fwd_weight.append(None)
        self._table, self._tables = {}, {}

    def record(self, index: int, weight: torch.Tensor, n_g: int) -> None:
        """The forward pass of point ``index`` used ``weight`` and made ``n_g`` outputs."""
        self.fwd_weight[index] = weight
        self.n_g[index] = n_g

    def forget_weights(self) -> None:
        self.fwd_weight = [None] * len(self.fwd_weight)
        self._factors = None

    def prepare(self, weights: list[torch.Tensor]) -> None:
        self._factors = None
        sizes = tuple(self.n_g)
        for w in weights:
            key = (w.device, _stat_dtype(w.dtype))
            tables = self._tables.setdefault(key, {})
            if sizes not in tables:
                if len(tables) >= 4:  # a few batch geometries at most (e.g. a last partial batch)
                    tables.pop(next(iter(tables)))
                rows = [self._row(i) for i in range(len(self.points))]
                tables[sizes] = host_to_device(rows, key[1], key[0]).reshape(-1, 4)
            self._table[key] = tables[sizes]
            if key not in self._one:
                self._one[key] = torch.ones((), dtype=key[1], device=key[0])
                _low(key[1], str(key[0]))  # made now, not in the backward pass

    def _row(self, index: int) -> list[float]:
        a, b = self.points[index].constants
        return [self.rule.lower_constant(a, self.n_g[index]), b, *self.rule.caps]

    def _rows(self, indices: list[int], weight: torch.Tensor) -> torch.Tensor:
        """The table rows of points ``indices`` for statistics of ``weight`` (made here if ``prepare`` did
        not, for direct use of the ops outside a scaler)."""
        key = (weight.device, _stat_dtype(weight.dtype))
        if key not in self._table:
            self.prepare([weight])
        table = self._table[key]
        if indices == list(range(len(self.points))):
            return table
        if len(indices) == 1:
            return table[indices[0] : indices[0] + 1]
        return torch.stack([table[i] for i in indices])

    def one(self, weight: torch.Tensor) -> torch.Tensor:
        """A 0-dim 1 where ``weight``'s statistics are taken (:func:`adaloss.adaptive.rules.grad_stats`)."""
        key = (weight.device, _stat_dtype(weight.dtype))
        if key not in self._one:
            self.prepare([weight])
        return self._one[key]

    def layer_factors(self, index: int, weight: torch.Tensor) -> torch.Tensor:
        """Point ``index``'s weight factors from ``weight`` alone (a point whose forward was not recorded,
        or a distributed pass). No host sync, no host-to-device copy once the constants are prepared."""
        return weight_factors([weight], self._rows([index], weight))[0]

    def factors_for(self, index: int) -> torch.Tensor | None:
        """Point ``index``'s weight factors for Algorithm 4, computed for every recorded point at once on
        the first call of a recompute pass, per (device, dtype) group: three ``_foreach`` calls and a few
        vector ops. ``None`` if the point's forward was not recorded (then use :meth:`layer_factors`)."""
        if self._factors is None:
            self._factors = [None] * len(self.fwd_weight)
            groups: dict[tuple, list[int]] = {}
            for i, w in enumerate(self.fwd_weight):
                if w is not None:
                    groups.setdefault((w.device, w.dtype), []).append(i)
            for idx in groups.values():
                weights = [self.fwd_weight[i] for i in idx]
                rows = weight_factors(weights, self._rows(idx, weights[0])).unbind(0)
                for i, row in zip(idx, rows, strict=True):
                    self._factors[i] = row
            self.fwd_weight = [None] * len(self.fwd_weight)  # do not keep the weight copies alive
        return self._factors[index]


# --------------------------------------------------------------------------------------------------------
# GEMM


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
# one call that says whether any device's autocast is on (most passes: no), before the per-device question
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _conv_forward(x, w, b, spec):
    return _CONV[spec["dims"]](x, w, b, spec["stride"], spec["padding"], spec["dilation"], spec["groups"])


def _conv_transpose_forward(x, w, b, spec):
    conv = _CONV_T[spec["dims"]]
    return conv(
        x, w, b, spec["stride"], spec["padding"], spec["output_padding"], spec["groups"], spec["dilation"]
    )


def _conv_backward(grad, x, w, spec, mask):
    # ``.default`` skips the overload resolution of the packet (a few microseconds per call)
    return torch.ops.aten.convolution_backward.default(grad, x, w, None, *spec["backward_args"], mask)


class ScaledGEMM(torch.autograd.Function):
    """A conv or linear layer whose backward pass is Algorithm 3 with Algorithm 4's local scale.

    ``spec`` describes the layer (``kind``: "linear" | "conv" | "conv_transpose", strides, padding, ...).
    In emulation it rounds like :class:`~adaloss.numerics.emulation.EmulatedAutocast` would around a GEMM:
    the weight copy, the output, the beta-scaled gradient used for the input gradient, and the weight
    gradient before it is brought to the root scale in the FP32 master gradient; the incoming gradient
    arrives already rounded (and counted for telemetry) by the :class:`GradRound` node on its output. Under
    autocast (CUDA, or the CPU's own FP16/BF16) it computes in the autocast dtype explicitly, backward pass
    included. ``record`` (grad mode was on at the call) lets the forward pass leave its weight in the state
    for the batched weight statistics. ``carried``: the parameters of the module the layer feeds directly
    (``GemmPoint.carried``, a batch norm after a conv); the node returns a view of each beside ``y`` and
    brings their gradients to the root scale as :class:`ParamUnscale` would (the module's backward pass
    runs just before this one, and its gradient carries this layer's ``alpha_j``): one Python node fewer
    per such module.

    Per backward call, beyond what the plain layer does: on a recompute pass the gradient's statistics (two
    reductions) and the beta arithmetic (about ten 0-dim ops, :meth:`adaloss.adaptive.rules.ScaleRule.beta`);
    on every pass one multiply of the incoming gradient by beta (skipped when a host beta is 1) and one of
    the weight gradient by ``alpha_{N+1} / alpha_j`` (skipped when it is a host 1). No host sync.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x, weight, bias, point: GemmPoint, state: AdaptiveState, spec: dict, record: bool, *carried
    ):
        # Torch-function modes (the CPU emulation's) off: every op here, even ``.dtype``, would otherwise
        # take a Python round trip through the mode; the emulation's rounding is done explicitly below.
        with torch._C.DisableTorchFunction():
            y = ScaledGEMM._forward(ctx, x, weight, bias, point, state, spec, record)
            if not carried:
                return y
            ctx.set_materialize_grads(False)  # as in ParamUnscale
            return (y, *_param_views(ctx, carried))

    @staticmethod
    def _forward(ctx, x, weight, bias, point, state, spec, record):
        emu = active_emulation()
        fmt = emu.fmt if emu is not None else None
        # With a gradient format, GradRound (applied to this op's output by AdaptiveGEMM) rounds the incoming
        # gradient and feeds the probe; without one (FP32 telemetry) the probe is fed here.
        ctx.grad_fmt = emu.grad_fmt if emu is not None else None
        ctx.probe = emu.probe_for(point.name) if emu is not None and ctx.grad_fmt is None else None
        ctx.point, ctx.state, ctx.spec = point, state, spec
        ctx.x_dtype = x.dtype
        ctx.w_dtype = weight.dtype  # the master weight's dtype: parameter gradients are returned in it
        # Under autocast (any device type: CUDA, or the CPU's real FP16/BF16 kernels) the layer computes in
        # the autocast dtype, and so does its backward pass, which autocast does not cover: cast explicitly.
        if _ANY_AUTOCAST() and torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        if fmt is not None:
            if not is_low_precision(x):  # usually already stored in the format by its producer
                x = round_to_format(x, fmt)
            weight = round_to_format(weight, fmt)
            bias = round_to_format(bias, fmt) if bias is not None else None
        # With an FP8 recipe's quantizer (precision.grad_scaling) the weight and bias gradients are stored
        # through it, each at a site of its own, as the plain emulation stores them (None: plain rounding).
        sites = (None, None)
        if emu is not None and emu.grad_quantizer is not None and record:
            sites = (emu.grad_site(weight), emu.grad_site(bias) if bias is not None else None)
        ctx.sites = sites
        if spec["kind"] == "linear":
            y = F.linear(x, weight, bias)
        elif spec["kind"] == "conv":
            y = _conv_forward(x, weight, bias, spec)
        else:
            y = _conv_transpose_forward(x, weight, bias, spec)
        if fmt is not None:
            y = mark_low_precision(round_to_format(y, fmt))
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        if record:
            state.constants.record(point.index, weight, y.numel())
        return y

    @staticmethod
    def backward(ctx, delta, *carried):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            if not carried:
                return ScaledGEMM._backward(ctx, delta)
            grads = ScaledGEMM._backward(ctx, delta) if delta is not None else (None,) * 7
            return (*grads, *_to_root_each(ctx.state, ctx.point.carried, carried))

    @staticmethod
    def _backward(ctx, delta):
        # ``delta`` is already in the gradient format (GradRound rounded it).
        x, w = ctx.saved_tensors
        point, state = ctx.point, ctx.state
        alpha_j = state.read_alpha(point.in_slot, point.name)
        k = point.index
        if ctx.probe is not None:
            ctx.probe.record(delta)
        if delta.dtype != w.dtype:
            delta = delta.to(w.dtype)
        beta = state.point_beta(k, lambda: gemm_beta(state, k, w, delta, alpha_j))
        state.current.alpha[point.out_slot] = alpha_j * beta
        return ScaledGEMM._gradients(ctx, delta, x, w, state.root_over(point.in_slot, point.name), beta)

    @staticmethod
    def _gradients(ctx, delta, x, w, to_root, beta):
        """Input, weight and bias gradients from the (rounded) ``delta`` and the layer's beta (Algorithm 3).

        The input gradient is ``Backprop(beta * delta)``: the gradient is scaled, stored in the gradient
        format (an FP16 product beyond 65504 becomes infinite, as in FP16 training), then multiplied by the
        weight. The weight and bias gradients come from ``delta``, are rounded to the gradient format, and
        are multiplied by ``to_root = alpha_{N+1} / alpha_j`` in the master dtype, so that they carry the
        root scale as every parameter gradient does (exact: a power of two).
        """
        point, state, spec, grad_fmt = ctx.point, ctx.state, ctx.spec, ctx.grad_fmt
        grad_x = grad_w = grad_b = None
        needs = ctx.needs_input_grad
        need_x = needs[0]
        need_w = needs[1] or (ctx.has_bias and needs[2])
        need_b = need_w and ctx.has_bias
        scaled = delta
        if need_x and not _is_one(beta):
            scaled = delta * (beta if isinstance(beta, float) else beta.to(delta.dtype))
            # Stored in the gradient format. Under a quantizer's scales ``delta`` is already a stored value
            # (payload times its scale), and ``beta * delta`` is that payload with the scale times beta, a
            # power of two: rounding it again without the scale would flush what the scale kept.
            if grad_fmt is not None and ctx.sites[0] is None:
                scaled = round_to_format(scaled, grad_fmt)
        if spec["kind"] == "linear":
            if need_x:
                grad_x = scaled.matmul(w)
            if need_w:
                d2 = delta.reshape(-1, delta.shape[-1])
                grad_w = d2.t().matmul(x.reshape(-1, x.shape[-1]))
                grad_b = d2.sum(0) if ctx.has_bias else None
        elif scaled is not delta:
            grad_x = _conv_backward(scaled, x, w, spec, [True, False, False])[0]
            if need_w:
                _, grad_w, grad_b = _conv_backward(delta, x, w, spec, [False, True, need_b])
        else:
            # One call for both: the weight gradient depends on delta and x only, not on the weight.
            grad_x, grad_w, grad_b = _conv_backward(delta, x, w, spec, [need_x, need_w, need_b])
        if need_x:
            if grad_x.dtype is not ctx.x_dtype:
                grad_x = grad_x.to(ctx.x_dtype)
            if point.feeds is not None:
                state.current.fresh[point.feeds] = grad_x
        if need_w:
            grad_w = _to_root(grad_w, grad_fmt, ctx.w_dtype, to_root, ctx.sites[0])
            if grad_b is not None:
                grad_b = _to_root(grad_b, grad_fmt, ctx.w_dtype, to_root, ctx.sites[1])
        return grad_x, grad_w, grad_b, None, None, None, None


def gemm_beta(
    state: AdaptiveState, k: int, w: torch.Tensor, delta: torch.Tensor, alpha_j: torch.Tensor | float
) -> torch.Tensor:
    """Algorithm 4 at GEMM point ``k`` on device tensors: the weight's factors (batched over the pass's
    layers unless the statistics are reduced across ranks), the gradient's statistics (all-reduced under
    DDP), then :func:`adaloss.adaptive.rules.gemm_loss_scale`. No host sync and no host-to-device copy
    (the constants were prepared when the scaler was armed)."""
    consts = state.constants
    factors = consts.factors_for(k) if state.reduce_fn is None else None
    if factors is None:
        factors = consts.layer_factors(k, w)
    stats = grad_stats(delta, alpha_j, consts.one(w))
    if state.reduce_fn is not None:
        n_g = delta.numel()
        ms_g, max_g = state.reduce_fn(stats[0].square() / n_g, stats[1])
        max_g = max_g.reshape(())
        stats = torch.stack([torch.sqrt(ms_g * n_g).reshape(()), max_g, max_g, stats[3], stats[4]])
    return gemm_loss_scale(w, delta, state.rule, factors=factors, stats=stats)


def _to_root(
    grad: torch.Tensor,
    grad_fmt: Any,
    master: torch.dtype,
    to_root: torch.Tensor | float,
    site: Any = None,
) -> torch.Tensor:
    """A parameter gradient computed from ``delta``: stored in the gradient format (through ``site``'s
    quantizer under an FP8 recipe, :func:`adaloss.numerics.quantizers.quantize_grad`), cast to the master
    dtype and multiplied by ``alpha_{N+1} / alpha_j`` (in place: every tensor here is fresh)."""
    if grad_fmt is not None:
        grad = quantize_grad(grad, grad_fmt, site)
    if grad.dtype != master:
        grad = grad.to(master)
    elif grad._base is not None:
        grad = grad.clone()  # a view (e.g. of a reshaped matmul): do not write into its base
    if _is_one(to_root):
        return grad
    return grad.mul_(to_root if isinstance(to_root, float) else to_root.to(master))


class GradRound(torch.autograd.Function):
    """Identity forward; backward stores the gradient reaching a GEMM point's output in the gradient format
    (:func:`adaloss.numerics.quantizers.quantize_grad`: plain rounding, or the FP8 recipe's quantizer).

    A separate autograd node rather than a step inside :class:`ScaledGEMM`'s backward, for memory: the
    engine frees the unrounded gradient as soon as this node returns, so the GEMM's own backward (whose
    input gradient is activation-sized) reuses that memory, as the plain layer's rounding node and
    convolution backward do. The probe (underflow telemetry) compares the gradient before and after
    rounding here.
    """

    @staticmethod
    def forward(ctx, y, grad_fmt, probe, site=None):  # type: ignore[override]
        ctx.grad_fmt, ctx.probe, ctx.site = grad_fmt, probe, site
        with torch._C.DisableTorchFunction():
            return mark_low_precision(y.view_as(y))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            rounded = quantize_grad(grad, ctx.grad_fmt, ctx.site, ctx.probe)
        return rounded, None, None, None

    @staticmethod
    def wrap(y: torch.Tensor, point: GemmPoint) -> torch.Tensor:
        """``y`` behind a GradRound node when an emulation with a gradient format is active and grad is on."""
        emu = active_emulation()
        if emu is None or emu.grad_fmt is None or not torch.is_grad_enabled():
            return y
        return GradRound.apply(y, emu.grad_fmt, emu.probe_for(point.name), emu.grad_site(y))


def _alias(y: torch.Tensor) -> torch.Tensor:
    """A view of ``y`` for an identity node's output, stored in the format exactly when ``y`` is."""
    with torch._C.DisableTorchFunction():
        out = y.view_as(y)
        if is_low_precision(y):
            mark_low_precision(out)
    return out


def _param_views(ctx: Any, params: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The views an identity node returns for parameters (:class:`ParamUnscale`, or the parameters a
    :class:`ScaledGEMM` carries); a frozen parameter's view is marked as needing no gradient (else its
    module would compute one). Call with torch-function modes off (``requires_grad`` included)."""
    views = tuple(p.view_as(p) for p in params)
    frozen = [v for v, p in zip(views, params, strict=True) if not p.requires_grad]
    if frozen:
        ctx.mark_non_differentiable(*frozen)
    return views


def _to_root_each(
    state: AdaptiveState, points: tuple[UnscalePoint, ...], grads: tuple[torch.Tensor | None, ...]
) -> list[torch.Tensor | None]:
    """Each parameter gradient of a use times ``alpha_{N+1} / alpha`` of its point, in its own dtype (none
    when the factor is a host 1; None stays None). Call with torch-function modes off."""
    out: list[torch.Tensor | None] = []
    for point, grad in zip(points, grads, strict=True):
        if grad is not None:
            factor = state.root_over(point.in_slot, point.name)
            if not _is_one(factor):
                grad = grad * (factor if isinstance(factor, float) else factor.to(grad.dtype))
        out.append(grad)
    return out


class ParamUnscale(torch.autograd.Function):
    """Identity on the parameters of one use outside a GEMM point (:class:`UnscalePoint`: a batch norm's
    affine parameters, a tied embedding), one point per parameter; the backward pass multiplies each
    parameter's gradient from that use by ``alpha_{N+1} / alpha`` of its point, in the parameter's own
    dtype, so it joins the other contributions in ``.grad`` at the root scale, as every parameter gradient
    leaves the backward pass. One node for all the parameters of a call (a batch norm's weight and bias
    together). Cost: one pass over each gradient (none when the factor is a host 1); no host sync.

    A module fed directly by a conv or linear layer (a batch norm after a conv) needs no node of its own:
    the layer's :class:`ScaledGEMM` carries its parameters (``GemmPoint.carried``) and does the same in
    its backward pass, which runs right after the module's and reads the same alpha."""

    @staticmethod
    def forward(ctx, points: tuple[UnscalePoint, ...], state: AdaptiveState, *params):  # type: ignore[override]
        ctx.points, ctx.state = points, state
        ctx.set_materialize_grads(False)  # a parameter without a gradient from this use gets None, not zeros
        with torch._C.DisableTorchFunction():  # as in ScaledGEMM.forward (``requires_grad`` included)
            return _param_views(ctx, params)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            return (None, None, *_to_root_each(ctx.state, ctx.points, grads))


class GradProbe(torch.autograd.Function):
    """Identity; on the way back, counts the underflow of the gradient passing through (telemetry of an
    activation-by-activation product's output gradient, which the emulation rounds just after this node
    in the backward pass) and passes it on unchanged. ``operands`` (an :class:`AttentionOperands`, or
    None) counts the attention scores' gradient as well. Telemetry steps only."""

    @staticmethod
    def forward(ctx, y, probe, fmt, operands=None):  # type: ignore[override]
        ctx.probe, ctx.fmt, ctx.operands = probe, fmt, operands
        return _alias(y)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        with torch._C.DisableTorchFunction(), torch.no_grad():
            rounded = round_to_format(grad, ctx.fmt) if ctx.fmt is not None else None
            if ctx.probe is not None:
                ctx.probe.record(grad, rounded)
            if ctx.operands is not None:
                ctx.operands.record(rounded if rounded is not None else grad, 1.0)
        return grad, None, None, None


# --------------------------------------------------------------------------------------------------------
# Activation-by-activation products


def product_beta(
    pairs: list[tuple[torch.Tensor, float, int, torch.Tensor]],
    rule: ScaleRule,
    alpha_in: torch.Tensor | float,
    reduce_fn: Any = None,
) -> torch.Tensor:
    """The beta of an activation-by-activation product: Algorithm 4 for each input gradient the product
    makes, with the other operand in the weight's place, combined into one scale for all of them.

    ``pairs``: per input gradient ``(operand, multiplier, F, delta)``: the operand it is multiplied by
    (times the Python float ``multiplier``, e.g. attention's ``1/sqrt(d)``), its backward fan-in, and the
    gradient it is computed from. Each gives Algorithm 4's underflow bound ``lower_i`` and overflow bound
    ``upper_i`` (module docstring of :mod:`adaloss.adaptive.rules`; the layer constants come from the
    operand's size, which varies with the batch, so they are Python floats here rather than a prepared
    table). The product's beta is the rule's beta for ``lower = max_i lower_i`` and ``upper = min_i
    upper_i``: as large as the most demanding input asks, as long as no input passes its own overflow
    bound (the branch point all of them would otherwise need, Algorithm 5, decided with the bounds instead
    of the gradients, which exist only after the product's backward). Bounded, rounded down to a power of
    two and 1 for an all-zero or non-finite gradient, as every beta. Under ``torch.distributed``
    (``reduce_fn``) every tensor's second moment and max are combined over the ranks first, as the
    activations differ between ranks. Cost: two reductions per tensor and a few scalar ops; no host sync.
    """
    lowers, uppers = [], []
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a tensor in several pairs is read once

    def norm_and_max(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if id(t) not in seen:
            seen[id(t)] = _norm_and_max(t, reduce_fn)
        return seen[id(t)]

    for w, multiplier, fan_in, delta in pairs:
        a_const, b_const = rule.layer_constants(w.numel(), fan_in)
        (w_norm, w_max), (d_norm, d_max) = norm_and_max(w), norm_and_max(delta)
        lowers.append((a_const / multiplier) * math.sqrt(delta.numel()) / (w_norm * d_norm))
        uppers.append((b_const / multiplier) / (w_max * d_max))
    lower = torch.stack(lowers).amax()
    upper = torch.stack(uppers).amin()
    # the rule's 5-vectors (ScaleRule): q = [lower, upper, upper, scale cap, accumulation cap / alpha_in]
    scale_cap, accum_cap = rule.caps
    factors = torch.stack([lower, upper, upper, lower.new_full((), scale_cap), lower.new_full((), accum_cap)])
    alpha = alpha_in.reshape(1).to(lower.dtype) if isinstance(alpha_in, torch.Tensor) else None
    stats = torch.cat([lower.new_ones(4), alpha if alpha is not None else lower.new_full((1,), alpha_in)])
    return rule.beta(factors, stats)


def _norm_and_max(t: torch.Tensor, reduce_fn: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(||t||, max|t|)`` in the statistics dtype; over all ranks with ``reduce_fn``. On the CPU a strided
    view (the heads of a split projection) is copied first: the norm's strided CPU path takes 3.5x the copy
    and the norm together (tiny GPT's keys, 131,072 floats: 117 us against 33 us, one core). Elsewhere the
    view is reduced as it is (unmeasured there, and the copy would be one more pass)."""
    red = None if t.dtype in (torch.float32, torch.float64) else torch.float32
    if t.device.type == "cpu" and not t.is_contiguous():
        t = t.contiguous()
    norm = torch.linalg.vector_norm(t, dtype=red)
    top = max_magnitude(t).to(norm.dtype)
    if reduce_fn is not None:
        n = t.numel()
        ms, top = reduce_fn(norm.square() / n, top)
        norm, top = torch.sqrt(ms * n).reshape(()), top.reshape(())
    return norm, top


class MatmulOperands:
    """What :func:`product_beta` needs of ``y = a @ b`` (``torch.matmul``, ``@``, ``bmm``, ``mm``, and the
    ``input @ weight^T`` of an ``F.linear`` whose weight is an activation): ``da = delta b^T`` sums
    ``b.shape[-1]`` products, ``db = a^T delta`` sums ``a.shape[-2]``. Only the inputs that need a gradient
    count. The operands are the ones the product saved for its own backward: no extra memory."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a.detach(), b.detach()
        self.need = (a.requires_grad, b.requires_grad)

    def pairs(self, delta: torch.Tensor) -> list[tuple[torch.Tensor, float, int, torch.Tensor]]:
        a, b = self.a, self.b
        out = []
        if self.need[0]:
            out.append((b, 1.0, b.shape[-1] if b.dim() > 1 else 1, delta))
        if self.need[1]:
            out.append((a, 1.0, a.shape[-2] if a.dim() > 1 else 1, delta))
        return out

    def record(self, delta: torch.Tensor, beta: torch.Tensor | float) -> None:
        """Nothing beyond the output gradient (counted where it is rounded)."""


class AttentionOperands:
    """What :func:`product_beta` needs of scaled dot-product attention ``O = softmax(s Q K^T + M) V``
    (``s = 1/sqrt(d)`` unless given): its four products, ``dP = dO V^T`` (F = d), ``dV = P^T dO``
    (F = queries), ``dQ = s dS K`` (F = keys), ``dK = s dS^T Q`` (F = queries), with
    ``dS = P (dP - rowsum(dP P))``. ``P`` and ``dS`` exist only inside the attention kernel, so they are
    recomputed from the saved query, key and value (recompute passes, and telemetry steps: an attention
    forward and half a backward; attention dropout is not replayed, so its statistics are those without
    dropout). On a telemetry step :meth:`record` counts what storing ``dS`` at the scale the kernel sees it
    (the gradient times beta) would lose: GPU attention kernels store it in half precision before its
    two products; the emulation keeps it in FP32 inside the kernel, as the CPU's does."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        scale: float | None,
        scores_probe: Any = None,
        grad_fmt: Any = None,
    ) -> None:
        self.q, self.k, self.v = q.detach(), k.detach(), v.detach()
        self.mask = None if mask is None else mask.detach()
        self.is_causal = is_causal
        self.scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        self.scores_probe, self.grad_fmt = scores_probe, grad_fmt
        self._scores: torch.Tensor | None = None

    def _recompute(
        self, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k, v, P, dS)`` in float32 (float64 for float64 inputs), heads of k/v repeated to q's."""
        dtype = torch.promote_types(self.q.dtype, torch.float32)
        q, k, v, d_out = (t.to(dtype) for t in (self.q, self.k, self.v, delta))
        if k.dim() > 2 and k.shape[-3] != q.shape[-3]:  # grouped-query attention
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        # every score-sized tensor below is made here and updated in place: a pass over the scores costs
        # more than the products that make them (T x T against T x d)
        s = q.matmul(k.transpose(-2, -1)).mul_(self.scale)
        if self.is_causal:  # an additive -inf mask: a broadcast masked_fill_ takes 4x longer on the CPU
            drop = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).triu_(1)
            s.add_(torch.zeros(drop.shape, dtype=s.dtype, device=s.device).masked_fill_(drop, -math.inf))
        if self.mask is not None:
            s = s.masked_fill_(~self.mask, -math.inf) if self.mask.dtype == torch.bool else s.add_(self.mask)
        p = torch.softmax(s, dim=-1)
        d_p = d_out.matmul(v.transpose(-2, -1))
        # dS = P (dP - rowsum(dP P)): softmax's own backward kernel, one pass (four as separate ops)
        d_s = torch.ops.aten._softmax_backward_data(d_p, p, -1, p.dtype)
        return k, v, p, d_s

    def pairs(self, delta: torch.Tensor) -> list[tuple[torch.Tensor, float, int, torch.Tensor]]:
        k, v, p, d_s = self._recompute(delta)
        self._scores = d_s
        q = self.q
        n_q, n_k = q.shape[-2], k.shape[-2]
        return [
            (v, 1.0, q.shape[-1], delta),  # dP = dO V^T
            (p, 1.0, n_q, delta),  # dV = P^T dO
            (k, self.scale, n_k, d_s),  # dQ = s dS K
            (q, self.scale, n_q, d_s),  # dK = s dS^T Q
        ]

    def record(self, delta: torch.Tensor, beta: torch.Tensor | float) -> None:
        if self.scores_probe is None:
            return
        d_s = self._scores if self._scores is not None else self._recompute(delta)[3]
        self._scores = None
        self.scores_probe.record(d_s * beta)


class ScaledProduct(torch.autograd.Function):
    """Algorithm 3 at an activation-by-activation product: ``Backprop(beta * delta)``, beta from
    :func:`product_beta`.

    The transform wires a product like a GEMM point (a :class:`GemmPoint` of kind "product"): the gradient
    of its output arrives with ``alpha_j``, and every input gradient it makes leaves with ``alpha_j *
    beta``. It sits on the product's output: its forward is the identity (and, in emulation, the output's
    rounding to the format); its backward receives ``delta`` already stored in the gradient format (by the
    :class:`GradRound` on its output) and hands ``beta * delta`` to the product's own backward, whose input
    gradients, linear in ``delta``, then carry ``beta`` (exact: a power of two). Multiplying before the
    product's backward rather than after keeps the scaled values inside an attention kernel too (``dS``).
    ``operands``: :class:`MatmulOperands` or :class:`AttentionOperands`. Betas are computed on recompute
    passes and reused in between, as a layer's; no host sync (host floats on the CPU's host path).
    Per backward call: one multiply of the output gradient by beta (skipped when a host beta is 1); on a
    recompute pass the statistics of the operands and gradients (an attention call also recomputes its
    scores, see :class:`AttentionOperands`).
    """

    @staticmethod
    def forward(ctx, y, point: GemmPoint, state: AdaptiveState, operands: Any, round_fmt: Any):  # type: ignore[override]
        ctx.point, ctx.state, ctx.operands = point, state, operands
        with torch._C.DisableTorchFunction():
            if round_fmt is None:
                return _alias(y)
            return mark_low_precision(round_to_format(y, round_fmt))

    @staticmethod
    def backward(ctx, delta):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            point, state, operands = ctx.point, ctx.state, ctx.operands
            k = point.index
            alpha = state.read_alpha(point.in_slot, point.name)
            beta = state.point_beta(
                k, lambda: product_beta(operands.pairs(delta), state.rule, alpha, state.reduce_fn)
            )
            ctx.operands = None
            state.current.alpha[point.out_slot] = alpha * beta
            operands.record(delta, beta)
            if isinstance(beta, float):
                return (delta if beta == 1.0 else delta * beta), None, None, None, None
            return delta * beta.to(delta.dtype), None, None, None, None


# --------------------------------------------------------------------------------------------------------
# Branches


class Rescale(torch.autograd.Function):
    """Identity in the forward pass; in the backward pass, Algorithm 5 over the gradients of its outputs.

    For a tensor with n consumers the transform calls ``Rescale.apply(point, state, x, x, ..., x)`` and
    hands one output to each consumer, so the n gradients arrive here together; each is brought to the
    common alpha and they are summed here, the rescaling fused into the sum (``torch.add(a, b, alpha=f)`` or
    ``addcmul``) so no separately scaled copy is made; the sum is returned for the first input and ``None``
    for the others, so autograd has nothing left to add. For an op with several outputs (split, chunk) it
    is called with those outputs instead, and each gradient is rescaled on its own.
    """

    @staticmethod
    def forward(ctx, point: BranchPoint, state: AdaptiveState, *xs):  # type: ignore[override]
        ctx.point, ctx.state = point, state
        ctx.shared = len(xs) > 1 and all(x is xs[0] for x in xs)
        # An output no gradient reaches (a head the loss does not use) arrives as None, not as zeros: its
        # consumer emitted no alpha, and it must not count in Algorithm 5.
        ctx.set_materialize_grads(False)
        with torch._C.DisableTorchFunction():  # as in ScaledGEMM.forward
            outs = tuple(x.view_as(x) for x in xs)
            emu = active_emulation()
            if emu is not None and emu.fmt is not None:
                # A view holds its input's values: stored in the format only if the input was (an
                # unrounded FP32 input, the network's own for one, still gets rounded by its consumers).
                for x, o in zip(xs, outs, strict=True):
                    if is_low_precision(x):
                        mark_low_precision(o)
        return outs

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            return Rescale._backward(ctx, *grads)

    @staticmethod
    def _backward(ctx, *grads):
        point, state = ctx.point, ctx.state
        k = point.index
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return (None, None, *grads)
        if torch.is_grad_enabled():
            state.graph_built = True
        floats = state.current.floats
        if floats is not None:  # reuse pass with host copies, or a plain pass: floats
            common, host = floats.branch_alpha[k], floats.branch_factors[k]
            if host is None:
                raise unplanned_point(point.name)
            factors: list[Any] = [host[i] for i in present]
        else:
            common, vec = branch_scales(state, point, grads, present)
            factors = list(vec.unbind(0))
        state.current.alpha[point.out_slot] = common
        # A gradient made by a GEMM point feeding this branch directly is ours to write into.
        owned = None
        fresh = state.current.fresh
        if fresh:
            for i in range(len(grads)):
                t = fresh.pop((k, i), None)
                if owned is None and t is not None and t is grads[i]:
                    owned = i
        factor = dict(zip(present, factors, strict=True))
        out: list[torch.Tensor | None] = list(grads)
        if ctx.shared:
            order = present if owned is None else [owned, *(i for i in present if i != owned)]
            total, fresh, start = None, False, 0
            if owned is not None:
                total, fresh, start = grads[owned], True, 1
                f = factor[owned]
                if not _is_one(f):
                    nxt = order[1] if len(order) > 1 else None
                    if nxt is not None and _is_one(factor[nxt]):  # one pass: grads[nxt] + f * total
                        total = torch.add(grads[nxt], total, alpha=f, out=total)
                        start = 2
                    else:
                        total = total.mul_(f)
            for i in order[start:]:
                total, fresh = _accumulate(total, fresh, grads[i], factor[i])
            for i in present:
                out[i] = None
            out[order[0]] = total
        else:
            for i in present:
                f = factor[i]
                if not _is_one(f):
                    out[i] = grads[i].mul_(f) if i == owned else grads[i] * f
        return (None, None, *out)


def branch_scales(
    state: AdaptiveState, point: BranchPoint, grads: tuple, present: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Branch point ``point``'s common alpha and the factors of its present inputs, as device tensors:
    Algorithm 5 (:func:`adaloss.adaptive.rules.branch_loss_scale`) on a recompute pass (or where no
    scales exist yet), the last recompute's otherwise. No host sync."""
    k = point.index
    last = state.last
    if not (state.current.recompute or last.branch_factors[k] is None):
        vec = last.branch_factors[k]
        if len(present) != len(grads):
            vec = torch.stack([vec[i] for i in present])
        return last.branch_alpha[k], vec
    alphas = [state.read_alpha(point.in_slots[i], point.name) for i in present]
    a = torch.stack([torch.as_tensor(x).float().reshape(()) for x in alphas])
    m = torch.stack([max_magnitude(grads[i]) for i in present]).float()  # one reduction per input
    if state.reduce_fn is not None:
        m = state.reduce_fn(None, m)[1]
    common = branch_loss_scale(a, m, state.u_max, state.rule.name)
    vec = common / a
    last.branch_alpha[k] = common
    last.branch_rescaled[k] = (a, common)
    if len(present) == len(grads):
        last.branch_factors[k] = vec
    else:  # element by element: indexing with a list would copy host data to the device
        full = torch.ones(len(grads), dtype=vec.dtype, device=vec.device)
        for i, v in zip(present, vec.unbind(0), strict=True):
            full[i] = v
        last.branch_factors[k] = full
    return common, vec


def _is_one(factor: torch.Tensor | float) -> bool:
    """Whether ``factor`` is known on the host to be exactly 1 (a device tensor never is)."""
    return isinstance(factor, float) and factor == 1.0


def _accumulate(
    total: torch.Tensor | None, fresh: bool, grad: torch.Tensor, factor: torch.Tensor | float
) -> tuple[torch.Tensor, bool]:
    """``total + factor * grad`` in one pass (``total`` is None for the first term); never writes ``grad``.

    ``fresh`` says whether ``total`` was made here (then it is updated in place). ``factor`` is a power of
    two, so ``factor * grad`` is exact and the fused op rounds once, as a separate multiply and add would.
    Returns the new total and whether it is fresh.
    """
    if isinstance(factor, float):
        if total is None:
            return (grad, False) if factor == 1.0 else (grad * factor, True)
        if fresh:
            return total.add_(grad, alpha=factor), True
        return torch.add(total, grad, alpha=factor), True
    if total is None:
        return grad * factor, True
    if fresh:
        return total.addcmul_(grad, factor), True
    return torch.addcmul(total, grad, factor), True
