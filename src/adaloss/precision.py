"""Training precision: FP32, real autocast on CUDA, or rounding emulation on the CPU.

=========== ============================================== =================================================
precision   CUDA                                            CPU (and FP8 everywhere)
=========== ============================================== =================================================
fp32        plain FP32                                      plain FP32
fp16        ``torch.autocast(float16)``, FP32 master        :class:`EmulatedAutocast` rounding to FP16
            weights, channels_last, cudnn.benchmark
bf16        ``torch.autocast(bfloat16)``                    emulation rounding to BF16
fp8_e5m2    emulation: FP16 weights/activations,            the same
            FP8 e5m2 gradients (no FP8 autocast exists)
=========== ============================================== =================================================

Master weights stay FP32 in every mode: the optimizer and the loss scaler only ever see FP32 parameters and
gradients. Telemetry steps always go through the emulated path (FP32 compute plus rounding, or FP32 with
counting only for an FP32 run), because only there can a gradient be seen both before and after rounding.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from adaloss.errors import ConfigError
from adaloss.numerics.emulation import LAYER_NAMES, EmulatedAutocast
from adaloss.numerics.formats import FORMATS, FloatFormat, get_format

__all__ = ["Precision", "PRECISION_NAMES", "GEMM_MODULES"]

PRECISION_NAMES = ("fp32", "fp16", "bf16", "fp8_e5m2")

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
        name (str): ``fp32``, ``fp16``, ``bf16`` or ``fp8_e5m2``.
        device (str or torch.device): the training device.
        telemetry_format (str, optional, default="fp16"): the format underflow is measured against when the
            run itself is FP32.
    """

    def __init__(self, name: str, device: str | torch.device, telemetry_format: str = "fp16") -> None:
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
        if name == "fp32":
            self.format: FloatFormat | None = None
            self.grad_format: FloatFormat | None = None
        elif name == "fp8_e5m2":
            self.format = get_format("fp16")
            self.grad_format = get_format("fp8_e5m2")
        else:
            self.format = self.grad_format = get_format(name)
        self.telemetry_format = self.grad_format or get_format(telemetry_format)
        self.uses_autocast = self.device.type == "cuda" and name in ("fp16", "bf16")
        self.emulated = self.format is not None and not self.uses_autocast
        self._hooks: list[Any] = []

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return self.format.dtype if self.uses_autocast and self.format is not None else None

    def prepare(self, model: nn.Module) -> nn.Module:
        """Name GEMM layers for telemetry and apply device speed settings; returns the model to train.

        Call after ``scaler.attach(model)``. Adds two cheap Python hooks per GEMM module (they push and pop
        the module's path so an op can be attributed to ``layer3.2.conv1``). On CUDA the model moves to the
        channels_last memory format, which cuDNN's FP16 convolutions prefer.
        """
        for name, module in model.named_modules():
            if isinstance(module, GEMM_MODULES):
                self._hooks.append(module.register_forward_pre_hook(_push_name(name)))
                self._hooks.append(module.register_forward_hook(_pop_name))
        if self.device.type == "cuda":
            model = model.to(memory_format=torch.channels_last)
        return model

    def autocast(self, monitor: Any = None) -> contextlib.AbstractContextManager:
        """Context for the forward pass and the loss.

        Without ``monitor``: real autocast on CUDA FP16/BF16, emulation where the format is emulated, and
        nothing for FP32. With ``monitor`` (a telemetry step): always the emulated path, so the monitor can
        count each activation gradient before and after rounding. Entering it does not synchronize.
        """
        if monitor is not None:
            return EmulatedAutocast(self.format, monitor=monitor, grad_fmt=self.grad_format)
        if self.uses_autocast:
            return torch.autocast(device_type="cuda", dtype=self.autocast_dtype)
        if self.emulated:
            return EmulatedAutocast(self.format, grad_fmt=self.grad_format)
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        mode = "autocast" if self.uses_autocast else ("emulated" if self.emulated else "native")
        return f"Precision({self.name}, {self.device}, {mode})"


def _push_name(name: str):
    def hook(module: nn.Module, args: Any) -> None:
        LAYER_NAMES.push(name)

    return hook


def _pop_name(module: nn.Module, args: Any, output: Any) -> None:
    LAYER_NAMES.pop()
