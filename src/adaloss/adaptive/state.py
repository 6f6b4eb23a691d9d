"""What the adaptive scaler knows about an attached model: its scaling points, and their scales as device
tensors at fixed addresses.

The transform (:mod:`adaloss.adaptive.transform`) wires the points: every GEMM point and branch point
writes the alpha of the gradient it emits into its own *slot*, and reads the alpha of the gradient it
receives from the slot of whichever point emitted it (slot 0 holds the root scale ``alpha_{N+1}``). The
scales themselves live in :class:`ScaleBuffers`, preallocated when the model is attached: each alpha,
beta and branch factor is one element of a device tensor, which a recompute pass fills in place
(``copy_``) and every other pass reads. No Python float enters a backward pass and no backward pass
writes Python state, so a compiled or captured step reads the same addresses on every replay
(``torch.compile(..., fullgraph=True)`` traces it; a CUDA graph replays it).

The kind of each pass (:class:`PassKind`) is one value, ``AdaptiveState.kind``: fixed before its forward
pass by the scaler (from the iteration counter and the last step's outcome, both known on the host without
a sync), raised to a recompute by :class:`GradSignature`, and set by ``scale()`` for the backward pass it
arms (a plain pass after one that built a graph; a reuse for the further passes of the iteration). Each op
keeps the kind of its forward pass for its backward: one traced graph per kind, and no Python branch on
state computed after the forward (a plain pass, eager only, is read at the backward).

The host reads the buffers in one place, :meth:`AdaptiveState.snapshot` (one device-to-host copy of all of
them): reporting, telemetry and checkpoints take their values from it; nothing else keeps a host copy of a
scale. What the host derives from the buffers, the last snapshot (kept for the reuse steps after it, which
do not change the buffers) and ``units`` (which scales are exactly 1, so an eager reuse pass can skip
multiplying by them without a sync), is dropped in one place (:meth:`AdaptiveState.scales_written`) whenever
the buffers are written other than by reuse passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from adaloss.adaptive.rules import ScaleRule

__all__ = [
    "PASS_KINDS",
    "AdaptiveState",
    "BranchPoint",
    "GemmPoint",
    "GradSignature",
    "PassKind",
    "Points",
    "Reach",
    "ScaleBuffers",
    "ScaleSnapshot",
    "UnscalePoint",
]


class PassKind(StrEnum):
    """The kind of a pass (a ``str``: ``PassKind.REUSE == "reuse"``).

    ``RECOMPUTE``: Algorithms 4 and 5 compute new betas, branch factors and alphas, written into
    :class:`ScaleBuffers`; ``REUSE``: the buffers are read (the last recompute's scales; its alphas stay
    valid because a change of ``alpha_{N+1}`` always recomputes); ``PLAIN``: every beta and branch factor
    1, every gradient carries ``alpha_{N+1}`` (after a backward pass that built a graph, GradScaler's
    gradient-penalty recipe; eager only)."""

    RECOMPUTE = "recompute"
    REUSE = "reuse"
    PLAIN = "plain"


#: The kinds of pass, as strings (``scaler.last_pass`` takes these values).
PASS_KINDS = tuple(k.value for k in PassKind)


@dataclass
class GemmPoint:
    """A scaling point at one call of a conv/linear layer (a module called twice has two points), or at an
    activation-by-activation product (``kind="product"``: a matmul of two activations, or an attention
    call; see :class:`~adaloss.adaptive.ops.ScaledProduct`)."""

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
    """A branch point: one tensor feeding several consumers, or several outputs of one op. Its factors are
    ``ScaleBuffers.branch_factors[offset : offset + len(in_slots)]``."""

    index: int
    name: str
    in_slots: list[int] = field(default_factory=list)  # one per consumer
    out_slot: int = -1
    # the value turned out not to be a tensor (a shape, an int, a tuple of them passed along beside the
    # activations): no gradient ever reaches it, and it counts as no point without scales
    inert: bool = False
    offset: int = 0  # where its factors start in ScaleBuffers.branch_factors (set by allocate)


@dataclass
class UnscalePoint:
    """A non-GEMM use of a parameter that GEMM points also use (a token embedding whose weight is the output
    projection's): the gradient this use contributes is brought to the root scale by its own alpha in the
    backward pass (:class:`~adaloss.adaptive.ops.ParamUnscale`), as each GEMM call's contribution is, so the
    parameter's ``.grad`` sums true gradients."""

    index: int
    name: str  # the parameter's name, with "#k" for its k-th such use
    in_slot: int = -1  # slot holding the alpha of the gradient this use contributes


@dataclass
class Points:
    """What :func:`adaloss.adaptive.transform.attach_adaptive` wired, fixed once attached: the scaling
    points, the number of alpha slots (slot 0 is ``alpha_{N+1}``'s) and the GEMM layers' weights."""

    gemms: list[GemmPoint] = field(default_factory=list)
    branches: list[BranchPoint] = field(default_factory=list)
    unscales: list[UnscalePoint] = field(default_factory=list)
    num_slots: int = 1
    gemm_weights: list[torch.Tensor] = field(default_factory=list)


@dataclass
class ScaleBuffers:
    """Every scale of Algorithms 3-5, as float32 device tensors allocated once (their addresses never
    change; a compiled or captured step reads them there).

    ``alpha[s]``: the alpha of the gradient emitted into slot ``s`` (``alpha[0] = alpha_{N+1}``, the loss
    scale itself: the scaler keeps it here and nowhere else once attached); ``carried_root``: the
    ``alpha_{N+1}`` the last (not plain) backward pass carried, a record for reporting written by
    :meth:`AdaptiveState.arm` (``alpha[0]`` may have moved on since, at ``update()``);
    ``to_root[s] = alpha[0] / alpha[s]``, what brings a parameter gradient carrying ``alpha[s]`` to the
    root scale; ``beta[k]`` per GEMM point; ``branch_alpha[k]`` (the common alpha) and
    ``rescaled[k]`` (whether the incoming alphas differed) per branch point; ``branch_factors``: each
    branch's factors, one per consumer, from ``BranchPoint.offset``. Powers of two, so float32 holds them
    exactly for every model dtype. A recompute pass starts by filling ``beta``, ``branch_alpha`` and
    ``branch_factors`` with NaN (:meth:`AdaptiveState.arm`): a point no gradient reaches keeps NaN, which
    says so (``layer_betas`` leaves it out), and a later reuse pass that reaches it anyway makes NaN
    gradients, so that step is skipped like an overflow and the next one recomputes."""

    alpha: torch.Tensor
    to_root: torch.Tensor
    beta: torch.Tensor
    branch_alpha: torch.Tensor
    branch_factors: torch.Tensor
    rescaled: torch.Tensor
    carried_root: torch.Tensor

    @classmethod
    def allocate(cls, points: Points, device: torch.device) -> ScaleBuffers:
        n_factors = 0
        for branch in points.branches:
            branch.offset = n_factors
            n_factors += len(branch.in_slots)

        def vector(n: int, value: float) -> torch.Tensor:
            return torch.full((n,), value, dtype=torch.float32, device=device)

        buffers = cls(
            alpha=vector(points.num_slots, 1.0),
            to_root=vector(points.num_slots, 1.0),
            beta=vector(len(points.gemms), math.nan),
            branch_alpha=vector(len(points.branches), math.nan),
            branch_factors=vector(n_factors, math.nan),
            rescaled=torch.zeros(len(points.branches), dtype=torch.bool, device=device),
            carried_root=vector(1, 1.0),
        )
        for t in buffers.tensors().values():
            # fixed addresses, for the compiler too: Inductor's CUDA graphs (mode="reduce-overhead") then
            # read them in place instead of copying them in, and accept the recompute pass's writes
            torch._dynamo.mark_static_address(t)
        return buffers

    @property
    def device(self) -> torch.device:
        return self.alpha.device

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in ScaleBuffers.__dataclass_fields__}


