"""Per-layer underflow telemetry: how much of each activation gradient the training format loses.

For every GEMM layer (conv, linear), named by module path such as ``layer3.2.conv1``, the *activation-gradient
underflow rate* is the fraction of elements of the gradient with respect to the layer's output that are
non-zero before rounding to the format and zero after. In the CPU emulation this is exact: the gradient is
counted just before it is rounded. On CUDA, telemetry steps run through the same emulated path (FP32 compute
plus rounding) instead of real autocast, so the count is honest there too; see
:meth:`adaloss.precision.Precision.autocast`.

Optionally (``expected_loss_scale=True``) each layer's *expected loss scale* is recorded too: one over the
``ceil(quantile * N)``-th smallest non-zero ``|g|`` among the ``N`` non-zero elements of its activation
gradient, i.e. the scale that would lift all but the smallest ``quantile`` share of them to 1 (the paper's
Figure 1b uses ``quantile = 0.01``).

Each layer's gradient storage is described too (:data:`STORAGE_KEYS`, read ``last_storage`` after
:meth:`UnderflowMonitor.underflow_rates`): ``saturation_rate``, the share of elements whose scaled magnitude
passed the format's largest value (clamped there by a gradient quantizer, Inf for plain E5M2 rounding);
``grad_scale_min`` / ``grad_scale_max``, the range of the gradient quantizer's scales over the layer's tensors
or MX blocks (1 without a quantizer, ``precision.grad_scaling=none``); and ``sqnr_db``, the signal to
quantization-noise ratio ``10 log10(sum g^2 / sum (g - q)^2)`` of the stored gradient ``q`` against the
unquantized ``g`` (finite elements; Inf when storing changed nothing). An FP32 run stores nothing in a lower
format; its numbers say what plain rounding to ``telemetry.format`` would do, as its underflow rates do.
Under data parallelism these four are rank 0's (the underflow rates are averaged over the ranks).

**Counterfactual mode** (``counterfactual=True``, ``telemetry.counterfactual=true``): on each telemetry step
every probed gradient is also stored, for the measurement only, under each recipe of
:data:`COUNTERFACTUAL_RECIPES` (the gradient the run itself stored flows on unchanged), so one batch shows
what every other recipe would have done to the same gradients: ``last_storage["counterfactual"]`` is
``{recipe: {quantity: {layer: value}}}`` with ``underflow_rate`` and the :data:`STORAGE_KEYS`. Delayed
scaling is left out: its scale depends on the run's history, not on the batch. The gradients are the ones
that reached each layer in this run (upstream layers stored theirs under the run's own recipe). Cost on
telemetry steps: five more quantizations per probed gradient.

**FP4 layers** (``precision=nvfp4`` / ``mxfp4``, :mod:`adaloss.numerics.fp4_gemm`): a layer whose GEMMs take
FP4 operands is probed at its dgrad operand, the output gradient as stored in FP4 (underflow, saturation,
``sqnr_db``; ``grad_scale_min``/``max`` are the range of its blocks' stored scales, E4M3 or ``2^e``), and
:data:`FP4_KEYS` are recorded per layer besides: ``fp4_block_clamped_share`` and
``fp4_block_subnormal_share`` (the share of the dgrad operand's non-zero blocks whose scale was clamped:
NVFP4 a decode scale past 448 or an E4M3 scale of 0, MXFP4 an E8M0 exponent at its limit; or subnormal:
an E4M3 scale below 2^-6), ``fp4_block_scale_spread_log2`` (``log2`` of the largest over the smallest block
scale) and ``fp4_grad_to_noise``, the layer's weight-gradient norm over the norm of the error FP4 put on it
(the unquantized wgrad GEMM, computed on telemetry steps only): training stalls where it falls below about
sqrt(3) ("FP4 All the Way", 2025).

Telemetry is sampled on the first iteration, every ``every`` iterations and on the last iteration, so its
cost (one extra comparison pass per probed gradient and one host sync per telemetry step) is negligible in
long runs while short runs still report it, and the final numbers describe the end of training (a 200-step
run with ``every=100`` samples iterations 0, 100 and 199, not 0 and 100 only).
"""

