"""Adaptive loss scaling (Zhao et al., "Adaptive Loss Scaling for Mixed Precision Training", section 3)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from adaloss.adaptive.ops import AdaptiveState
from adaloss.adaptive.transform import attach_adaptive
from adaloss.errors import ConfigError
from adaloss.numerics.formats import FloatFormat, get_format
from adaloss.scalers.base import LossScaler

__all__ = ["AdaptiveLossScaler"]


class AdaptiveLossScaler(LossScaler):
    """Layer-wise loss scaling computed from each layer's statistics during the backward pass.

    * ``attach(model)`` rewrites the model (torch.fx) so its backward pass carries the pair
      ``<alpha, delta>``: at every conv/linear layer a local scale ``beta`` is computed from the layer's
      weight and incoming gradient (Algorithm 4), the gradient sent to the previous layer is scaled by it and
      carries ``alpha * beta``, and gradients meeting at a branch are rescaled to one common alpha before they
      are summed (Algorithm 5). Element-wise ops pass alpha through.
    * Every weight gradient is divided by its own layer's alpha, so the optimizer sees true gradients; a step
      with an Inf/NaN gradient is skipped, counted, and the scales are recomputed on the next step.
    * The same training loop as ``torch.amp.GradScaler``; no hyperparameter to tune per model.

    Example::

        scaler = AdaptiveLossScaler(t_uf=1e-3, update_every=100)
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
    27% to 0.27% of training time). If a recomputed step overflows again, the initial scale
    ``alpha_{N+1}`` is halved; after ``growth_interval`` clean steps it doubles back, never above
    ``init_scale``.

    Where gradients are unscaled: conv/linear weight and bias gradients during the backward pass, per call of
    the layer (so a layer used twice gets each contribution unscaled by its own alpha); gradients of other
    parameters (batch-norm affine weights, ...) in ``unscale_``, by the alpha of their op's output gradient.
    Parameters outside the attached model are assumed to get their gradient through the loss and are
    unscaled by ``alpha_{N+1}``.

    Args:
        t_uf (float, optional, default=1e-3): the tolerated underflow probability per layer (``T_uf``); the
            paper uses 1e-3 throughout.
        update_every (int, optional, default=100): recompute the betas every this many steps.
        init_scale (float, optional, default=1.0): the initial scale ``alpha_{N+1}`` applied to the loss.
        fmt (FloatFormat or str, optional, default="fp16"): the gradients' storage format; gives ``u_min``
            (smallest subnormal, 2**-24 for FP16) and ``u_max`` (largest finite, 65504) unless given.
        u_min (float, optional): override of the underflow threshold ``u`` in Algorithm 4.
        u_max (float, optional): override of the overflow bound of section 3.2.3 and Algorithm 5.
        allow_below_one (bool, optional, default=False): let ``beta`` fall below 1 when the gradient is
            already large. The paper's scales only grow going backwards; keeping ``beta >= 1`` means a layer
            never has less scale than the layers after it.
        growth_interval (int, optional, default=2000): clean steps before a lowered ``alpha_{N+1}`` doubles.
        enabled (bool, optional, default=True): ``False`` makes every method a passthrough.
    """

    name = "adaptive"

    def __init__(
        self,
        t_uf: float = 1e-3,
        update_every: int = 100,
        init_scale: float = 1.0,
        fmt: FloatFormat | str | None = "fp16",
        u_min: float | None = None,
        u_max: float | None = None,
        allow_below_one: bool = False,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        t_uf = _number(t_uf, "scaler.t_uf")
        if not 0.0 < t_uf < 1.0:
            raise ConfigError(f"scaler.t_uf must lie strictly between 0 and 1 (e.g. 1e-3), got {t_uf}")
        update_every = _integer(update_every, "scaler.update_every")
        growth_interval = _integer(growth_interval, "scaler.growth_interval")
        init_scale = _number(init_scale, "scaler.init_scale")
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ConfigError(f"scaler.init_scale must be a positive number (e.g. 1), got {init_scale}")
        fmt = get_format(fmt if fmt is not None else "fp16")
        self.fmt = fmt
        self.u_min = _number(u_min, "scaler.u_min") if u_min is not None else fmt.u_min
        self.u_max = _number(u_max, "scaler.u_max") if u_max is not None else fmt.u_max
        if not 0 < self.u_min < self.u_max:
            raise ConfigError(f"need 0 < scaler.u_min < scaler.u_max, got {self.u_min} and {self.u_max}")
        super().__init__(init_scale=2.0 ** math.floor(math.log2(init_scale)), enabled=enabled)
        self.t_uf = t_uf
        self.update_every = update_every
        self.allow_below_one = bool(allow_below_one)
        self.growth_interval = growth_interval
        self._init_scale = self._loss_scale
        self.state: AdaptiveState | None = None
        self._iteration = 0
        self._force_recompute = True
        self._recomputing = False
        self._scaled_this_iteration = False
        self._consecutive_overflows = 0
        self._clean_steps = 0
        self._pending: dict[str, Any] | None = None
        self._param_names: dict[int, str] = {}

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], fmt: FloatFormat | None) -> AdaptiveLossScaler:
        """Build from the ``scaler=adaptive`` config group (``fmt`` is the training gradient format)."""
        known = {
            "name",
            "t_uf",
            "update_every",
            "init_scale",
            "allow_below_one",
            "growth_interval",
            "u_min",
            "u_max",
        }
        unknown = sorted(set(cfg.keys()) - known)
        if unknown:
            raise ConfigError(
                f"scaler=adaptive has no field(s) {', '.join(unknown)}; its fields are: "
                f"{', '.join(sorted(known - {'name'}))}"
            )
        return cls(
            t_uf=cfg.get("t_uf", 1e-3),
            update_every=cfg.get("update_every", 100),
            init_scale=cfg.get("init_scale", 1.0),
            fmt=fmt,
            u_min=cfg.get("u_min"),
            u_max=cfg.get("u_max"),
            allow_below_one=cfg.get("allow_below_one", False),
            growth_interval=cfg.get("growth_interval", 2000),
        )

    # ------------------------------------------------------------------ model

    def attach(self, model: nn.Module) -> nn.Module:
        """Return ``model`` rewritten for adaptive scaling; parameters and buffers are the same objects.

        Raises ``AdaptiveTransformError`` (a ``ConfigError``) naming the construct if the model cannot be
        rewritten. Call once per scaler.
        """
        if not self._enabled:
            return model
        if self.state is not None:
            raise RuntimeError("attach() was already called on this scaler; use one scaler per model")
        state = AdaptiveState(self.u_min, self.u_max, self.t_uf, self.allow_below_one)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            state.reduce_fn = _all_reduce_statistics
        gm = attach_adaptive(model, state)
        self.state = state
        self._gemm_param_ids = {
            id(p) for m in gm.modules() if type(m).__name__ == "AdaptiveGEMM" for p in m.parameters()
        }
        self._param_names = {id(p): n for n, p in gm.named_parameters()}
        return gm

    # ------------------------------------------------------------------ training-loop API

    def scale(self, outputs: Any) -> Any:
        """Multiply the loss by ``alpha_{N+1}`` and arm the backward pass. No host sync.

        The first ``scale()`` of an iteration decides whether this iteration recomputes the betas; further
        calls before ``update()`` (gradient accumulation) reuse that decision and those betas.
        """
        if not self._enabled:
            return outputs
        if self.state is None:
            raise RuntimeError("call scaler.attach(model) and train the returned module before scale()")
        device = _first_tensor(outputs).device
        if self._pending is not None:
            self._restore(self._pending, device)
            self._pending = None
        if not self._scaled_this_iteration:
            self._recomputing = self._force_recompute or self._iteration % self.update_every == 0
            self._scaled_this_iteration = True
            recompute = self._recomputing
        else:
            recompute = False
        self.state.start_backward(self._scale_tensor(device), recompute)
        return super().scale(outputs)

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Check every gradient for Inf/NaN; divide non-GEMM parameters' gradients by their alpha.

        One fused pass per (slot, device, dtype) group, as in ``GradScaler``. No host sync.
        """
        state = self.state
        groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.dtype == torch.float16:
                    raise ValueError("refusing to unscale FP16 gradients: keep FP32 parameters")
                grad = p.grad._values() if p.grad.is_sparse else p.grad
                if id(p) in self._gemm_param_ids:
                    slot = None  # already unscaled in the backward pass
                else:
                    slot = state.param_slot_by_id.get(id(p), 0) if state is not None else 0
                groups[(slot, grad.device, grad.dtype)].append(grad)
        found: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (slot, device, _), grads in groups.items():
                flag = found.setdefault(device, torch.zeros((), dtype=torch.float32, device=device))
                alpha = state.alpha[slot] if (state is not None and slot is not None) else None
                if alpha is None:
                    inv = torch.ones((), dtype=torch.float32, device=device)
                else:
                    inv = (1.0 / alpha.float()).to(device).reshape(())
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv)
        if not found:
            return torch.zeros((), dtype=torch.float32, device=self._last_device or "cpu")
        flags = list(found.values())
        combined = flags[0]
        for f in flags[1:]:
            combined = combined + f.to(combined.device, non_blocking=True)
        return combined

    def _update_scale(self, found_inf: bool) -> None:
        """Count the iteration; on an update step copy betas and branch factors to the host (one sync)."""
        self._iteration += 1
        self._scaled_this_iteration = False
        state = self.state
        if found_inf:
            self._force_recompute = True
            self._consecutive_overflows += 1
            self._clean_steps = 0
            if self._consecutive_overflows >= 2:
                self._set_loss_scale(max(self._loss_scale / 2.0, 2.0**-24))
            if state is not None:
                state.beta_host = None
                state.branch_factors_host = None
            return
        self._force_recompute = False
        self._consecutive_overflows = 0
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval and self._loss_scale < self._init_scale:
            self._set_loss_scale(min(self._loss_scale * 2.0, self._init_scale))
            self._clean_steps = 0
            self._force_recompute = True
        if state is not None and self._recomputing and self.update_every > 1:
            self._fetch_host_copies()

    def _fetch_host_copies(self) -> None:
        state = self.state
        values = [b for b in state.beta if b is not None]
        values += [f for f in state.branch_factors if f is not None]
        if not values:
            return
        device = values[0].device
        flat = torch.cat([v.float().reshape(-1).to(device) for v in values]).cpu().tolist()  # the one sync
        it = iter(flat)
        state.beta_host = [next(it) if b is not None else 1.0 for b in state.beta]
        state.branch_factors_host = [
            [next(it) for _ in range(f.numel())] if f is not None else None for f in state.branch_factors
        ]

    # ------------------------------------------------------------------ telemetry

    def layer_scales(self) -> dict[str, float]:
        """``{layer: alpha}``: the accumulated scale each conv/linear layer's gradient carried in the last
        backward pass (the scale its weight gradient was divided by). One host sync."""
        return self._per_layer(lambda p: self.state.alpha[p.in_slot])

    def layer_betas(self) -> dict[str, float]:
        """``{layer: beta}``: each layer's local scale (Algorithm 4) currently in use. One host sync."""
        return self._per_layer(lambda p: self.state.beta[p.index])

    def branch_rescaled(self) -> dict[str, bool]:
        """``{branch: whether its incoming gradients had different alphas}`` at the last recompute."""
        if self.state is None:
            return {}
        out = {}
        for point, flag in zip(self.state.branches, self.state.branch_rescaled, strict=True):
            if flag is not None:
                out[point.name] = bool(flag.item())
        return out

    def loss_scale_metric(self) -> dict[str, float]:
        """What the logger records as the loss scale: ``layer_scales()``."""
        return self.layer_scales()

    def _per_layer(self, pick) -> dict[str, float]:
        if self.state is None:
            return {}
        names, values = [], []
        for point in self.state.gemms:
            v = pick(point)
            if v is not None:
                names.append(point.name)
                values.append(v.float().reshape(()))
        if not values:
            return {}
        host = torch.stack([v.to(values[0].device) for v in values]).cpu().tolist()
        return dict(zip(names, host, strict=True))

    # ------------------------------------------------------------------ checkpointing

    def _extra_state(self) -> dict[str, Any]:
        state = self.state
        extra: dict[str, Any] = {
            "iteration": self._iteration,
            "force_recompute": self._force_recompute,
            "consecutive_overflows": self._consecutive_overflows,
            "clean_steps": self._clean_steps,
            "init_scale": self._init_scale,
        }
        if self._pending is not None:
            extra.update(
                {
                    k: self._pending[k]
                    for k in (
                        "layers",
                        "betas",
                        "branches",
                        "branch_alphas",
                        "branch_factors",
                        "beta_host",
                        "branch_factors_host",
                    )
                }
            )
            return extra
        if state is None:
            return extra

        def host(t):
            return None if t is None else t.float().reshape(-1).cpu().tolist()

        extra["layers"] = [p.name for p in state.gemms]
        extra["betas"] = [None if b is None else host(b)[0] for b in state.beta]
        extra["branches"] = [p.name for p in state.branches]
        extra["branch_alphas"] = [None if a is None else host(a)[0] for a in state.branch_alpha]
        extra["branch_factors"] = [host(f) for f in state.branch_factors]
        extra["beta_host"] = state.beta_host
        extra["branch_factors_host"] = state.branch_factors_host
        return extra

    def _load_extra_state(self, saved: dict[str, Any]) -> None:
        self._iteration = int(saved.get("iteration", 0))
        self._force_recompute = bool(saved.get("force_recompute", True))
        self._consecutive_overflows = int(saved.get("consecutive_overflows", 0))
        self._clean_steps = int(saved.get("clean_steps", 0))
        self._init_scale = float(saved.get("init_scale", self._init_scale))
        if "betas" in saved:
            self._pending = {
                k: saved.get(k)
                for k in (
                    "layers",
                    "betas",
                    "branches",
                    "branch_alphas",
                    "branch_factors",
                    "beta_host",
                    "branch_factors_host",
                )
            }

    def _restore(self, saved: dict[str, Any], device: torch.device) -> None:
        state = self.state
        layers = [p.name for p in state.gemms]
        if saved["layers"] != layers or saved["branches"] != [p.name for p in state.branches]:
            raise ConfigError(
                "the checkpoint's adaptive scaler state belongs to a different model (its layers differ); "
                "resume with the same model config or start a fresh run"
            )

        def dev(v):
            return None if v is None else torch.tensor(v, dtype=torch.float32, device=device)

        state.beta = [None if b is None else dev(b).reshape(()) for b in saved["betas"]]
        state.branch_alpha = [None if a is None else dev(a).reshape(()) for a in saved["branch_alphas"]]
        state.branch_factors = [dev(f) for f in saved["branch_factors"]]
        state.beta_host = saved["beta_host"]
        state.branch_factors_host = saved["branch_factors_host"]


def _first_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)) and value:
        return _first_tensor(value[0])
    raise TypeError(f"scale() takes a Tensor or a (nested) list/tuple of Tensors, got {type(value).__name__}")


def _all_reduce_statistics(second_moment: torch.Tensor | None, max_abs: torch.Tensor):
    """Average the gradient's second moment and take the max of its magnitude over all ranks."""
    import torch.distributed as dist

    if second_moment is not None:
        second_moment = second_moment.clone()
        dist.all_reduce(second_moment, op=dist.ReduceOp.SUM)
        second_moment = second_moment / dist.get_world_size()
    max_abs = max_abs.clone()
    dist.all_reduce(max_abs, op=dist.ReduceOp.MAX)
    return second_moment, max_abs


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{field} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{field} must be a number, got '{value}'") from None


def _integer(value: Any, field: str) -> int:
    number = _number(value, field)
    if not (math.isfinite(number) and number == int(number) and number >= 1):
        raise ConfigError(f"{field} must be a positive integer, got {value}")
    return int(number)