class GradSignature:
    """Forward pre-hook of an attached model: records which tensors need gradients in this forward pass.

    Why: a point that no gradient reached in a recompute pass (a frozen layer, a model input used by two
    layers) has no scales, and reuse passes may go without them only while the same tensors need gradients
    (the traced graph is fixed, so then the same points are reached). The signature is the parameters'
    ``requires_grad`` flags and the forward's tensor inputs' flags. If it changed since the last recompute
    and some point has no scales, this forward pass becomes a recompute pass (``AdaptiveState.kind``).
    Cost: one pass over the parameters' flags per forward pass with grad enabled (22 us for ResNet-110's
    329 tensors on the project's CPU), read with torch-function modes off; a host sync only when the
    signature changed (to read which points have scales). Not traced when the model is compiled.
    """

    def __init__(self, state: AdaptiveState, params: list[torch.Tensor]) -> None:
        self.state = state
        self.params = params

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        # Compiled, the hook would make the graphs depend on Python state that changes between steps; a
        # compiled graph is guarded on the flags itself, and a point reached without scales makes NaN
        # gradients, a skipped step and a recompute (ScaleBuffers).
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        # Torch-function modes off: the hook runs inside the forward pass, where under the CPU emulation's
        # mode each ``requires_grad`` read would be a Python round trip (7 us each, 0.4 ms per ResNet-20 step)
        with torch._C.DisableTorchFunction():
            sig = (tuple(p.requires_grad for p in self.params), tuple(t.requires_grad for t in inputs))
        state, reach = self.state, self.state.reach
        state.forward_at = AdaptiveState.scale_calls
        if self.params and state.buffers.device != self.params[0].device:  # the model moved
            state.allocate(self.params[0].device)
        if reach.latest != sig:
            reach.latest = sig
        if state.kind is PassKind.REUSE and reach.at_recompute is not None and sig != reach.at_recompute:
            if state.has_unreached():
                state.kind = PassKind.RECOMPUTE
        return None


