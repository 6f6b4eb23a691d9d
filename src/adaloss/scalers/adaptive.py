"""Adaptive loss scaling (Zhao et al., "Adaptive Loss Scaling for Mixed Precision Training", section 3)."""

from __future__ import annotations

import math
import uuid
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from adaloss.adaptive.algorithm3 import root_over
from adaloss.adaptive.coverage import Coverage, build_coverage, recurrent_layers
from adaloss.adaptive.rules import NO_BOUND, Statistics, gemm_bounds
from adaloss.adaptive.state import AdaptiveState, GradSignature, PassKind, ScaleSnapshot
from adaloss.adaptive.transform import attach_adaptive
from adaloss.errors import ConfigError
from adaloss.numerics.emulation import is_low_precision, mark_low_precision
from adaloss.numerics.formats import FloatFormat
from adaloss.scalers.base import LossScaler, distributed_world_size, positive_int
from adaloss.scalers.dynamic import backed_off, grown
from adaloss.scalers.recipe import ROOTS, AdaptiveRecipe

__all__ = ["ROOTS", "AdaptiveLossScaler"]

# How alpha_{N+1} regrows and backs off: powers of two, so that every gradient unscales exactly.
_ALPHA_GROWTH, _ALPHA_BACKOFF = 2.0, 0.5
#: The smallest alpha_{N+1} a backoff reaches (FP16's smallest subnormal).
_ROOT_FLOOR = 2.0**-24
#: The loss gradient's binade histogram (root="adaptive"): bin ``e + _BIN_OFFSET`` counts the elements
#: ``|g| = m 2**e`` (float32's exponents lie in [-148, 128]); the last bin takes the zeros.
_BINS, _BIN_OFFSET = 300, 160
#: What a checkpoint holds of the scale buffers (``_extra_state``).
_SCALE_KEYS = ("layers", "betas", "branches", "branch_alphas", "branch_factors", "slot_alphas")
#: The models attached in this process: their states by token, and what a copy needs to take one over
#: (``_take_over``): a copy carries its original's token and generation (``__getstate__``).
_STATES: weakref.WeakValueDictionary[str, AdaptiveState] = weakref.WeakValueDictionary()
_BINDINGS: weakref.WeakKeyDictionary[AdaptiveState, _Binding] = weakref.WeakKeyDictionary()


