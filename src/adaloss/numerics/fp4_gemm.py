"""FP4 as a GEMM-operand format: the three GEMMs of a linear or 2-D conv layer with NVFP4 or MXFP4 operands.

A linear layer ``y = x W^T + b`` (``x``: ``(M, K)`` tokens by input features, ``W``: ``(N, K)``) runs three
GEMMs, and each quantizes its operands in blocks along that GEMM's reduction dimension, as Transformer
Engine does:

========= ======================== ===================================== ==================================
GEMM      computes                  operand A (blocks along)              operand B (blocks along)
========= ======================== ===================================== ==================================
fprop     ``y = x W^T``             ``x``, along K (1x16 / 1x32)          ``W``, along K (NVFP4: 16x16 tiles)
dgrad     ``dx = dy W``             ``dy``, along N (SR when enabled)     ``W``, along N (the same 16x16
                                                                          tiles for NVFP4; MXFP4 requantizes
                                                                          ``W^T`` along N)
wgrad     ``dW = dy^T x``           ``dy^T``, along M (SR; RHT)           ``x^T``, along M (RHT)
========= ======================== ===================================== ==================================

Stochastic rounding (``stochastic_rounding``) applies to the gradient operands only (``dy`` in dgrad and
wgrad), as in the NVFP4 recipe; the 16x16 random Hadamard transform (``hadamard``) multiplies both wgrad
operands, blockwise along M, by the same orthogonal ``T`` before quantization, so that without quantization
``(T dy^T)(T x^T)^T = dy^T x``. ``operands="grad"`` quantizes the gradient operands only (forward and the
weight/activation operands stay in the run's base format), the FP8 lab's gradient-only view.

A 2-D convolution (``groups=1``, any stride, padding and dilation) is the same three GEMMs over its im2col
columns (:meth:`FP4Gemm.conv_forward`, :meth:`~FP4Gemm.conv_dgrad`, :meth:`~FP4Gemm.conv_wgrad`):
``cols = unfold(x)`` has one row per output position (``M = N * H_out * W_out``) and ``K = C * kh * kw``
columns, ``W`` is read as ``(out, K)``, fprop is ``cols W^T`` (blocks along K), dgrad ``dy W`` (blocks along
the output channels) followed by ``fold`` (col2im, unfold's adjoint) back to ``dx``, and wgrad
``dy^T cols`` (blocks along M). The FP4 code is :meth:`FP4Gemm.forward`, :meth:`~FP4Gemm.dgrad` and
:meth:`~FP4Gemm.wgrad`, the linear layer's, on these matrices.

Which layers: every ``nn.Linear`` and every ``nn.Conv2d`` with ``groups=1`` except those matching one of
``keep``'s glob patterns (the head and the embeddings by default) and those in the first ``keep_first`` and
last ``keep_last`` blocks (a block: the module path up to and including its first integer component, ``h.0``
or ``layer3.2``, in model order). A layer outside every block (a ResNet's stem ``conv1``) is FP4 unless a
``keep`` pattern names it. Grouped and depthwise convolutions, 1-D and 3-D and transposed convolutions,
attention's activation-by-activation products and everything else stay in the base format.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from adaloss.errors import ConfigError
from adaloss.numerics.fp4 import (
    FP4_RECIPES,
    MX_ROUNDINGS,
    FP4Blocks,
    hadamard_transform,
    quantize_fp4,
    random_hadamard,
)
from adaloss.numerics.quantizers import QuantStats

__all__ = ["FP4Recipe", "FP4Gemm", "FP4Linear", "FP4Conv2d", "conv_geometry", "fp4_recipe_from_config"]

OPERANDS = ("all", "grad")


@dataclass(frozen=True)
class FP4Recipe:
    """An FP4 training recipe (module docstring): ``name`` (``nvfp4`` | ``mxfp4``), ``rounding`` (MXFP4's
    E8M0 rule: ``floor`` | ``rceil``), ``stochastic_rounding`` (gradient operands), ``hadamard`` (wgrad
    operands), ``operands`` (``all`` | ``grad``), the layers kept in the base format (``keep`` patterns,
    ``keep_first`` / ``keep_last`` blocks) and ``seed`` (the SR generator's and the Hadamard signs')."""

    name: str = "nvfp4"
    rounding: str = "floor"
    stochastic_rounding: bool = False
    hadamard: bool = False
    operands: str = "all"
    keep: tuple[str, ...] = ("lm_head", "head", "fc", "classifier", "*embed*")
    keep_first: int = 1
    keep_last: int = 1
    seed: int = 0


def fp4_recipe_from_config(name: str, options: dict[str, Any]) -> FP4Recipe:
    """The recipe of ``precision=name`` with ``options`` (``precision.<field>``); one-line ConfigError for
    an unknown field or a bad value."""
    known = {f.name: f.default for f in fields(FP4Recipe) if f.name != "name"}
    unknown = sorted(k for k in options if k not in known)
    if unknown:
        raise ConfigError(
            f"precision={name} has no option(s) {', '.join(unknown)}: its FP4 options are {', '.join(known)}"
        )
    checked: dict[str, Any] = {}
    for key, value in options.items():
        default = known[key]
        where = f"precision.{key}"
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        if isinstance(default, int) and not isinstance(default, bool):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{where} must be an integer >= 0, got {value!r}")
        choices = {"rounding": MX_ROUNDINGS, "operands": OPERANDS}.get(key)
        if choices and value not in choices:
            raise ConfigError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
        if key == "keep":
            if isinstance(value, str) or not all(isinstance(p, str) for p in value):
                raise ConfigError(f"{where} must be a list of glob patterns, e.g. '[lm_head,*embed*]'")
            value = tuple(value)
        checked[key] = value
    if name not in FP4_RECIPES:
        raise ConfigError(f"unknown FP4 recipe '{name}': choose precision=nvfp4 or precision=mxfp4")
    return FP4Recipe(name=name, **checked)


def _block_of(name: str) -> str | None:
    """The block a layer belongs to: its path up to the first integer component (``h.0.mlp.c_fc`` ->
    ``h.0``), None outside any block."""
    match = re.match(r"^(.*?(?:^|\.)\d+)(?:\.|$)", name)
    return match.group(1) if match else None


def conv_geometry(
    weight: torch.Tensor, stride: Any = 1, padding: Any = 0, dilation: Any = 1
) -> dict[str, tuple[int, ...]] | None:
    """``F.unfold``'s keyword arguments for a 2-D convolution with ``weight`` (``(out, C, kh, kw)``), or None
    where its padding is not the same amount on both sides (``padding='same'`` with an even extent)."""
    kernel, dilation = tuple(weight.shape[-2:]), _pair(dilation)
    if padding == "valid":
        padding = 0
    elif padding == "same":
        total = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
        if any(t % 2 for t in total):
            return None
        padding = tuple(t // 2 for t in total)
    return {"kernel_size": kernel, "dilation": dilation, "padding": _pair(padding), "stride": _pair(stride)}


def _pair(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value) if isinstance(value, (tuple, list)) else (int(value),) * 2


def _conv_rows(t: torch.Tensor) -> torch.Tensor:
    """``(N, C, H, W)`` as a GEMM operand: one row per position (``N * H * W``), one column per channel."""
    return t.flatten(2).transpose(1, 2).reshape(-1, t.shape[1])


def _conv_columns(x: torch.Tensor, geometry: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """im2col: ``(N * L, C * kh * kw)``, one row per output position (``L`` per image), in ``W``'s order."""
    cols = F.unfold(x, **geometry)
    return cols.transpose(1, 2).reshape(-1, cols.shape[1])


