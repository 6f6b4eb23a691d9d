"""The numerical core of adaptive loss scaling (Zhao et al., section 3): Algorithms 3, 4, 5 as autograd ops.

Backpropagation carries the pair ``<alpha, delta>``: ``delta`` is the gradient already multiplied by the
accumulated scale ``alpha`` (Algorithm 3). Autograd only passes gradients, so the alphas travel beside them in
an :class:`AdaptiveState`: one 0-dim device tensor per *slot*. Slot 0 holds the initial scale
``alpha_{N+1}`` applied to the loss; every GEMM point and every branch point writes the alpha of the gradient
it emits into its own slot, and reads the alpha of the gradient it receives from the slot of whichever point
emitted it (that wiring is static and comes from :mod:`adaloss.adaptive.transform`). Element-wise ops sit
between points and pass alpha through unchanged (section 3.2.2), so they need no code at all.

* :class:`ScaledGEMM` (conv, linear): receives ``delta_j`` scaled by ``alpha_j``; computes the local scale
  ``beta`` from the statistics of its weight and ``delta_j`` (Algorithm 4, by the rule of
  :mod:`adaloss.adaptive.rules`); computes the input gradient as ``Backprop(beta * delta_j)``, the scaled
  gradient stored in the gradient format (so an FP16 overflow of ``beta * delta_j`` is an overflow, as in
  FP16 training; scaling the weight instead would overflow wherever ``beta * W`` does) and emits
  ``alpha_j * beta``; computes the weight gradient from ``delta_j`` and divides it by ``alpha_j`` in FP32 so
  the master weights receive true gradients.
* :class:`ScaledProduct` (an activation-by-activation product, an attention call): the same
  ``Backprop(beta * delta_j)`` with the beta of :func:`product_beta` (Algorithm 4 with the other operand in
  the weight's place); no weight gradient to unscale.
* :class:`Rescale` (branches, Algorithm 5): all gradients flowing into one tensor arrive together; they are
  brought to one common alpha (:func:`~adaloss.adaptive.rules.branch_loss_scale`) and summed, the rescaling
  fused into the sum.
* :class:`ParamUnscale`: a non-GEMM use of a GEMM's parameter (a tied embedding), unscaled by its own alpha.

Nothing here synchronizes host and device, and nothing copies host data to a device during a backward pass:
the statistics, betas and alphas stay on the device as tensors, and each layer's constants of Algorithm 4
are put on the device when the scaler is armed (``AdaptiveState.prepare_constants``).
On update steps the scaler copies all betas, branch factors and branch alphas to the host once (one sync
per ``update_every`` steps); on the other steps the ops run on those host copies: every alpha is a Python
float, so no scalar device op runs at all, multiplications by exactly 1 are skipped and the rest take
Python scalars. On the CPU there is no device to wait for, so with the native kernels
(:mod:`adaloss.numerics.native`) a recompute pass runs on host floats as well: one kernel pass over each
GEMM point's incoming gradient rounds it and takes its statistics (in :class:`GradRound`), a native call
turns them into beta as a float, and each branch point's kernel pass returns its inputs' maxima; the device
tensors are filled alongside for checkpoints and telemetry.

Where the time goes (emulated FP16 on the CPU, measured against the dynamic scaler): on a recompute step,
one pass over each incoming gradient that also does the FP16 rounding the dynamic scaler does anyway, one
pass per branch input (its max magnitude) and one over each weight for its statistics; on every step the
multiplication of the gradient by beta (fused into its rounding pass in the fused nodes; a pass of its own
in the Python nodes) and the division of the weight gradient by alpha (fused into its rounding). In
emulated FP16 on the CPU the Python nodes here are replaced by fused C++ nodes
(:mod:`adaloss.numerics.fused`) that compute the same values: the scaler tells the forward pass which kind
of pass follows (``AdaptiveState.fused_mode``), so on a reuse pass each layer's node carries its beta and
``1/alpha`` as constants (:class:`ReusePlan`), and on a recompute pass the nodes compute Algorithms 4 and 5
and pass the alphas through a shared float64 record (``AdaptiveState.arm_record``). The Python nodes remain
the path for CUDA (where their Python time overlaps with kernel execution), distributed recompute passes,
FP8 gradients, telemetry steps and transposed convolutions. Two things keep the Python path at the plain
layer's cost: the ops run with torch-function modes disabled (under the CPU emulation's mode, every tensor
op and even ``.dtype`` inside them would take a Python round trip), and a branch adds its inputs' gradients
in place into the gradient a GEMM point made for it, as autograd's own accumulation would, instead of
allocating a rescaled copy.
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
    branch_loss_scale_host,
    gemm_loss_scale,
    grad_stats,
    weight_factors,
)
from adaloss.numerics import fused, native
from adaloss.numerics.emulation import active_emulation, is_low_precision, mark_low_precision
from adaloss.numerics.formats import round_to_format

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


@dataclass
class BranchPoint:
    """A branch point: one tensor feeding several consumers, or several outputs of one op."""

    index: int
    name: str
    in_slots: list[int] = field(default_factory=list)  # one per consumer
    out_slot: int = -1


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
    last recompute and the fused nodes were armed with a partial plan, this re-arms them to recompute
    before any node is built, and asks the scaler to make this step a recompute step.
    Cost: one pass over the parameters' flags per forward pass with grad enabled (22 us for ResNet-110's
    329 tensors on the project's CPU, 0.003% of its step); no tensor data is read, no sync.
    """

    def __init__(self, state: AdaptiveState, params: list[torch.Tensor]) -> None:
        self.state = state
        self.params = params

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return None
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        sig = (tuple(p.requires_grad for p in self.params), tuple(t.requires_grad for t in inputs))
        state = self.state
        state.fwd_sig = sig
        # Real autocast (half tensors, CPU or CUDA): the backward pass then takes the device path, whose
        # statistics are tensors (the host path's kernels read float32 only).
        device_type = inputs[0].device.type if inputs else "cpu"
        state.fwd_autocast = torch.is_autocast_enabled(device_type)
        if state.reach_sig is None or sig == state.reach_sig or not state.has_unreached():
            return None
        state.recompute_requested = True
        if state.fused_mode == "reuse":  # the fused nodes were armed with the partial plan
            state.plan, state.fused_mode = None, None
            if state.reduce_fn is None:
                state.arm_record()
        return None


def contiguous(t: torch.Tensor) -> bool:
    """``t.is_contiguous()`` without a round trip through the torch-function modes."""
    with torch._C.DisableTorchFunction():
        return t.is_contiguous()


