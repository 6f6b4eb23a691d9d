"""Training precision: FP32, real autocast (CUDA, or the CPU's own half kernels), or rounding emulation.

=========== ============================================== =================================================
precision   backend ``autocast`` (CUDA's default)           backend ``emulate`` (the CPU's default)
=========== ============================================== =================================================
fp32        plain FP32, TF32 off                            plain FP32
fp16        ``torch.autocast(<device>, float16)``, FP32     :class:`EmulatedAutocast`: FP32 compute rounded
            master weights (CUDA: channels_last for 4-D     to FP16 wherever autocast would store FP16
            weights, cudnn.benchmark)
bf16        ``torch.autocast(<device>, bfloat16)``          emulation rounding to BF16
fp8_e5m2    (none: no FP8 autocast exists)                  FP16 weights/activations, FP8 e5m2 gradients
fp8_e4m3    (none: no FP8 autocast exists)                  FP16 weights/activations, FP8 e4m3 gradients
nvfp4       (none: no FP4 autocast exists)                  BF16 emulation; linear and 2-D conv layers'
                                                            three GEMMs with NVFP4 operands
                                                            (:mod:`adaloss.numerics.fp4_gemm`)
mxfp4       (none)                                          the same with MXFP4 operands
=========== ============================================== =================================================

The FP4 precisions' options (``precision.<option>``, :class:`adaloss.numerics.fp4_gemm.FP4Recipe`):
``stochastic_rounding`` (gradient operands), ``hadamard`` (the 16x16 random Hadamard transform on the wgrad
operands), ``rounding`` (MXFP4's E8M0 rule, ``floor`` or ``rceil``), ``operands`` (``all`` or ``grad``),
``keep`` / ``keep_first`` / ``keep_last`` (the linear and conv layers kept in BF16) and ``seed``; any of them
set for another precision is an error.

``precision.grad_scaling`` (FP8 precisions only; default ``none``): how each stored gradient is scaled into
the FP8 range before it is rounded (:mod:`adaloss.numerics.quantizers`): ``none`` (the loss scale only),
``tensor_current``, ``tensor_delayed`` or ``mx_block``, or a mapping ``{name: mx_block, rounding: ceil}``
with the recipe's fields.

``precision.backend``: ``auto`` (the default: ``autocast`` on CUDA, ``emulate`` on the CPU), ``autocast`` or
``emulate``. ``precision.backend=autocast device=cpu`` runs the exact code a GPU run takes, with real FP16 or
BF16 tensors and the CPU's half kernels (about 60x slower than FP32 on a CPU: for tests, and for checking the
GPU path without a GPU). ``precision.allow_tf32`` (default false): PyTorch lets CUDA's FP32 matmuls and
convolutions use TF32 by default on Ampere and newer GPUs (cuDNN's convolutions do), so an "FP32" baseline
would not be FP32; the flags are turned off unless this is true, and recorded in ``metrics.json``.

Master weights stay FP32 in every mode: the optimizer and the loss scaler only ever see FP32 parameters and
gradients. Telemetry steps always go through the emulated path (FP32 compute plus rounding, or FP32 with
counting only for an FP32 run), because only there can a gradient be seen both before and after rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from adaloss.errors import ConfigError
from adaloss.numerics.emulation import LAYER_NAMES, EmulatedAutocast
from adaloss.numerics.formats import FORMATS, FloatFormat, get_format
from adaloss.numerics.fp4_gemm import FP4Gemm, fp4_recipe_from_config
from adaloss.numerics.quantizers import GlobalScaling, GradQuantizer, recipe_from_config

__all__ = ["Precision", "PRECISION_NAMES", "GEMM_MODULES"]

PRECISION_NAMES = ("fp32", "fp16", "bf16", "fp8_e5m2", "fp8_e4m3", "nvfp4", "mxfp4")
#: The FP4 precisions: BF16 emulation with FP4 GEMM operands in linear and conv layers (base format BF16).
FP4_PRECISIONS = ("nvfp4", "mxfp4")
#: The precisions whose gradients are FP8 (FP16 weights and activations): the ones with gradient quantizers.
FP8_PRECISIONS = ("fp8_e5m2", "fp8_e4m3")
#: The values of ``precision.backend``.
BACKENDS = ("auto", "autocast", "emulate")

#: Module types whose forward is a GEMM: the layers telemetry and the adaptive scaler are about.
GEMM_MODULES: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Linear,
)


class Precision:
    """How forward and backward numbers are stored during training.

    Args:
        name (str): ``fp32``, ``fp16``, ``bf16``, ``fp8_e5m2`` or ``fp8_e4m3``.
        device (str or torch.device): the training device.
        telemetry_format (str, optional, default="fp16"): the format underflow is measured against when the
            run itself is FP32.
        backend (str, optional, default="auto"): ``autocast`` (real half tensors on the device), ``emulate``
            (FP32 compute rounded to the format), or ``auto`` (autocast on CUDA, emulation on the CPU).
        allow_tf32 (bool, optional, default=False): let CUDA run FP32 matmuls and convolutions in TF32.
        grad_scaling (str or mapping, optional, default="none"): the gradient quantizer's recipe (FP8 only).
        **fp4_options: the FP4 precisions' options (module docstring), ``None`` for a recipe default.
    """

    def __init__(
        self,
        name: str,
        device: str | torch.device,
        telemetry_format: str = "fp16",
        backend: str = "auto",
        allow_tf32: bool = False,
        grad_scaling: Any = "none",
        **fp4_options: Any,
    ) -> None:
        name = str(name)
        if name not in PRECISION_NAMES:
            raise ConfigError(
                f"unknown precision '{name}' (precision.name): choose precision= one of "
                f"{', '.join(PRECISION_NAMES)}"
            )
        if not isinstance(telemetry_format, FloatFormat) and str(telemetry_format) not in FORMATS:
            # checked for every precision, not only fp32 (the one that reads it), so a typo never hides
            raise ConfigError(
                f"unknown telemetry.format '{telemetry_format}': choose telemetry.format= one of "
                f"{', '.join(FORMATS)}"
            )
        self.name = name
        self.device = torch.device(device)
        self.format, self.grad_format = _formats(name)
        self.telemetry_format = self.grad_format or get_format(telemetry_format)
        backend = _backend(name, backend, self.device)
        if not isinstance(allow_tf32, bool):
            raise ConfigError(f"precision.allow_tf32 must be true or false, got {allow_tf32!r}")
        self.backend = backend if self.format is not None else "none"
        self.allow_tf32 = allow_tf32
        self.uses_autocast = self.backend == "autocast"
        self.emulated = self.backend == "emulate"
        self._hooks: list[Any] = []
        recipe = recipe_from_config(grad_scaling)
        if not isinstance(recipe, GlobalScaling) and name not in FP8_PRECISIONS:
            raise ConfigError(
                f"precision.grad_scaling={recipe.name} needs an FP8 precision (precision=fp8_e5m2 or "
                f"fp8_e4m3); precision={name} scales its gradients with the loss scale only"
            )
        #: Scales the gradients the emulation stores (None for FP32); its state goes into checkpoints.
        self.grad_quantizer = (
            GradQuantizer(recipe, self.grad_format) if self.grad_format is not None else None
        )
        #: The FP4 GEMM operands' state (``precision=nvfp4`` / ``mxfp4``; None otherwise).
        self.fp4 = _fp4_gemm(name, fp4_options, self.device)

    def state_dict(self) -> dict[str, Any]:
        """The gradient quantizer's state (delayed scaling's amax histories and scales; tensors), for the
        checkpoint; empty for FP32."""
        state = self.grad_quantizer.state_dict() if self.grad_quantizer is not None else {}
        if self.fp4 is not None:  # the stochastic-rounding generator: a resumed run continues its stream
            state["fp4"] = self.fp4.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (an empty state, e.g. an older checkpoint, restores nothing)."""
        state = dict(state)
        fp4 = state.pop("fp4", None)
        if fp4 is not None and self.fp4 is not None:
            self.fp4.load_state_dict(fp4)
        if state and self.grad_quantizer is not None:
            self.grad_quantizer.load_state_dict(state)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return self.format.dtype if self.uses_autocast and self.format is not None else None

    def apply_tf32(self) -> dict[str, bool]:
        """Set PyTorch's TF32 switches for this run (off unless ``allow_tf32``) and return them, for
        ``metrics.json``. A process-wide setting: call it once, before training."""
        torch.backends.cuda.matmul.allow_tf32 = self.allow_tf32
        torch.backends.cudnn.allow_tf32 = self.allow_tf32
        return {
            "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        }

    def prepare(self, model: nn.Module) -> nn.Module:
        """Name GEMM layers for telemetry and apply device speed settings; returns the model to train.

        Call after ``scaler.attach(model)``. Adds two cheap Python hooks per GEMM module (they push and pop
        the module's path so an op can be attributed to ``layer3.2.conv1``). On CUDA the 4-D parameters and
        buffers (2-D convolutions' weights) move to the channels_last memory format, which cuDNN's FP16
        convolutions prefer; tensors of other ranks (Conv1d, Conv3d weights) keep theirs, as
        ``channels_last`` exists for 4-D tensors only.
        """
        if self.fp4 is not None:  # FP4 layers, also as the adaptive scaler's AdaptiveGEMM wraps them
            self.fp4.bind([n for n, m in model.named_modules() if _fp4_capable(m)])
        for name, module in model.named_modules():
            if isinstance(module, GEMM_MODULES):
                self._hooks.append(module.register_forward_pre_hook(_push_name(name)))
                self._hooks.append(module.register_forward_hook(_pop_name))
        if self.device.type == "cuda":
            _channels_last_4d(model)
        return model

    def autocast(self, monitor: Any = None) -> contextlib.AbstractContextManager:
        """Context for the forward pass and the loss.

        Without ``monitor``: real autocast on CUDA FP16/BF16, emulation where the format is emulated, and
        nothing for FP32. With ``monitor`` (a telemetry step): always the emulated path, so the monitor can
        count each activation gradient before and after rounding. Entering it does not synchronize.
        """
        if monitor is not None:
            return EmulatedAutocast(
                self.format,
                monitor=monitor,
                grad_fmt=self.grad_format,
                grad_quantizer=self.grad_quantizer,
                fp4=self.fp4,
            )
        if self.uses_autocast:
            return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)
        if self.emulated:
            return EmulatedAutocast(
                self.format, grad_fmt=self.grad_format, grad_quantizer=self.grad_quantizer, fp4=self.fp4
            )
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        mode = "autocast" if self.uses_autocast else ("emulated" if self.emulated else "native")
        return f"Precision({self.name}, {self.device}, {mode})"