def _conv_output_size(x: torch.Tensor, geometry: dict[str, tuple[int, ...]]) -> tuple[int, int]:
    k, s, p, d = (geometry[key] for key in ("kernel_size", "stride", "padding", "dilation"))
    h, w = ((x.shape[2 + i] + 2 * p[i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(2))
    return h, w


class FP4Gemm:
    """A run's FP4 state: the recipe, which layers are FP4 (:meth:`bind`), the stochastic-rounding
    generator (seeded; :meth:`state_dict` for checkpoints, so a resumed run continues the same stream) and
    the Hadamard matrix. Quantizes the operands of the three GEMMs (:meth:`forward`, :meth:`dgrad`,
    :meth:`wgrad`)."""

    def __init__(self, recipe: FP4Recipe, device: str | torch.device = "cpu") -> None:
        self.recipe = recipe
        self.generator = torch.Generator(device=device).manual_seed(recipe.seed)
        self.hadamard = random_hadamard(16, recipe.seed, device) if recipe.hadamard else None
        self.layers: set[str] | None = None  # None: every FP4-capable layer not matching ``keep``

    def bind(self, gemm_names: list[str]) -> None:
        """Choose the FP4 layers among the model's linear and ``groups=1`` 2-D conv layers (``gemm_names``,
        in model order)."""
        self.layers = self.layers_of(gemm_names)

    def layers_of(self, gemm_names: list[str]) -> set[str]:
        """The FP4 layers among ``gemm_names`` (in model order): not matching ``keep``, not in the first
        ``keep_first`` or last ``keep_last`` blocks."""
        blocks = list(dict.fromkeys(b for b in map(_block_of, gemm_names) if b is not None))
        r = self.recipe
        kept = set(blocks[: r.keep_first]) | set(blocks[len(blocks) - r.keep_last :] if r.keep_last else [])
        return {n for n in gemm_names if _block_of(n) not in kept and not self._matches_keep(n)}

    def _matches_keep(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name.rsplit(".", 1)[-1], p)
                   for p in self.recipe.keep)  # fmt: skip

    def applies(self, name: str | None) -> bool:
        """Whether layer ``name`` runs its GEMMs in FP4 (``name#k``, a later call of a layer, as ``name``)."""
        if name is None:
            return False
        name = name.split("#", 1)[0]
        return name in self.layers if self.layers is not None else not self._matches_keep(name)

    def quantize(
        self, x: torch.Tensor, tile: int = 1, gradient: bool = False, stats: bool = False
    ) -> FP4Blocks:
        """``x`` (2-D) in the recipe's FP4 along its last dimension; stochastic for a ``gradient`` operand
        when the recipe says so."""
        r = self.recipe
        gen = self.generator if gradient and r.stochastic_rounding else None
        return quantize_fp4(x, r.name, r.rounding, tile, gen, stats)

    def _weight(self, w: torch.Tensor, along_rows: bool = False) -> torch.Tensor:
        """The weight operand: NVFP4 in 16x16 tiles (the same values along K and along N), MXFP4 in 1x32
        blocks along K, or along N (``along_rows``) for dgrad."""
        if self.recipe.operands == "grad":
            return w
        if self.recipe.name == "nvfp4":
            return self.quantize(w, tile=16).dequantized
        return self.quantize(w.t()).dequantized.t() if along_rows else self.quantize(w).dequantized

    def forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """fprop: ``q(x) q(W)^T + b`` (``x`` of any leading shape)."""
        x2 = x.reshape(-1, x.shape[-1])
        xq = x2 if self.recipe.operands == "grad" else self.quantize(x2).dequantized
        y = xq @ self._weight(w).t()
        if b is not None:
            y = y + b
        return y.reshape(*x.shape[:-1], w.shape[0])

    def dgrad(self, dy: torch.Tensor, w: torch.Tensor, probe: Any = None) -> torch.Tensor:
        """``q(dy) q(W)`` (``dy`` 2-D); with ``probe``, records the stored ``dy`` and its blocks."""
        q = self.quantize(dy, gradient=True, stats=probe is not None)
        if probe is not None:
            s = q.stats
            scale_min, scale_max = torch.exp2(s["log2_min"]), torch.exp2(s["log2_max"])
            probe.record(dy, q.dequantized, QuantStats(s["saturated"], scale_min, scale_max))
            probe.record_blocks(s)
        return q.dequantized @ self._weight(w, along_rows=True)

    def wgrad(self, dy: torch.Tensor, x: torch.Tensor, probe: Any = None) -> torch.Tensor:
        """``q(T dy^T) q(T x^T)^T`` (``dy``, ``x`` 2-D; ``T`` the Hadamard transform when enabled); with
        ``probe``, records the weight gradient's norm against its FP4 error (the unquantized GEMM in FP32)."""
        a, b = dy.t(), x.t()
        if self.hadamard is not None:
            a, b = hadamard_transform(a, self.hadamard), hadamard_transform(b, self.hadamard)
        aq = self.quantize(a, gradient=True).dequantized
        bq = b if self.recipe.operands == "grad" else self.quantize(b).dequantized
        grad = aq @ bq.t()
        if probe is not None:
            probe.record_wgrad(dy.t() @ x, grad)
        return grad

    def conv_forward(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, geometry: dict[str, tuple[int, ...]]
    ) -> torch.Tensor:
        """fprop of a 2-D convolution (``x``: ``(N, C, H, W)``, ``w``: ``(out, C, kh, kw)``, ``geometry``:
        :func:`conv_geometry`): :meth:`forward` on the im2col columns and ``W`` as ``(out, C * kh * kw)``,
        returned as ``(N, out, H_out, W_out)``."""
        n, out = x.shape[0], w.shape[0]
        h, wd = _conv_output_size(x, geometry)
        y = self.forward(_conv_columns(x, geometry), w.reshape(out, -1), b)
        return y.reshape(n, h * wd, out).transpose(1, 2).reshape(n, out, h, wd)

    def conv_dgrad(
        self,
        dy: torch.Tensor,
        w: torch.Tensor,
        x_shape: torch.Size,
        geometry: dict[str, tuple[int, ...]],
        probe: Any = None,
    ) -> torch.Tensor:
        """dgrad of a 2-D convolution: :meth:`dgrad` of ``dy``'s rows (blocks along the output channels) and
        ``W`` as ``(out, C * kh * kw)``, the columns' gradient then folded (col2im) to ``x_shape``."""
        dcols = self.dgrad(_conv_rows(dy), w.reshape(w.shape[0], -1), probe)
        dcols = dcols.reshape(dy.shape[0], -1, dcols.shape[1]).transpose(1, 2)
        return F.fold(dcols, tuple(x_shape[-2:]), **geometry)

    def conv_wgrad(
        self, dy: torch.Tensor, x: torch.Tensor, geometry: dict[str, tuple[int, ...]], probe: Any = None
    ) -> torch.Tensor:
        """wgrad of a 2-D convolution: :meth:`wgrad` of ``dy``'s rows and ``x``'s im2col columns (both
        blocked along the output positions), shaped as the weight."""
        grad = self.wgrad(_conv_rows(dy), _conv_columns(x, geometry), probe)
        return grad.reshape(dy.shape[1], x.shape[1], *geometry["kernel_size"])

    def state_dict(self) -> dict[str, Any]:
        """The recipe's fields and the stochastic-rounding generator's state (a uint8 tensor)."""
        return {"fp4_recipe": {f.name: getattr(self.recipe, f.name) for f in fields(self.recipe)},
                "generator": self.generator.get_state()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a checkpoint of another FP4 recipe is a ConfigError."""
        saved = dict(state.get("fp4_recipe", {}))
        saved["keep"] = tuple(saved.get("keep", ()))
        mine = {f.name: getattr(self.recipe, f.name) for f in fields(self.recipe)}
        if saved != mine:
            raise ConfigError(
                f"the checkpoint's FP4 recipe is {saved}, this run's is {mine}: resume with the same "
                "precision options"
            )
        self.generator.set_state(state["generator"])


class FP4Linear(torch.autograd.Function):
    """``F.linear`` with FP4 operands in all three GEMMs (:class:`FP4Gemm`); ``probe`` (telemetry steps)
    records the dgrad operand, its blocks and the weight gradient's noise. Torch-function modes are off
    inside (the emulation has already stored ``x`` and ``W`` in its base format)."""

    @staticmethod
    def forward(ctx, x, w, b, gemm: FP4Gemm, probe: Any = None):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            ctx.gemm, ctx.probe, ctx.has_bias = gemm, probe, b is not None
            ctx.save_for_backward(x, w)
            return gemm.forward(x, w, b)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            x, w = ctx.saved_tensors
            gemm, needs = ctx.gemm, ctx.needs_input_grad
            dy2 = dy.reshape(-1, dy.shape[-1]).float()
            x2 = x.reshape(-1, x.shape[-1])
            dx = gemm.dgrad(dy2, w, ctx.probe).reshape(x.shape).to(x.dtype) if needs[0] else None
            dw = gemm.wgrad(dy2, x2, ctx.probe).to(w.dtype) if needs[1] else None
            db = dy2.sum(0).to(w.dtype) if ctx.has_bias and needs[2] else None
            return dx, dw, db, None, None


class FP4Conv2d(torch.autograd.Function):
    """``F.conv2d`` with ``groups=1`` (``geometry``: :func:`conv_geometry`) with FP4 operands in all three
    GEMMs (:meth:`FP4Gemm.conv_forward`, :meth:`~FP4Gemm.conv_dgrad`, :meth:`~FP4Gemm.conv_wgrad`);
    ``probe`` and the torch-function modes as for :class:`FP4Linear`."""

    @staticmethod
    def forward(ctx, x, w, b, gemm: FP4Gemm, geometry: dict, probe: Any = None):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            ctx.gemm, ctx.geometry, ctx.probe, ctx.has_bias = gemm, geometry, probe, b is not None
            ctx.save_for_backward(x, w)
            return gemm.conv_forward(x, w, b, geometry)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            x, w = ctx.saved_tensors
            gemm, geometry, needs = ctx.gemm, ctx.geometry, ctx.needs_input_grad
            dy = dy.float()
            dx = gemm.conv_dgrad(dy, w, x.shape, geometry, ctx.probe).to(x.dtype) if needs[0] else None
            dw = gemm.conv_wgrad(dy, x, geometry, ctx.probe).to(w.dtype) if needs[1] else None
            db = _conv_rows(dy).sum(0).to(w.dtype) if ctx.has_bias and needs[2] else None
            return dx, dw, db, None, None, None