def fused_gemm(
    state: AdaptiveState,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    spec: Any,
    point_index: int,
) -> torch.Tensor | None:
    """In emulated FP16 on the CPU, a GEMM point as one fused C++ node (:func:`adaloss.numerics.fused.gemm`)
    with the values of ScaledGEMM + GradRound bit for bit: on a reuse pass it carries the plan's beta
    and 1/alpha, on a recompute pass it computes them into the state's record. None when that does not
    apply (no FP16 emulation, underflow telemetry on, no fused form (``spec`` False), or on a reuse pass
    inputs that are not float32 CPU tensors)."""
    emu = active_emulation()
    if emu is None or not emu._fp16 or emu.monitor is not None or spec is False or spec is None:
        return None
    with torch._C.DisableTorchFunction():  # plain attribute reads, not a round trip through the mode
        ok = x.dtype is torch.float32 and x.is_cpu and weight.dtype is torch.float32 and weight.is_cpu
        round_x = not is_low_precision(x)
        if state.fused_mode == "reuse":
            if not ok:
                return None
            entry = state.plan.gemm[point_index]  # type: ignore[union-attr]
            if entry is None:  # no gradient reached this point in the last recompute pass
                if x.requires_grad or any(p is not None and p.requires_grad for p in (weight, bias)):
                    raise unplanned_point(state.gemms[point_index].name)
                entry = (1.0, 1.0)  # no node is recorded: nothing requires a gradient
            beta, inv_alpha = entry
            y = fused.gemm(x, weight, bias, spec, round_x, False, beta, inv_alpha)
        else:
            if not ok:  # the other points share the record: no Python node may join them
                raise RuntimeError(
                    f"adaptive loss scaling: layer {state.gemms[point_index].name} got a {x.dtype} "
                    f"{x.device.type} input in emulated FP16; set ADALOSS_FUSED=0 to use the Python nodes"
                )
            y = fused.gemm(
                x,
                weight,
                bias,
                spec,
                round_x,
                False,
                record=state.record,
                where=state.record_where["gemm"][point_index],
                consts=state.record_where["gemm_consts"][point_index],
            )
    state.fused_built = state.fused_mode
    return mark_low_precision(y)


@dataclass
class ReusePlan:
    """Every scale of a reuse pass, fixed before its forward pass starts (see ``AdaptiveState.arm_plan``).

    Between recomputes nothing in a backward pass depends on the gradients' values: each GEMM point's
    beta and each branch point's factors are the host copies of the last recompute, the root scale is
    ``root``, so every slot's alpha follows (``slot_alpha``). With the scales known in the forward pass,
    the layers and branch points can be built as fused C++ nodes that carry them as constants
    (:mod:`adaloss.numerics.fused`): ``gemm[k]`` is point k's ``(beta, 1 / alpha_j)``, ``branch[k]`` point
    k's factors, one per consumer.
    """

    root: float
    slot_alpha: list[float | None]
    gemm: list[tuple[float, float] | None]
    branch: list[list[float] | None]
    #: Some points got no gradient in the last recompute pass (frozen layers, an input used twice):
    #: their entries are None, valid only while the model's requires_grad signature stays the same.
    partial: bool = False


