"""PyTorch Lightning precision plugins that train with any adaloss scaler, the adaptive one included.

``Trainer(plugins=[ScalerPrecision(scaler)])`` and ``Fabric(plugins=[FabricScalerPrecision(scaler)])`` run an
unchanged ``LightningModule`` (or any ``nn.Module`` under Fabric) with one of the four scalers. They follow
Lightning's own ``MixedPrecision`` plugins (``lightning/pytorch/plugins/precision/amp.py`` and
``lightning/fabric/plugins/precision/amp.py``), with our scaler in GradScaler's place:

* ``convert_module``, the hook Lightning gives precision plugins before it moves and wraps the model (DDP,
  FSDP): ``scaler.attach(module)``. The adaptive scaler returns a rewritten module; Lightning needs the
  object it was given (the ``LightningModule`` with its hooks, the same ``state_dict`` keys), so that module
  is kept and its ``forward`` calls the rewritten one. ``training_step`` must therefore reach the network
  through ``self(...)``; a backward pass whose loss did not is refused with that advice.
* The forward pass runs under :class:`adaloss.precision.Precision`'s context: real autocast on CUDA, the
  rounding emulation on the CPU (``precision="fp32"`` for none).
* Trainer: ``pre_backward`` scales the loss; ``optimizer_step`` runs the closure (forward and backward),
  unscales, lets Lightning clip (``gradient_clip_val``) and call ``on_before_optimizer_step``, then
  ``scaler.step`` and ``scaler.update``. Gradient accumulation (``accumulate_grad_batches``) is Lightning's:
  several scaled backward passes, one step. Fabric: ``backward`` scales, ``clip_gradients`` unscales first,
  ``optimizer.step()`` steps and updates.
* ``state_dict``/``load_state_dict``: the scaler's state and the iteration count, which Lightning stores in
  its checkpoints under the plugin's class name (Fabric: put the plugin in ``fabric.save``'s state).
* Telemetry every ``telemetry_every`` iterations (the first one included): per-layer activation-gradient
  underflow rates (:class:`adaloss.telemetry.UnderflowMonitor`) and the adaptive scaler's per-layer alpha,
  logged through the module's loggers (Trainer) or kept in ``pop_telemetry()`` for ``fabric.log_dict``.

Host-device syncs per iteration: ``scaler.step``'s one (the Inf/NaN flag), the scaler's own on its
recompute steps, and one on telemetry steps (the underflow counts and alphas); the plugins add none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import torch
from torch import nn

from adaloss.integrations._telemetry import scaler_telemetry
from adaloss.precision import GEMM_MODULES, PRECISION_NAMES, Precision
from adaloss.scalers import AdaptiveLossScaler, LossScaler
from adaloss.telemetry import UnderflowMonitor

try:
    from lightning.fabric.plugins.precision import Precision as _FabricPrecision
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import Precision as _TrainerPrecision
except ImportError as exc:  # pragma: no cover - exercised only where lightning is absent
    raise ImportError(
        "adaloss.integrations.lightning needs PyTorch Lightning: pip install -e '.[lightning]' "
        f"(or pip install lightning); {exc}"
    ) from exc

__all__ = ["FabricScalerPrecision", "ScalerPrecision"]


class _AttachedForward:
    """The ``forward`` of a module whose network the adaptive scaler rewrote: calls the rewritten module
    (through ``__call__``, so its hooks run). A class rather than a closure, so that ``copy.deepcopy`` of the
    module copies the rewritten network with it. ``__wrapped__`` is the module class's own ``forward``, as
    ``functools.wraps`` sets it: what Lightning's ``is_overridden("forward")`` (run by ``predict``,
    ``validate`` and ``test``) and ``inspect.signature`` read."""

    def __init__(self, attached: nn.Module, forward: Callable[..., Any]) -> None:
        self.attached = attached
        self.__wrapped__ = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.attached(*args, **kwargs)


#: Lightning's precision names (``Trainer(precision=...)``) the plugins take, as the precision they train in
LIGHTNING_NAMES = {
    "16-mixed": "fp16", "bf16-mixed": "bf16", "32-true": "fp32", "16": "fp16", "bf16": "bf16", "32": "fp32",
}  # fmt: skip
#: What ``trainer.precision`` reports for ours (Lightning's name where it has one)
_REPORTED = {"fp16": "16-mixed", "bf16": "bf16-mixed", "fp32": "32-true"}


def precision_name(precision: Any) -> str:
    """Our precision's name for ``precision``: one of ours (``fp16``, ``fp8_e5m2``, ...) or Lightning's mixed
    names (``"16-mixed"``, ``"bf16-mixed"``, ``"32-true"``, 16, 32); ``ValueError`` naming both lists."""
    name = str(precision).strip()
    if name in PRECISION_NAMES:
        return name
    if name in LIGHTNING_NAMES:
        return LIGHTNING_NAMES[name]
    half = " (half weights have nothing to scale against here: use '16-mixed')" if "-true" in name else ""
    raise ValueError(
        f"the plugin's precision {precision!r} is not one it trains in{half}: pass Lightning's "
        f"{', '.join(repr(n) for n in LIGHTNING_NAMES if '-' in n)} or one of ours "
        f"({', '.join(PRECISION_NAMES)})"
    )


def _network_path(module: nn.Module) -> str:
    """The path of the smallest submodule of ``module`` that holds every GEMM layer (``"net"`` for a
    LightningModule that keeps its network in ``self.net``), or ``""``: the layers are named relative to it,
    as in a loop that trains the network itself. Host-side."""
    paths = [name.split(".")[:-1] for name, m in module.named_modules() if isinstance(m, GEMM_MODULES)]
    common = paths[0] if paths else []
    for path in paths[1:]:
        n = 0
        while n < min(len(common), len(path)) and common[n] == path[n]:
            n += 1
        common = common[:n]
    return ".".join(common)


class _ScalerDriver:
    """What the Trainer's and Fabric's plugins share: the scaler, the precision, the telemetry, the count of
    iterations. No method synchronizes host and device except ``finish_iteration`` on telemetry steps."""

    def __init__(
        self,
        scaler: Any,
        precision: str | Precision,
        device: str | torch.device | None,
        telemetry_every: int | str | None,
    ) -> None:
        if not isinstance(scaler, LossScaler):
            raise TypeError(
                f"the plugin needs an adaloss scaler, got {type(scaler).__name__}: pass one of "
                "adaloss.scalers (e.g. AdaptiveLossScaler() or build_scaler({'name': 'dynamic'})); for "
                "torch.amp.GradScaler use Lightning's own MixedPrecision plugin"
            )
        if telemetry_every not in (None, "trainer"):
            if type(telemetry_every) is not int or telemetry_every < 1:
                raise ValueError(
                    f"telemetry_every must be a positive int, 'trainer' or None, got {telemetry_every!r}"
                )
        self.scaler = scaler
        # a name without a device: the emulation's precision until the model's device is known (first
        # forward pass: where the Trainer's accelerator or Fabric put it)
        self._device_known = isinstance(precision, Precision) or device is not None
        if not isinstance(precision, Precision):
            precision = Precision(precision_name(precision), device if device is not None else "cpu")
        self.precision = precision
        self.reported = _REPORTED.get(precision.name, precision.name)
        # "trainer": every Trainer(log_every_n_steps=...) iterations, on the ones Lightning logs (known at the
        # first training forward pass); an int: the first iteration and every this many
        self.telemetry_every = telemetry_every
        self._offset = 1 if telemetry_every == "trainer" else 0
        self.monitor = None
        if telemetry_every is not None:
            every = 1 if telemetry_every == "trainer" else int(telemetry_every)
            self.monitor = UnderflowMonitor(every=every, fmt=self.precision.telemetry_format)
        self.steps = 0  # iterations completed (scaler.update() calls): the telemetry schedule's clock
        self.telemetry: dict[str, float] = {}
        self._module: nn.Module | None = None
        self._network: nn.Module | None = None  # the attached module's submodule the layers are named in
        self._rewritten = False
        self._forward_seen = False
        self._device_checked = False
        self._unscaled: set[int] = set()

    def convert(self, module: nn.Module) -> nn.Module:
        """Attach the scaler to ``module`` (once; Lightning converts again on each ``fit``/``validate``) and
        return ``module`` itself: the adaptive scaler's rewrite becomes its ``forward``. Layers are named
        relative to the submodule holding them all (:func:`_network_path`). No sync."""
        if module is self._module:
            return module
        if self._module is not None:
            raise RuntimeError(
                f"this plugin's scaler is already attached to a {type(self._module).__name__}; an adaloss "
                "scaler rewrites one model: make one plugin (and one scaler) per model"
            )
        path = _network_path(module)
        if isinstance(self.scaler, AdaptiveLossScaler):
            attached = self.scaler.attach_within(module, path)
        else:
            attached = self.scaler.attach(module)
        self._network = attached.get_submodule(path)
        if self._device_known:
            self.precision.prepare(self._network)  # names the GEMM layers for telemetry
        if attached is not module:
            self._rewritten = True
            attached.register_forward_pre_hook(self._note_forward)
            module.forward = _AttachedForward(attached, type(module).forward)  # type: ignore[method-assign]
        self._module = module
        return module

    def _note_forward(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook of the rewritten module: a training forward pass went through it. No sync."""
        if torch.is_grad_enabled():
            self._forward_seen = True

    def forward_context(self, training: bool) -> contextlib.AbstractContextManager:
        """The precision's context; on a telemetry iteration's training passes, with the underflow monitor
        (the emulated path, so gradients are counted before and after rounding). No sync."""
        if not self._device_checked and self._module is not None:
            self._check_device(self._module)
        due = training and self._telemetry_due() and torch.is_grad_enabled()
        return self.precision.autocast(monitor=self.monitor if due else None)

    def _telemetry_due(self) -> bool:
        """Whether this iteration is a telemetry one. Under ``"trainer"``: the iterations Lightning logs
        (``(global step + 1) % log_every_n_steps == 0``). Host-side."""
        if self.monitor is None:
            return False
        if self.telemetry_every == "trainer" and self.monitor.every == 1 and self._module is not None:
            trainer = getattr(self._module, "_trainer", None)  # None under Fabric: every iteration
            if trainer is not None:
                self.monitor.every = max(int(trainer.log_every_n_steps), 1)
        return self.monitor.due(self.steps + self._offset)

    def _check_device(self, module: nn.Module) -> None:
        """Once, at the first forward pass (the model has been moved by then): a precision given without a
        device takes the model's (where the Trainer's accelerator put it); one given for a device must be
        the model's, as CUDA autocast around a CPU model would leave it in FP32 without a word."""
        param = next(module.parameters(), None)
        if param is not None and not self._device_known:
            if param.device.type != self.precision.device.type:
                self.precision = Precision(self.precision.name, param.device)
            self.precision.prepare(self._network)
            self._device_known = True
        elif param is not None and param.device.type != self.precision.device.type:
            raise ValueError(
                f"the plugin's precision is for device '{self.precision.device.type}' but the model is on "
                f"'{param.device}': pass device='{param.device.type}' to the plugin (or leave device out: "
                "it then follows the model)"
            )
        self._device_checked = True

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``scaler.scale(loss)``, after checking that the loss went through the attached forward. No sync."""
        if self._rewritten and not self._forward_seen and self.scaler.is_enabled():
            raise RuntimeError(
                "the loss was not computed through the model's forward, so the adaptive scaler's rewrite did "
                "not run: in training_step call the module itself (self(x), or model(x) under Fabric) rather "
                "than its submodules (self.net(x)) or self.forward(x)"
            )
        self._forward_seen = False
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """``scaler.unscale_(optimizer)`` once per iteration (a second call is a no-op). No sync.

        A ``LightningOptimizer`` (what ``self.clip_gradients`` gets under manual optimization) is unwrapped:
        the step that follows sees the optimizer inside it, which must count as unscaled."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        """``scaler.step`` and ``scaler.update``, then the iteration's telemetry. One sync (the Inf/NaN
        flag), plus the scaler's own and one on telemetry steps."""
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "LBFGS steps through a closure, which loss scaling cannot drive (as with Lightning's "
                "MixedPrecision): use another optimizer or precision without a scaler"
            )
        output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        self._finish_iteration()
        return output

    def _finish_iteration(self) -> None:
        due = self._telemetry_due()
        self.steps += 1
        self._unscaled.clear()
        if due:
            self.telemetry = self._telemetry()

    def _telemetry(self) -> dict[str, float]:
        """Per-layer underflow rates and alphas (or the scalar loss scale) and the counters. One sync."""
        return scaler_telemetry(self.scaler, self.monitor)

    def pop_telemetry(self) -> dict[str, float]:
        """The last telemetry step's record, then empty until the next one. No sync."""
        record, self.telemetry = self.telemetry, {}
        return record

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state and the iteration count."""
        return {"scaler": self.scaler.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state; a state of another plugin is refused with the fix."""
        if "scaler" not in state or "steps" not in state:
            raise RuntimeError(
                f"the checkpoint's precision-plugin state has keys {sorted(state)}, not an adaloss plugin's "
                "('scaler', 'steps'): resume with the plugin that saved it"
            )
        self.scaler.load_state_dict(state["scaler"])
        self.steps = int(state["steps"])