@dataclass
class Reach:
    """Which tensors needed gradients (:class:`GradSignature`) in the latest forward pass with grad enabled
    (``latest``) and in the forward pass of the last recompute (``at_recompute``; None: unknown). A point
    no gradient reached in that pass will not be reached while the two are equal (a traced graph)."""

    latest: tuple | None = None
    at_recompute: tuple | None = None


class AdaptiveState:
    """Per-model state of the adaptive scaler: ``rule`` (:class:`ScaleRule`), ``points`` (:class:`Points`,
    what the transform wired), ``buffers`` (:class:`ScaleBuffers`, every scale, ``alpha_{N+1}`` included, on
    the model's device: the only place a scale is kept), ``kind`` (the :class:`PassKind` of the current
    pass: see the module docstring), ``reach`` (:class:`Reach`), ``armed`` (``scale()`` was called this
    iteration, so a backward pass may run: not a pass kind), ``graph_built`` (a backward pass of this
    iteration ran with ``create_graph=True``, which makes the next one plain), ``reduce_fn`` (combines
    statistics over ranks under ``torch.distributed``, else None) and ``fresh`` (gradients a GEMM point made
    for a branch alone, eager passes only).
    """

    #: ``scale()`` calls of this process's adaptive scalers, attached or not (a clock for ``forward_at``)
    scale_calls = 0

    @classmethod
    def note_scale(cls) -> None:
        """An adaptive scaler's ``scale()`` ran (bound to a model or not). Host-side."""
        cls.scale_calls += 1

    def unarmed_message(self, where: str) -> str:
        """Why a backward pass reached ``where`` without a scale: ``loss.backward()`` without
        ``scaler.scale`` (no ``scale()`` since this model's forward pass), or the ``scale()`` of a scaler not
        bound to this model (a copy attached to another model, a scaler attached to none). Host-side."""
        if self.forward_at is None or self.forward_at == AdaptiveState.scale_calls:
            return (
                f"adaptive loss scaling: no scale reached {where}; call scaler.scale(loss).backward() rather "
                "than loss.backward() on a model returned by scaler.attach()"
            )
        return (
            f"adaptive loss scaling: no scale reached {where}: scale() was called on an AdaptiveLossScaler "
            "that is not bound to this model (attached to another model, or to none); call scale() on the "
            "scaler whose attach() returned this model (a copy of it, made with copy.deepcopy or pickle, "
            "drives it too if never attached elsewhere)"
        )

    def __init__(self, rule: ScaleRule) -> None:
        self.rule = rule
        self.points = Points()
        self.buffers: ScaleBuffers | None = None
        self.kind = PassKind.RECOMPUTE
        self.reach = Reach()
        self.armed = False
        self.forward_at: int | None = None  # scale_calls at the last forward pass with grad (eager)
        self.graph_built = False
        self.reduce_fn: Any = None
        self.fresh: dict[tuple[int, int], torch.Tensor] = {}
        # derived from the buffers, never written beside them: which betas, branch factors and to_root
        # factors are exactly 1 (note_units), so an eager reuse pass skips multiplying by those without a
        # sync; None: unknown (dropped by scales_written, the one place, whenever the buffers change)
        self.units: tuple[list[bool], list[bool], list[bool]] | None = None
        self._snapshot: ScaleSnapshot | None = None  # the last snapshot(), until the buffers are written

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
        return self.points.num_slots - 1

    def add_gemm(self, name: str, fan_in: int = 1, n_weights: int = 1, kind: str = "layer") -> GemmPoint:
        gemms = self.points.gemms
        point = GemmPoint(len(gemms), name, fan_in, self.rule.layer_constants(n_weights, fan_in), kind=kind)
        point.out_slot = self.new_slot()
        gemms.append(point)
        return point

    def add_unscale(self, name: str) -> UnscalePoint:
        point = UnscalePoint(len(self.points.unscales), name)
        self.points.unscales.append(point)
        return point

    def add_branch(self, name: str) -> BranchPoint:
        point = BranchPoint(len(self.points.branches), name)
        point.out_slot = self.new_slot()
        self.points.branches.append(point)
        return point

    def allocate(self, device: torch.device) -> ScaleBuffers:
        """The scale buffers on ``device`` (made once the points are wired; again only if the model moved
        to another device, scales carried over)."""
        old = self.buffers
        if old is not None and old.device == device:
            return old
        self.buffers = ScaleBuffers.allocate(self.points, device)
        if old is not None:
            for name, t in self.buffers.tensors().items():
                t.copy_(getattr(old, name))
        return self.buffers

    def arm(self, kind: PassKind) -> None:
        """Called by ``scale(loss)`` before the backward pass it arms, of ``kind``: on a recompute pass, NaN
        into the scales it is about to compute (see :class:`ScaleBuffers`). Afterwards ``kind`` is what the
        iteration's further passes are: plain after a plain pass, else reuse (they reuse this pass's betas).
        A few device ops, no sync (``alpha_{N+1}`` is already in ``alpha[0]``, where the scaler keeps it)."""
        self.armed = True
        AdaptiveState.note_scale()
        self.kind = PassKind.PLAIN if kind is PassKind.PLAIN else PassKind.REUSE
        buf = self.buffers
        if kind is not PassKind.PLAIN:
            buf.carried_root.copy_(buf.alpha[:1])
        if kind is PassKind.RECOMPUTE:
            self.scales_written()
            self.reach.at_recompute = self.reach.latest
            for t in (buf.beta, buf.branch_alpha, buf.branch_factors):
                t.fill_(math.nan)

    def scales_written(self, root_only: bool = False) -> None:
        """The buffers are about to change (a recompute pass, a restored checkpoint; ``root_only``: a new
        ``alpha_{N+1}``, which ``units`` does not cover): drop what the host derived from them, the last
        snapshot and ``units``. The one place they are dropped. Host-side."""
        self._snapshot = None
        if not root_only:
            self.units = None

    def note_units(self) -> None:
        """Read which betas, branch factors and ``to_root`` factors are exactly 1 (``units``), if unknown: one
        host sync, after a step that recomputed (or restored) the scales, so that the eager reuse passes
        until the next recompute skip multiplying by them (the values are still only ever read from the
        buffers; a compiled pass multiplies by all). No sync while ``units`` is known."""
        if self.units is not None or self.buffers is None:
            return
        buf = self.buffers
        flags = torch.cat([buf.beta, buf.branch_factors, buf.to_root]).eq(1.0).cpu().tolist()
        n_beta, n_factor = len(buf.beta), len(buf.branch_factors)
        self.units = (flags[:n_beta], flags[n_beta : n_beta + n_factor], flags[n_beta + n_factor :])

    def has_unreached(self) -> bool:
        """Whether some point has no scales (no gradient reached it in the last recompute pass). One host
        sync: called only when the requires_grad signature changed (:class:`GradSignature`)."""
        buf = self.buffers
        live = [k for k, b in enumerate(self.points.branches) if not b.inert]
        flags = [buf.beta.isnan().any()]
        if live:
            flags.append(buf.branch_alpha[live].isnan().any())
        return bool(torch.stack(flags).any())

    def snapshot(self) -> ScaleSnapshot | None:
        """Every scale in the buffers, read to the host at once: one device-to-host copy (one host sync),
        kept until the buffers are next written (:meth:`scales_written`; reuse passes do not write them), so
        reading it again before then costs none. What reporting, telemetry and checkpoints read; None before
        the buffers exist. Read it after the backward pass, not between ``scale()`` and the end of a recompute
        pass (the buffers are being written then)."""
        buf = self.buffers
        if buf is None:
            return None
        if self._snapshot is not None:
            return self._snapshot
        parts = [
            buf.alpha,
            buf.beta,
            buf.branch_alpha,
            buf.branch_factors,
            buf.rescaled.float(),
            buf.carried_root,
        ]
        flat = torch.cat(parts).tolist()  # the one host read (a device-to-host copy)
        values, start = [], 0
        for t in parts:
            values.append(flat[start : start + len(t)])
            start += len(t)
        alpha, beta, branch_alpha, factors, rescaled, (carried,) = values
        flags = [f != 0 for f in rescaled]
        self._snapshot = ScaleSnapshot(self.points, alpha, beta, branch_alpha, factors, flags, carried)
        return self._snapshot

    def rescaled(self, index: int) -> torch.Tensor | None:
        """Whether branch ``index``'s incoming gradients had different alphas at the last recompute (a 0-dim
        device bool; None before any)."""
        if self.buffers is None:
            return None
        return self.buffers.rescaled[index]