class AdaptiveState:
    """Per-model state of the adaptive scaler: slots of alphas, the betas, and what the host knows of them.

    ``beta`` holds one device tensor per GEMM point, ``branch_alpha``/``branch_factors`` one per branch point.
    ``beta_host``, ``branch_factors_host`` and ``branch_alpha_host`` are their host copies, fetched in one
    sync after each update step (``update_every > 1``) and dropped when the betas are recomputed.

    ``alpha[s]`` is the scale of the gradient emitted into slot ``s`` during the current backward pass. On
    a *recompute* pass, and on a reuse pass without host copies, alphas are 0-dim device tensors computed
    from the device betas. On a reuse pass with host copies (``host`` is True) every alpha is a Python
    float: the ops then multiply by Python scalars, skip factors equal to 1, and run no scalar device ops.
    """

    def __init__(self, rule: ScaleRule) -> None:
        self.rule = rule
        self.u_max = rule.u_max
        self.gemms: list[GemmPoint] = []
        self.branches: list[BranchPoint] = []
        self.unscales: list[UnscalePoint] = []
        # Set by the transform for the scaler: the parameters whose gradients the backward pass unscales
        # (every parameter of a GEMM point, and the other uses of those), the parameters under GEMM
        # weights (their device and dtype key Algorithm 4's constants), and the modules of the GEMM points
        # (``fusable()``: whether each has a fused C++ form; recompute passes use the fused nodes only if
        # all have one, reuse passes mix them with Python nodes).
        self.unscaled_params: list[torch.Tensor] = []
        self.gemm_weight_params: list[torch.Tensor] = []
        self.point_modules: list[Any] = []
        self.num_slots = 1
        self.alpha: list[torch.Tensor | float | None] = [None]
        self.beta: list[torch.Tensor | None] = []
        self.beta_host: list[float] | None = None
        self.branch_alpha: list[torch.Tensor | None] = []
        self.branch_alpha_host: list[float] | None = None
        self.branch_factors: list[torch.Tensor | None] = []
        self.branch_factors_host: list[list[float]] | None = None
        # per branch point, (incoming alphas, common alpha) of the last recompute; see ``rescaled()``
        self.branch_rescaled: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.recompute = True
        self.host = False
        self.reduce_fn: Any = None
        self.param_slots: dict[str, int] = {}  # non-GEMM parameters -> slot of the gradient that scales them
        # the weight each GEMM point's forward used, for the batched weight statistics
        self.fwd_weight: list[torch.Tensor | None] = []
        self._weight_factors: list[torch.Tensor | None] | None = None
        # Algorithm 4's per-layer constants on the devices (``prepare_constants``): per (device, dtype) the
        # table for the current output sizes, tables cached by sizes, and a 0-dim 1
        self.n_g: list[int] = []  # each point's output size in its latest recorded forward pass
        self._caps_cpu = torch.tensor(rule.caps, dtype=torch.float32)  # beside native (CPU) factors
        self._table: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._tables: dict[tuple[torch.device, torch.dtype], dict[tuple, torch.Tensor]] = {}
        self._one: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        # input gradients made by GEMM points that feed a branch directly (see ``GemmPoint.feeds``)
        self.fresh: dict[tuple[int, int], torch.Tensor] = {}
        # statistics GradRound took of a rounded gradient, keyed by id() of that tensor (see GradRound)
        self.grad_stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Fused C++ nodes (CPU, emulated FP16; see ``arm_plan`` and ``arm_record``): which kind the next
        # forward pass may build ("reuse" with ``plan``, "recompute" with ``record``; set by the scaler),
        # and which kind a forward pass did build since the last ``start_backward``.
        self.fused_mode: str | None = None
        self.fused_built: str | None = None
        self.plan: ReusePlan | None = None
        # Which tensors need gradients (parameters, then the forward's tensor inputs) in the latest forward
        # pass with grad enabled, and in the forward pass of the last recompute (None: unknown). A point
        # no gradient reached in that pass will not be reached while the two are equal (a traced graph).
        self.fwd_sig: tuple | None = None
        self.reach_sig: tuple | None = None
        self.recompute_requested = False  # set by GradSignature: the scaler recomputes on this step
        self.fwd_autocast = False  # set by GradSignature: the latest forward pass ran under real autocast
        self.record: torch.Tensor | None = None
        self.record_where: dict[str, Any] = {}
        self._record_pending = False

    def new_slot(self) -> int:
        self.num_slots += 1
        self.alpha.append(None)
        return self.num_slots - 1

    def add_gemm(self, name: str, fan_in: int = 1, n_weights: int = 1, kind: str = "layer") -> GemmPoint:
        point = GemmPoint(
            len(self.gemms), name, fan_in, self.rule.layer_constants(n_weights, fan_in), kind=kind
        )
        self.n_g.append(1)
        self._table, self._tables = {}, {}
        point.out_slot = self.new_slot()
        self.gemms.append(point)
        self.beta.append(None)
        self.fwd_weight.append(None)
        return point

    def add_unscale(self, name: str) -> UnscalePoint:
        point = UnscalePoint(len(self.unscales), name)
        self.unscales.append(point)
        return point

    def add_branch(self, name: str) -> BranchPoint:
        point = BranchPoint(len(self.branches), name)
        point.out_slot = self.new_slot()
        self.branches.append(point)
        self.branch_alpha.append(None)
        self.branch_factors.append(None)
        self.branch_rescaled.append(None)
        return point

    def has_unreached(self) -> bool:
        """Whether some point has no scales (no gradient reached it in the last recompute pass)."""
        return any(b is None for b in self.beta) or any(f is None for f in self.branch_factors)

    def drop_host_copies(self) -> None:
        """Forget the host copies (the device betas are about to change, or did), and the plan."""
        self.beta_host = None
        self.branch_factors_host = None
        self.branch_alpha_host = None
        self.plan = None
        self.reach_sig = None
        if self.fused_mode == "reuse":
            self.fused_mode = None

    def arm_plan(self, root: float) -> ReusePlan | None:
        """Fix the scales of the next pass from the host copies, for a forward pass that will be followed
        by a reuse pass with root scale ``root``; sets and returns ``self.plan``. None (the Python nodes
        run) when a point was not reached by the last pass or a scale is not a power of two (dividing
        by it would not be exact as a multiplication by its reciprocal)."""
        self.plan = None
        self.fused_mode = None
        if self.beta_host is None or self.branch_factors_host is None or self.branch_alpha_host is None:
            return None
        reached_gemm = [b is not None for b in self.beta]
        reached_branch = [
            f is not None and a is not None
            for f, a in zip(self.branch_factors_host, self.branch_alpha_host, strict=True)
        ]
        partial = not (all(reached_gemm) and all(reached_branch))
        if partial and self.reach_sig is None:
            return None  # unreached points, and no signature to tell that they stay unreached
        slot: list[float | None] = [None] * self.num_slots
        slot[0] = float(root)
        for b in self.branches:
            if reached_branch[b.index]:
                slot[b.out_slot] = self.branch_alpha_host[b.index]
        pending = [p for p in self.gemms if reached_gemm[p.index]]
        while pending:  # a GEMM point's alpha is its input's times its beta: resolve in dependency order
            left = [p for p in pending if p.in_slot < 0 or slot[p.in_slot] is None]
            for p in pending:
                if p.in_slot >= 0 and slot[p.in_slot] is not None:
                    slot[p.out_slot] = slot[p.in_slot] * self.beta_host[p.index]
            if len(left) == len(pending):
                return None  # a reached point whose incoming scale is unknown
            pending = left
        gemm: list[tuple[float, float] | None] = []
        for p in self.gemms:
            if not reached_gemm[p.index]:
                gemm.append(None)
                continue
            alpha_j, beta = slot[p.in_slot], self.beta_host[p.index]
            if not (_is_pow2(alpha_j) and _is_pow2(beta)):
                return None
            gemm.append((beta, 1.0 / alpha_j))
        branch = [
            list(f) if ok else None for f, ok in zip(self.branch_factors_host, reached_branch, strict=True)
        ]
        if not partial and any(a is None for a in slot):
            return None
        self.plan = ReusePlan(float(root), slot, gemm, branch, partial)
        self.fused_mode = "reuse"
        return self.plan

    def arm_record(self) -> None:
        """Let the next forward pass build fused nodes that recompute the scales on host floats (the
        CPU counterpart of the host recompute pass, see ``start_backward``). They share ``record``, a
        float64 CPU tensor: every slot's alpha (NaN until reached), then each GEMM point's beta, then per
        branch point its common alpha, its factors and its incoming alphas; ``record_where`` says where.
        ``sync_record`` copies what a pass wrote into the usual fields."""
        self.plan = None
        if self.record is None:
            at = self.num_slots
            gemm, consts = [], []
            bounds = self.rule.caps
            for p in self.gemms:
                gemm.append((p.in_slot, p.out_slot, at, self.rule.flags))
                consts.append((*p.constants, *bounds))
                at += 1
            branch = []
            for b in self.branches:
                n = len(b.in_slots)
                branch.append([b.out_slot, at, at + 1, at + 1 + n, *b.in_slots])
                at += 1 + 2 * n
            self.record = torch.full((at,), math.nan, dtype=torch.float64)
            self.record_where = {"gemm": gemm, "branch": branch, "gemm_consts": consts}
        self.fused_mode = "recompute"

    def sync_record(self) -> None:
        """After a pass of fused recompute nodes: the alphas, betas and branch results they wrote into
        ``record``, copied into ``alpha``, the host copies and the device (CPU) tensors, as the Python host
        recompute pass would have left them. A no-op otherwise. No host sync (a CPU tensor)."""
        if not self._record_pending:
            return
        self._record_pending = False
        vals = self.record.tolist()  # type: ignore[union-attr]
        self.alpha = [None if math.isnan(v) else v for v in vals[: self.num_slots]]
        for p, (_, _, at, _) in zip(self.gemms, self.record_where["gemm"], strict=True):
            if not math.isnan(vals[at]):
                self.beta_host[p.index] = vals[at]  # type: ignore[index]
                self.beta[p.index] = torch.tensor(vals[at], dtype=torch.float32)
        for b, where in zip(self.branches, self.record_where["branch"], strict=True):
            common = vals[where[1]]
            if math.isnan(common):
                continue
            n = len(b.in_slots)
            full = vals[where[2] : where[2] + n]
            alphas = [a for a in vals[where[3] : where[3] + n] if not math.isnan(a)]
            k = b.index
            self.branch_alpha_host[k] = common  # type: ignore[index]
            self.branch_factors_host[k] = full  # type: ignore[index]
            self.branch_alpha[k] = torch.tensor(common, dtype=torch.float32)
            self.branch_factors[k] = torch.tensor(full, dtype=torch.float32)
            self.branch_rescaled[k] = (torch.tensor(alphas, dtype=torch.float32), self.branch_alpha[k])

    def start_backward(
        self,
        root_alpha: torch.Tensor,
        recompute: bool,
        root_host: float | None = None,
        host_recompute: bool = False,
    ) -> None:
        """Called by ``scaler.scale(loss)``: reset the slots and set the root scale alpha_{N+1}.

        ``recompute``: compute new betas in this backward pass (the host copies are dropped; the scaler
        fetches new ones after the step). Otherwise the existing betas are reused: as Python floats if the
        host copies and ``root_host`` (the root scale as a float) are available, else as device tensors (a
        second backward pass of a recompute iteration, under gradient accumulation). A pass before any
        betas exist always recomputes.

        ``host_recompute`` (the scaler sets it for a float32 model on the CPU with the native kernels, no
        distributed reduction, and ``root_host`` given): a recompute pass runs on host floats too. Each
        GEMM point gets its beta as a float (:func:`adaloss.numerics.native.beta_host`) and each branch
        point its inputs' maxima, so the alphas are floats and no 0-dim tensor op runs; the
        device tensors and host copies are filled as the pass goes, so nothing needs fetching afterwards.
        """
        self.sync_record()  # a previous pass of fused recompute nodes (gradient accumulation)
        self.alpha = [None] * self.num_slots
        self._weight_factors = None
        self.fresh = {}
        self.grad_stats = {}
        built, self.fused_built = self.fused_built, None
        if built == "reuse":
            # The forward pass built fused nodes that carry the plan's scales: this pass reuses them.
            plan = self.plan
            if plan is None or recompute or root_host is None or float(root_host) != plan.root:
                raise RuntimeError(
                    "adaptive loss scaling: the forward pass was built for a step that reuses the scales, "
                    "but this backward pass would recompute them (was load_state_dict() or the loss scale "
                    "changed between the forward pass and scale()?); run the forward pass again"
                )
            if plan.partial and self.fwd_sig != self.reach_sig:
                raise RuntimeError(
                    "adaptive loss scaling: which tensors need gradients changed since the scales were "
                    "last computed, and the forward pass was built before that was known; call "
                    "scaler.recompute_next() and run the forward pass again"
                )
            self.recompute = False
            self.host = True
            self.alpha = list(plan.slot_alpha)
            return
        if built == "recompute":
            # The forward pass built fused nodes that compute the scales into ``record``.
            if not (recompute and host_recompute and root_host is not None):
                raise RuntimeError(
                    "adaptive loss scaling: the forward pass was built for a step that recomputes the "
                    "scales, but this backward pass would reuse them (was load_state_dict() called between "
                    "the forward pass and scale()?); run the forward pass again"
                )
            self.recompute = True
            self.host = True
            self._reset_for_host_recompute()
            self.reach_sig = self.fwd_sig
            self.fwd_weight = [None] * len(self.fwd_weight)  # the nodes take the weights' statistics
            self.record.fill_(math.nan)  # type: ignore[union-attr]
            self.record[0] = float(root_host)  # type: ignore[index]
            self.alpha[0] = float(root_host)
            self._record_pending = True
            return
        missing = self.has_unreached()
        # Points the last recompute pass did not reach may stay without scales while nothing else changed
        # (GradSignature); with no such pass on record, every point needs its scales first.
        if recompute or (missing and (self.reach_sig is None or self.fwd_sig != self.reach_sig)):
            self.recompute = True
            self.host = host_recompute and root_host is not None
            if self.host:
                self._reset_for_host_recompute()
            else:
                self.drop_host_copies()
            self.reach_sig = self.fwd_sig
        else:
            self.recompute = False
            self.fwd_weight = [None] * len(self.fwd_weight)  # no statistics needed: drop the references
            self.host = (
                root_host is not None
                and self.beta_host is not None
                and self.branch_factors_host is not None
                and self.branch_alpha_host is not None
            )
        self.alpha[0] = float(root_host) if self.host else root_alpha

    def _reset_for_host_recompute(self) -> None:
        """Before a recompute pass on host floats (Python or fused nodes): fresh host copies, filled as the
        pass goes; a point the pass never reaches keeps beta 1, and its device values are cleared so that
        it is recomputed next time, as on the device path."""
        self.drop_host_copies()
        self.beta_host = [1.0] * len(self.beta)
        self.branch_factors_host = [None] * len(self.branches)
        self.branch_alpha_host = [None] * len(self.branches)
        self.beta = [None] * len(self.beta)
        self.branch_factors = [None] * len(self.branches)
        self.branch_alpha = [None] * len(self.branches)

    def read_alpha(self, slot: int, where: str) -> torch.Tensor | float:
        a = self.alpha[slot]
        if a is None:
            raise RuntimeError(
                f"adaptive loss scaling: no scale reached {where}; call scaler.scale(loss).backward() rather "
                "than loss.backward() on a model returned by scaler.attach()"
            )
        return a

    def prepare_constants(self, weights: list[torch.Tensor]) -> None:
        """Put Algorithm 4's constants where the coming backward pass computes its statistics (the
        devices, and float64 for float64 weights else float32, of ``weights``): per (device, dtype) a
        ``[points, 4]`` table of ``(A sqrt(n_g), B, scale cap, accumulation cap)`` for the output sizes
        ``n_g`` the forward pass just recorded (:func:`adaloss.adaptive.rules.weight_factors`), a 0-dim 1 and
        the reference rule's ``[1, 0, 0, 0, 0]``. The scaler calls this from ``scale()``, so a host-to-device
        copy happens there, before the backward pass, and only when a table is new (cached by the sizes)."""
        sizes = tuple(self.n_g)
        for w in weights:
            key = (w.device, _stat_dtype(w.dtype))
            tables = self._tables.setdefault(key, {})
            if sizes not in tables:
                if len(tables) >= 4:  # a few batch geometries at most (e.g. a last partial batch)
                    tables.pop(next(iter(tables)))
                rows = [self._table_row(i) for i in range(len(self.gemms))]
                tables[sizes] = torch.tensor(rows, dtype=key[1], device=key[0]).reshape(-1, 4)
            self._table[key] = tables[sizes]
            if key not in self._one:
                self._one[key] = torch.ones((), dtype=key[1], device=key[0])
                _low(key[1], str(key[0]))  # made now, not in the backward pass

    def _table_row(self, index: int) -> list[float]:
        point = self.gemms[index]
        a, b = point.constants
        return [self.rule.lower_constant(a, self.n_g[index]), b, *self.rule.caps]

    def _rows(self, indices: list[int], weight: torch.Tensor) -> torch.Tensor:
        """The ``[len(indices), 4]`` table rows of points ``indices`` for statistics of ``weight``: views
        and device ops on the table ``prepare_constants`` made (made here if it was not, for direct use of
        the ops outside a scaler)."""
        key = (weight.device, _stat_dtype(weight.dtype))
        if key not in self._table:
            self.prepare_constants([weight])
        table = self._table[key]
        if indices == list(range(len(self.gemms))):
            return table
        if len(indices) == 1:
            return table[indices[0] : indices[0] + 1]
        return torch.stack([table[i] for i in indices])

    def one(self, weight: torch.Tensor) -> torch.Tensor:
        """A 0-dim 1 where ``weight``'s statistics are taken (:func:`adaloss.adaptive.rules.grad_stats`)."""
        key = (weight.device, _stat_dtype(weight.dtype))
        if key not in self._one:
            self.prepare_constants([weight])
        return self._one[key]

    def _factors(self, indices: list[int], weights: list[torch.Tensor]) -> list[torch.Tensor]:
        """Factor rows (5-vectors) of points ``indices`` from ``weights``: for float32 CPU weights the
        first three columns by one native call (the caps appended), else :func:`weight_factors`."""
        consts = [(row[0], row[1]) for row in (self._table_row(i) for i in indices)]
        fused = native.weight_factors(weights, consts)
        if fused is not None:
            caps = self._caps_cpu.expand(len(indices), 2)
            return list(torch.cat([fused, caps], dim=1).unbind(0))
        return list(weight_factors(weights, self._rows(indices, weights[0])).unbind(0))

    def layer_factors(self, index: int, weight: torch.Tensor) -> torch.Tensor:
        """Point ``index``'s weight factors from ``weight`` alone (a point whose forward was not recorded,
        or a distributed pass). No host sync, no host-to-device copy once the constants are prepared."""
        return self._factors([index], [weight])[0]

    def factors_for(self, index: int) -> torch.Tensor | None:
        """Point ``index``'s weight factors for Algorithm 4, computed for every recorded point at once on
        the first call of a recompute pass (from the weights the forward pass recorded), per (device, dtype)
        group: for float32 CPU weights by one native call, else two ``_foreach_norm`` calls and three vector
        ops. ``None`` if the point's forward was not recorded (then use :meth:`layer_factors`)."""
        if self._weight_factors is None:
            self._weight_factors = [None] * len(self.fwd_weight)
            groups: dict[tuple, list[int]] = {}
            for i, w in enumerate(self.fwd_weight):
                if w is not None:
                    groups.setdefault((w.device, w.dtype), []).append(i)
            for idx in groups.values():
                rows = self._factors(idx, [self.fwd_weight[i] for i in idx])
                for i, row in zip(idx, rows, strict=True):
                    self._weight_factors[i] = row
            self.fwd_weight = [None] * len(self.fwd_weight)  # do not keep the weight copies alive
        return self._weight_factors[index]

    def rescaled(self, index: int) -> torch.Tensor | None:
        """Whether branch ``index``'s incoming gradients had different alphas at the last recompute."""
        entry = self.branch_rescaled[index]
        if entry is None:
            return None
        alphas, common = entry
        return (alphas != common).any()