class AdaptiveLossScaler(LossScaler):
    """Layer-wise loss scaling computed from each layer's statistics during the backward pass.

    * ``attach(model)`` rewrites the model (torch.fx) so its backward pass carries the pair
      ``<alpha, delta>``: at every conv/linear layer (every GEMM with a weight, attention's included; with
      ``product_betas``, every activation-by-activation product too) a local scale ``beta`` is computed
      from the layer's weight and incoming gradient (Algorithm 4), the incoming gradient is scaled by it
      before the input
      gradient is computed (Algorithm 3), which then carries ``alpha * beta``, and gradients meeting at a
      branch are rescaled to one common alpha before they are summed (Algorithm 5). Element-wise ops pass
      alpha through. ``rule`` chooses how beta is computed: ``"reference"`` (default), what the authors'
      released code computes, which produced the paper's tables, or ``"paper"``, the text as written
      (:mod:`adaloss.adaptive.rules` lists the differences).
    * Every parameter gradient leaves the backward pass carrying the root scale ``alpha_{N+1}``
      (``get_scale()``), as under GradScaler: each GEMM's weight gradient, and each other use of a
      parameter (a batch norm's, a tied embedding's), is multiplied by ``alpha_{N+1} / alpha`` of its own
      layer, a power of two, so exactly. ``unscale_`` then divides every gradient by ``get_scale()``, and
      GradScaler's recipes (clipping, gradient penalties, accumulation, fused optimizers) behave as they
      do under GradScaler. A step with an Inf/NaN gradient is skipped, counted, and the scales are
      recomputed on the next step.
    * The same training loop as ``torch.amp.GradScaler``; no hyperparameter to tune per model.

    Example::

        scaler = AdaptiveLossScaler("cuda", t_uf=1e-3, update_every=100, rule="reference")
        model = scaler.attach(model)          # same parameter objects, new backward pass
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            optimizer.zero_grad()
            with precision.autocast():
                loss = criterion(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)        # optional; afterwards every p.grad is the true gradient
            scaler.step(optimizer)
            scaler.update()
        scaler.layer_scales()                 # {layer: alpha}, e.g. for the paper's Figure 4a

    When the betas are computed: on the first step, then every ``update_every`` steps, and on the step after
    an overflow. In between, each layer reuses its beta (the paper uses 100 to cut the statistics' cost from
    27% to 0.27% of training time).

    The root scale ``alpha_{N+1}`` (``get_scale()``, what the loss is multiplied by), by ``root``:

    * ``"fixed"`` (default; the paper and the authors' scripts, where it is 1): ``init_scale``. If a
      recomputed step overflows again it is halved; after ``growth_interval`` clean steps it doubles back,
      never above ``init_scale``.
    * ``"dynamic"``: GradScaler's rule, shared with ``DynamicLossScaler(rule="torch")``
      (:func:`adaloss.scalers.dynamic.backed_off`, :func:`~adaloss.scalers.dynamic.grown`): from
      ``init_scale`` (GradScaler starts at 2**16), halved on every overflow (the step is skipped), doubled
      after ``growth_interval`` clean steps, with no ceiling (a growth past float32 is dropped); the
      layer-wise betas on top.
    * ``"adaptive"``: Algorithm 4 applied to the loss gradient itself (:meth:`root_target`): the loss
      gradient is measured where it enters the model (a forward hook passes every output through an
      identity node that counts its gradient's elements by binade and takes its largest magnitude, on the
      device), on the first iteration and on the iteration before each scheduled recompute; ``update()``
      reads the measurement (one host sync, after ``step()``'s) and sets the ceiling of ``alpha_{N+1}`` to
      the smallest power of two that leaves at most ``t_uf`` of it below ``u_min``, under its overflow
      bound and ``accum_upper_bound``. Overflows back off as under ``fixed``, below that ceiling. Under
      DDP the counts are summed and the maxima taken over the ranks (two collectives on the scaler's own
      group, in ``update()``), so every rank sets the same ``alpha_{N+1}``. Without a model attached
      there is nothing to measure: ``alpha_{N+1}`` stays as under ``fixed``.

    A change of ``alpha_{N+1}`` recomputes the betas on the next step.

    Every alpha, beta and branch factor lives in device tensors allocated at ``attach`` (fixed addresses,
    :class:`~adaloss.adaptive.state.ScaleBuffers`): a recompute pass writes them in place, the passes in
    between read them there, and whether a pass recomputes is decided before its forward pass (by
    ``update()``, or ``recompute_next()``). So ``torch.compile(scaler.attach(model), fullgraph=True)``
    traces the model with Algorithm 3 inside, one graph per pass kind, and the scales changing never
    recompile it. The same code runs on every device: on the CPU, in the emulation, the code a GPU runs,
    eager or compiled. Under gradient accumulation every
    ``scale()`` of one iteration uses the betas of its first backward pass. Layers and branch points that no
    gradient reaches (frozen layers while fine-tuning, a model input used by two layers) get no scales, and
    the steps in between go without them; the attached model notes at each forward pass which parameters
    and inputs require gradients, and a change there (unfreezing a stage) makes that step a recompute step.
    A reuse pass that reaches a point without scales anyway (what the flags cannot see, or a compiled
    model, which skips that note) makes NaN gradients: the step is skipped and the next one recomputes.

    Copies: ``copy.deepcopy`` and ``pickle`` give an independent scaler with the same state (see
    ``__getstate__``); attach it to a model with the same layers. Differences from GradScaler, deliberate:
    one scaler per model (``attach`` rewrites that model); without a model attached the scaler scales the
    loss by ``alpha_{N+1}`` alone. After a backward pass that built a graph (``create_graph=True``, the
    gradient-penalty recipe), the next backward pass of the same iteration applies ``alpha_{N+1}``
    everywhere (every beta 1): the penalty's gradients reach the activations at the root scale, where the
    layers' alphas would not match them.

    Distributed data parallel (``torch.distributed`` initialized, world size > 1): call ``attach`` on every
    rank after ``init_process_group`` and wrap the *returned* module in DDP
    (``adaloss.distributed.wrap_model(scaler.attach(model), info)``).

    * Identical scales on every rank: on recompute steps each GEMM point all-gathers its incoming gradient's
      second moment and max magnitude (mean and max over ranks) before computing beta, and each branch
      point all-reduces its inputs' maxima; so every rank computes the same betas, branch factors and
      alphas, bitwise. Cost: one two-float collective per GEMM point and one per branch point, on recompute
      steps only (none on reuse steps), on a process group of its own created by ``attach`` (so their order
      relative to DDP's bucket all-reduces, issued from the same backward pass, cannot matter). With NCCL
      they are queued on the device and add no host sync. The found-Inf flag is all-reduced like every
      scaler's (see ``LossScaler.unscale_``), so all ranks skip the same steps and change ``alpha_{N+1}``
      alike.
    * DDP's gradient all-reduce fires when a parameter's gradient has been accumulated, i.e. on what this
      scaler's backward pass produced: every parameter's gradient at the root scale, the same power of two
      on every rank, so DDP averages scaled gradients exactly as under GradScaler and ``unscale_``
      divides the average afterwards.
    * Relation to one process on the combined batch: each rank backpropagates the mean loss over its own
      ``1/W`` of the batch, so its gradients are ``W`` times the single process's. The combined statistics
      are therefore exactly those of a single process run with ``init_scale * W``, and each rank's alphas
      are that run's alphas divided by ``W`` (so ``layer_scales()`` may differ from those of a single process
      with the same ``init_scale``). The weights match the single process within rounding. The mean of
      per-rank second moments is the global one when all ranks hold equally many samples, as
      ``DistributedSampler`` arranges.

    GradScaler parity: a leading ``device`` (as ``torch.amp.GradScaler("cuda", ...)``, see ``LossScaler``);
    ``is_enabled()``; ``get_growth_interval``/``set_growth_interval`` for the regrowth of a lowered
    ``alpha_{N+1}``; ``get_growth_factor()`` is 2.0 and ``get_backoff_factor()`` 0.5, fixed: ``alpha_{N+1}``
    stays a power of two, so every gradient unscales exactly (their setters accept only those values).
    Host-device syncs: ``scale``, ``unscale_``, ``recompute_next``, the growth and backoff getters and
    setters: none; ``step``: one (the Inf/NaN flag); ``update``: one on a step that recomputed the scales
    (with ``update_every > 1``: which of them are exactly 1), one on a step that measured the loss gradient
    (``root="adaptive"``), one on a step that moves ``alpha_{N+1}`` (a backoff, a growth), else none;
    ``get_scale``: one (``alpha_{N+1}`` lives in the scale buffers, as GradScaler's in ``_scale``);
    ``snapshot`` and what reads it (``layer_scales``, ``layer_betas``, ``branch_rescaled``,
    ``loss_scale_metric``, ``state_dict``): one, the first time after the buffers were written (a recompute,
    a new ``alpha_{N+1}``, a loaded state), none again until then; the attached model's forward pass: one
    when the parameters' ``requires_grad`` flags changed since the last recompute (to read which points
    have scales).

    The options can also be given as one :class:`~adaloss.scalers.recipe.AdaptiveRecipe` (where each is
    declared, with its default and check): ``AdaptiveLossScaler.from_recipe(recipe, device)``.

    Args:
        device (str or torch.device, optional, default=None): As GradScaler's first argument (see
            ``LossScaler``): ``"cuda"`` without CUDA disables the scaler with a warning.
        t_uf (float, optional, default=1e-3): the tolerated underflow probability per layer (``T_uf``); the
            paper uses 1e-3 throughout.
        update_every (int, optional, default=100): recompute the betas every this many steps.
        init_scale (float, optional, default=1.0): the initial scale ``alpha_{N+1}`` applied to the loss.
        fmt (FloatFormat or str, optional, default="fp16"): the gradients' storage format; gives ``u_min``
            (smallest subnormal, 2**-24 for FP16) and ``u_max`` (largest finite, 65504) unless given.
        rule (str, optional, default="reference"): how a layer's beta is computed
            (:mod:`adaloss.adaptive.rules`): ``"reference"``, what the authors' released code computes (it
            produced the paper's tables), or ``"paper"``, Algorithm 4 as the text writes it.
        scale_upper_bound (float or None, optional, default="auto"): cap on each beta; None for no cap.
            ``"auto"``: 16 under ``reference`` (the authors' default), none under ``paper``.
        accum_upper_bound (float or None, optional, default="auto"): cap on the accumulated scale: a
            layer receiving ``alpha`` gets ``beta <= accum_upper_bound / alpha``; None for no cap.
            ``"auto"``: 1024 under ``reference``, none under ``paper``.
        u_min (float, optional): override of the underflow threshold ``u`` in Algorithm 4 (default: the
            format's smallest subnormal; under ``reference`` with FP16, the authors' 6.0e-8).
        u_max (float, optional): override of the overflow bound of section 3.2.3 and Algorithm 5.
        allow_below_one (bool, optional, default=False): under ``paper``, let ``beta`` fall below 1 when the
            gradient is already large (the text keeps ``beta >= 1``: a layer never has less scale than the
            layers after it). The ``reference`` rule lets beta fall below 1 through its bounds alone, so
            this must stay False there.
        growth_interval (int, optional, default=2000): clean steps before a lowered ``alpha_{N+1}`` doubles
            (``root="dynamic"``: before it doubles, lowered or not).
        enabled (bool, optional, default=True): ``False`` makes every method a passthrough.
        root (str, optional, default="fixed"): how ``alpha_{N+1}`` is chosen: ``"fixed"``, ``"dynamic"``
            or ``"adaptive"`` (above).
        product_betas (bool, optional, default=True): give activation-by-activation products (``matmul``,
            ``bmm``, ``@``) and attention calls (``F.scaled_dot_product_attention``,
            ``nn.MultiheadAttention``) a beta of their own, Algorithm 4 with the other operand in the
            weight's place (:func:`adaloss.adaptive.ops.product_beta`); ``False``: alpha passes through them
            unchanged.
    """

    name = "adaptive"
    _number_keyword = "t_uf"
    _attached: nn.Module | None = None  # the module attach() returned, for coverage()

    def __init__(
        self,
        device: str | torch.device | None = None,
        t_uf: float = 1e-3,
        update_every: int = 100,
        init_scale: float = 1.0,
        fmt: FloatFormat | str | None = "fp16",
        u_min: float | None = None,
        u_max: float | None = None,
        allow_below_one: bool = False,
        growth_interval: int = 2000,
        enabled: bool = True,
        rule: str = "reference",
        scale_upper_bound: float | str | None = "auto",
        accum_upper_bound: float | str | None = "auto",
        product_betas: bool = True,
        root: str = "fixed",
    ) -> None:
        # the arguments, what a copy is built from (``__getstate__``)
        self._options = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        options = {k: v for k, v in self._options.items() if k not in ("device", "enabled")}
        recipe = AdaptiveRecipe(**options)
        super().__init__(device, init_scale=2.0 ** math.floor(math.log2(recipe.init_scale)), enabled=enabled)
        self._configure(recipe)

    @classmethod
    def from_recipe(
        cls, recipe: AdaptiveRecipe, device: str | torch.device | None = None, enabled: bool = True
    ) -> AdaptiveLossScaler:
        """The scaler of ``recipe`` (its options, checked when it was made). No host-device sync."""
        options = {f: getattr(recipe, f) for f in AdaptiveRecipe.__dataclass_fields__}
        return cls(device, enabled=enabled, **options)

    def _configure(self, recipe: AdaptiveRecipe) -> None:
        """Set up from the checked ``recipe`` (``self.recipe``, the options as parsed)."""
        self.recipe = recipe
        self.fmt, self.product_betas, self.root = recipe.fmt, recipe.product_betas, recipe.root
        self.u_min, self.u_max = recipe.thresholds()
        self.t_uf, self.update_every = recipe.t_uf, recipe.update_every
        self.allow_below_one, self.growth_interval = recipe.allow_below_one, recipe.growth_interval
        self.rule = recipe.scale_rule()
        self._ceiling = self._init_scale  # the ceiling of alpha_{N+1} (root="adaptive": the measured one)
        self.state: AdaptiveState | None = None
        self._iteration = 0
        # a recompute is owed (an overflow, a new alpha_{N+1}, a request, a loaded state): an input of the
        # plan (_plan), kept in checkpoints; the pass kind itself is AdaptiveState.kind
        self._force_recompute = True
        self._scaled_this_iteration = False  # scale() was called since update(), attached or not
        self._consecutive_overflows, self._clean_steps = 0, 0
        # a state_dict loaded before attach(), as loaded, until attach() restores it (_restore_loaded)
        self._loaded: dict[str, Any] | None = None
        self._last_pass: PassKind | None = None  # the kind of the last backward pass (``last_pass``)
        # root="adaptive": what this iteration measured of the loss gradient (binade counts and max
        # magnitude, on the device) and the alpha_{N+1} it was measured at (a 0-dim device tensor)
        self._root_stats: tuple[torch.Tensor, torch.Tensor] | None = None
        self._root_at: torch.Tensor | None = None
        self._binding: tuple[str, int] | None = None  # its model's (token, generation): _take_over

    # ------------------------------------------------------------------ copies

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and ``pickle`` keep: the options and ``state_dict()`` (the scale, the
        counters, every layer's beta and branch factors) and which scaler it was copied from. One host sync
        per per-layer device tensor, as ``state_dict``.

        The copy is a scaler of its own: ``attach`` it to a model with the same layers (a copy of the
        model before it was attached, say) and it continues with the same scales, as a resumed run does;
        nothing done to the copy reaches the original's model. Or, as with GradScaler (PyTorch's
        ``test_grad_scaling_autocast`` pickles its scaler after every iteration), go on training the
        original's model with the copy, unattached: its first ``scale()`` takes that model over (in the
        same process), loading the copy's state into it, and the original is refused from then on. Like
        GradScaler's, take a copy between iterations (after ``update()``), not between ``scale()`` and
        ``update()``."""
        if self._scaled_this_iteration:
            raise RuntimeError(
                "an AdaptiveLossScaler can be copied or pickled between iterations only: call update() first"
            )
        return {
            "options": dict(self._options),
            "state": self.state_dict(),
            "scaled": self._has_scaled,
            "binding": self._binding,
        }

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self.__init__(**saved["options"])
        if saved["state"]:
            self.load_state_dict(saved["state"])
        self._has_scaled = saved["scaled"]
        self._binding = saved.get("binding")

    def _take_over(self) -> None:
        """A copy never attached, at its first ``scale()``: drive its original's model if that model lives in
        this process and no other copy of the same original took it over (the binding's generation moved
        on); the copy's state (what the original had when copied) goes into that model's scale buffers, as
        ``attach`` restores a loaded state. Host-side, a few device copies; no sync."""
        token, generation = self._binding
        self._binding = None
        state = _STATES.get(token)
        binding = _BINDINGS.get(state) if state is not None else None
        model = binding.model() if binding is not None else None
        if model is None or binding.generation != generation:
            return
        binding.generation += 1
        self._adopt(state)
        self._attached, self._binding = model, (token, binding.generation)
        if (root_hook := binding.root_hook()) is not None:
            root_hook.scaler = self
        self._restore_loaded()

    def _bound(self) -> bool:
        """Whether this attached scaler still drives its model (no copy took it over). Host-side."""
        token, generation = self._binding
        return _BINDINGS[self.state].generation == generation

    # ------------------------------------------------------------------ model

    def attach(self, model: nn.Module, *example_inputs: Any, **example_kwargs: Any) -> nn.Module:
        """Return ``model`` rewritten for adaptive scaling; parameters and buffers are the same objects.

        Raises ``AdaptiveTransformError`` (a ``ConfigError``) naming the construct if the model cannot be
        rewritten. Call once per scaler. No host-device sync.

        ``example_inputs`` / ``example_kwargs``: a forward call's arguments, for models torch.fx cannot
        trace symbolically (Hugging Face transformers): they are captured with ``torch.export`` on these
        (every tensor dimension dynamic where the model allows: other batch sizes and lengths need no new
        capture), rewritten by the same passes, and ``model`` itself is returned, its class and methods
        kept, with the rewritten graph as its ``forward`` for calls with the same arguments (see
        :mod:`adaloss.adaptive.capture`). Ignored for models fx traces. Give batch and sequence sizes of 2
        or more: export fixes dimensions of size 1.

        Warns (``UserWarning``, one per module) about each recurrent layer (``nn.LSTM``, ``nn.GRU``,
        ``nn.RNN`` and their cells), naming its GEMM weights: its GEMMs run inside one ATen op, so they get
        no scaling point; their gradients stay exact. :meth:`coverage` reports every weight without a point.
        """
        if not self._enabled:
            return model
        if self.state is not None:
            raise RuntimeError("attach() was already called on this scaler; use one scaler per model")
        state = AdaptiveState(self.rule)
        if distributed_world_size() > 1:
            # A group of its own: these collectives are issued from inside the backward pass, interleaved
            # with DDP's bucket all-reduces; on a separate communicator their relative order cannot matter.
            state.reduce_fn = _StatisticsReducer(torch.distributed.new_group())
        example = (example_inputs, example_kwargs) if example_inputs or example_kwargs else None
        gm = attach_adaptive(model, state, self.product_betas, example)
        self._adopt(state)
        self._restore_loaded()
        # Which tensors need gradients, per forward pass: lets reuse steps skip points no gradient reaches
        # (frozen layers) instead of recomputing every step (see AdaptiveState.start_backward).
        gm.register_forward_pre_hook(GradSignature(state, list(gm.parameters())), with_kwargs=True)
        root_hook = _LossGradientHook(self) if self.root == "adaptive" else None
        if root_hook is not None:  # the loss gradient's statistics, at the model's outputs
            gm.register_forward_hook(root_hook)
        self._attached = gm
        token = uuid.uuid4().hex  # a copy attached to a model of its own takes no other over
        _STATES[token], _BINDINGS[state] = state, _Binding(gm, root_hook)
        self._binding = (token, 0)
        for layer in recurrent_layers(gm, state):  # never silently: name the weights left without a point
            warnings.warn(layer.warning(), UserWarning, stacklevel=2)
        return gm

    def attach_within(
        self, model: nn.Module, path: str, *example_inputs: Any, **example_kwargs: Any
    ) -> nn.Module:
        """``attach(model, ...)`` for a model that holds the user's network at submodule ``path`` (a
        ``LightningModule`` with it in ``self.net``, say): the points under ``path`` are named relative to it
        (``0`` rather than ``net.0``), as ``attach`` on the network itself names them, so scaler states,
        ``layer_scales()`` and telemetry carry over between the two. A state loaded before is restored
        under those names. ``path=""``: ``attach``. No host-device sync."""
        loaded, self._loaded = self._loaded, None
        attached = self.attach(model, *example_inputs, **example_kwargs)
        if path and self.state is not None:
            cut = f"{path}."
            for point in (*self.state.gemms, *self.state.branches, *self.state.points.unscales):
                if point.name.startswith(cut):
                    point.name = point.name[len(cut) :]
        self._loaded = loaded
        self._restore_loaded()
        return attached

    def _adopt(self, state: AdaptiveState) -> None:
        """Drive ``state`` from now on: ``alpha_{N+1}`` moves into its buffers (``alpha[0]``), which hold it
        from then on (nothing else keeps it). A device copy, no sync."""
        root = self._scale_holder()
        self.state = state
        state.scales_written(root_only=True)
        if root is None:
            state.buffers.alpha[0].fill_(self._init_scale)
        else:
            state.buffers.alpha[0].copy_(root)
        self._scale = None

    def coverage(self, *example_inputs: Any, **example_kwargs: Any) -> Coverage:
        """What ``attach`` scaled, for a user to check a model in one call: every GEMM point (a layer's, with
        the parameter under its weight; a product's, with or without a beta), every parameter of 2 or more
        dimensions under no point and why (a recurrent layer's weight, an embedding table, a positional
        embedding), and, given example inputs (as the model takes them), the GEMM calls of one forward pass
        counted in ATen, each inside a point or not: a GEMM the transform does not recognize shows up
        there, named by its parameter. ``print(scaler.coverage(x))`` shows a table;
        ``.every_gemm_weight_has_a_point`` sums it up (see :mod:`adaloss.adaptive.coverage`).

        Without inputs: host-side only, no sync. With inputs: one forward pass with every ATen op through
        Python, to be counted as a host-device sync: call it before training, not in the loop. That pass
        runs under ``torch.no_grad()`` in the model's training mode; the buffers (batch-norm statistics)
        and the random generators are restored after it, and the scaler's state is untouched. Under
        autocast the count follows each weight into its cast copy.

        Raises:
            RuntimeError: before ``attach`` (or on a disabled scaler, which attaches nothing).
        """
        if self.state is None or self._attached is None:
            why = (
                "the scaler is disabled, so attach() rewrote nothing"
                if not self._enabled
                else "call it first"
            )
            raise RuntimeError(f"coverage() reports on the model attach() rewrote: {why}")
        return build_coverage(self._attached, self.state, example_inputs, example_kwargs)

    # ------------------------------------------------------------------ training-loop API

    def scale(self, outputs: Any) -> Any:
        """Multiply the loss by ``alpha_{N+1}`` and arm the backward pass. No host sync.

        Without a model attached, the scaler scales the loss by ``alpha_{N+1}`` alone, as a GradScaler
        would (with this scaler's backoff and regrowth of ``alpha_{N+1}``).

        Whether this iteration recomputes the betas was decided before its forward pass (``update()``
        decides it for the next iteration, see :attr:`last_pass`); further calls before ``update()``
        (gradient accumulation) reuse the betas of the first backward pass. On the device: ``alpha_{N+1}``
        copied into the scale buffers, and on a recompute step NaN into the scales about to be computed
        (a few device ops).
        """
        if not self._enabled:
            return outputs
        if self.state is None and self._binding is not None:
            self._take_over()  # a copy going on with its original's model, as GradScaler's copies do
        if self.state is None:  # no model attached: GradScaler's loss scaling at alpha_{N+1}
            AdaptiveState.note_scale()
            return super().scale(outputs)
        if not self._bound():
            raise RuntimeError(
                "this AdaptiveLossScaler's model is driven by a copy of it now (copy.deepcopy or pickle, "
                "whose scale() took the model over): go on with the copy, or attach the copy to a model of "
                "its own before using it"
            )
        state = self.state
        if not self._scaled_this_iteration:
            self._scaled_this_iteration = True
            self._root_stats = None
            if self._measuring_root:
                self._root_at = state.buffers.alpha[0].clone()
        # the planned kind on the iteration's first pass (reuse on the further ones: arm() sets it); a plain
        # pass after one that built a graph (GradScaler's gradient-penalty recipe)
        kind = PassKind.PLAIN if state.graph_built else state.kind
        state.arm(kind)
        self._last_pass = kind
        return super().scale(outputs)

    @property
    def _measuring_root(self) -> bool:
        """root="adaptive": whether this iteration measures the loss gradient: the first iteration and the
        one before each scheduled recompute, whose alpha_{N+1} it decides (see _follow_loss_gradient)."""
        due = self._iteration == 0 or (self._iteration + 1) % self.update_every == 0
        return self.root == "adaptive" and self._scaled_this_iteration and due

    def _scale_holder(self) -> torch.Tensor | None:
        """``alpha_{N+1}``'s one tensor: ``alpha[0]`` of the scale buffers once attached, else the base
        scaler's ``_scale``. Host-side, no sync."""
        if self.state is not None and self.state.buffers is not None:
            return self.state.buffers.alpha[0]
        return self._scale

    def _store_scale(self, value: float) -> None:
        """A new ``alpha_{N+1}``, written in place into its buffer (fixed address). No sync."""
        if self.state is not None and self.state.buffers is not None:
            self.state.scales_written(root_only=True)
            self.state.buffers.alpha[0].fill_(value)
        else:
            super()._store_scale(value)

    def recompute_next(self) -> None:
        """Recompute the betas on the next step, as after an overflow (for instance after changing the
        weights by hand, or to time a recompute step). Call it before that step's forward pass, which
        fixes the kind of its backward pass. No host sync."""
        self._force_recompute = True
        self._plan()

    def _plan(self) -> None:
        """Decide the kind of the next iteration's passes, before its forward pass (``AdaptiveState.kind``):
        a recompute on schedule (every ``update_every`` iterations), after an overflow, after a change of
        ``alpha_{N+1}`` and on request; else a reuse. Host-side; no sync."""
        if self.state is not None and not self._scaled_this_iteration:
            due = self._force_recompute or self._iteration % self.update_every == 0
            self.state.kind = PassKind.RECOMPUTE if due else PassKind.REUSE

    def _set_loss_scale(self, value: float, current: float | None = None) -> None:
        """A new ``alpha_{N+1}`` (backoff, growth, ``update(new_scale)``, a loaded state): the alphas in the
        buffers were computed under the old one, so the next step recomputes. ``current``: the old one, if
        the caller has read it; else it is read here (one sync, on these rare steps only)."""
        if value != (self._current_scale() if current is None else current):
            self._force_recompute = True
        super()._set_loss_scale(value)

    @property
    def last_pass(self) -> str | None:
        """What the last backward pass did with the layer-wise scales: ``"recompute"`` (Algorithms 4 and 5
        computed new betas and branch factors), ``"reuse"`` (the last recompute's were applied, as on the
        ``update_every - 1`` steps between recomputes), ``"plain"`` (every beta 1: a pass after one that
        built a graph, GradScaler's gradient-penalty recipe), or None before the first backward pass or
        without a model attached. Host-side; no sync."""
        if self.state is None or not self._has_scaled:
            return None
        return self._last_pass

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Finish the iteration: count it, and decide what the next one does (see the class docstring).

        ``new_scale`` sets ``alpha_{N+1}``, as GradScaler's ``update(new_scale)`` sets its scale.

        .. note::
            One sync on a step that recomputed the scales (with ``update_every > 1``: which are exactly
            1, so that eager reuse steps skip multiplying by them) and one on a step that measured the loss
            gradient (``root="adaptive"``); else none (``step()`` has read the Inf/NaN flag already).
            Decides the kind of the next iteration's passes (see :meth:`recompute_next`).

        Raises:
            ScaleNotCalledError: if no ``scale()`` call has been made yet (as GradScaler).
        """
        super().update(new_scale)
        self._scaled_this_iteration = False
        if self.state is not None:
            self.state.armed = self.state.graph_built = False
        self._plan()

    # ------------------------------------------------------------------ GradScaler's growth and backoff

    def get_growth_interval(self) -> int:
        """Clean steps after which a lowered ``alpha_{N+1}`` doubles (never above its ceiling; under
        ``root="dynamic"`` it doubles, lowered or not). No sync."""
        return self.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (a positive integer); steps already counted still count. No sync."""
        self.growth_interval = positive_int(new_interval, "scaler.growth_interval", "2000")

    def get_growth_factor(self) -> float:
        """2.0: a lowered ``alpha_{N+1}`` doubles (a power of two, so gradients unscale exactly). No sync."""
        return _ALPHA_GROWTH

    def set_growth_factor(self, new_factor: float) -> None:
        """Only 2.0 is accepted (see ``get_growth_factor``), so GradScaler-style code that sets it runs.
        No sync."""
        _fixed_factor(new_factor, _ALPHA_GROWTH, "growth", "doubles")

    def get_backoff_factor(self) -> float:
        """0.5: ``alpha_{N+1}`` halves after two overflowing steps in a row (the first one only recomputes
        the betas; ``root="dynamic"``: on every overflow). No sync."""
        return _ALPHA_BACKOFF

    def set_backoff_factor(self, new_factor: float) -> None:
        """Only 0.5 is accepted (see ``get_backoff_factor``), so GradScaler-style code that sets it runs.
        No sync."""
        _fixed_factor(new_factor, _ALPHA_BACKOFF, "backoff", "halves")

    def _update_scale(self, found_inf: bool) -> None:
        """Count the iteration; move ``alpha_{N+1}`` by the ``root`` rule (class docstring)."""
        self._iteration += 1
        measured, self._root_stats = self._root_stats, None
        if found_inf:
            self._force_recompute = True
            self._consecutive_overflows += 1
            self._clean_steps = 0
            # fixed, adaptive: the first overflow only recomputes the betas; dynamic: GradScaler's backoff
            if self._consecutive_overflows >= (1 if self.root == "dynamic" else 2):
                current = self._current_scale()  # the one read of alpha_{N+1} (a sync): a backoff step
                self._set_loss_scale(backed_off(current, _ALPHA_BACKOFF, _ROOT_FLOOR), current)
            return
        self._force_recompute = False
        self._consecutive_overflows = 0
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            current = self._current_scale()  # the one read of alpha_{N+1} (a sync): every growth_interval
            if self.root == "dynamic" or current < self._ceiling:
                ceiling = None if self.root == "dynamic" else self._ceiling
                self._set_loss_scale(grown(current, _ALPHA_GROWTH, ceiling), current)
                self._clean_steps = 0
                self._force_recompute = True
        if measured is not None:
            self._follow_loss_gradient(measured)
        if self.state is not None and self.update_every > 1:
            self.state.note_units()  # one sync after a recompute (units unknown): reuse steps skip 1s

    # ------------------------------------------------------------------ root="adaptive"

    def _record_root(self, grad: torch.Tensor) -> None:
        """Add one model output's gradient (the loss gradient, at ``alpha_{N+1}``) to this iteration's
        measurement: how many of its non-zero elements lie in each binade (``|g| = m 2**e``, ``m`` in
        [0.5, 1): a histogram of ``e``, :data:`_BINS` int64 counts) and its largest magnitude, on the
        gradient's device. Called from the backward pass on measuring iterations only; static shapes, no
        host sync."""
        if not self._measuring_root or grad is None or grad.numel() == 0:
            return
        with torch._C.DisableTorchFunction(), torch.no_grad():
            a = grad.detach().abs().float().reshape(-1)
            e = torch.frexp(a).exponent.to(torch.int64).add_(_BIN_OFFSET).clamp_(0, _BINS - 2)
            e = torch.where(a == 0, _BINS - 1, e)  # zeros (and nothing else) in the last bin, not counted
            counts = torch.zeros(_BINS, dtype=torch.int64, device=a.device).index_add_(
                0, e, torch.ones_like(e)
            )
            peak = a.amax()
            if self._root_stats is None:
                self._root_stats = (counts, peak)
            else:  # another output, or another backward pass of this iteration (accumulation)
                old_counts, old_peak = self._root_stats
                self._root_stats = (
                    old_counts + counts.to(old_counts.device),
                    old_peak.maximum(peak.to(old_peak.device)),
                )

    def _follow_loss_gradient(self, measured: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Algorithm 4 on the loss gradient itself: the new ceiling of ``alpha_{N+1}`` from a clean step's
        measurement (one host sync, in ``update()``, after ``step()``'s). A backoff in force stays:
        ``alpha_{N+1}`` moves by the same power of two as its ceiling. A change recomputes the betas on
        the next step (those in use were computed under the old ``alpha_{N+1}``)."""
        counts, peak = measured
        if self.state is not None and self.state.reduce_fn is not None:  # the same root on every rank
            dist, group = torch.distributed, self.state.reduce_fn.group
            counts, peak = counts.clone(), peak.clone()
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        roots = torch.stack([self._root_at, self._scale_holder()]).to(counts.device).double()
        host = torch.cat([counts.double(), peak.double().reshape(1), roots]).cpu().tolist()  # the one sync
        root_at, current = host[-2:]
        peak_value = host[-3] / root_at
        if not math.isfinite(peak_value):
            return
        by_exponent = {e - _BIN_OFFSET: int(c) for e, c in enumerate(host[: _BINS - 1]) if c}
        ceiling = self.root_target(by_exponent, peak_value, root_at)
        if ceiling == self._ceiling:
            return
        scale = max(current * (ceiling / self._ceiling), _ROOT_FLOOR)
        self._ceiling = ceiling
        if scale != current:
            self._set_loss_scale(scale, current)
            self._force_recompute = True

    def root_target(self, by_exponent: dict[int, int], peak: float, measured_at: float = 1.0) -> float:
        """``alpha_{N+1}`` as Algorithm 4 chooses a layer's beta, for a loss gradient measured at scale
        ``measured_at``: ``by_exponent`` counts its non-zero elements by binade (``{e: n}`` for ``|g| = m
        2**e``, ``m`` in [0.5, 1)) and ``peak`` is its largest unscaled magnitude.

        * Lower bound: the smallest power of two ``alpha`` under which at most ``T_uf`` of the elements
          fall below ``u_min`` (rounded to the nearest power of two), Equation 1's condition ``P(alpha |g|
          <= u) <= T_uf`` on the measured distribution: a layer's ``p`` is a product inside its GEMM,
          which the paper models as normal; the loss gradient is there to be counted (a softmax's is far
          from normal: its many small elements spread over many binades).
        * Overflow bound ``u_max / peak``; the two combined and rounded down to a power of two as
          ``scaler.rule`` combines a layer's, under the accumulation cap (``accum_upper_bound``:
          ``alpha_{N+1}`` is the accumulated scale of the output layers' gradients; the per-layer cap does
          not apply). No elements: 1. On the host; no device involved."""
        total = sum(by_exponent.values())
        if total == 0:
            return 1.0
        threshold = round(math.log2(self.u_min))  # |g| alpha < 2**threshold underflows
        shift = round(math.log2(measured_at))  # the binades were counted at this scale (a power of two)
        allowed, below, lower_exp = self.t_uf * total, 0, None
        exponents = sorted(by_exponent)
        # alpha = 2**s keeps |g| = m 2**(e - shift) when e - shift + s > threshold: scan the smallest s
        for s in range(threshold - exponents[-1] + shift, threshold - exponents[0] + shift + 2):
            below = sum(n for e, n in by_exponent.items() if e - shift + s <= threshold)
            if below <= allowed:
                lower_exp = s
                break
        lower = 2.0**lower_exp if lower_exp is not None else NO_BOUND
        cap = self.rule.caps[1]
        # Algorithm 4's bounds and rule as a layer's: the loss gradient in the gradient's place, no weight
        # (statistics 1), its counted quantile as the underflow bound's constant
        one = torch.ones((), dtype=torch.float64)
        unit, grad = Statistics(one, one), Statistics(one, torch.tensor(peak, dtype=torch.float64))
        bounds = gemm_bounds(unit, grad, lower, self.u_max)
        return min(max(float(self.rule.beta(*bounds, caps=(cap, cap))), _ROOT_FLOOR), NO_BOUND)

    # ------------------------------------------------------------------ telemetry

    def snapshot(self) -> ScaleSnapshot | None:
        """Every scale of the attached model, ``alpha_{N+1}`` included, read from its device buffers in one
        host read (one sync; none while the buffers are unchanged since the last one): what
        :meth:`layer_scales`, :meth:`layer_betas`, :meth:`branch_rescaled`, :meth:`loss_scale_metric` and
        :meth:`state_dict` report. None before ``attach``."""
        return self.state.snapshot() if self.state is not None else None

    def layer_scales(self, snapshot: ScaleSnapshot | None = None) -> dict[str, float]:
        """``{layer: alpha}``: the accumulated scale each conv/linear layer's gradient carried in the last
        backward pass (the scale its weight gradient was divided by). Read from :meth:`snapshot` (one host
        sync after a recompute, none on the reuse steps after it), or from the ``snapshot`` given."""
        return self._scales_and_betas(snapshot)[0]

    def layer_betas(self, snapshot: ScaleSnapshot | None = None) -> dict[str, float]:
        """``{layer: beta}``: each layer's local scale (Algorithm 4) currently in use. Read from
        :meth:`snapshot` (shares its one sync), or from the ``snapshot`` given."""
        return self._scales_and_betas(snapshot)[1]

    def branch_rescaled(self) -> dict[str, bool]:
        """``{branch: whether its incoming gradients had different alphas}`` at the last recompute, for the
        branch points a gradient reached then. Read from :meth:`snapshot` (shares its one sync)."""
        if self.state is None or self.state.buffers is None or not self.state.branches:
            return {}
        return self.snapshot().branch_rescaled()

    def loss_scale_metric(self) -> dict[str, float]:
        """What the logger records as the loss scale: ``layer_scales()`` (and its one sync)."""
        return self.layer_scales()

    def _scales_and_betas(self, snap: ScaleSnapshot | None) -> tuple[dict[str, float], dict[str, float]]:
        """Every layer's alpha and beta, from one snapshot of the buffers. After a plain pass every alpha is
        ``alpha_{N+1}``."""
        snap = snap if snap is not None else self.snapshot()
        if snap is None:
            return {}, {}
        alphas, betas = snap.point_scales()
        out: tuple[dict[str, float], dict[str, float]] = ({}, {})
        for point, alpha, beta in zip(self.state.gemms, alphas, betas, strict=True):
            if beta is not None:
                out[0][point.name] = snap.root if self._last_pass is PassKind.PLAIN else alpha
                out[1][point.name] = beta
        return out

    # ------------------------------------------------------------------ checkpointing

    def _extra_state(self) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "iteration": self._iteration,
            "force_recompute": self._force_recompute,
            "consecutive_overflows": self._consecutive_overflows,
            "clean_steps": self._clean_steps,
            "init_scale": self._ceiling,  # the ceiling of alpha_{N+1} (root="adaptive": the measured one)
            "root": self.root,
        }
        if self._loaded is not None:  # loaded before attach(): as loaded
            extra.update({k: self._loaded.get(k) for k in _SCALE_KEYS})
            return extra
        snap = self.snapshot()
        if snap is not None:  # the scale with every other, in the snapshot's one host read
            extra.update(scale=snap.root, **snap.checkpoint())
        return extra

    def _load_extra_state(self, saved: dict[str, Any]) -> None:
        saved_root = saved.get("root", "fixed")  # states saved before scaler.root existed: fixed
        if saved_root != self.root:
            raise ConfigError(
                f"the checkpoint holds state of scaler.root={saved_root} but this run uses "
                f"scaler.root={self.root}; resume with scaler.root={saved_root} or start a fresh run"
            )
        self._iteration = int(saved.get("iteration", 0))
        self._force_recompute = bool(saved.get("force_recompute", True))
        self._consecutive_overflows = int(saved.get("consecutive_overflows", 0))
        self._clean_steps = int(saved.get("clean_steps", 0))
        self._ceiling = float(saved.get("init_scale", self._ceiling))
        if "betas" in saved:
            self._loaded = {k: saved.get(k) for k in _SCALE_KEYS}
        self._restore_loaded()

    def _restore_loaded(self) -> None:
        """The one path a loaded state takes into the scale buffers, now (attached) or at ``attach`` (before
        it, it waits as loaded); then the next pass is planned. Host-side, a few device copies, no sync."""
        if self.state is not None and self._loaded is not None:
            loaded, self._loaded = self._loaded, None
            self._restore(loaded)
        self._plan()

    def _restore(self, saved: dict[str, Any]) -> None:
        """Write a checkpoint's scales into the scale buffers (NaN where it had none); ``alpha_{N+1}`` is
        the checkpoint's ``scale``, already in ``alpha[0]`` (its ``slot_alphas[0]`` is the one the last
        backward pass carried, for reporting). A checkpoint written before the buffers held the
        slots' alphas recomputes on its first step."""
        state = self.state
        layers = [p.name for p in state.gemms]
        if saved["layers"] != layers or saved["branches"] != [p.name for p in state.branches]:
            raise ConfigError(
                "the checkpoint's adaptive scaler state belongs to a different model (its layers differ); "
                "resume with the same model config or start a fresh run"
            )
        buf = state.buffers
        state.scales_written()

        def put(target: torch.Tensor, values: list[float | None]) -> None:
            row = [math.nan if v is None else float(v) for v in values]
            if row:
                target.copy_(torch.tensor(row, dtype=torch.float32))

        put(buf.beta, saved["betas"])
        put(buf.branch_alpha, saved["branch_alphas"])
        factors = []
        for point, f in zip(state.branches, saved["branch_factors"], strict=True):
            factors += list(f) if f is not None else [None] * len(point.in_slots)
        put(buf.branch_factors, factors)
        if saved.get("slot_alphas") is not None:  # slot 0's: the alpha_{N+1} the last pass carried
            carried = torch.tensor(saved["slot_alphas"], dtype=torch.float32).to(buf.device)
            buf.alpha[1:].copy_(carried[1:])
            buf.carried_root.copy_(carried[:1])
            buf.to_root.copy_(root_over(carried[0], carried))
        else:
            self._force_recompute = True
        # Points without scales in the checkpoint are fine only under the requires_grad flags they were
        # computed with, which the checkpoint does not hold: a partial state recomputes once.
        state.reach.at_recompute = None
        if any(b is None for b in saved["betas"]):
            self._force_recompute = True


def _fixed_factor(value: Any, fixed: float, kind: str, verb: str) -> None:
    """Accept ``value`` only if it is the fixed ``fixed`` (setting it again is harmless)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != fixed:
        raise ValueError(
            f"the adaptive scaler's {kind} factor is fixed at {fixed:g} (alpha_{{N+1}} {verb}, a power of "
            f"two, so gradients unscale exactly), got {value!r}; tune scaler.growth_interval, t_uf or "
            "init_scale instead"
        )


class _LossGradientProbe(torch.autograd.Function):
    """Identity on a model output; on the way back, hands the loss gradient reaching it to the scaler
    (``root="adaptive"``) and passes it on unchanged. A view of the output, but a copy of a 0-dim one (a
    loss the model computed), which callers change in place (transformers' Trainer: ``loss *= ...``) and
    autograd refuses that on a custom Function's view."""

    @staticmethod
    def forward(ctx, y, scaler):  # type: ignore[override]
        ctx.scaler = scaler
        with torch._C.DisableTorchFunction():
            out = y.clone() if y.dim() == 0 else y.view_as(y)
            if is_low_precision(y):  # stored in the format exactly when y is (the CPU emulation's mark)
                mark_low_precision(out)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.scaler._record_root(grad)
        return grad, None


class _Binding:
    """A model attached in this process, for its scaler's copies (``AdaptiveLossScaler._take_over``): the
    module ``attach`` returned (weakly), the ``root="adaptive"`` forward hook (whose scaler a copy
    replaces) and the generation, counting the copies that took the model over."""

    def __init__(self, model: nn.Module, root_hook: _LossGradientHook | None) -> None:
        self.model = weakref.ref(model)  # weakly, all three: the model holds its state, this entry's key
        self.root_hook = weakref.ref(root_hook) if root_hook is not None else lambda: None
        self.generation = 0


class _LossGradientHook:
    """Forward hook of an attached model under ``root="adaptive"``: every floating-point output tensor
    that requires grad (in tuples, lists and dicts too) passes through :class:`_LossGradientProbe`."""

    def __init__(self, scaler: AdaptiveLossScaler) -> None:
        self.scaler = scaler

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output
        return self._wrap(output)

    def _wrap(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.requires_grad and value.is_floating_point():
                return _LossGradientProbe.apply(value, self.scaler)
            return value
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
            return type(value)(*(self._wrap(v) for v in value))
        if isinstance(value, (list, tuple)):
            return type(value)(self._wrap(v) for v in value)
        if isinstance(value, dict):
            wrapped = {k: self._wrap(v) for k, v in value.items()}
            if type(value) is dict:
                return wrapped
            try:  # a dict of its own class (a transformers ModelOutput, an OrderedDict) stays one
                return type(value)(**wrapped)
            except TypeError:
                return wrapped
        return value


def _first_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)) and value:
        return _first_tensor(value[0])
    raise TypeError(f"scale() takes a Tensor or a (nested) list/tuple of Tensors, got {type(value).__name__}")


class _StatisticsReducer:
    """``reduce_fn`` of :class:`AdaptiveState` under ``torch.distributed``: combine statistics over ranks.

    ``(second_moment, max_abs) -> (mean over ranks, max over ranks)``: the second moment of the gradient
    spread over all ranks (every rank holds the same number of elements, so the mean of the per-rank means
    is the global mean) and its global max magnitude. One ``all_gather_into_tensor`` of two numbers per
    GEMM point (a branch point: one ``all_reduce`` MAX of its per-input maxima), on the device, no host
    sync; every rank combines the gathered values in the same order, so all get bitwise identical results.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.world_size = torch.distributed.get_world_size(group)

    def __call__(self, second_moment: torch.Tensor | None, max_abs: torch.Tensor):
        dist = torch.distributed
        if second_moment is None:
            max_abs = max_abs.clone()
            dist.all_reduce(max_abs, op=dist.ReduceOp.MAX, group=self.group)
            return None, max_abs
        mine = torch.stack([second_moment.reshape(()), max_abs.reshape(()).to(second_moment.dtype)])
        gathered = mine.new_empty(self.world_size * 2)
        dist.all_gather_into_tensor(gathered, mine, group=self.group)
        gathered = gathered.view(self.world_size, 2)
        return gathered[:, 0].sum() / self.world_size, gathered[:, 1].amax().to(max_abs.dtype)