from __future__ import annotations

import math

import torch

from adaloss.errors import ConfigError
from adaloss.numerics.emulation import Probe
from adaloss.numerics.formats import FloatFormat, get_format
from adaloss.numerics.quantizers import (
    CurrentScaling,
    GlobalScaling,
    GradQuantizer,
    MXBlockScaling,
    QuantStats,
)

__all__ = ["UnderflowMonitor", "STORAGE_KEYS", "FP4_KEYS", "COUNTERFACTUAL_RECIPES"]

#: The per-layer gradient-storage quantities of a telemetry step (module docstring), in record order.
STORAGE_KEYS = ("saturation_rate", "grad_scale_min", "grad_scale_max", "sqnr_db")
#: The per-layer FP4 block quantities (module docstring), for the FP4 layers of an FP4 run only.
FP4_KEYS = (
    "fp4_block_clamped_share",
    "fp4_block_subnormal_share",
    "fp4_block_scale_spread_log2",
    "fp4_grad_to_noise",
)
_FP4_ROW = ("blocks", "clamped", "subnormal", "log2_min", "log2_max", "wgrad_signal", "wgrad_noise")
#: The recipes the counterfactual mode applies to each probed gradient (module docstring).
COUNTERFACTUAL_RECIPES = {
    "none": GlobalScaling(),
    "tensor_current": CurrentScaling(),
    "tensor_current_pow2": CurrentScaling(power_2_scale=True),
    "mx_block_floor": MXBlockScaling(rounding="floor"),
    "mx_block_ceil": MXBlockScaling(rounding="ceil"),
}


class _CounterfactualProbe(Probe):
    """A probe that also stores each gradient it sees under every counterfactual recipe, each counted by its
    own probe (``alternatives``); the stored values are dropped. No host sync."""

    def __init__(self, fmt: FloatFormat, quantile: float | None) -> None:
        super().__init__(fmt, quantile)
        self.alternatives = {
            label: (GradQuantizer(recipe, fmt), Probe(fmt))
            for label, recipe in COUNTERFACTUAL_RECIPES.items()
        }

    def record(self, grad, rounded=None, stats: QuantStats | None = None) -> None:  # type: ignore[override]
        super().record(grad, rounded, stats)
        dim = 1 if grad.dim() in (4, 5) else -1  # the emulation's block dimension (grad_site)
        for label, (quantizer, probe) in self.alternatives.items():
            out, alt = quantizer.quantize(grad.detach(), label, dim, stats=True)
            probe.record(grad, out, alt)