# --------------------------------------------------------------------------------------------------------
# GEMM


def _conv_forward(x, w, b, spec):
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[spec["dims"]]
    return conv(x, w, b, spec["stride"], spec["padding"], spec["dilation"], spec["groups"])


def _conv_transpose_forward(x, w, b, spec):
    conv = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[spec["dims"]]
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
    gradient before it is unscaled into the FP32 master gradient; the incoming gradient arrives already
    rounded (and counted for telemetry) by the :class:`GradRound` node on its output. Under autocast (CUDA,
    or the CPU's own FP16/BF16) it computes in the autocast dtype explicitly, backward pass included.
    ``record`` (grad mode was on at the call) lets the forward
    pass leave its weight in the state for the batched weight statistics.

    Per backward call, beyond what the plain layer does: on a recompute pass the gradient's statistics
    (taken by GradRound in its rounding pass, or here in one native pass or two torch reductions) and the
    beta arithmetic (one native call, or about ten scalar ops); on every pass one multiply of the incoming
    gradient by beta (skipped when beta is known to be 1) and the division of the weight gradient by alpha
    (skipped when alpha is known to be 1), each fused with its FP16 rounding for host scales on the CPU.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, point: GemmPoint, state: AdaptiveState, spec: dict, record: bool):  # type: ignore[override]
        # Torch-function modes (the CPU emulation's) off: every op here, even ``.dtype``, would otherwise
        # take a Python round trip through the mode; the emulation's rounding is done explicitly below.
        with torch._C.DisableTorchFunction():
            return ScaledGEMM._forward(ctx, x, weight, bias, point, state, spec, record)

    @staticmethod
    def _forward(ctx, x, weight, bias, point, state, spec, record):
        emu = active_emulation()
        fmt = emu.fmt if emu is not None else None
        # With a gradient format, GradRound (applied to this op's output by AdaptiveGEMM) rounds the incoming
        # gradient and feeds the probe; without one (FP32 telemetry) the probe is fed here.
        ctx.grad_fmt = emu.grad_fmt if emu is not None else None
        ctx.fp16 = ctx.grad_fmt is not None and ctx.grad_fmt.dtype is torch.float16
        ctx.probe = emu.probe_for(point.name) if emu is not None and ctx.grad_fmt is None else None
        ctx.point, ctx.state, ctx.spec = point, state, spec
        ctx.x_dtype = x.dtype
        ctx.w_dtype = weight.dtype  # the master weight's dtype: unscaled gradients are returned in it
        # Under autocast (any device type: CUDA, or the CPU's real FP16/BF16 kernels) the layer computes in
        # the autocast dtype, and so does its backward pass, which autocast does not cover: cast explicitly.
        dtype = None
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        if dtype is not None:
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        if fmt is not None:
            if not is_low_precision(x):  # usually already stored in the format by its producer
                x = round_to_format(x, fmt)
            weight = round_to_format(weight, fmt)
            bias = round_to_format(bias, fmt) if bias is not None else None
        if spec["kind"] == "linear":
            y = F.linear(x, weight, bias)
        elif spec["kind"] == "conv":
            y = _conv_forward(x, weight, bias, spec)
        else:
            y = _conv_transpose_forward(x, weight, bias, spec)
        if fmt is not None:
            y = round_to_format(y, fmt)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        if record:
            state.fwd_weight[point.index] = weight
            state.n_g[point.index] = y.numel()
        if fmt is not None:
            mark_low_precision(y)
        return y

    @staticmethod
    def backward(ctx, delta):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            return ScaledGEMM._backward(ctx, delta)

    @staticmethod
    def _backward(ctx, delta):
        # ``delta`` is already in the gradient format (GradRound rounded it); on a recompute pass GradRound
        # may also have left its statistics in ``state.grad_stats``, taken in the same pass.
        x, w = ctx.saved_tensors
        point, state = ctx.point, ctx.state
        alpha_j = state.read_alpha(point.in_slot, point.name)
        k = point.index
        stats = None
        if state.grad_stats:
            entry = state.grad_stats.pop(id(delta), None)
            if entry is not None and entry[0] is delta:
                stats = entry[1]
        if ctx.probe is not None:
            ctx.probe.record(delta)
        if delta.dtype != w.dtype:
            delta = delta.to(w.dtype)

        rule = state.rule
        if state.host and state.recompute:  # a recompute pass on host floats (CPU, native kernels)
            factors = state.factors_for(k)
            if factors is None:
                factors = state.layer_factors(k, w)
            if stats is None:  # no GradRound before this point (no gradient format, or not FP16)
                stats = native.grad_stats(delta, False, always=True)[1]
            beta_t, beta = native.beta_host(factors, stats, rule.flags, *rule.caps, alpha_j)
            state.beta[k] = beta_t
            state.beta_host[k] = beta
            state.alpha[point.out_slot] = alpha_j * beta
        elif state.host:  # reuse pass with host copies: plain floats, nothing to compute on the device
            beta = state.beta_host[k]
            state.alpha[point.out_slot] = alpha_j * beta
        else:
            if state.recompute or state.beta[k] is None:
                beta = ScaledGEMM._device_beta(state, k, w, delta, alpha_j, stats)
                state.beta[k] = beta
            else:
                beta = state.beta[k]
            state.alpha[point.out_slot] = alpha_j * beta

        return ScaledGEMM._gradients(ctx, delta, x, w, alpha_j, beta)

    @staticmethod
    def _device_beta(state, k, w, delta, alpha_j, stats):
        """Algorithm 4 on device tensors: the weight's factors (batched over the pass's layers unless the
        statistics are reduced across ranks), the gradient's statistics (all-reduced under DDP), beta.
        No host sync and no host-to-device copy (the constants were prepared when the scaler was armed);
        about a dozen kernels per layer (see :class:`adaloss.adaptive.rules.ScaleRule`)."""
        n_g = delta.numel()
        factors = state.factors_for(k) if state.reduce_fn is None else None
        if factors is None:
            factors = state.layer_factors(k, w)
        one = state.one(w)
        if stats is None:
            fused = native.grad_stats(delta, round_fp16=False)  # one native pass for a float32 CPU tensor
            stats = None if fused is None else fused[1]
        if stats is None:
            stats = grad_stats(delta, alpha_j, one)
        else:  # [||delta||, |min|, |max|] from a native pass: the rule's 5-vector
            peak, alpha = stats[1:].amax(), alpha_j.reshape(()).to(stats.dtype)
            stats = torch.stack([stats[0], peak, peak, one.to(stats.dtype), alpha])
        if state.reduce_fn is not None:
            ms_g, max_g = state.reduce_fn(stats[0].square() / n_g, stats[1])
            max_g = max_g.reshape(())
            stats = torch.stack([torch.sqrt(ms_g * n_g).reshape(()), max_g, max_g, stats[3], stats[4]])
        return gemm_loss_scale(w, delta, state.rule, factors=factors, stats=stats)

    @staticmethod
    def _gradients(ctx, delta, x, w, alpha_j, beta):
        """Input, weight and bias gradients from the (rounded) ``delta`` and the layer's beta (Algorithm 3).

        The input gradient is ``Backprop(beta * delta)``: the gradient is scaled, stored in the gradient
        format (an FP16 product beyond 65504 becomes infinite, as in FP16 training), then multiplied by the
        weight. The weight and bias gradients come from ``delta`` and are divided by ``alpha_j``.

        One tensor serves both when beta is a host float above 1 and the layer computes in float32/64 (the
        emulation, float64 checks): ``beta * delta`` is then exact unless it overflows, and the weight
        gradient computed from it and divided by beta has the same bits as one computed from ``delta``;
        when it overflows, the weight gradient is infinite too and the step is skipped (the fused C++ nodes
        do exactly this). Otherwise (a device beta, whose value the host does not know; beta below 1, where
        the product loses bits; half-precision compute, where ``beta * grad_W`` could overflow) the two
        come from separate tensors: one more convolution call, the same total work.
        """
        point, state, spec, grad_fmt, fp16 = ctx.point, ctx.state, ctx.spec, ctx.grad_fmt, ctx.fp16
        grad_x = grad_w = grad_b = None
        needs = ctx.needs_input_grad
        need_x = needs[0]
        need_w = needs[1] or (ctx.has_bias and needs[2])
        need_b = need_w and ctx.has_bias
        host_beta = isinstance(beta, float)
        scaled, g_scale = delta, 1.0  # g_scale: what the tensor the weight gradient comes from carries
        if need_x and not (host_beta and beta == 1.0):
            scaled = _scaled_gradient(delta, beta, grad_fmt, fp16)
            if host_beta and beta > 1.0 and delta.dtype in (torch.float32, torch.float64):
                g_scale = beta
        separate = scaled is not delta and g_scale == 1.0
        if spec["kind"] == "linear":
            if need_x:
                grad_x = scaled.matmul(w)
            if need_w:
                src = delta if separate else scaled
                d2 = src.reshape(-1, src.shape[-1])
                grad_w = d2.t().matmul(x.reshape(-1, x.shape[-1]))
                grad_b = d2.sum(0) if ctx.has_bias else None
        elif separate:
            grad_x = _conv_backward(scaled, x, w, spec, [True, False, False])[0]
            if need_w:
                _, grad_w, grad_b = _conv_backward(delta, x, w, spec, [False, True, need_b])
        else:
            # One call for both: the weight gradient depends on delta and x only, not on the weight.
            grad_x, grad_w, grad_b = _conv_backward(scaled, x, w, spec, [need_x, need_w, need_b])
        if need_x:
            if grad_x.dtype is not ctx.x_dtype:
                grad_x = grad_x.to(ctx.x_dtype)
            if point.feeds is not None:
                state.fresh[point.feeds] = grad_x
        if need_w:
            # The low-precision weight gradient reaches the FP32 master copy, then is unscaled there. Every
            # tensor here is fresh (made by this backward), so dividing in place is safe; alpha (and
            # g_scale) are powers of two, so dividing equals multiplying by the reciprocal, exactly.
            master = ctx.w_dtype
            done = None
            if fp16 and master == grad_w.dtype and isinstance(alpha_j, float) and _is_pow2(alpha_j):
                # bring back g_scale, round and unscale in one native pass, in place unless grad_w is a view
                out = grad_w if grad_w._base is None else None
                done = native.round_f16(grad_w, out=out, pre=1.0 / g_scale, post=1.0 / alpha_j)
            if done is not None:
                grad_w = done
            else:
                grad_w = _from_scaled(grad_w, g_scale, grad_fmt, master, alpha_j)
            if grad_b is not None:
                grad_b = _from_scaled(grad_b, g_scale, grad_fmt, master, alpha_j)
        return grad_x, grad_w, grad_b, None, None, None, None