@dataclass(frozen=True)
class ScaleSnapshot:
    """The scale buffers as the host read them at one moment (:meth:`AdaptiveState.snapshot`): lists of
    Python floats, NaN where no gradient reached a point in the last recompute pass."""

    points: Points
    alpha: list[float]
    beta: list[float]
    branch_alpha: list[float]
    branch_factors: list[float]
    rescaled: list[bool]
    carried_root: float  # the alpha_{N+1} the last (not plain) backward pass carried

    @property
    def root(self) -> float:
        """``alpha_{N+1}``, the loss scale (``alpha[0]``)."""
        return self.alpha[0]

    def point_scales(self) -> tuple[list[float | None], list[float | None]]:
        """Each GEMM point's alpha (of the gradient it receives) and beta, None where no gradient reached
        it in the last recompute pass (a point that received the loss gradient: the ``alpha_{N+1}`` the last
        backward pass carried)."""
        betas = self.beta
        carried = self.carried_alphas()
        alphas = [carried[p.in_slot] for p in self.points.gemms]

        def known(values: list[float]) -> list[float | None]:
            pairs = zip(values, betas, strict=True)
            return [v if not (math.isnan(v) or math.isnan(b)) else None for v, b in pairs]

        return known(alphas), known(betas)

    def branch_rescaled(self) -> dict[str, bool]:
        """``{branch: whether its incoming gradients had different alphas}`` for the branch points a
        gradient reached in the last recompute pass."""
        pairs = zip(self.points.branches, self.branch_alpha, self.rescaled, strict=True)
        return {p.name: f for p, a, f in pairs if not math.isnan(a)}

    def checkpoint(self) -> dict[str, Any]:
        """The checkpoint's entries for the scales (``None`` where a point has none)."""

        def known(v: float) -> float | None:
            return None if math.isnan(v) else v

        branches = self.points.branches
        return {
            "layers": [p.name for p in self.points.gemms],
            "betas": [known(b) for b in self.beta],
            "branches": [p.name for p in branches],
            "branch_alphas": [known(a) for a in self.branch_alpha],
            "branch_factors": [
                None if math.isnan(a) else self.branch_factors[p.offset : p.offset + len(p.in_slots)]
                for p, a in zip(branches, self.branch_alpha, strict=True)
            ],
            "slot_alphas": self.carried_alphas(),
        }

    def carried_alphas(self) -> list[float]:
        """Each slot's alpha as the last backward pass carried it (slot 0: ``carried_root``)."""
        return [self.carried_root, *self.alpha[1:]]