class UnderflowMonitor:
    """Collects per-layer activation-gradient underflow counts on telemetry steps.

    Example::

        monitor = UnderflowMonitor(every=100, fmt="fp16")
        for step, (x, y) in enumerate(loader):
            due = monitor.due(step, steps=len(loader))
            with precision.autocast(monitor=monitor if due else None):
                loss = criterion(model(x), y)
            scaler.scale(loss).backward()
            if due:
                rates = monitor.underflow_rates()   # {layer: rate}; one host sync

    Args:
        every (int, optional, default=100): sample the first iteration and every ``every`` after it (and the
            last one, see :meth:`due`).
        fmt (str or FloatFormat, optional, default="fp16"): the format whose underflow is counted (for an
            FP32 run this is the format the gradients *would* lose values in).
        expected_loss_scale (bool, optional, default=False): also record each layer's expected loss scale
            (read ``last_expected_loss_scale`` after :meth:`underflow_rates`). Costs one ``kthvalue`` per
            probed gradient on telemetry steps.
        quantile (float, optional, default=0.01): the share of smallest non-zero magnitudes the expected
            loss scale may leave below 1; in (0, 1).
        counterfactual (bool, optional, default=False): also measure what each recipe of
            :data:`COUNTERFACTUAL_RECIPES` would have done to the same gradients (module docstring).
    """

    def __init__(
        self,
        every: int = 100,
        fmt: str | FloatFormat = "fp16",
        expected_loss_scale: bool = False,
        quantile: float = 0.01,
        counterfactual: bool = False,
    ) -> None:
        try:
            every = int(every)
        except (TypeError, ValueError):
            raise ConfigError(f"telemetry.every must be a positive integer, got '{every}'") from None
        if every < 1:
            raise ConfigError(f"telemetry.every must be a positive integer, got {every}")
        if isinstance(quantile, bool) or not isinstance(quantile, int | float) or not 0.0 < quantile < 1.0:
            raise ConfigError(f"telemetry.quantile must be a number in (0, 1), got {quantile!r}")
        self.every = every
        self.fmt = get_format(fmt)
        self.quantile = float(quantile) if expected_loss_scale else None
        if not isinstance(counterfactual, bool):
            raise ConfigError(f"telemetry.counterfactual must be true or false, got {counterfactual!r}")
        self._probe_type = _CounterfactualProbe if counterfactual else Probe
        self._probes: dict[str, Probe] = {}
        self.last_rates: dict[str, float] = {}
        self.last_expected_loss_scale: dict[str, float] = {}
        #: ``{key: {layer: value}}`` for :data:`STORAGE_KEYS` (and ``counterfactual``), set by
        #: :meth:`underflow_rates`.
        self.last_storage: dict[str, dict[str, float]] = {}

    def due(self, step: int, steps: int | None = None) -> bool:
        """Whether iteration ``step`` (0-based) is a telemetry step: the first, every ``every``-th and, when
        the run's length ``steps`` is given, the last (``steps - 1``), so the last sample describes the end
        of training. No host sync."""
        return step % self.every == 0 or (steps is not None and step == steps - 1)

    def probe(self, name: str) -> Probe:
        """The probe that counts the gradient of layer ``name`` this step (created on first use)."""
        p = self._probes.get(name)
        if p is None:
            p = self._probes[name] = self._probe_type(self.fmt, self.quantile)
        return p

    def underflow_rates(self) -> dict[str, float]:
        """Per-layer underflow rates of the last telemetry step, in network order; resets the counts.

        With ``expected_loss_scale``, also sets ``last_expected_loss_scale`` (``{layer: 1 / kth |g|}``, for
        the layers with a non-zero gradient). Synchronizes host and device once (all counts and magnitudes
        are stacked and copied together).
        """
        names = [n for n, p in self._probes.items() if p.underflow is not None and p.numel > 0]
        if not names:
            self._probes.clear()
            self.last_expected_loss_scale = {}
            self.last_storage = {}
            return {}
        kth_names = [n for n in names if self._probes[n].kth is not None]
        values = [self._probes[n].underflow.float() for n in names]
        values += [self._probes[n].kth.float() for n in kth_names]
        storage = [_storage_row(self._probes[n]) for n in names]  # each: 6 float64 scalars
        labels = list(COUNTERFACTUAL_RECIPES) if self._probe_type is _CounterfactualProbe else []
        storage += [_storage_row(self._probes[n].alternatives[lb][1]) for lb in labels for n in names]
        fp4_names = [n for n in names if self._probes[n].fp4 is not None]
        nan = torch.tensor(math.nan, dtype=torch.float64, device=values[0].device)
        fp4_rows = [torch.stack([self._probes[n].fp4.get(k, nan) for k in _FP4_ROW]) for n in fp4_names]
        flat = torch.cat([torch.stack(values).double(), *storage, *fp4_rows]).cpu().tolist()
        fp4_flat = flat[len(flat) - len(_FP4_ROW) * len(fp4_names) :]
        flat = flat[: len(flat) - len(fp4_flat)]
        counts, kths = flat[: len(names)], flat[len(names) : len(names) + len(kth_names)]
        rows = flat[len(names) + len(kth_names) :]
        numel = {n: self._probes[n].numel for n in names}
        rates = {n: c / numel[n] for n, c in zip(names, counts, strict=True)}
        self.last_expected_loss_scale = {n: 1.0 / k for n, k in zip(kth_names, kths, strict=True) if k > 0}
        self.last_storage = _storage_values(names, rows[: 6 * len(names)], numel)
        if labels:
            width = 6 * len(names)
            self.last_storage["counterfactual"] = {
                label: _storage_values(names, rows[width * (i + 1) : width * (i + 2)], numel, with_rate=True)
                for i, label in enumerate(labels)
            }
        if fp4_names:
            self.last_storage.update(_fp4_values(fp4_names, fp4_flat))
        self._probes.clear()
        self.last_rates = rates
        return rates

    @staticmethod
    def mean_rate(rates: dict[str, float]) -> float:
        """Unweighted mean over layers (each layer counts once, as in the paper's per-layer plots)."""
        return sum(rates.values()) / len(rates) if rates else 0.0