def _scaled_gradient(
    delta: torch.Tensor, beta: torch.Tensor | float, grad_fmt: Any, fp16: bool
) -> torch.Tensor:
    """``beta * delta`` stored in the gradient format (a new tensor; ``delta`` is already in the format).

    For a host beta and a float32 CPU gradient in emulated FP16, one native pass; otherwise a multiply
    (in the gradient's own dtype: real half tensors overflow as FP16 does) and, in emulation, a rounding.
    """
    if fp16 and isinstance(beta, float):
        out = native.round_f16(delta, pre=beta)  # delta is FP16-valued: fp16(delta * beta)
        if out is not None:
            return out
    scaled = delta * beta
    if grad_fmt is not None:
        scaled = round_to_format(scaled, grad_fmt)
    return scaled


def _from_scaled(
    grad: torch.Tensor, g_scale: float, grad_fmt: Any, master: torch.dtype, alpha: torch.Tensor | float
) -> torch.Tensor:
    """A weight or bias gradient computed from a gradient carrying ``g_scale`` (beta, or 1): brought back
    to ``delta``'s scale (exact, a power of two), rounded to the gradient format, divided by ``alpha``."""
    if g_scale != 1.0:
        grad = grad.mul_(1.0 / g_scale) if grad._base is None else grad * (1.0 / g_scale)
    if grad_fmt is not None:
        grad = round_to_format(grad, grad_fmt)
    return _unscaled(grad, master, alpha)