def _formats(name: str) -> tuple[FloatFormat | None, FloatFormat | None]:
    """The storage format of precision ``name``'s weights and activations, and of its gradients (None:
    FP32)."""
    if name == "fp32":
        return None, None
    if name in FP8_PRECISIONS:
        return get_format("fp16"), get_format(name)
    if name in FP4_PRECISIONS:
        return get_format("bf16"), get_format("bf16")
    return get_format(name), get_format(name)


def _backend(name: str, backend: Any, device: torch.device) -> str:
    """``precision.backend`` checked against precision ``name`` (one-line ConfigErrors), ``auto`` resolved:
    autocast for FP16/BF16 on CUDA, emulation elsewhere."""
    backend = str(backend).strip().lower()
    if backend not in BACKENDS:
        raise ConfigError(
            f"unknown precision.backend '{backend}': choose one of {', '.join(BACKENDS)} "
            "(e.g. precision.backend=autocast for real half tensors)"
        )
    if backend == "autocast" and name in FP8_PRECISIONS + FP4_PRECISIONS:
        raise ConfigError(
            f"precision={name} has no autocast (PyTorch has no FP8 or FP4 autocast): use "
            "precision.backend=emulate or auto"
        )
    if backend == "autocast" and name == "fp32":
        raise ConfigError(
            "precision.backend=autocast needs a half format (precision=fp16 or bf16); precision=fp32 "
            "runs plain FP32"
        )
    if backend == "auto":
        backend = "autocast" if device.type == "cuda" and name in ("fp16", "bf16") else "emulate"
    return backend