class _Driven:
    """What both plugins share: the constructor (a :class:`_ScalerDriver` does the work) and ``scaler``."""

    def __init__(
        self,
        scaler: LossScaler,
        precision: str | Precision = "16-mixed",
        device: str | torch.device | None = None,
        telemetry_every: int | str | None = "trainer",
    ) -> None:
        self._driver = _ScalerDriver(scaler, precision, device, telemetry_every)
        self.precision = self._driver.reported  # what trainer.precision reports

    @property
    def scaler(self) -> LossScaler:
        """The scaler this plugin drives."""
        return self._driver.scaler


class ScalerPrecision(_Driven, _TrainerPrecision):
    """``Trainer(plugins=[ScalerPrecision(scaler)])``: train a ``LightningModule`` with an adaloss scaler.

    Args:
        scaler (LossScaler): one of :mod:`adaloss.scalers`, not yet attached (the plugin attaches it).
        precision (str or Precision, optional, default="16-mixed"): the training precision: Lightning's
            name (``"16-mixed"``, ``"bf16-mixed"``, ``"32-true"``; ``trainer.precision`` reports it), ours
            (``fp16``, ``bf16``, ``fp32``, ``fp8_e5m2``, ``fp8_e4m3``, ...) or an
            :class:`adaloss.precision.Precision`.
        device (str, optional, default=None): the device the precision is for (``"cuda"``: real autocast;
            ``"cpu"``: the emulation), as Lightning's ``MixedPrecision(device=...)``; None: the model's,
            where the Trainer's accelerator puts it.
        telemetry_every (int, "trainer" or None, optional, default="trainer"): per-layer underflow rates and
            alphas (or the loss scale), logged with the module's ``log`` (so in ``callback_metrics``, for
            ``ModelCheckpoint`` and ``EarlyStopping`` to monitor): ``"trainer"``, on the iterations the
            Trainer logs (``log_every_n_steps``); an int, on the first iteration and every this many (the
            loggers get those that fall on the Trainer's logging steps); None: never.

    Layers are named relative to the submodule that holds them all (``0`` for a ``LightningModule`` whose
    network is ``self.net``, a ``Sequential``), as ``scaler.attach(net)`` names them in a loop of your own:
    a scaler state saved by one loads in the other. ``training_step`` must call ``self(...)`` (the adaptive
    scaler rewrites ``forward``). The LR scheduler steps on skipped iterations too, as under Lightning's
    ``MixedPrecision``.
    """

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Attach the scaler to ``module``, before Lightning moves and wraps it; returns ``module`` itself.
        No sync."""
        return self._driver.convert(module)

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Validation, test and predict steps: the precision's context, no telemetry. No sync."""
        with self._driver.forward_context(training=False):
            yield

    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        """Training steps: the precision's context, counting underflow on telemetry iterations. No sync."""
        with self._driver.forward_context(training=True):
            yield

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        """The loss, scaled (``scaler.scale``), for Lightning's backward pass. No sync."""
        return super().pre_backward(self._driver.scale(tensor), module)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Lightning's ``MixedPrecision.optimizer_step`` with our scaler: forward and backward (the
        closure), unscale, the ``on_before_optimizer_step`` hooks and clipping, step, update. One sync
        (``scaler.step``), one more on telemetry steps."""
        closure_result = closure()
        # training_step returned None under automatic optimization: no backward pass, nothing to step
        skip = closure_result is None and model.automatic_optimization
        if not skip:
            self._driver.unscale(optimizer)  # clipping (in _after_closure) sees the true gradients
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        output = self._driver.step(optimizer, **kwargs)
        telemetry = self._driver.pop_telemetry()  # empty but on telemetry steps
        if telemetry:  # through the module: callback_metrics, then the loggers at Lightning's log steps
            model.log_dict(telemetry, on_step=True, on_epoch=False, batch_size=1)
        return output

    def clip_gradients(
        self, optimizer: Any, clip_val: int | float = 0.0, gradient_clip_algorithm: Any = None
    ):
        """Clip the true gradients: unscale first (a no-op if done), so ``self.clip_gradients`` in manual
        optimization clips what automatic optimization clips. No sync."""
        if clip_val and clip_val > 0:
            self._driver.unscale(optimizer)
        kwargs = (
            {} if gradient_clip_algorithm is None else {"gradient_clip_algorithm": gradient_clip_algorithm}
        )
        return super().clip_gradients(optimizer, clip_val, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """``{"scaler": scaler.state_dict(), "steps": iterations}``, for the checkpoint. The scaler's own
        sync (the adaptive scaler's per-layer state: one)."""
        return self._driver.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state (before or after ``convert_module``). No sync."""
        self._driver.load_state_dict(state_dict)


class FabricScalerPrecision(_Driven, _FabricPrecision):
    """``Fabric(plugins=[FabricScalerPrecision(scaler)])``: Fabric's loop with an adaloss scaler.

    ``fabric.setup(model, optimizer)`` attaches the scaler; ``fabric.backward(loss)`` scales the loss;
    ``fabric.clip_gradients(...)`` unscales before clipping; ``optimizer.step()`` steps (skipping an
    overflowing step) and updates the scale. The arguments are :class:`ScalerPrecision`'s; telemetry is
    kept for the loop to log: ``fabric.log_dict(plugin.pop_telemetry(), step)`` (empty between telemetry
    steps). Save and restore the scaler with the plugin in the checkpoint state:
    ``fabric.save(path, {"model": model, "optimizer": optimizer, "precision": plugin})``.
    """

    def __init__(
        self,
        scaler: LossScaler,
        precision: str | Precision = "16-mixed",
        device: str | torch.device | None = None,
        telemetry_every: int | None = 100,
    ) -> None:
        super().__init__(scaler, precision, device, telemetry_every)

    @property
    def steps(self) -> int:
        """Iterations completed (optimizer steps, applied or skipped)."""
        return self._driver.steps

    def pop_telemetry(self) -> dict[str, float]:
        """The last telemetry step's record (``underflow_rate/<layer>``, ``alpha/<layer>`` or
        ``loss_scale``, counters), then empty until the next one. No sync."""
        return self._driver.pop_telemetry()

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Attach the scaler to ``module``, before Lightning moves and wraps it; returns ``module`` itself.
        No sync."""
        return self._driver.convert(module)

    def forward_context(self) -> contextlib.AbstractContextManager:
        """The precision's context; with grad enabled on telemetry iterations, counting underflow. No
        sync."""
        return self._driver.forward_context(training=True)

    def backward(self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """``scaler.scale(tensor).backward()``. No sync."""
        super().backward(self._driver.scale(tensor), model, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``scaler.step(optimizer)`` (skipped on an Inf/NaN gradient) and ``scaler.update()``. One sync
        (the Inf/NaN flag), one more on telemetry iterations."""
        return self._driver.step(optimizer, **kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """``scaler.unscale_(optimizer)``, once per iteration (``fabric.clip_gradients`` calls it). No
        sync."""
        self._driver.unscale(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """``{"scaler": scaler.state_dict(), "steps": iterations}``, for the checkpoint. The scaler's own
        sync (the adaptive scaler's per-layer state: one)."""
        return self._driver.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state (before or after ``convert_module``). No sync."""
        self._driver.load_state_dict(state_dict)