class GradRound(torch.autograd.Function):
    """Identity forward; backward rounds the gradient reaching a GEMM point's output to the gradient format.

    A separate autograd node rather than a step inside :class:`ScaledGEMM`'s backward, for memory: the
    engine frees the unrounded gradient as soon as this node returns, so the GEMM's own backward (whose
    input gradient is activation-sized) reuses that memory, still warm in cache, as the plain layer's
    rounding node and convolution backward do. Rounding inside ScaledGEMM kept both alive at once; that cost
    about 0.25 ms per 3x3 convolution at batch 32 with 32x32x32 activations (measured on one core).

    On a recompute pass it also takes the statistics Algorithm 4 needs in the same pass (native kernels) and
    leaves them in ``state.grad_stats`` for the ScaledGEMM that receives the rounded tensor. The probe
    (underflow telemetry) compares the gradient before and after rounding here.
    """

    @staticmethod
    def forward(ctx, y, state, grad_fmt, probe):  # type: ignore[override]
        ctx.state, ctx.grad_fmt, ctx.probe = state, grad_fmt, probe
        ctx.fp16 = grad_fmt.dtype is torch.float16
        with torch._C.DisableTorchFunction():
            out = y.view_as(y)
            mark_low_precision(out)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if ctx.fp16 and ctx.probe is None and not ctx.state.recompute:  # the common case: just round
            rounded = native.round_f16(grad)
            if rounded is not None:
                return rounded, None, None, None
        with torch._C.DisableTorchFunction():
            state, fmt = ctx.state, ctx.grad_fmt
            rounded = stats = None
            if state.recompute and fmt.dtype is torch.float16 and grad.dtype == torch.float32:
                fused = native.grad_stats(grad, True, always=state.host)
                if fused is not None:
                    rounded, stats = fused
            if rounded is None:
                rounded = round_to_format(grad, fmt)
            if ctx.probe is not None:
                ctx.probe.record(grad, rounded)
            if stats is not None:
                state.grad_stats[id(rounded)] = (rounded, stats)
        return rounded, None, None, None

    @staticmethod
    def wrap(y: torch.Tensor, point: GemmPoint, state: AdaptiveState) -> torch.Tensor:
        """``y`` behind a GradRound node when an emulation with a gradient format is active and grad is on."""
        emu = active_emulation()
        if emu is None or emu.grad_fmt is None or not torch.is_grad_enabled():
            return y
        return GradRound.apply(y, state, emu.grad_fmt, emu.probe_for(point.name))