def _fp4_capable(module: nn.Module) -> bool:
    """Whether FP4 can run ``module``'s GEMMs (:mod:`adaloss.numerics.fp4_gemm`): an ``nn.Linear`` or an
    ``nn.Conv2d`` with ``groups=1``, also behind the adaptive scaler's AdaptiveGEMM wrapper."""
    layer = getattr(module, "layer", module) if hasattr(module, "layer_type") else module
    return isinstance(layer, nn.Linear) or (isinstance(layer, nn.Conv2d) and layer.groups == 1)


def _fp4_gemm(name: str, options: dict[str, Any], device: torch.device) -> FP4Gemm | None:
    """The FP4 state of ``precision=name`` from its options (those left None take the recipe's default);
    an option set for a precision that is not FP4 is a ConfigError."""
    options = {k: _plain(v) for k, v in options.items() if v is not None}
    if name not in FP4_PRECISIONS:
        if options:
            raise ConfigError(
                f"precision.{sorted(options)[0]} is an FP4 option: use it with precision=nvfp4 or "
                f"precision=mxfp4 (precision={name} has none)"
            )
        return None
    return FP4Gemm(fp4_recipe_from_config(name, options), device)


def _plain(value: Any) -> Any:
    """A mapping that is not a dict (a config node: OmegaConf's DictConfig) as a dict, its values likewise;
    other values unchanged. The runner passes plain values already (``build_target`` converts them)."""
    if isinstance(value, Mapping) and not isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _channels_last_4d(model: nn.Module) -> None:
    """channels_last for every 4-D parameter and buffer, in place (the same objects: optimizers and the
    adaptive scaler keep their references); other ranks are left alone."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.dim() == 4:
                tensor.data = tensor.data.contiguous(memory_format=torch.channels_last)


def _push_name(name: str):
    def hook(module: nn.Module, args: Any) -> None:
        LAYER_NAMES.push(name)

    return hook


def _pop_name(module: nn.Module, args: Any, output: Any) -> None:
    LAYER_NAMES.pop()