def _storage_row(probe: Probe):
    """``[saturated, scale_min, scale_max, signal, noise, underflow]`` of one probe as a float64 tensor (NaN
    where a quantity was never recorded); stacked with the other counts for the one host sync."""
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=probe.underflow.device)
    parts = [probe.saturated, probe.scale_min, probe.scale_max, probe.signal, probe.noise, probe.underflow]
    return torch.stack([nan if t is None else t.detach().double().reshape(()) for t in parts])


def _storage_values(
    names: list[str], flat: list[float], numel: dict[str, int], with_rate: bool = False
) -> dict[str, dict[str, float]]:
    """The :data:`STORAGE_KEYS` per layer from the probes' rows (``flat``: 6 numbers per layer); with
    ``with_rate``, ``underflow_rate`` first."""
    keys = ("underflow_rate", *STORAGE_KEYS) if with_rate else STORAGE_KEYS
    out: dict[str, dict[str, float]] = {key: {} for key in keys}
    for i, name in enumerate(names):
        saturated, low, high, signal, noise, underflow = flat[6 * i : 6 * i + 6]
        if with_rate:
            out["underflow_rate"][name] = underflow / numel[name]
        out["saturation_rate"][name] = saturated / numel[name]
        out["grad_scale_min"][name] = low
        out["grad_scale_max"][name] = high
        out["sqnr_db"][name] = sqnr_db(signal, noise)
    return out


def _fp4_values(names: list[str], flat: list[float]) -> dict[str, dict[str, float]]:
    """:data:`FP4_KEYS` per FP4 layer from the probes' FP4 rows (``flat``: ``len(_FP4_ROW)`` per layer)."""
    out: dict[str, dict[str, float]] = {key: {} for key in FP4_KEYS}
    width = len(_FP4_ROW)
    for i, name in enumerate(names):
        row = dict(zip(_FP4_ROW, flat[width * i : width * (i + 1)], strict=True))
        blocks = row["blocks"]
        out["fp4_block_clamped_share"][name] = row["clamped"] / blocks if blocks > 0 else math.nan
        out["fp4_block_subnormal_share"][name] = row["subnormal"] / blocks if blocks > 0 else math.nan
        spread = row["log2_max"] - row["log2_min"]
        out["fp4_block_scale_spread_log2"][name] = spread if math.isfinite(spread) else math.nan
        out["fp4_grad_to_noise"][name] = _ratio_of_norms(row["wgrad_signal"], row["wgrad_noise"])
    return out


def _ratio_of_norms(signal: float, noise: float) -> float:
    """``sqrt(signal / noise)``: Inf for no noise, NaN when either is NaN or both are 0."""
    if math.isnan(signal) or math.isnan(noise) or (signal == 0 and noise == 0):
        return math.nan
    return math.inf if noise == 0 else math.sqrt(signal / noise)


def sqnr_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)``: Inf for no noise, -Inf for no signal or infinite noise (a finite value
    stored as Inf), NaN when either sum is NaN."""
    if math.isnan(signal) or math.isnan(noise):
        return math.nan
    if noise == 0:
        return math.inf
    ratio = signal / noise
    if ratio == 0:
        return -math.inf
    return math.inf if math.isinf(ratio) else 10.0 * math.log10(ratio)