def _alias(y: torch.Tensor) -> torch.Tensor:
    """A view of ``y`` for an identity node's output, stored in the format exactly when ``y`` is."""
    with torch._C.DisableTorchFunction():
        out = y.view_as(y)
        if is_low_precision(y):
            mark_low_precision(out)
    return out


class ParamUnscale(torch.autograd.Function):
    """Identity on a parameter for one of its non-GEMM uses (:class:`UnscalePoint`); the backward pass
    divides the gradient of that use by the alpha it carries, in the parameter's own dtype, so it joins the
    GEMM calls' contributions (unscaled by :class:`ScaledGEMM`) in ``.grad`` as a true gradient. Cost: one
    pass over that gradient (an embedding's weight gradient); no host sync (a device alpha is divided by
    as a tensor)."""

    @staticmethod
    def forward(ctx, p, point: UnscalePoint, state: AdaptiveState):  # type: ignore[override]
        ctx.point, ctx.state = point, state
        with torch._C.DisableTorchFunction():
            return p.view_as(p)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        alpha = ctx.state.read_alpha(ctx.point.in_slot, ctx.point.name)
        with torch._C.DisableTorchFunction():
            if isinstance(alpha, float):
                grad = grad if alpha == 1.0 else grad / alpha
            else:
                grad = grad / alpha.to(grad.dtype)
        return grad, None, None


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
    for w, multiplier, fan_in, delta in pairs:
        a_const, b_const = rule.layer_constants(w.numel(), fan_in)
        (w_norm, w_max), (d_norm, d_max) = (_norm_and_max(t, reduce_fn) for t in (w, delta))
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
    """``(||t||, max|t|)`` in the statistics dtype; over all ranks with ``reduce_fn``."""
    red = None if t.dtype in (torch.float32, torch.float64) else torch.float32
    norm = torch.linalg.vector_norm(t, dtype=red)
    top = _max_magnitude(t).to(norm.dtype)
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
        s = q.matmul(k.transpose(-2, -1)) * self.scale
        if self.is_causal:
            keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~keep, -math.inf)
        if self.mask is not None:
            s = s.masked_fill(~self.mask, -math.inf) if self.mask.dtype == torch.bool else s + self.mask
        p = torch.softmax(s, dim=-1)
        d_p = d_out.matmul(v.transpose(-2, -1))
        d_s = p * (d_p - (d_p * p).sum(-1, keepdim=True))
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
            if state.grad_stats:  # GradRound's statistics of this gradient: not needed here
                state.grad_stats.pop(id(delta), None)
            alpha = state.read_alpha(point.in_slot, point.name)
            if state.recompute or (not state.host and state.beta[k] is None):
                beta = product_beta(operands.pairs(delta), state.rule, alpha, state.reduce_fn)
                state.beta[k] = beta
                if state.host:
                    beta = float(beta)  # a CPU tensor: the host path runs on host floats
                    state.beta_host[k] = beta
            elif state.host:
                beta = state.beta_host[k]
            else:
                beta = state.beta[k]
            ctx.operands = None
            state.alpha[point.out_slot] = alpha * beta
            operands.record(delta, beta)
            if isinstance(beta, float):
                return (delta if beta == 1.0 else delta * beta), None, None, None, None
            return delta * beta.to(delta.dtype), None, None, None, None


