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

Telemetry is sampled on the first iteration, every ``every`` iterations and on the last iteration, so its
cost (one extra comparison pass per probed gradient and one host sync per telemetry step) is negligible in
long runs while short runs still report it, and the final numbers describe the end of training (a 200-step
run with ``every=100`` samples iterations 0, 100 and 199, not 0 and 100 only).
"""

from __future__ import annotations

from adaloss.errors import ConfigError
from adaloss.numerics.emulation import Probe
from adaloss.numerics.formats import FloatFormat, get_format

__all__ = ["UnderflowMonitor"]


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
    """

    def __init__(
        self,
        every: int = 100,
        fmt: str | FloatFormat = "fp16",
        expected_loss_scale: bool = False,
        quantile: float = 0.01,
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
        self._probes: dict[str, Probe] = {}
        self.last_rates: dict[str, float] = {}
        self.last_expected_loss_scale: dict[str, float] = {}

    def due(self, step: int, steps: int | None = None) -> bool:
        """Whether iteration ``step`` (0-based) is a telemetry step: the first, every ``every``-th and, when
        the run's length ``steps`` is given, the last (``steps - 1``), so the last sample describes the end
        of training. No host sync."""
        return step % self.every == 0 or (steps is not None and step == steps - 1)

    def probe(self, name: str) -> Probe:
        """The probe that counts the gradient of layer ``name`` this step (created on first use)."""
        p = self._probes.get(name)
        if p is None:
            p = self._probes[name] = Probe(self.fmt, self.quantile)
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
            return {}
        import torch

        kth_names = [n for n in names if self._probes[n].kth is not None]
        values = [self._probes[n].underflow.float() for n in names]
        values += [self._probes[n].kth.float() for n in kth_names]
        flat = torch.stack(values).cpu().tolist()
        counts, kths = flat[: len(names)], flat[len(names) :]
        rates = {n: c / self._probes[n].numel for n, c in zip(names, counts, strict=True)}
        self.last_expected_loss_scale = {n: 1.0 / k for n, k in zip(kth_names, kths, strict=True) if k > 0}
        self._probes.clear()
        self.last_rates = rates
        return rates

    @staticmethod
    def mean_rate(rates: dict[str, float]) -> float:
        """Unweighted mean over layers (each layer counts once, as in the paper's per-layer plots)."""
        return sum(rates.values()) / len(rates) if rates else 0.0