def _is_pow2(value: float) -> bool:
    """Whether a positive finite float is a power of two (then x / value == x * (1 / value) exactly)."""
    return 0.0 < value < math.inf and math.frexp(value)[0] == 0.5


def _unscaled(grad: torch.Tensor, dtype: torch.dtype, alpha: torch.Tensor | float) -> torch.Tensor:
    if grad.dtype != dtype:
        grad = grad.to(dtype)
    elif grad._base is not None:
        grad = grad.clone()  # a view (e.g. of a reshaped matmul): do not write into its base
    if isinstance(alpha, float):
        return grad if alpha == 1.0 else grad.div_(alpha)
    return grad.div_(alpha)


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
        factors: list[Any]
        if state.host and not state.recompute and state.branch_factors_host[k] is None:
            raise unplanned_point(point.name)
        if state.host and state.recompute:  # Algorithm 5 on host floats (CPU, native kernels)
            alphas = [state.read_alpha(point.in_slots[i], point.name) for i in present]
            maxima = [native.max_abs_host(grads[i]) for i in present]
            common = branch_loss_scale_host(alphas, maxima, state.u_max, state.rule.name)
            factors = [common / a for a in alphas]
            full = [1.0] * len(grads)
            for i, f in zip(present, factors, strict=True):
                full[i] = f
            state.branch_alpha_host[k] = common
            state.branch_factors_host[k] = full
            state.branch_alpha[k] = torch.tensor(common, dtype=torch.float32)
            state.branch_factors[k] = torch.tensor(full, dtype=torch.float32)
            state.branch_rescaled[k] = (torch.tensor(alphas, dtype=torch.float32), state.branch_alpha[k])
        elif state.host:
            common = state.branch_alpha_host[k]
            host = state.branch_factors_host[k]
            factors = [host[i] for i in present]
        else:
            alphas = [state.read_alpha(point.in_slots[i], point.name) for i in present]
            if state.recompute or state.branch_factors[k] is None:
                a = torch.stack([x.float().reshape(()) for x in alphas])
                # one reduction kernel per input for its max magnitude, one to stack them
                m = torch.stack([_max_magnitude(grads[i]) for i in present]).float()
                if state.reduce_fn is not None:
                    m = state.reduce_fn(None, m)[1]
                common = branch_loss_scale(a, m, state.u_max, state.rule.name)
                vec = common / a
                state.branch_alpha[k] = common
                state.branch_rescaled[k] = (a, common)
                if len(present) == len(grads):
                    state.branch_factors[k] = vec
                else:  # element by element: indexing with a list would copy host data to the device
                    full = torch.ones(len(grads), dtype=vec.dtype, device=vec.device)
                    for i, v in zip(present, vec.unbind(0), strict=True):
                        full[i] = v
                    state.branch_factors[k] = full
            else:
                common = state.branch_alpha[k]
                vec = state.branch_factors[k]
                if len(present) != len(grads):
                    vec = torch.stack([vec[i] for i in present])
            factors = list(vec.unbind(0))
        state.alpha[point.out_slot] = common
        # A gradient made by a GEMM point feeding this branch directly is ours to write into.
        owned = None
        if state.fresh:
            for i in range(len(grads)):
                t = state.fresh.pop((k, i), None)
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


def _max_magnitude(x: torch.Tensor) -> torch.Tensor:
    """max|x| in one reduction (in float32 for half-precision tensors)."""
    red = None if x.dtype in (torch.float32, torch.float64) else torch.float32
    return torch.linalg.vector_norm(x, math.inf, dtype=red)


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
